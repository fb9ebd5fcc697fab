"""The one list of logged metric names (docs/design.md#where-each-metric-comes-from).

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
    "critic/advantages",
    "response_length",
    "timing_s",
    "perf",
    "val",
    "multiturn",
    "async",
)

# guidance/*: provenance and importance-weight statistics of guided rollouts. A metric averages
# only tokens whose inputs are known (finite, above LOG_PROB_FLOOR); *_excluded_frac says how many
# it left out (the same rule holds for mismatch/* and distill/*).
GUIDANCE_OFFPOLICY_TOKEN_RATIO = "guidance/offpolicy_token_ratio"
GUIDANCE_OFFPOLICY_SEQ_RATIO = "guidance/offpolicy_seq_ratio"
GUIDANCE_ACCEPT_RATE = "guidance/accept_rate"
GUIDANCE_LAMBDA = "guidance/lambda"
GUIDANCE_IS_WEIGHT_MEAN = "guidance/is_weight_mean"
GUIDANCE_IS_WEIGHT_STD = "guidance/is_weight_std"
GUIDANCE_IS_WEIGHT_MIN = "guidance/is_weight_min"
GUIDANCE_IS_WEIGHT_MAX = "guidance/is_weight_max"
GUIDANCE_IS_CLIP_FRAC = "guidance/is_clip_frac"
GUIDANCE_IS_WEIGHT_EXCLUDED_FRAC = "guidance/is_weight_excluded_frac"
GUIDANCE_MISSING_LOGPROB_RATIO = "guidance/missing_logprob_ratio"
GUIDANCE_BEHAVIOR_KL = "guidance/behavior_kl"
GUIDANCE_BEHAVIOR_KL_EXCLUDED_FRAC = "guidance/behavior_kl_excluded_frac"
GUIDANCE_TOPK_TAIL_MASS = "guidance/topk_tail_mass"
GUIDANCE_TARGET_TV = "guidance/target_tv"
GUIDANCE_DRAFT_LOOKUP_RATIO = "guidance/draft_lookup_ratio"
# per-position λ_t (lam_gate) and the guided subset (guided_samples, guided_advantage)
GUIDANCE_LAMBDA_MEAN = "guidance/lambda_mean"
GUIDANCE_TARGET_LAMBDA_MEAN = "guidance/target_lambda_mean"
GUIDANCE_GATE_MEAN = "guidance/gate_mean"
GUIDANCE_GATE_OPEN_FRAC = "guidance/gate_open_frac"
GUIDANCE_DRAFT_ENTROPY_MEAN = "guidance/draft_entropy_mean"
GUIDANCE_ENTROPY_THRESHOLD = "guidance/entropy_threshold"
GUIDANCE_SUBSET_GUIDED_SCORE = "guidance/subset_guided_score"
GUIDANCE_SUBSET_UNGUIDED_SCORE = "guidance/subset_unguided_score"
GUIDANCE_GUIDED_ADV_WEIGHT = "guidance/guided_adv_weight"
GUIDANCE_GUIDED_ADV_MEAN = "guidance/guided_adv_mean"
# guide_when: group_fails (the draft-only first stage) and the teacher prefix
GUIDANCE_GUIDED_PROMPT_FRAC = "guidance/guided_prompt_frac"
GUIDANCE_FIRST_STAGE_SCORE = "guidance/first_stage_score"
GUIDANCE_FIRST_STAGE_ANY_SUCCESS = "guidance/first_stage_any_success"
GUIDANCE_GUIDED_PROMPTS_FIRST_SCORE = "guidance/guided_prompts_first_score"
GUIDANCE_PREFIX_FRACTION = "guidance/prefix_fraction"
# guidance/guided_*: what the update gets from the guidance tokens (diagnosis of a guided step).
GUIDANCE_GUIDED_IS_WEIGHT_MEAN = "guidance/guided_is_weight_mean"
GUIDANCE_GUIDED_IS_CLIP_FRAC = "guidance/guided_is_clip_frac"
GUIDANCE_GUIDED_EXCLUDED_FRAC = "guidance/guided_excluded_frac"
GUIDANCE_GUIDED_GRAD_SHARE = "guidance/guided_grad_share"
GUIDANCE_GUIDED_SEQ_SCORE = "guidance/guided_seq_score"
GUIDANCE_UNGUIDED_SEQ_SCORE = "guidance/unguided_seq_score"
GUIDANCE_GUIDED_SCORE_GAP = "guidance/guided_score_gap"

# mismatch/*: sampling (vLLM) vs training (FSDP) log-probs on draft-emitted tokens.
MISMATCH_KL_V1 = "mismatch/kl_v1"
MISMATCH_KL_V2 = "mismatch/kl_v2"
MISMATCH_KL_K3 = "mismatch/kl_k3"
MISMATCH_FORCED_TOKEN_RATIO = "mismatch/forced_token_ratio"
MISMATCH_EXCLUDED_FRAC = "mismatch/excluded_frac"
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
DISTILL_EXCLUDED_FRAC = "distill/excluded_frac"
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
ACTOR_REWARD_KL_PENALTY = "actor/reward_kl_penalty"
ACTOR_REWARD_KL_COEF = "actor/reward_kl_coef"
ACTOR_DISTILL_LOSS = "actor/distill_loss"
ACTOR_OPSM_MASKED_SEQ_FRAC = "actor/opsm_masked_seq_frac"
ACTOR_SKIPPED_STEPS = "actor/skipped_steps"
ACTOR_LUFFY_TOKEN_FRAC = "actor/luffy_token_frac"

# critic/*, response_length/*: the batch's rewards, advantages and lengths (verl/trainer/metrics.py).
CRITIC_SCORE_MEAN = "critic/score/mean"
CRITIC_SCORE_MAX = "critic/score/max"
CRITIC_SCORE_MIN = "critic/score/min"
CRITIC_SCORE_GROUP_ANY_SUCCESS = "critic/score/group_any_success"
CRITIC_ADVANTAGES_MEAN = "critic/advantages/mean"
CRITIC_ADVANTAGES_MAX = "critic/advantages/max"
CRITIC_ADVANTAGES_MIN = "critic/advantages/min"
RESPONSE_LENGTH_MEAN = "response_length/mean"
RESPONSE_LENGTH_MAX = "response_length/max"
RESPONSE_LENGTH_MIN = "response_length/min"
RESPONSE_LENGTH_CLIP_RATIO = "response_length/clip_ratio"

# perf/*: throughput of the step.
PERF_TOTAL_NUM_TOKENS = "perf/total_num_tokens"
PERF_TIME_PER_STEP = "perf/time_per_step"
PERF_THROUGHPUT = "perf/throughput"

# timing_s/*: wall seconds of each stage of a step (`verl.trainer.metrics.timed`).
TIMING_GEN = "timing_s/gen"
TIMING_OLD_LOG_PROB = "timing_s/old_log_prob"
TIMING_REF = "timing_s/ref"
TIMING_REWARD = "timing_s/reward"
TIMING_OFF_POLICY = "timing_s/off_policy"
TIMING_ADV = "timing_s/adv"
TIMING_UPDATE_ACTOR = "timing_s/update_actor"
TIMING_SYNC_WEIGHTS = "timing_s/sync_weights"

# async/*: the rollout producer of an asynchronous run (async_training.staleness >= 1).
ASYNC_STALENESS_MEAN = "async/staleness_mean"
ASYNC_STALENESS_MAX = "async/staleness_max"
ASYNC_DROPPED_FRAC = "async/dropped_frac"
ASYNC_TRAINER_IDLE_S = "async/trainer_idle_s"
ASYNC_PRODUCER_IDLE_S = "async/producer_idle_s"
ASYNC_QUEUED_BATCHES = "async/queued_batches"

# val/*: the draft alone on the validation set (greedy unless val_override_config says otherwise).
VAL_REWARD_SCORE = "val/reward_score"
VAL_RESPONSE_LENGTH = "val/response_length"
VAL_GENERATIONS = "val/generations"  # a wandb table (file logger: <run>/val_generations.jsonl)

# multiturn/*: tool-using episodes (worker.rollout.multi_turn), from the packed batch.
MULTITURN_TURNS_MEAN = "multiturn/turns_mean"
MULTITURN_TOOL_CALLS_MEAN = "multiturn/tool_calls_mean"
MULTITURN_TOOL_ERROR_FRAC = "multiturn/tool_error_frac"
MULTITURN_TRUNCATED_FRAC = "multiturn/truncated_frac"
MULTITURN_TOOL_TOKEN_FRAC = "multiturn/tool_token_frac"
MULTITURN_RETOKENIZED_FRAC = "multiturn/retokenized_token_frac"

# Families whose last part is a reward component returned by the reward function (e.g. accuracy).
FAMILIES = ("critic/score/<component>", "val/score/<component>")

ALL_FIXED = tuple(
    v for k, v in dict(globals()).items() if k.isupper() and isinstance(v, str) and "/" in v
)


def in_namespace(name: str) -> bool:
    """True when `name` belongs to one of the documented namespaces."""
    return any(name.startswith(ns + "/") for ns in NAMESPACES)


def is_known(name: str) -> bool:
    """True when the trainer may log `name`: a fixed name or a member of a component family."""
    if name in ALL_FIXED:
        return True
    head, _, component = name.rpartition("/")
    return bool(component) and f"{head}/<component>" in FAMILIES
