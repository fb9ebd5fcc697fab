"""A reward with no signal, for the evidence's diagnosis of the weak draft: each response scores 1
with probability `rate` (the weak draft's own success rate when sampling), independently of what
it says, so GRPO's updates have the usual sparsity and size but point nowhere."""

from __future__ import annotations

import random

_rng = random.Random(0)


def coin(reward_input: dict, rate: float = 0.08) -> dict[str, float]:
    """1 with probability `rate`, else 0, whatever the response."""
    return {"overall": float(_rng.random() < rate)}
