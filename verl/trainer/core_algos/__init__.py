"""The algorithm core (DESIGN.md §4): pure tensor functions on (B, T) tensors in registries.

Look algorithms up by name: `get_adv_estimator_fn`, `get_policy_loss_fn`, `KL_ESTIMATORS`,
`LOSS_AGG_MODES`, `RATIO_LEVELS`, `GUIDANCE_MODES`, `BEHAVIORS`, `LAM_SCHEDULES`.
Nothing here imports vLLM, Ray, torch.distributed or worker code.
"""

from verl.trainer.core_algos.advantage import (
    ADV_ESTIMATORS,
    compute_grpo_outcome_advantage,
    compute_optimal_token_baseline_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_tir_optimal_token_baseline_advantage,
    discounted_returns,
    get_adv_estimator_fn,
    group_ids,
    is_grouped,
    needs_sum_pi_squared,
    register_adv_est,
)
from verl.trainer.core_algos.guidance import (
    BEHAVIORS,
    GUIDANCE_MODES,
    LAM_SCHEDULES,
    compute_behavior_log_probs,
    compute_guidance_metrics,
    lam_at_step,
    mixture_log_probs,
    provenance_log_probs,
)
from verl.trainer.core_algos.kl import (
    KL_ESTIMATORS,
    apply_kl_penalty,
    compute_mismatch_metrics,
    kl_penalty,
)
from verl.trainer.core_algos.offpolicy import (
    RATIO_LEVELS,
    compute_geometric_mask,
    compute_importance_weights,
    compute_opsm_mask,
    compute_rejection_mask,
)
from verl.trainer.core_algos.policy_loss import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    PolicyLossConfig,
    agg_loss,
    compute_policy_loss_cppo,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_ppo,
    cppo_keep_mask,
    dppo_tv_keep_mask,
    get_policy_loss_fn,
    luffy_shaping,
    register_policy_loss,
)
from verl.trainer.core_algos.sum_pi_squared import (
    compute_sum_pi_squared,
    compute_variance_proxy_metrics,
)

__all__ = [
    "ADV_ESTIMATORS",
    "BEHAVIORS",
    "GUIDANCE_MODES",
    "KL_ESTIMATORS",
    "LAM_SCHEDULES",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "RATIO_LEVELS",
    "PolicyLossConfig",
    "agg_loss",
    "apply_kl_penalty",
    "compute_behavior_log_probs",
    "compute_geometric_mask",
    "compute_grpo_outcome_advantage",
    "compute_guidance_metrics",
    "compute_importance_weights",
    "compute_mismatch_metrics",
    "compute_opsm_mask",
    "compute_optimal_token_baseline_advantage",
    "compute_policy_loss_cppo",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_ppo",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rejection_mask",
    "compute_rloo_outcome_advantage",
    "compute_sum_pi_squared",
    "compute_tir_optimal_token_baseline_advantage",
    "compute_variance_proxy_metrics",
    "cppo_keep_mask",
    "discounted_returns",
    "dppo_tv_keep_mask",
    "get_adv_estimator_fn",
    "get_policy_loss_fn",
    "group_ids",
    "is_grouped",
    "kl_penalty",
    "lam_at_step",
    "luffy_shaping",
    "mixture_log_probs",
    "needs_sum_pi_squared",
    "provenance_log_probs",
    "register_adv_est",
    "register_policy_loss",
]
