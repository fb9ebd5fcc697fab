"""What a generation mode receives from the rollout: `RolloutContext`, the engines and the call's
sampling settings, built by `VLLMRollout.generate_sequences` once per call.

The dependencies run one way: the rollout imports the modes (`modes.py`, `speculative_mode.py`,
`multi_turn_mode.py`) and this module; the modes import this module and never the rollout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from verl.workers.rollout.config import RolloutConfig
from verl.workers.rollout.packing import Counters

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams

    from verl.workers.rollout.guidance_server import GuidanceChannel
    from verl.workers.rollout.multi_turn import MultiTurnRuntime
    from verl.workers.rollout.vllm_sessions import SessionEngine


@dataclass
class Engines:
    """The rollout's engines: the draft `vllm.LLM` in this process (None once shut down) and the
    channel to the guidance engine (its process or a `GuidanceService`; None without guidance)."""

    draft: Any
    guidance: GuidanceChannel | None


class WaveCounter:
    """Numbers the waves of sessions over all of a rollout's calls, so that each wave's session
    ids (`d<wave>-<i>` on the draft, `g<wave>-<i>` and `t<wave>-<i>` on the guidance) are new."""

    def __init__(self) -> None:
        self.last = 0

    def next(self) -> int:
        """The next wave's number (the first is 1)."""
        self.last += 1
        return self.last


@contextmanager
def same_cores(engine: str) -> Iterator[None]:
    """`RolloutContext.cores_to` where nobody moves cores: each engine keeps its share."""
    yield


@dataclass
class RolloutContext:
    """The rollout as a generation mode sees it during one `generate_sequences` call: the engines,
    the call's sampling settings (`temperature`, `ignore_eos` and `max_tokens` from its meta_info)
    with the sampling parameters built from them, the call's `counters`, and the rollout's
    `waves` (shared by its calls)."""

    config: RolloutConfig
    engines: Engines
    num_logprobs: int
    """K: the log-probs each engine lists per position."""
    eos_token_id: int
    pad_token_id: int
    max_tokens: int
    """The call's response budget (at most `config.response_length`)."""
    temperature: float
    ignore_eos: bool
    draft_sessions: SessionEngine | None = None
    """The draft engine's rewindable sessions (speculative mode only)."""
    counters: Counters = field(default_factory=Counters)
    waves: WaveCounter = field(default_factory=WaveCounter)
    cores_to: Callable[[str], AbstractContextManager[None]] = same_cores
    """On CPU, every core to one engine ("draft" or "guidance") inside the block
    (`EngineLifecycle.cores_to`)."""
    multi_turn: MultiTurnRuntime | None = None
    """The tools, call format and delta rule of `config.multi_turn` (None: multi-turn off)."""

    @property
    def eos_stop_ids(self) -> list[int]:
        """The ids a request stops at by default: EOS, unless the call ignores it."""
        return [] if self.ignore_eos else [self.eos_token_id]

    def sampling_kwargs(self, max_tokens: int, logprobs: int, seed: int, **overrides) -> dict:
        """SamplingParams fields of a rollout request (the guidance process builds its own)."""
        cfg = self.config
        kwargs = dict(
            temperature=self.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            max_tokens=max_tokens,
            logprobs=logprobs,
            seed=seed,
            detokenize=False,
            ignore_eos=self.ignore_eos,
            flat_logprobs=True,
            stop_token_ids=self.eos_stop_ids,
            skip_clone=True,
        )
        kwargs.update(overrides)
        return kwargs

    def draft_params(
        self, max_tokens: int, logprobs: int, seed: int, **overrides
    ) -> SamplingParams:
        """The draft engine's `SamplingParams` of a request (`sampling_kwargs`)."""
        from vllm.sampling_params import SamplingParams

        return SamplingParams(**self.sampling_kwargs(max_tokens, logprobs, seed, **overrides))

    def guidance_processing(self) -> dict:
        """The guidance's sampling settings (temperature, top_k, top_p): the call's, each replaced
        by `offpolicy_guidance.sampling_overrides` where it sets one. The guidance processes its
        log-probs with these, and samples with them in mix mode."""
        cfg, over = self.config, self.config.offpolicy_guidance.sampling_overrides
        base = {"temperature": self.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p}
        return {k: over.get(k, v) for k, v in base.items()}
