"""Importance weights and off-policy masks built from π_old (proximal) and μ (behavior).

Notation: π_θ current policy, π_old proximal policy (old_log_probs, recomputed by the actor), μ
behavior policy (the distribution the tokens were actually sampled from). All inputs are (B, T)
log-probs right-padded with mask 0; every output is exactly 0 (weights) or 1 (masks) on padding
as documented per function.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from verl.trainer.core_algos.guidance import known_log_probs
from verl.utils import metric_names as M
from verl.utils.registry import Registry
from verl.utils.torch_functional import masked_mean, masked_sum

LOG_RATIO_CLAMP = 20.0  # |log ratio| beyond this is numerically meaningless in float32

LevelFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
RATIO_LEVELS: Registry[LevelFn] = Registry("importance-ratio level")


@RATIO_LEVELS.register("token")
def token_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """log r_t = log π_old(y_t) - log μ(y_t), per token (B, T)."""
    return log_ratio * response_mask


@RATIO_LEVELS.register("sequence")
def sequence_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """log r_seq = Σ_t log r_t, the log of the product ratio, broadcast over the response (B, T)."""
    return (
        masked_sum(log_ratio, response_mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
        * response_mask
    )


@RATIO_LEVELS.register("geometric")
def geometric_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """log r_geo = mean_t log r_t, the log of the geometric-mean ratio, broadcast (B, T).

    Length-invariant: repeating every token's ratio to double the length leaves it unchanged.
    Paper: https://arxiv.org/abs/2507.20673 (geometric-mean policy optimization).
    """
    return (
        masked_mean(log_ratio, response_mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
        * response_mask
    )


def _level_log_ratio(
    old_log_probs: torch.Tensor,
    behavior_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
) -> torch.Tensor:
    log_ratio = (old_log_probs - behavior_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return RATIO_LEVELS.get(level)(log_ratio * response_mask, response_mask)


def compute_importance_weights(
    old_log_probs: torch.Tensor,
    behavior_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    level: str = "token",
    clamp_min: float = 0.0,
    clamp_max: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated IS weights: w = clamp(π_old/μ, clamp_min, clamp_max) at token or sequence level.

    Token (TIS): w_t = clamp(exp(log π_old(y_t) - log μ(y_t))). Sequence: w_t = clamp(Π_t r_t)
    for every token of the response. Returns weights (B, T), 0 on padding, always detached, and
    the `guidance/is_weight_*` / `guidance/is_clip_frac` statistics over the valid tokens whose
    weight reads only known log-probs (`known_log_probs`; at sequence and geometric level every
    token of its response); is_weight_excluded_frac = the share of valid tokens left out.
    Paper: https://arxiv.org/abs/2110.00641 (decoupled PPO); TIS https://fengyao.notion.site/off-policy-rl.
    """
    with torch.no_grad():
        raw = _level_log_ratio(old_log_probs, behavior_log_probs, response_mask, level).exp()
        weights = raw.clamp(min=clamp_min, max=clamp_max) * response_mask
        valid = response_mask.bool()
        known = valid & known_log_probs(old_log_probs, behavior_log_probs)
        if level != "token":  # a response's weight reads every one of its tokens
            known = known & ~(valid & ~known).any(dim=-1, keepdim=True)
        sel = weights[known]
        clipped = ((raw < clamp_min) | (raw > clamp_max))[known]
        num_valid = valid.sum().item()
        metrics = {
            M.GUIDANCE_IS_WEIGHT_MEAN: sel.mean().item() if sel.numel() else 0.0,
            M.GUIDANCE_IS_WEIGHT_STD: sel.std().item() if sel.numel() > 1 else 0.0,
            M.GUIDANCE_IS_WEIGHT_MIN: sel.min().item() if sel.numel() else 0.0,
            M.GUIDANCE_IS_WEIGHT_MAX: sel.max().item() if sel.numel() else 0.0,
            M.GUIDANCE_IS_CLIP_FRAC: clipped.float().mean().item() if sel.numel() else 0.0,
            M.GUIDANCE_IS_WEIGHT_EXCLUDED_FRAC: 1.0 - sel.numel() / num_valid if num_valid else 0.0,
        }
    return weights, metrics


def compute_rejection_mask(
    old_log_probs: torch.Tensor,
    behavior_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    level: str = "token",
    lower: float = 0.5,
    upper: float = 2.0,
) -> torch.Tensor:
    """Masked IS (MIS): keep = [lower ≤ r ≤ upper], r the token, sequence or geometric ratio π_old/μ.

    Token: drops single tokens; sequence: drops whole responses whose product ratio leaves the
    band; geometric: drops responses whose per-token mean log-ratio leaves [log lower, log upper].
    Returns a float mask (B, T), 0 on padding. Paper: https://arxiv.org/abs/2510.18855 (IcePop-style
    masking); see also verl's rollout correction notes.
    """
    if not 0.0 < lower <= upper:
        raise ValueError(
            f"rejection bounds must satisfy 0 < lower <= upper, got lower={lower}, upper={upper}"
        )
    with torch.no_grad():
        log_r = _level_log_ratio(old_log_probs, behavior_log_probs, response_mask, level)
        keep = (log_r >= math.log(lower)) & (log_r <= math.log(upper))
    return keep.to(response_mask.dtype) * response_mask


def compute_geometric_mask(
    old_log_probs: torch.Tensor,
    behavior_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    lower: float = 0.5,
    upper: float = 2.0,
) -> torch.Tensor:
    """Geometric sequence mask: keep a response iff lower ≤ exp(mean_t log(π_old/μ)) ≤ upper.

    Shapes (B, T) -> (B, T) float mask. The decision depends on the per-token mean log-ratio only,
    so it does not change with length, unlike the product ratio. Paper: https://arxiv.org/abs/2507.20673.
    """
    return compute_rejection_mask(
        old_log_probs, behavior_log_probs, response_mask, "geometric", lower, upper
    )


def sequence_advantage(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-response advantage (B,): the masked mean of the token advantages."""
    return masked_mean(advantages, response_mask, dim=-1)


def compute_opsm_mask(
    log_probs: torch.Tensor,
    behavior_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    delta: float,
) -> torch.Tensor:
    """OPSM: drop response i iff A_i < 0 and mean_t log(μ(y_t)/π_θ(y_t)) > δ.

    Keeps every response with A_i ≥ 0. Computed without gradient from the current π_θ.
    Shapes: (B, T) inputs -> (B, 1) float keep mask.
    Paper: https://arxiv.org/abs/2512.02556 (DeepSeek-V3.2, off-policy sequence masking).
    """
    with torch.no_grad():
        drift = masked_mean(behavior_log_probs - log_probs.detach(), response_mask, dim=-1)
        drop = (sequence_advantage(advantages, response_mask) < 0) & (drift > delta)
    return (~drop).to(response_mask.dtype).unsqueeze(-1)
