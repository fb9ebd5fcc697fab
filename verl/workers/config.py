"""Worker configuration: actor, reference, rollout and reward (EasyR1's `worker` section)."""

from __future__ import annotations

from dataclasses import dataclass, field

from verl.utils.config_checks import fail
from verl.workers.actor.config import ActorConfig, RefConfig
from verl.workers.reward.config import RewardConfig
from verl.workers.rollout.config import RolloutConfig


@dataclass
class WorkerConfig:
    """Everything the Ray workers need."""

    hybrid_engine: bool = True
    """Must be true (EasyR1's key, kept for its configs): the actor's FSDP ranks and the draft engines always share the GPUs (or the CPU); false is refused in one line."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The trained policy (draft)."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The frozen reference policy."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Draft and guidance engines."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function."""

    def validate(self, prefix: str) -> None:
        """Fail fast on bad values in every sub-section."""
        if self.hybrid_engine is not True:
            fail(f"{prefix}.hybrid_engine", self.hybrid_engine,
                 "expected true: actor and rollout are always colocated")  # fmt: skip
        self.actor.validate(f"{prefix}.actor")
        self.ref.validate(f"{prefix}.ref")
        self.rollout.validate(f"{prefix}.rollout")
        self.reward.validate(f"{prefix}.reward")
