"""Reward configuration (EasyR1's worker.reward)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl.utils.config_checks import check_choice, check_range, fail


@dataclass
class RewardConfig:
    """How responses are scored."""

    reward_type: str = "batch"
    """batch: one call scores the whole batch; sequential: one call per response."""
    reward_function: str | None = None
    """A built-in reward (arithmetic, runsum, toolchain, math) or `path/to/file.py:fn` (None: the embedded task's own, else math)."""
    val_reward_function: str | None = None
    """The reward validation scores with, same forms (None: `reward_function`), e.g. the accuracy beside a shaped training reward."""
    reward_function_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the reward function."""
    skip_special_tokens: bool = True
    """Decode responses without special tokens before scoring."""
    num_cpus: int = 1
    """CPUs of the reward worker."""

    def validate(self, prefix: str) -> None:
        """Fail fast on bad values."""
        check_choice(f"{prefix}.reward_type", self.reward_type, ["batch", "sequential"])
        check_range(f"{prefix}.num_cpus", self.num_cpus, 1)
        for key in ("reward_function", "val_reward_function"):
            fn = getattr(self, key)
            if fn is not None and ".py" in fn and not fn.rsplit(":", 1)[-1].isidentifier():
                fail(f"{prefix}.{key}", fn, "expected 'path/to/file.py:function_name'")
