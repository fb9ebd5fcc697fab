"""KL estimators (k1, k2, k3) and sampling-vs-training mismatch diagnostics.

Estimators take per-token log-probs of the sampled tokens, (B, T), and return (B, T). Notation:
x ~ π (the sampling policy), ref the reference policy. Reference: http://joschu.net/blog/kl-approx.html.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verl.trainer.core_algos.guidance import known_log_probs
from verl.utils import metric_names as M
from verl.utils.registry import Registry
from verl.utils.torch_functional import selected_mean

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1", "kl")
def kl_k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k1 = log π(x) - log π_ref(x): unbiased, high variance. (B, T). Ref: http://joschu.net/blog/kl-approx.html."""
    return log_probs - ref_log_probs


@KL_ESTIMATORS.register("abs")
def kl_abs(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """|log π(x) - log π_ref(x)|, a biased magnitude. (B, T). Ref: http://joschu.net/blog/kl-approx.html."""
    return (log_probs - ref_log_probs).abs()


@KL_ESTIMATORS.register("k2", "mse")
def kl_k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k2 = ½ (log π(x) - log π_ref(x))²: biased, low variance. (B, T). Ref: http://joschu.net/blog/kl-approx.html."""
    return 0.5 * (log_probs - ref_log_probs) ** 2


@KL_ESTIMATORS.register("k3", "low_var_kl")
def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k3 = π_ref/π - log(π_ref/π) - 1 ≥ 0, clamped to [-10, 10]: unbiased, low variance. (B, T).

    Ref: http://joschu.net/blog/kl-approx.html.
    """
    log_r = (ref_log_probs - log_probs).clamp(-20.0, 20.0)
    return (log_r.exp() - log_r - 1.0).clamp(-10.0, 10.0)


def kl_penalty(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "k3"
) -> torch.Tensor:
    """Per-token KL estimate of the registered `kind` (B, T)."""
    return KL_ESTIMATORS.get(kind)(log_probs, ref_log_probs)


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward: r_t = s_t - β·KL_t(π_old ‖ π_ref), padding untouched. (B, T) -> (B, T).

    Paper: https://arxiv.org/abs/2203.02155 (InstructGPT's per-token KL penalty).
    """
    kl = kl_penalty(old_log_probs, ref_log_probs, kind) * response_mask
    rewards = token_level_scores - kl_coef * kl
    seq_kl = kl.sum(dim=-1)
    return rewards, {
        M.ACTOR_REWARD_KL_PENALTY: seq_kl.mean().item(),
        M.ACTOR_REWARD_KL_COEF: kl_coef,
    }


def compute_mismatch_metrics(
    rollout_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    offpolicy_mask: torch.Tensor | None = None,
    forced_threshold: float = -0.01,
) -> dict[str, float]:
    """kl_v1 = mean(log μ - log π_old), kl_v2 = ½·mean((log μ - log π_old)²) on draft tokens.

    Sampling (μ, vLLM) vs training (π_old, FSDP) divergence; also
    kl_k3 = mean(π_old/μ - 1 - log(π_old/μ)); all over the known, non-forced draft-emitted
    tokens. Known: log μ and log π_old both finite and above LOG_PROB_FLOOR (`known_log_probs`);
    excluded_frac = unknown / draft-emitted tokens. A known token is forced when its sampling
    log-prob > `forced_threshold` (near-deterministic: its KL is noise); forced_token_ratio =
    forced / known draft-emitted. Guidance-emitted tokens (offpolicy_mask) are left out
    altogether: their μ is not the draft's. Inputs (B, T).
    Paper: https://fengyao.notion.site/off-policy-rl.
    """
    draft = response_mask.bool()
    if offpolicy_mask is not None:
        draft = draft & ~offpolicy_mask.bool()
    known = draft & known_log_probs(rollout_log_probs, old_log_probs)
    forced = known & (rollout_log_probs > forced_threshold)
    kl_tokens = known & ~forced
    diff = rollout_log_probs - old_log_probs
    neg = (-diff).clamp(max=20.0)
    num_draft, num_known = draft.sum().item(), known.sum().item()
    return {
        M.MISMATCH_KL_V1: selected_mean(diff, kl_tokens).item(),
        M.MISMATCH_KL_V2: selected_mean(0.5 * diff**2, kl_tokens).item(),
        M.MISMATCH_KL_K3: selected_mean(neg.exp() - 1.0 - neg, kl_tokens).item(),
        M.MISMATCH_FORCED_TOKEN_RATIO: forced.sum().item() / num_known if num_known else 0.0,
        M.MISMATCH_EXCLUDED_FRAC: 1.0 - num_known / num_draft if num_draft else 0.0,
    }
