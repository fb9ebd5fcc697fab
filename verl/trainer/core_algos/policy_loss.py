"""Policy losses: a registry of plain functions on (B, T) tensors, plus loss aggregation.

Every loss is called as ``fn(old_log_probs, log_probs, advantages, response_mask, config=...,
behavior_log_probs=None, importance_weights=None, offpolicy_mask=None, rollout_mask=None,
global_num_tokens=None, global_num_seqs=None)`` and returns ``(loss, metrics)``.

Notation: π_θ current (log_probs), π_old proximal (old_log_probs), μ behavior
(behavior_log_probs; falls back to π_old when absent). r = π_θ/π_old; w the importance weight
π_old/μ built by the trainer. Shared by every loss, in this order: LUFFY shaping of guidance
tokens (optional), the rollout mask (MIS / geometric, from the trainer), the OPSM mask
(optional), then aggregation. Masks drop contributions; they never change the normaliser, which
always comes from `response_mask` (or the global counts passed for gradient accumulation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from verl.trainer.core_algos.offpolicy import LOG_RATIO_CLAMP, compute_opsm_mask
from verl.utils import metric_names as M
from verl.utils.config_checks import check_choice, check_range
from verl.utils.registry import Registry
from verl.utils.torch_functional import masked_mean

# ----------------------------------------------------------------------------------------------
# Aggregation
# ----------------------------------------------------------------------------------------------

AggFn = Callable[..., torch.Tensor]
LOSS_AGG_MODES: Registry[AggFn] = Registry("loss aggregation mode")


def _num_seqs(mask: torch.Tensor, global_num_seqs: float | None) -> torch.Tensor | float:
    if global_num_seqs is not None:
        return global_num_seqs
    return (mask.sum(dim=-1) > 0).sum().clamp(min=1)


@LOSS_AGG_MODES.register("token-mean")
def agg_token_mean(loss_mat, loss_mask, horizon=None, global_num_tokens=None, global_num_seqs=None):
    """L = Σ_{i,t} l·m / Σ_{i,t} m: every token of the batch weighs the same. (B, T) -> scalar.

    Paper: https://arxiv.org/abs/2503.14476 (DAPO token-level loss).
    """
    denom = global_num_tokens if global_num_tokens is not None else loss_mask.sum().clamp(min=1)
    return (loss_mat * loss_mask).sum() / denom


@LOSS_AGG_MODES.register("seq-mean-token-mean")
def agg_seq_mean_token_mean(
    loss_mat, loss_mask, horizon=None, global_num_tokens=None, global_num_seqs=None
):
    """L = mean_i (Σ_t l·m / Σ_t m): each response weighs the same (original GRPO). (B, T) -> scalar.

    Responses without valid tokens are left out. Paper: https://arxiv.org/abs/2402.03300.
    """
    per_seq = (loss_mat * loss_mask).sum(dim=-1) / loss_mask.sum(dim=-1).clamp(min=1)
    return per_seq.sum() / _num_seqs(loss_mask, global_num_seqs)


@LOSS_AGG_MODES.register("seq-mean-token-sum-norm")
def agg_seq_mean_token_sum_norm(
    loss_mat, loss_mask, horizon=None, global_num_tokens=None, global_num_seqs=None
):
    """L = mean_i (Σ_t l·m / H) with a fixed horizon H (default: T): no length bias. (B, T) -> scalar.

    Paper: https://arxiv.org/abs/2503.20783 (Dr. GRPO).
    """
    horizon = horizon or loss_mat.shape[-1]
    return (loss_mat * loss_mask).sum() / horizon / _num_seqs(loss_mask, global_num_seqs)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    horizon: int | None = None,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
) -> torch.Tensor:
    """Aggregate a (B, T) per-token loss with the registered `loss_agg_mode`.

    For gradient accumulation pass the counts of the whole mini-batch (`global_num_tokens`,
    `global_num_seqs`): the sum of the micro-batch losses then equals the full-batch value.
    """
    return LOSS_AGG_MODES.get(loss_agg_mode)(
        loss_mat, loss_mask, horizon, global_num_tokens, global_num_seqs
    )


# ----------------------------------------------------------------------------------------------
# Config and registry
# ----------------------------------------------------------------------------------------------


@dataclass
class PolicyLossConfig:
    """The policy loss and its hyper-parameters: `worker.actor.policy_loss`, declared here once.

    The four importance/OPSM keys (`DERIVED`) belong to `algorithm.*`, which the trainer reads
    too; `PPOConfig.post_init` copies them here, and refuses a value set here that differs."""

    DERIVED: ClassVar[tuple[str, ...]] = (
        "importance_clamp_min", "importance_clamp_max", "importance_detach", "opsm_delta",
    )  # fmt: skip
    """The fields copied from algorithm.* (not keys a user sets here)."""

    loss_type: str = "ppo"
    """Policy loss, a name of the policy-loss registry (POLICY_LOSSES)."""
    clip_ratio_low: float = 0.2
    """PPO: lower clip ε_low, r ≥ 1 - ε_low."""
    clip_ratio_high: float = 0.28
    """PPO: upper clip ε_high, r ≤ 1 + ε_high."""
    clip_ratio_dual: float = 3.0
    """PPO dual clip c (> 1): for A < 0 the loss is capped at -c·A."""
    loss_agg_mode: str = "token-mean"
    """Aggregation mode, a name of LOSS_AGG_MODES."""
    loss_horizon: int | None = None
    """Fixed horizon H of seq-mean-token-sum-norm (None: the padded response length)."""
    importance_clamp_min: float = 0.0
    """auto: algorithm.importance_clamp_min; the lower clamp of π_θ/μ recomputed live (importance_detach=False)."""
    importance_clamp_max: float = 2.0
    """auto: algorithm.importance_clamp_max; the upper clamp of π_θ/μ recomputed live (importance_detach=False)."""
    importance_detach: bool = True
    """auto: algorithm.importance_detach; True: w = π_old/μ is a constant, False: w = clamp(π_θ/μ) carries gradient."""
    tv_delta: float = 0.15
    """DPPO/CPPO: TV trust-region radius δ on |π_θ(y) - μ(y)|."""
    is_ratio_cap: float = 20.0
    """DPPO/CPPO: truncation of the IS ratio π_θ/μ in the surrogate."""
    cppo_w_min: float = 0.8
    """CPPO: position weight at the last token (w_1 = 1, linear down to w_min)."""
    cppo_budget: float = 0.02
    """CPPO: base prefix budget δ_b; the per-response budget is clamp(P_q(D), δ_b, 2δ_b)."""
    cppo_budget_quantile: float = 0.9
    """CPPO: quantile q of the response's token divergences that sets its budget."""
    luffy_shaping: bool = False
    """LUFFY: replace the loss of guidance tokens by -A·f(π_θ), f(π) = π/(π+γ)."""
    luffy_gamma: float = 0.1
    """LUFFY shaping constant γ."""
    opsm_delta: float | None = None
    """auto: algorithm.opsm_delta; OPSM threshold δ on mean log(μ/π_θ) for responses with A < 0 (None: off)."""

    def validate(self, prefix: str) -> None:
        """Fail fast on bad values, naming `prefix`.key."""
        check_choice(f"{prefix}.loss_type", self.loss_type, POLICY_LOSSES.names())
        check_choice(f"{prefix}.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES.names())
        check_range(f"{prefix}.clip_ratio_low", self.clip_ratio_low, 0.0, 1.0)
        check_range(f"{prefix}.clip_ratio_high", self.clip_ratio_high, 0.0)
        check_range(f"{prefix}.clip_ratio_dual", self.clip_ratio_dual, 1.0, low_open=True)
        check_range(f"{prefix}.tv_delta", self.tv_delta, 0.0, 1.0, low_open=True)
        check_range(f"{prefix}.is_ratio_cap", self.is_ratio_cap, 0.0, low_open=True)
        check_range(f"{prefix}.cppo_w_min", self.cppo_w_min, 0.0, 1.0, low_open=True)
        check_range(f"{prefix}.cppo_budget", self.cppo_budget, 0.0, low_open=True)
        check_range(f"{prefix}.cppo_budget_quantile", self.cppo_budget_quantile, 0.0, 1.0)
        check_range(f"{prefix}.luffy_gamma", self.luffy_gamma, 0.0, low_open=True)
        if self.loss_horizon is not None:
            check_range(f"{prefix}.loss_horizon", self.loss_horizon, 1)


PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def register_policy_loss(name: str, *aliases: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a policy loss under `name` (verl's decorator)."""
    return POLICY_LOSSES.register(name, *aliases)


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered as `name`; ValueError listing the valid names otherwise."""
    return POLICY_LOSSES.get(name)


# ----------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------


def luffy_shaping(log_probs: torch.Tensor, advantages: torch.Tensor, gamma: float) -> torch.Tensor:
    """LUFFY's regularised IS for guidance tokens: l_t = -A_t · π_θ/(π_θ + γ). (B, T).

    d l/d log π = -A·γπ/(π+γ)²: low-probability guidance tokens keep a large gradient.
    Paper: https://arxiv.org/abs/2504.14945 (LUFFY, policy shaping).
    """
    prob = log_probs.exp()
    return -advantages * prob / (prob + gamma)


def _finish(
    loss_mat: torch.Tensor,
    metrics: dict[str, float],
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    anchor_log_probs: torch.Tensor,
    offpolicy_mask: torch.Tensor | None,
    rollout_mask: torch.Tensor | None,
    global_num_tokens: float | None,
    global_num_seqs: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    if config.luffy_shaping and offpolicy_mask is not None:
        guided = offpolicy_mask.bool() & response_mask.bool()
        loss_mat = torch.where(
            guided, luffy_shaping(log_probs, advantages, config.luffy_gamma), loss_mat
        )
        metrics[M.ACTOR_LUFFY_TOKEN_FRAC] = masked_mean(guided.float(), response_mask).item()
    keep = torch.ones_like(response_mask)
    if rollout_mask is not None:
        keep = keep * rollout_mask
    if config.opsm_delta is not None:
        opsm = compute_opsm_mask(
            log_probs, anchor_log_probs, advantages, response_mask, config.opsm_delta
        )
        has_tokens = response_mask.sum(dim=-1) > 0
        metrics[M.ACTOR_OPSM_MASKED_SEQ_FRAC] = (
            (opsm.squeeze(-1) == 0)[has_tokens].float().mean().item() if has_tokens.any() else 0.0
        )
        keep = keep * opsm
    loss = agg_loss(
        loss_mat * keep,
        response_mask,
        config.loss_agg_mode,
        config.loss_horizon,
        global_num_tokens,
        global_num_seqs,
    )
    metrics[M.ACTOR_PG_LOSS] = loss.detach().item()
    return loss, metrics


def _log_ratio(numer: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
    return (numer - denom).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


# ----------------------------------------------------------------------------------------------
# Losses
# ----------------------------------------------------------------------------------------------


@register_policy_loss("ppo", "vanilla")
def compute_policy_loss_ppo(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig | None = None,
    behavior_log_probs: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    offpolicy_mask: torch.Tensor | None = None,
    rollout_mask: torch.Tensor | None = None,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled three-policy PPO: l_t = -w_t · min(r_t·A_t, clip(r_t, 1-ε_low, 1+ε_high)·A_t).

    r = π_θ/π_old, w = π_old/μ (`importance_weights`, constant) or clamp(π_θ/μ) with gradient
    when `importance_detach=False`; w = 1 without weights (plain PPO/GRPO). For A < 0 the loss is
    further capped at -c·A (dual clip). Shapes: all (B, T).
    Paper: https://arxiv.org/abs/2110.00641 (decoupled PPO), https://arxiv.org/abs/1707.06347 (PPO).
    """
    config = config or PolicyLossConfig()
    log_ratio = _log_ratio(log_probs, old_log_probs)
    ratio = log_ratio.exp()
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(
        1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high
    )
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    dual_cap = -advantages * config.clip_ratio_dual
    dual_hit = (advantages < 0) & (loss_mat > dual_cap)
    loss_mat = torch.where(dual_hit, dual_cap, loss_mat)

    if not config.importance_detach and behavior_log_probs is not None:
        live = _log_ratio(log_probs, behavior_log_probs).exp()
        loss_mat = loss_mat * live.clamp(config.importance_clamp_min, config.importance_clamp_max)
    elif importance_weights is not None:
        loss_mat = loss_mat * importance_weights.detach()

    metrics = {
        M.ACTOR_PPO_KL: masked_mean(-log_ratio, response_mask).item(),
        M.ACTOR_PG_CLIPFRAC: masked_mean(
            (loss_clipped > loss_unclipped).float(), response_mask
        ).item(),
        M.ACTOR_PG_CLIPFRAC_LOWER: masked_mean(dual_hit.float(), response_mask).item(),
    }
    anchor = behavior_log_probs if behavior_log_probs is not None else old_log_probs
    return _finish(
        loss_mat, metrics, log_probs, advantages, response_mask, config, anchor,
        offpolicy_mask, rollout_mask, global_num_tokens, global_num_seqs,
    )  # fmt: skip


def _trust_region_surrogate(
    log_probs: torch.Tensor, anchor_log_probs: torch.Tensor, advantages: torch.Tensor, cap: float
) -> torch.Tensor:
    """-A · sg(min(π_θ/μ, cap)) · π_θ/sg(π_θ): value -A·min(r, cap), gradient -A·min(r, cap)·∇log π_θ."""
    ratio = _log_ratio(log_probs, anchor_log_probs).exp().clamp(max=cap).detach()
    return -advantages * ratio * (log_probs - log_probs.detach()).exp()


def moves_toward_anchor(
    advantages: torch.Tensor, log_probs: torch.Tensor, anchor_log_probs: torch.Tensor
) -> torch.Tensor:
    """A_t·(r_t - 1) ≤ 0 with r = π_θ/μ: the update pushes π_θ(y_t) back toward μ(y_t). (B, T) bool."""
    return advantages * (log_probs.detach() - anchor_log_probs).sign() <= 0


def _dppo_family_loss(
    keep_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    old_log_probs, log_probs, advantages, response_mask, config, behavior_log_probs,
    offpolicy_mask, rollout_mask, global_num_tokens, global_num_seqs,
) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    config = config or PolicyLossConfig()
    anchor = behavior_log_probs if behavior_log_probs is not None else old_log_probs
    with torch.no_grad():
        keep = keep_fn(log_probs.detach(), anchor, advantages, response_mask).to(log_probs.dtype)
    loss_mat = _trust_region_surrogate(log_probs, anchor, advantages, config.is_ratio_cap) * keep
    raw_ratio = _log_ratio(log_probs.detach(), anchor).exp()
    metrics = {
        M.ACTOR_PPO_KL: masked_mean(old_log_probs - log_probs.detach(), response_mask).item(),
        M.ACTOR_PG_CLIPFRAC: masked_mean(1.0 - keep, response_mask).item(),
        M.ACTOR_PG_CLIPFRAC_LOWER: masked_mean(
            (raw_ratio > config.is_ratio_cap).float(), response_mask
        ).item(),
    }
    return _finish(
        loss_mat, metrics, log_probs, advantages, response_mask, config, anchor,
        offpolicy_mask, rollout_mask, global_num_tokens, global_num_seqs,
    )  # fmt: skip


def dppo_tv_keep_mask(
    log_probs: torch.Tensor, anchor_log_probs: torch.Tensor, advantages: torch.Tensor, delta: float
) -> torch.Tensor:
    """Binary-TV trust region: keep iff the update moves π_θ toward μ, or |π_θ(y) - μ(y)| ≤ δ. (B, T) bool."""
    tv = (log_probs.exp() - anchor_log_probs.exp()).abs()
    return moves_toward_anchor(advantages, log_probs, anchor_log_probs) | (tv <= delta)


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig | None = None,
    behavior_log_probs: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    offpolicy_mask: torch.Tensor | None = None,
    rollout_mask: torch.Tensor | None = None,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO Binary-TV: l_t = -A_t · min(π_θ/μ, c) · 1[A_t(r_t-1) ≤ 0 or |π_θ(y_t) - μ(y_t)| ≤ δ].

    The trust region is anchored at the behavior μ, whose ratio already corrects the sampling, so
    `importance_weights` (π_old/μ) is not applied again. Shapes: all (B, T).
    Paper: https://arxiv.org/abs/2602.04879 (Rethinking the Trust Region in LLM RL).
    """
    delta = (config or PolicyLossConfig()).tv_delta

    def keep_fn(lp, anchor, adv, mask):
        return dppo_tv_keep_mask(lp, anchor, adv, delta)

    return _dppo_family_loss(
        keep_fn, old_log_probs, log_probs, advantages, response_mask, config, behavior_log_probs,
        offpolicy_mask, rollout_mask, global_num_tokens, global_num_seqs,
    )  # fmt: skip


def cppo_keep_mask(
    log_probs: torch.Tensor,
    anchor_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    delta: float = 0.15,
    w_min: float = 0.8,
    budget: float = 0.02,
    quantile: float = 0.9,
) -> torch.Tensor:
    """CPPO: keep iff A_t(r_t - 1) ≤ 0 or w_t·D_t ≤ min(δ, δ + δ_b^i·W_{t-1} - S_{t-1}).

    D_t = |π_θ(y_t) - μ(y_t)|; w_t = w_min + (1 - w_min)(L_i - t)/(L_i - 1) over the response's own
    length L_i (t = 1..L_i; w = 1 when L_i = 1); S_{t-1} = Σ_{j<t} w_j D_j, W_{t-1} = Σ_{j<t} w_j;
    δ_b^i = clamp(P_q(D_i), δ_b, 2δ_b) from the response's own valid tokens. Shapes (B, T) -> bool.
    Paper: https://arxiv.org/abs/2606.10968 (Beyond Uniform Token-Level Trust Region, CPPO).
    """
    valid = response_mask.bool()
    mask = response_mask.to(log_probs.dtype)
    div = (log_probs.exp() - anchor_log_probs.exp()).abs() * mask
    rank = mask.cumsum(dim=-1)  # 1-based position among valid tokens
    length = mask.sum(dim=-1, keepdim=True)
    frac = ((length - rank) / (length - 1).clamp(min=1)).clamp(0.0, 1.0)
    weight = (w_min + (1.0 - w_min) * frac) * mask
    weighted = weight * div
    prev_s = weighted.cumsum(dim=-1) - weighted
    prev_w = weight.cumsum(dim=-1) - weight
    q = torch.nanquantile(div.masked_fill(~valid, float("nan")), quantile, dim=-1, keepdim=True)
    seq_budget = torch.nan_to_num(q, nan=budget).clamp(budget, 2.0 * budget)
    threshold = torch.minimum(torch.full_like(prev_s, delta), delta + seq_budget * prev_w - prev_s)
    return moves_toward_anchor(advantages, log_probs, anchor_log_probs) | (weighted <= threshold)


@register_policy_loss("cppo")
def compute_policy_loss_cppo(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig | None = None,
    behavior_log_probs: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    offpolicy_mask: torch.Tensor | None = None,
    rollout_mask: torch.Tensor | None = None,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CPPO: DPPO's surrogate -A_t·min(π_θ/μ, c) under the position-weighted prefix-budget mask.

    See `cppo_keep_mask` for the mask. Shapes: all (B, T).
    Paper: https://arxiv.org/abs/2606.10968 (CPPO).
    """
    cfg = config or PolicyLossConfig()

    def keep_fn(lp, anchor, adv, mask):
        return cppo_keep_mask(
            lp,
            anchor,
            adv,
            mask,
            cfg.tv_delta,
            cfg.cppo_w_min,
            cfg.cppo_budget,
            cfg.cppo_budget_quantile,
        )

    return _dppo_family_loss(
        keep_fn, old_log_probs, log_probs, advantages, response_mask, cfg, behavior_log_probs,
        offpolicy_mask, rollout_mask, global_num_tokens, global_num_seqs,
    )  # fmt: skip


def policy_loss_kwargs() -> tuple[str, ...]:
    """The keyword tensors every registered policy loss accepts (besides the four positional)."""
    return ("config", "behavior_log_probs", "importance_weights", "offpolicy_mask", "rollout_mask",
            "global_num_tokens", "global_num_seqs")  # fmt: skip
