"""Advantage estimators: a registry of plain functions on (B, T) tensors grouped by `index` (uid).

Every estimator is called with keyword tensors
``token_level_rewards (B, T), response_mask (B, T), index (B,)`` plus whatever else it needs
(``old_log_probs``, ``sum_pi_squared``, ``rollout_is_weights`` for OTB) and hyper-parameters, and
returns ``(advantages, returns)``, both (B, T) with exactly zero on padding. Unused keywords are
accepted and ignored so the trainer can call every estimator the same way.

Convention shared by the grouped estimators: a group of one sample has no baseline, so its
advantage is its raw return.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from verl.utils.registry import Registry
from verl.utils.torch_functional import masked_whiten

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADV_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")


def register_adv_est(name: str, *aliases: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register an advantage estimator under `name` (verl's decorator)."""
    return ADV_ESTIMATORS.register(name, *aliases)


def get_adv_estimator_fn(name: str) -> AdvantageFn:
    """The estimator registered as `name`; ValueError listing the valid names otherwise."""
    return ADV_ESTIMATORS.get(name)


def group_ids(index: Any, device: torch.device | str = "cpu") -> tuple[torch.Tensor, int]:
    """Map uids (any hashable values, shape (B,)) to dense group ids 0..G-1 and return (ids, G)."""
    _, inverse = np.unique(np.asarray(index, dtype=object).astype(str), return_inverse=True)
    ids = torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device)
    return ids, int(ids.max().item()) + 1 if ids.numel() else 0


def _group_sum(values: torch.Tensor, ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(
        0, ids, values
    )


@register_adv_est("grpo")
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: A_i = (R_i - mean_g R) / (std_g R + ε), broadcast over the response.

    Shapes: rewards, mask (B, T); index (B,). std is the unbiased group std; with
    `norm_adv_by_std_in_grpo=False` it is the Dr. GRPO form R_i - mean_g R.
    Paper: https://arxiv.org/abs/2402.03300 (DeepSeekMath), https://arxiv.org/abs/2503.20783 (Dr. GRPO).
    """
    with torch.no_grad():
        scores = (token_level_rewards * response_mask).sum(dim=-1)
        ids, num_groups = group_ids(index, scores.device)
        count = _group_sum(torch.ones_like(scores), ids, num_groups)
        mean = _group_sum(scores, ids, num_groups) / count
        sq_dev = _group_sum((scores - mean[ids]) ** 2, ids, num_groups)
        std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))
        single = count[ids] <= 1
        centered = torch.where(single, scores, scores - mean[ids])
        if norm_adv_by_std_in_grpo:
            centered = torch.where(single, centered, centered / (std[ids] + epsilon))
        advantages = centered.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("rloo")
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: A_i = R_i - (Σ_{j∈g} R_j - R_i) / (n_g - 1), the leave-one-out mean as baseline.

    Shapes: rewards, mask (B, T); index (B,). Paper: https://arxiv.org/abs/2402.14740.
    """
    with torch.no_grad():
        scores = (token_level_rewards * response_mask).sum(dim=-1)
        ids, num_groups = group_ids(index, scores.device)
        count = _group_sum(torch.ones_like(scores), ids, num_groups)[ids]
        total = _group_sum(scores, ids, num_groups)[ids]
        loo = (count * scores - total) / (count - 1).clamp(min=1)
        adv = torch.where(count > 1, loo, scores)
        advantages = adv.unsqueeze(-1) * response_mask
    return advantages, advantages


def discounted_returns(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """G_t = Σ_{j≥t} γ^{j-t} r_j·m_j, zero where mask = 0 (B, T).

    Rewards of masked tokens never count, but the sum flows through them, so in a multi-turn
    response the tokens before a tool-output hole still see the final reward.
    """
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] * response_mask[:, t] + gamma * running
        returns[:, t] = running
    return returns * response_mask


@register_adv_est("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: A_t = whiten_batch(G_t), G_t = Σ_{j≥t} γ^{j-t} r_j (batch, not group, norm).

    Shapes: rewards, mask (B, T). Paper: https://arxiv.org/abs/2501.03262.
    """
    with torch.no_grad():
        returns = discounted_returns(token_level_rewards, response_mask, gamma)
        advantages = masked_whiten(returns, response_mask)
    return advantages, returns


def _otb_positions(response_mask: torch.Tensor, compact: bool) -> torch.Tensor:
    """Position of each token for the per-position baseline: its column, or its rank among the
    valid tokens of its response when `compact` (multi-turn: tool output does not count)."""
    if compact:
        return (response_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
    return torch.arange(response_mask.shape[1], device=response_mask.device).expand_as(
        response_mask
    )


def _optimal_token_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
    epsilon: float,
    handle_zero_tail: bool,
    compact: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    energy = 1.0 - 2.0 * old_log_probs.exp() + sum_pi_squared
    if rollout_is_weights is not None:
        energy = energy * rollout_is_weights.detach() ** 2
    realized = (energy * mask).cumsum(dim=-1)  # W_t: tokens with mask 0 do not accumulate

    ids, num_groups = group_ids(index, returns.device)
    width = returns.shape[1]
    cells = num_groups * width
    # cell (group, position) of every token; padding goes to one extra trash cell
    key = ids.unsqueeze(-1) * width + _otb_positions(response_mask, compact)
    key = torch.where(mask.bool(), key, torch.full_like(key, cells)).reshape(-1)
    stacked = torch.stack([returns * realized, realized, mask], dim=-1).reshape(-1, 3)
    sums = torch.zeros(cells + 1, 3, dtype=returns.dtype, device=returns.device).index_add_(
        0, key, stacked
    )
    numer, denom, alive = sums[:cells].unbind(-1)
    baseline = numer / (denom + epsilon)
    group_size = _group_sum(torch.ones_like(returns[:, 0]), ids, num_groups)
    lonely = (alive <= 1) & (handle_zero_tail | (group_size <= 1).repeat_interleave(width))
    baseline = torch.cat(
        [torch.where(lonely, torch.zeros_like(baseline), baseline), baseline.new_zeros(1)]
    )
    token_baseline = baseline[key].reshape(returns.shape)
    return (returns - token_baseline) * mask, returns * mask


@register_adv_est("optimal_token_baseline", "otb")
def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    otb_epsilon: float = 1e-8,
    otb_handle_zero_tail: bool = True,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB: A_t = (G_t - B*_t)·m_t, B*_t = Σ_i G_t W_t / (Σ_i W_t + ε), W_t = Σ_{j≤t} (1 - 2π_j + Σπ_j²).

    Sums run over the samples of one group alive at column t. π_j = exp(old_log_probs); with
    importance weights each W term is scaled by w_j². Where at most one sample of the group is
    alive (group of one, or the tail of a unique longest response when `otb_handle_zero_tail`)
    the baseline is 0, so the advantage is the return. Shapes: all (B, T); index (B,).
    Paper: https://arxiv.org/abs/2602.07078 (Optimal Token Baseline).
    """
    with torch.no_grad():
        return _optimal_token_baseline(
            token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
            rollout_is_weights, otb_epsilon, otb_handle_zero_tail, compact=False,
        )  # fmt: skip


@register_adv_est("tir_optimal_token_baseline", "tir_otb")
def compute_tir_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    otb_epsilon: float = 1e-8,
    otb_handle_zero_tail: bool = True,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-turn OTB: as OTB, but position t is the t-th *model* token of each response.

    Tokens with mask 0 inside a response (tool output) neither accumulate W nor take a position,
    so B*_t pools the samples' t-th generated tokens. Formula: A_t = (G_t - B*_t)·m_t with
    B*_t = Σ_i G_{k_i(t)} W_{k_i(t)} / (Σ_i W_{k_i(t)} + ε). Shapes: all (B, T); index (B,).
    Paper: https://arxiv.org/abs/2602.07078 (Optimal Token Baseline, tool-integrated variant).
    """
    with torch.no_grad():
        return _optimal_token_baseline(
            token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
            rollout_is_weights, otb_epsilon, otb_handle_zero_tail, compact=True,
        )  # fmt: skip


@register_adv_est("none")
def compute_no_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, **_: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """No outcome signal: A = 0 (B, T), so only a distillation term trains (pure on-policy
    distillation, no verifier: `algorithm.distill.coef` > 0). Returns are the raw returns.
    Paper: https://thinkingmachines.ai/blog/on-policy-distillation.
    """
    returns = discounted_returns(token_level_rewards, response_mask)
    return torch.zeros_like(token_level_rewards) * response_mask, returns


def needs_sum_pi_squared(name: str) -> bool:
    """True for the estimators that read `sum_pi_squared` (the OTB family)."""
    return ADV_ESTIMATORS.canonical(name) in (
        "optimal_token_baseline",
        "tir_optimal_token_baseline",
    )


def is_grouped(name: str) -> bool:
    """True for estimators whose baseline pools the samples of one uid group."""
    return ADV_ESTIMATORS.canonical(name) not in ("reinforce_plus_plus", "none")


GuidedAdvantageFn = Callable[..., torch.Tensor]
GUIDED_ADVANTAGES: Registry[GuidedAdvantageFn] = Registry("guided advantage")
"""How guided responses (the guided subset of a speculative rollout) get their advantages."""


@GUIDED_ADVANTAGES.register("standard")
def standard_guided_advantage(advantages: torch.Tensor, **_: Any) -> torch.Tensor:
    """A_i unchanged: guided and unguided responses share the estimator's advantages. (B, T)."""
    return advantages


def guided_advantage_weight(step: int, decay_steps: int) -> float:
    """MENTOR's cosine decay of the guided responses' weight: w(n) = ½(1 + cos(π n / S)).

    `step` n is the 1-based number of the step being run, as MENTOR counts it (its counter is
    incremented before w is computed, so its first step already uses w(1) < 1); `decay_steps` S.
    w = ½ at n = S/2 and 0 for n outside [0, S): from step S on the rollout is unguided.
    Paper: https://arxiv.org/abs/2510.04140 (MENTOR).
    """
    if not 0 <= step < decay_steps:
        return 0.0
    return 0.5 * (1.0 + math.cos(math.pi * step / decay_steps))


@GUIDED_ADVANTAGES.register("mentor")
def mentor_guided_advantage(
    advantages: torch.Tensor,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    guided: torch.Tensor,
    weight: float,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    cap: float | None = None,
    **_: Any,
) -> torch.Tensor:
    """MENTOR: unguided A_i = (R_i - mean_u R) / (std_u R + ε); guided A_i = c_g·max(R_i - mean_u R, 0)·w.

    mean_u and std_u (unbiased) pool only the *unguided* responses of each group, so the
    unguided ones get GRPO among themselves and a guided response counts only where it beats
    them, scaled by `weight` w (`guided_advantage_weight`) and never std-normalised. GRPO's
    conventions hold on the unguided subset: without `norm_adv_by_std_in_grpo` there is no std
    division, and a lone unguided response has no baseline (its raw return); guided responses
    are always compared with the unguided mean, a lone unguided response's return included.
    `cap` (MENTOR's expert_cap, None: off) bounds a group's guided advantages: where their sum
    D_g = Σ_guided max(R_i - mean_u R, 0) exceeds it, c_g = cap / D_g, else c_g = 1.
    `advantages` (the estimator's output) is ignored. A group with guided but no unguided
    responses raises ValueError. With no guided response this is exactly GRPO.
    Shapes: rewards, mask (B, T); index, guided (B,); returns (B, T), zero on padding.
    Paper: https://arxiv.org/abs/2510.04140 (MENTOR).
    """
    with torch.no_grad():
        scores = (token_level_rewards * response_mask).sum(dim=-1)
        is_guided = torch.as_tensor(guided, device=scores.device).reshape(-1).bool()
        if is_guided.shape != scores.shape:
            raise ValueError(
                f"guided has {is_guided.numel()} entries for {scores.numel()} responses"
            )
        ids, num_groups = group_ids(index, scores.device)
        unguided = (~is_guided).to(scores.dtype)
        count = _group_sum(unguided, ids, num_groups)
        orphans = int((count == 0).sum())  # every group has a member, so these are all guided
        if orphans:
            raise ValueError(
                f"mentor guided advantage: {orphans} of {num_groups} group(s) hold guided responses "
                "but no unguided one to compare them with"
            )
        mean = _group_sum(scores * unguided, ids, num_groups) / count.clamp(min=1)
        sq_dev = _group_sum((scores - mean[ids]) ** 2 * unguided, ids, num_groups)
        std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))
        single = count[ids] <= 1
        centered = torch.where(single, scores, scores - mean[ids])
        if norm_adv_by_std_in_grpo:
            centered = torch.where(single, centered, centered / (std[ids] + epsilon))
        beat = (scores - mean[ids]).clamp(min=0)  # guided: against the unguided mean, no std
        if cap is not None:  # a group's guided advantages sum to at most `cap`
            total = _group_sum(beat * is_guided.to(scores.dtype), ids, num_groups)
            beat = beat * torch.where(total > cap, cap / total.clamp(min=1e-30), 1.0)[ids]
        beat = beat * weight
        adv = torch.where(is_guided, beat, centered)
        return adv.unsqueeze(-1) * response_mask
