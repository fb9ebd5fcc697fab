"""The one list of logged metric names (DESIGN.md §5).

Trainer, algorithm core, docs tooling and dashboards import these constants, so code, docs and
panels cannot drift apart. Names are stable: dashboards and tests depend on them.
"""

from __future__ import annotations

# Namespaces (prefixes) of every metric the trainer logs.
NAMESPACES = (
    "guidance",
    "mismatch",
    "variance_proxy",
    "distill",
    "actor",
    "critic/score",
    "response_length",
    "timing_s",
    "perf",
    "val",
)

# guidance/*: provenance and importance-weight statistics of guided rollouts.
GUIDANCE_OFFPOLICY_TOKEN_RATIO = "guidance/offpolicy_token_ratio"
GUIDANCE_OFFPOLICY_SEQ_RATIO = "guidance/offpolicy_seq_ratio"
GUIDANCE_ACCEPT_RATE = "guidance/accept_rate"
GUIDANCE_LAMBDA = "guidance/lambda"
GUIDANCE_IS_WEIGHT_MEAN = "guidance/is_weight_mean"
GUIDANCE_IS_WEIGHT_STD = "guidance/is_weight_std"
GUIDANCE_IS_WEIGHT_MIN = "guidance/is_weight_min"
GUIDANCE_IS_WEIGHT_MAX = "guidance/is_weight_max"
GUIDANCE_IS_CLIP_FRAC = "guidance/is_clip_frac"
GUIDANCE_MISSING_LOGPROB_RATIO = "guidance/missing_logprob_ratio"
GUIDANCE_BEHAVIOR_KL = "guidance/behavior_kl"
GUIDANCE_TOPK_TAIL_MASS = "guidance/topk_tail_mass"

# mismatch/*: sampling (vLLM) vs training (FSDP) log-probs on draft-emitted tokens.
MISMATCH_KL_V1 = "mismatch/kl_v1"
MISMATCH_KL_V2 = "mismatch/kl_v2"
MISMATCH_KL_K3 = "mismatch/kl_k3"
MISMATCH_FORCED_TOKEN_RATIO = "mismatch/forced_token_ratio"
MISMATCH_MIS_MASKED_FRAC = "mismatch/mis_masked_frac"
MISMATCH_GEO_MASKED_SEQ_FRAC = "mismatch/geo_masked_seq_frac"

# variance_proxy/*: forward-only gradient-variance diagnostics (needs Σπ²).
VARIANCE_PROXY_SIGNAL = "variance_proxy/proxy1_signal_strength"
VARIANCE_PROXY_TOTAL_POWER = "variance_proxy/proxy2_total_power"
VARIANCE_PROXY_PURE_NOISE = "variance_proxy/proxy3_pure_noise"
VARIANCE_PROXY_EXPECTED_A2 = "variance_proxy/expected_a_squared"
VARIANCE_PROXY_EXPECTED_W = "variance_proxy/expected_w"

# distill/*: on-policy distillation from the guidance (the teacher's log-probs of sampled tokens).
DISTILL_REVERSE_KL = "distill/reverse_kl"
DISTILL_TEACHER_LOG_PROB = "distill/teacher_log_prob"
DISTILL_MISSING_FRAC = "distill/missing_frac"
DISTILL_ADVANTAGE_ABS = "distill/advantage_abs"

# actor/*: policy update.
ACTOR_PG_LOSS = "actor/pg_loss"
ACTOR_PPO_KL = "actor/ppo_kl"
ACTOR_PG_CLIPFRAC = "actor/pg_clipfrac"
ACTOR_PG_CLIPFRAC_LOWER = "actor/pg_clipfrac_lower"
ACTOR_GRAD_NORM = "actor/grad_norm"
ACTOR_LR = "actor/lr"
ACTOR_ENTROPY = "actor/entropy"
ACTOR_KL_LOSS = "actor/kl_loss"
ACTOR_DISTILL_LOSS = "actor/distill_loss"
ACTOR_OPSM_MASKED_SEQ_FRAC = "actor/opsm_masked_seq_frac"
ACTOR_SKIPPED_STEPS = "actor/skipped_steps"
ACTOR_LUFFY_TOKEN_FRAC = "actor/luffy_token_frac"

ALL_FIXED = tuple(
    v for k, v in dict(globals()).items() if k.isupper() and isinstance(v, str) and "/" in v
)


def in_namespace(name: str) -> bool:
    """True when `name` belongs to one of the documented namespaces."""
    return any(name.startswith(ns + "/") for ns in NAMESPACES)
