"""Where guidance applies: which prompts get guided responses (two-stage `guide_when`), and the
teacher prefix (λ_t = 1 on a response's first j tokens). Plain functions on tensors and arrays.

Two-stage selection (`offpolicy_guidance.guide_when: group_fails`; BREAD arXiv:2506.17211,
Guide-GRPO arXiv:2506.13923): the draft first answers each prompt n times alone; a prompt whose n
responses all score below `fail_below` then gets m guided responses in place of its first m.
The λ a response is sampled with is a function of its prompt's first-stage outcome, which the
fresh second-stage draws (their own seeds) do not depend on, so each guided token's behavior is
exactly q_λ(·|prefix) with that λ (docs/design.md#guide-only-where-the-student-fails).

Teacher prefix (BREAD; Prefix-RFT arXiv:2507.01679; UFT arXiv:2505.16984): λ_t = 1 for the
first j response tokens of a guided response and the step's λ after, j = round(f·T) or drawn
per response from {0, ..., round(f·T)} with the response's own seed; λ_t depends on the
position only, never on the tokens, so μ stays exact per token.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from verl.utils import metric_names as M
from verl.utils.registry import Registry

SelectFn = Callable[[torch.Tensor, int, float], torch.Tensor | None]
GUIDE_WHEN: Registry[SelectFn] = Registry("guide_when rule")


@GUIDE_WHEN.register("always")
def guide_always(scores: torch.Tensor, n: int, fail_below: float) -> None:
    """Every prompt guided in one stage (no draft-only first stage): None."""
    return None


@GUIDE_WHEN.register("group_fails")
def guide_group_fails(scores: torch.Tensor, n: int, fail_below: float) -> torch.Tensor:
    """g_i = ∀j: r_ij < fail_below. scores (P·n,) row-major by prompt -> (P,) bool: the prompts
    whose n first-stage responses all fail."""
    if scores.numel() % n:
        raise ValueError(f"{scores.numel()} scores are not whole groups of n = {n}")
    return (scores.view(-1, n) < fail_below).all(dim=-1)


def replaced_rows(guided: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Rows of the first stage's (P·n) batch that a guided prompt's m responses replace: the
    first m of each guided prompt's group, in prompt order (the second stage's row order).
    guided (P,) bool -> (G·m,) long."""
    if not 1 <= m <= n:
        raise ValueError(f"m = {m} guided responses per prompt: expected 1..n (n = {n})")
    prompts = torch.nonzero(guided, as_tuple=True)[0]
    return (prompts[:, None] * n + torch.arange(m)).reshape(-1)


def selection_metrics(scores: torch.Tensor, n: int, guided: torch.Tensor) -> dict[str, float]:
    """The first stage as metrics (names in `verl.utils.metric_names`): the share of prompts
    guided, the share of groups with any success (a response at or above the threshold is one
    that the rule did not count as failing), and the first-stage mean reward of the guided
    prompts' responses. scores (P·n,), guided (P,) bool."""
    groups = scores.view(-1, n)
    out = {
        M.GUIDANCE_GUIDED_PROMPT_FRAC: guided.float().mean().item(),
        M.GUIDANCE_FIRST_STAGE_SCORE: groups.mean().item(),
        M.GUIDANCE_FIRST_STAGE_ANY_SUCCESS: (~guided).float().mean().item(),
    }
    if guided.any():
        out[M.GUIDANCE_GUIDED_PROMPTS_FIRST_SCORE] = groups[guided].mean().item()
    return out


DrawFn = Callable[[int, np.ndarray], np.ndarray]
PREFIX_DRAWS: Registry[DrawFn] = Registry("prefix draw")


@PREFIX_DRAWS.register("fixed")
def prefix_fixed(j: int, seeds: np.ndarray) -> np.ndarray:
    """j_r = j for every response. seeds (R,) -> (R,)."""
    return np.full(len(seeds), j, dtype=np.int64)


@PREFIX_DRAWS.register("uniform")
def prefix_uniform(j: int, seeds: np.ndarray) -> np.ndarray:
    """j_r ~ U{0, ..., j}, drawn from each response's own seed (independent of its tokens).
    seeds (R,) -> (R,)."""
    return np.array([np.random.default_rng([int(s), 7]).integers(0, j + 1) for s in seeds],
                    dtype=np.int64)  # fmt: skip


def prefix_lengths(
    fraction: float, max_tokens: int, draw: str, seeds: np.ndarray, guided: np.ndarray
) -> np.ndarray:
    """Per response (R,): how many leading tokens the guidance writes (λ_t = 1), j_max =
    round(fraction·max_tokens) drawn by `draw` (PREFIX_DRAWS); 0 for responses not `guided`."""
    j = round(fraction * max_tokens)
    if j == 0:
        return np.zeros(len(seeds), dtype=np.int64)
    return np.where(guided, PREFIX_DRAWS.get(draw)(j, seeds), 0)


def prefix_lam(lam: np.ndarray, positions: np.ndarray, prefix: np.ndarray) -> np.ndarray:
    """λ_t = 1 where the response position t < j of its response, else the given λ_t.
    lam, positions, prefix all (N,) -> (N,)."""
    return np.where(positions < prefix, 1.0, lam)
