"""On-policy distillation from the guidance: a per-token reverse KL toward the teacher q.

The guided rollout already scores every draft token with the guidance, so `guidance_log_probs`
holds log q(x_t) of the sampled tokens with no extra teacher pass. Per token the reverse KL
KL(π ‖ q) is estimated with a registered KL estimator k_t = k(log π(x_t), log q(x_t)) (k1:
log π - log q; k3: q/π - 1 - log(q/π); both unbiased for x ~ π; the other KL_ESTIMATORS names
are accepted too, biased). Under guided sampling (λ > 0)
the tokens come from μ = q_λ, so every term carries the importance weight w = π_old/μ the
trainer already builds: E_μ[w·k] = E_π[k] = KL(π ‖ q).

Two ways to train on it (DISTILL_MODES):
- reward: A_t += -β·k_t(π_old, q), after the outcome advantage's normalisation (Thinking Machines'
  on-policy distillation, prime-rl's teacher reward); the policy loss applies w.
- loss: β·agg(w·k_t(π_θ, q)) joins the actor loss, with the gradient of the expectation, pathwise
  plus score function: w·(∇k_t + k_t·∇log π_θ). The pathwise part alone is not the reverse-KL
  gradient (k1's is zero in expectation, k3's is the forward KL's). With `topk_forward` the loss
  term is instead the forward KL over the guidance's top-K at each position
  (`distill_topk_forward_loss`), from the rows the teacher-only rollout keeps.

Tokens whose teacher log-prob is missing (`guidance_missing_mask`) are left out and counted. A
teacher probability that the sampling settings make exactly 0 (log q = the floor) is kept, with
|log π - log q| clamped to LOG_RATIO_CLAMP: the teacher's strongest "never". The distill/*
metrics leave such tokens out (a floor is not a log-prob to average) and count them.
Notation: π_θ current, π_old proximal, μ behavior, q the guidance (teacher). Shapes (B, T).
Papers: https://thinkingmachines.ai/blog/on-policy-distillation (on-policy distillation),
https://arxiv.org/abs/2306.13649 (GKD), http://joschu.net/blog/kl-approx.html (estimators).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verl.trainer.core_algos.guidance import LOG_PROB_FLOOR, known_log_probs
from verl.trainer.core_algos.kl import KL_ESTIMATORS
from verl.trainer.core_algos.offpolicy import LOG_RATIO_CLAMP
from verl.trainer.core_algos.policy_loss import agg_loss
from verl.utils import metric_names as M
from verl.utils.registry import Registry
from verl.utils.torch_functional import selected_mean

DISTILL_MODES: Registry[Callable] = Registry("distillation mode")


def distill_token_kl(
    log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, estimator: str = "k1"
) -> torch.Tensor:
    """k_t = KL_ESTIMATORS[estimator](log π(x_t), log q(x_t)), |log π - log q| <= 20. (B, T).

    log q is clamped to within 20 of a detached log π, so it stays a constant of π_θ.
    Ref: http://joschu.net/blog/kl-approx.html.
    """
    anchor = log_probs.detach()
    log_q = teacher_log_probs.clamp(min=anchor - LOG_RATIO_CLAMP, max=anchor + LOG_RATIO_CLAMP)
    return KL_ESTIMATORS.get(estimator)(log_probs, log_q)


def scored_mask(
    response_mask: torch.Tensor, missing_mask: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """(B, T) 0/1 of `dtype`: valid tokens whose teacher log-prob was reported."""
    keep = response_mask.bool()
    if missing_mask is not None:
        keep = keep & ~missing_mask.bool()
    return keep.to(dtype)


@DISTILL_MODES.register("reward")
def distill_advantages(
    advantages: torch.Tensor,
    old_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    missing_mask: torch.Tensor | None,
    coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A_t = A_outcome,t + β·(-k_t(π_old, q)) on scored tokens (k1: β·(log q - log π_old)). (B, T).

    Returns (advantages, the added term). `A_outcome` is the estimator's output, already
    normalised; with `adv_estimator: none` it is 0 (pure distillation, no verifier).
    Paper: https://thinkingmachines.ai/blog/on-policy-distillation (per-token reverse-KL reward).
    """
    with torch.no_grad():
        keep = scored_mask(response_mask, missing_mask, advantages.dtype)
        term = -coef * distill_token_kl(old_log_probs, teacher_log_probs, estimator) * keep
    return advantages + term, term


@DISTILL_MODES.register("loss")
def distill_loss(
    log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    missing_mask: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    estimator: str = "k1",
    loss_agg_mode: str = "token-mean",
    **agg,
) -> torch.Tensor:
    """L = agg(w_t·k_t(π_θ, q)) over scored tokens, gradient w_t·(∇k_t + k_t·∇log π_θ(x_t)).

    Its gradient is that of E_π[k] = KL(π_θ ‖ q) (pathwise plus score function), q constant.
    Missing tokens add nothing; the normaliser is the response mask's, as for every loss term.
    Returns the unscaled term (the caller multiplies by β). Shapes (B, T) -> scalar.
    Paper: https://arxiv.org/abs/2306.13649 (GKD: on-policy reverse-KL distillation).
    """
    k = distill_token_kl(log_probs, teacher_log_probs, estimator)
    score = log_probs - log_probs.detach()  # value 0, gradient ∇log π_θ
    loss_mat = k + k.detach() * score
    if importance_weights is not None:
        loss_mat = loss_mat * importance_weights.detach()
    keep = scored_mask(response_mask, missing_mask, loss_mat.dtype)
    return agg_loss(loss_mat * keep, response_mask, loss_agg_mode, **agg)


def distill_topk_forward_loss(
    log_probs_topk: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    missing_mask: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    **agg,
) -> torch.Tensor:
    """L = agg(Σ_k q̃_k·(log q̃_k - log π_θ(k))): the forward KL over the guidance's top-K at
    each position, q̃ = q renormalised over its K listed tokens, π_θ at the same ids.

    Inputs (B, T, K): log π_θ and log q of the listed tokens (the floor marks an unlisted slot
    or q = 0); response_mask (B, T). Its gradient is the soft-label cross-entropy's,
    -Σ_k q̃_k·∇log π_θ(k). Not importance-weighted: its prefix's weight is a product over the
    earlier tokens, so it is exact for the teacher-only rollout (λ = 0), where μ = π. Returns
    the unscaled term. Paper: https://arxiv.org/abs/2306.13649 (GKD: forward KL on the student's
    own sequences).
    """
    teacher = torch.log_softmax(teacher_topk_log_probs.double(), dim=-1).to(log_probs_topk.dtype)
    listed = teacher_topk_log_probs > LOG_PROB_FLOOR
    q = teacher.exp() * listed
    per_slot = torch.where(listed, q * (teacher - log_probs_topk), torch.zeros_like(q))
    keep = scored_mask(response_mask, missing_mask, log_probs_topk.dtype)
    return agg_loss(per_slot.sum(-1) * keep, response_mask, loss_agg_mode, **agg)


def compute_distill_metrics(
    old_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    missing_mask: torch.Tensor | None,
    importance_weights: torch.Tensor | None,
    estimator: str = "k1",
    advantage_term: torch.Tensor | None = None,
) -> dict[str, float]:
    """distill/*: reverse_kl = mean of w·k_t(π_old, q) over known tokens, the per-token estimate
    of KL(π_old ‖ q). (B, T).

    Known tokens: valid, scored (teacher log-prob reported), log π_old and log q both known
    (`known_log_probs`: not at LOG_PROB_FLOOR, so q > 0) and w finite. teacher_log_prob = mean
    log q and advantage_abs = mean |β·k_t| (reward mode) over the same tokens; excluded_frac =
    the share of valid tokens left out of the three; missing_frac = unscored / valid tokens, the
    share left out of the distillation term itself (a q = 0 token stays in it, clamped).
    Paper: https://thinkingmachines.ai/blog/on-policy-distillation (reverse KL per token)."""
    valid = response_mask.bool()
    scored = scored_mask(response_mask, missing_mask, old_log_probs.dtype).bool()
    known = scored & known_log_probs(old_log_probs, teacher_log_probs)
    k = distill_token_kl(old_log_probs, teacher_log_probs, estimator)
    if importance_weights is not None:
        known = known & importance_weights.isfinite()
        k = k * importance_weights
    num_valid = max(valid.sum().item(), 1)
    metrics = {
        M.DISTILL_REVERSE_KL: selected_mean(k, known).item(),
        M.DISTILL_TEACHER_LOG_PROB: selected_mean(teacher_log_probs, known).item(),
        M.DISTILL_MISSING_FRAC: 1.0 - scored.sum().item() / num_valid,
        M.DISTILL_EXCLUDED_FRAC: 1.0 - known.sum().item() / num_valid,
    }
    if advantage_term is not None:
        metrics[M.DISTILL_ADVANTAGE_ABS] = selected_mean(advantage_term.abs(), known).item()
    return metrics
