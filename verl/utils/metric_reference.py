"""What every logged metric means and what a healthy run shows: the source of the metric reference
in README_guidance.md (`python -m verl.tools.docs`) and of the wandb dashboard's sections
(`python -m verl.tools.wandb_dashboard`). Names come from `verl.utils.metric_names`.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl.utils import metric_names as M


@dataclass(frozen=True)
class MetricDoc:
    """One logged name (or `<component>` family) with its dashboard section and its reading."""

    name: str
    section: str
    meaning: str
    healthy: str


SECTIONS = (
    "Guidance",
    "Off-policy correction",
    "Mismatch",
    "OTB variance",
    "Distillation",
    "Actor",
    "Rewards",
    "Timing",
    "Multi-turn",
    "Asynchronous",
)
"""Dashboard sections, in the order they appear (README_guidance.md groups the reference alike)."""

_G, _O, _MM, _V, _D, _A, _R, _T, _MT, _AS = SECTIONS

_DOCS = (
    # ---------------------------------------------------------------- Guidance
    MetricDoc(M.GUIDANCE_LAMBDA, _G, "λ of this step's rollout (the schedule's value; 0 for a teacher-only rollout).",
              "Follows `lam` → `lam_end`."),
    MetricDoc(M.GUIDANCE_OFFPOLICY_TOKEN_RATIO, _G, "Share of response tokens the guidance emitted (provenance: the residual drawn where a proposal or the bonus lookahead was rejected); mix mode: share of tokens in guidance-written responses.",
              "Grows with λ and with the draft–guidance disagreement; at fixed λ it should fall as the draft learns (6.2 % on the demo of 2026-11-29 at k = 1, λ 0.5 → 0.1)."),
    MetricDoc(M.GUIDANCE_OFFPOLICY_SEQ_RATIO, _G, "Share of responses with at least one guidance token.",
              "Between the token ratio and 1; near 1 means almost every response is a blend."),
    MetricDoc(M.GUIDANCE_ACCEPT_RATE, _G, "Speculative mode: accepted / proposed draft tokens. Its expectation is 1 − λ·TV(p, q), since q_λ − p = λ(q − p).",
              "1 − accept_rate ≤ λ; near 1 − λ means draft and guidance almost never agree."),
    MetricDoc(M.GUIDANCE_BEHAVIOR_KL, _G, "mean(log μ − log p) over sampled tokens whose log μ and log p are both known (a draft log-prob at the floor, p = 0 or unreported, is left out): the k1 estimate of KL(μ ‖ p), how far the behavior is from the draft's own sampler. Not logged in mix mode.",
              "≥ 0 in expectation; 0 at λ = 0; large values mean large importance-weight corrections."),
    MetricDoc(M.GUIDANCE_BEHAVIOR_KL_EXCLUDED_FRAC, _G, "Share of response tokens left out of behavior_kl: log μ or log p at the floor or not finite (mostly guidance tokens outside the draft's top-k/top-p support, where p = 0). Not logged in mix mode.",
              "0 without top-k/top-p; otherwise at most offpolicy_token_ratio. behavior_kl describes only the other tokens."),
    MetricDoc(M.GUIDANCE_MISSING_LOGPROB_RATIO, _G, "Share of response tokens without a guidance log-prob (outside the guidance's top-K, or a draft response in mix mode).",
              "0 when `logprobs` covers the vocabulary; in mix mode 1 − offpolicy_token_ratio."),
    MetricDoc(M.GUIDANCE_TOPK_TAIL_MASS, _G, "Mean probability mass 1 − Q_S of the guidance's processed distribution (after temperature, top-k, top-p) outside the `logprobs` top-K set S it listed, per scored position.",
              "0 when K covers the vocabulary or the top-k/top-p cut; otherwise how much of q the speculative target leaves out (see target_tv)."),
    MetricDoc(M.GUIDANCE_TARGET_TV, _G, "Mean over emitted tokens of TV(target, q_λ) = λ·(1 − Q_S) at their positions: how far the distribution the rollout sampled exactly (q renormalised over its listed set S, mixed with p) is from the ideal q_λ; under `topk_target: draft_tail` that value is an upper bound (the exact distance needs q off S). μ is exact for the target either way.",
              "0 when K covers the vocabulary or the cut; raise `logprobs` if it matters for your experiment."),
    MetricDoc(M.GUIDANCE_DRAFT_LOOKUP_RATIO, _G, "Draft-engine lookups (a residual token the guidance drew, after a proposal or the bonus lookahead, that the draft's own top-K does not list, whose p μ needs) per emitted token.",
              "0 when the draft's `logprobs` cover the vocabulary; each lookup recomputes one token of the draft."),
    MetricDoc(M.GUIDANCE_GUIDED_IS_WEIGHT_MEAN, _G, "Mean truncated weight clamp(π_old/μ) over the guidance tokens whose π_old and μ are known.",
              "Below 1 when the draft finds the guidance's tokens unlikely; near 0 means they barely train."),
    MetricDoc(M.GUIDANCE_GUIDED_IS_CLIP_FRAC, _G, "Share of guidance tokens (π_old and μ known) whose raw ratio left [importance_clamp_min, importance_clamp_max].",
              "Low; high means the clamp, not the data, sets their weight."),
    MetricDoc(M.GUIDANCE_GUIDED_EXCLUDED_FRAC, _G, "Share of guidance tokens left out of the guided_* weight statistics and of guided_grad_share: π_old or μ at the floor or not finite.",
              "0; above 0 means a behavior log-prob was never reported for some guidance token."),
    MetricDoc(M.GUIDANCE_GUIDED_GRAD_SHARE, _G, "Guidance tokens' share of Σ_t (w·A)²·‖e_y − π_old‖², the per-token policy-gradient energy in logit space, over tokens with π_old and μ known (needs Σπ²; cross-token terms ignored).",
              "Compare with offpolicy_token_ratio: far below it means the guidance tokens contribute little to the update."),
    MetricDoc(M.GUIDANCE_GUIDED_SEQ_SCORE, _G, "Mean outcome reward of responses with at least one guidance token.",
              "Above unguided_seq_score when guidance helps the rollout find rewards."),
    MetricDoc(M.GUIDANCE_UNGUIDED_SEQ_SCORE, _G, "Mean outcome reward of responses without guidance tokens.", "—"),
    MetricDoc(M.GUIDANCE_GUIDED_SCORE_GAP, _G, "Within groups that hold both kinds: mean of (mean reward with guidance tokens − without), averaged over such groups.",
              "Positive when guidance makes the group's successes; ≤ 0 means it adds no reward signal."),
    # selective guidance: per-position λ_t (lam_gate), a guided subset (guided_samples), MENTOR's advantages
    MetricDoc(M.GUIDANCE_LAMBDA_MEAN, _G, "Mean λ_t = λ·g_t over the emitted tokens of the speculative rollout (unguided responses of a guided subset count 0).",
              "Equals lambda without a gate and with every response guided; with the entropy gate and guided_samples m of n, at most lambda·m/n."),
    MetricDoc(M.GUIDANCE_TARGET_LAMBDA_MEAN, _G, "Mean λ'_t, the guidance's weight in the target each token was sampled from, over the same tokens: λ_t under topk_target renormalize, λ_t·Q_S under draft_tail (Q_S the guidance's listed mass).",
              "Equals guidance/lambda_mean when K covers the vocabulary or the target renormalizes; below it by the unlisted mass the draft_tail target hands to the draft."),
    MetricDoc(M.GUIDANCE_GATE_MEAN, _G, "Mean gate g_t = λ_t/λ over the guided responses' tokens (entropy gate: min(1, H_t/τ)).",
              "1 with lam_gate none; with the entropy gate well below 1 (the guidance acts on the uncertain positions only); near 1 means τ is too low."),
    MetricDoc(M.GUIDANCE_GATE_OPEN_FRAC, _G, "Share of the guided responses' tokens whose gate is fully open (H_t ≥ τ, λ_t = λ).",
              "Small (a few %) with MENTOR's 95th-percentile τ; it falls as the draft grows confident."),
    MetricDoc(M.GUIDANCE_DRAFT_ENTROPY_MEAN, _G, "Mean draft entropy H_t over emitted tokens, from the draft's K listed log-probs with the tail as one atom: −Σ_topK p log p − R log R, R = 1 − Σ_topK p (a lower bound of H, exact when K covers the vocabulary).",
              "Falls slowly over training; a collapse toward 0 means exploration is gone (MENTOR's gate then closes too)."),
    MetricDoc(M.GUIDANCE_ENTROPY_THRESHOLD, _G, "τ of the entropy gate this step: `entropy_threshold`, or max(the `entropy_percentile`-th percentile of the previous step's draft entropies on unguided responses, that floor).",
              "Constant without a percentile; with one, at or above the floor and tracking draft_entropy_mean's upper tail."),
    MetricDoc(M.GUIDANCE_SUBSET_GUIDED_SCORE, _G, "Mean reward of the guided subset (the first `guided_samples` responses of each prompt); logged when guided_samples < n.",
              "Above subset_unguided_score while the guidance helps; the two meet when the draft has caught up (or λ_t is 0)."),
    MetricDoc(M.GUIDANCE_SUBSET_UNGUIDED_SCORE, _G, "Mean reward of the draft-only responses of the same rollout; logged when guided_samples < n.",
              "Rises: the draft's own reward on the training prompts."),
    MetricDoc(M.GUIDANCE_GUIDED_PROMPT_FRAC, _G, "guide_when group_fails: share of this step's prompts whose n draft-only first-stage responses all failed (reward below `fail_below`), which got guided responses in place of their first m.",
              "High early on a hard task, falling as the draft learns; 0 means the step ran unguided."),
    MetricDoc(M.GUIDANCE_FIRST_STAGE_SCORE, _G, "guide_when group_fails: mean reward of the draft-only first stage (every prompt, before any guided response replaced some).",
              "The draft's own training reward; rises as it learns."),
    MetricDoc(M.GUIDANCE_FIRST_STAGE_ANY_SUCCESS, _G, "guide_when group_fails: share of prompts with at least one first-stage response at or above `fail_below` (1 − guided_prompt_frac): the groups GRPO learns from without guidance.",
              "Rises as the draft learns; compare with any_success, the share after guidance."),
    MetricDoc(M.GUIDANCE_GUIDED_PROMPTS_FIRST_SCORE, _G, "guide_when group_fails: mean first-stage reward of the prompts that were guided (below `fail_below` by construction; above 0 with partial credit). Their rewards after guidance: subset_guided_score.",
              "Below `fail_below`."),
    MetricDoc(M.GUIDANCE_PREFIX_FRACTION, _G, "Teacher prefix: this step's j_max / response budget (`prefix_fraction` → `prefix_fraction_end` under `prefix_schedule`); a guided response's first j tokens are written at λ_t = 1.",
              "Follows its schedule; 0 once the prefix is gone."),
    MetricDoc(M.GUIDANCE_GUIDED_ADV_WEIGHT, _G, "guided_advantage mentor: the guided responses' weight w(s) = ½(1 + cos(π·s/S)) at step s, 0 from S = `guided_advantage_decay_steps` on.",
              "Falls from 1 to 0 over S steps; 0 afterwards (the rollout is then unguided)."),
    MetricDoc(M.GUIDANCE_GUIDED_ADV_MEAN, _G, "guided_advantage mentor: mean advantage of the guided responses, max(r − unguided group mean, 0)·w(s).",
              "≥ 0 by construction; 0 when the guided responses never beat their group's unguided mean (the guidance adds no signal) and after S steps."),
    # ---------------------------------------------------------------- Off-policy correction
    MetricDoc(M.GUIDANCE_IS_WEIGHT_MEAN, _O, "Mean truncated importance weight w = clamp(π_old/μ) over response tokens whose weight reads only known log-probs (`tis_level`).",
              "Near 1; below 1 even at λ = 0 under top-k/top-p (π_old is the untruncated softmax)."),
    MetricDoc(M.GUIDANCE_IS_WEIGHT_STD, _O, "Standard deviation of the weights.",
              "Small (< 0.5); growth means the update leans on a few tokens."),
    MetricDoc(M.GUIDANCE_IS_WEIGHT_MIN, _O, "Smallest weight of the batch.",
              "≥ `importance_clamp_min`; near 0 for guidance tokens the draft finds unlikely."),
    MetricDoc(M.GUIDANCE_IS_WEIGHT_MAX, _O, "Largest weight of the batch.",
              "≤ `importance_clamp_max`; at the cap when some token is clipped."),
    MetricDoc(M.GUIDANCE_IS_CLIP_FRAC, _O, "Share of tokens whose raw ratio left [clamp_min, clamp_max].",
              "A few percent; a large value biases the update (raise the cap or lower λ)."),
    MetricDoc(M.GUIDANCE_IS_WEIGHT_EXCLUDED_FRAC, _O, "Share of response tokens left out of the is_weight_* statistics: π_old or μ at the floor or not finite (at sequence and geometric level, any such token of the response). The update still uses their clamped weight.",
              "0; above 0 means a behavior log-prob was never reported."),
    MetricDoc(M.MISMATCH_MIS_MASKED_FRAC, _O, "Masked IS (`mis_level`): share of tokens dropped because their ratio left the band.",
              "A few percent at most."),
    MetricDoc(M.MISMATCH_GEO_MASKED_SEQ_FRAC, _O, "Geometric mask: share of responses dropped because exp(mean log π_old/μ) left the band.",
              "Near 0."),
    MetricDoc(M.ACTOR_OPSM_MASKED_SEQ_FRAC, _O, "OPSM (`opsm_delta`): share of responses dropped (A < 0 and mean log(μ/π_θ) > δ).",
              "Near 0 on-policy; grows with λ."),
    MetricDoc(M.ACTOR_LUFFY_TOKEN_FRAC, _O, "LUFFY shaping: share of tokens whose loss is the shaped −A·π/(π+γ) (the guidance tokens).",
              "Equals offpolicy_token_ratio."),
    # ---------------------------------------------------------------- Mismatch
    MetricDoc(M.MISMATCH_KL_V1, _MM, "mean(log μ − log π_old) over draft-emitted, non-forced tokens with both log-probs known: vLLM's sampler vs the FSDP actor (`algorithm.proximal=rollout`: the update's first mini-batch, before its step).",
              "|kl_v1| < 1e-3 in float32; ~1e-3–1e-2 in bf16."),
    MetricDoc(M.MISMATCH_KL_V2, _MM, "½·mean((log μ − log π_old)²) over the same tokens.",
              "< 1e-3; a jump means the engines disagree (weights not synced, dtype, kernels); above "
              "`algorithm.max_mismatch_kl` (0.05) the step fails."),
    MetricDoc(M.MISMATCH_KL_K3, _MM, "mean(r − 1 − log r), r = π_old/μ, over the same tokens (non-negative estimator).",
              "Like kl_v2."),
    MetricDoc(M.MISMATCH_FORCED_TOKEN_RATIO, _MM, "Share of draft tokens (log-probs known) sampled with log-prob above `mismatch_forced_threshold` (left out of the KLs).",
              "Rises as the policy sharpens."),
    MetricDoc(M.MISMATCH_EXCLUDED_FRAC, _MM, "Share of draft-emitted tokens left out of the mismatch KLs because log μ or log π_old is at the floor or not finite.",
              "0; above 0 means the sampler reported no log-prob for some token."),
    # ---------------------------------------------------------------- OTB variance
    MetricDoc(M.VARIANCE_PROXY_TOTAL_POWER, _V, "mean_i A_i²·W_i, W_i = Σ_t ‖e_y − π‖² (× w²): the summed per-sample gradient energy (needs Σπ²).",
              "Falls with a better baseline (OTB below GRPO at equal data)."),
    MetricDoc(M.VARIANCE_PROXY_SIGNAL, _V, "‖ḡ‖², the squared measured gradient norm.",
              "Compare with total power: signal ≪ power means a noisy step."),
    MetricDoc(M.VARIANCE_PROXY_PURE_NOISE, _V, "(total_power − signal)/(N − 1): the noise part of the batch gradient.",
              "Lower is better at equal signal."),
    MetricDoc(M.VARIANCE_PROXY_EXPECTED_A2, _V, "mean_i A_i², the advantage power.",
              "≈ 1 with GRPO's std normalisation, less with Dr. GRPO or OTB."),
    MetricDoc(M.VARIANCE_PROXY_EXPECTED_W, _V, "mean_i W_i, the score-function energy of a response.",
              "Falls as the policy sharpens."),
    # ---------------------------------------------------------------- Distillation
    MetricDoc(M.DISTILL_REVERSE_KL, _D, "mean of w·k_t(π_old, q) over scored tokens with q > 0 (log q above the floor): the per-token estimate of KL(π_old ‖ q) toward the guidance.",
              "Falls over training; the distillation signal."),
    MetricDoc(M.DISTILL_TEACHER_LOG_PROB, _D, "mean log q over the same tokens as reverse_kl (scored, q > 0).",
              "Rises toward 0 as the draft imitates the guidance."),
    MetricDoc(M.DISTILL_MISSING_FRAC, _D, "Share of response tokens left out of the distillation term (no guidance log-prob).",
              "0 when `logprobs` covers the vocabulary."),
    MetricDoc(M.DISTILL_EXCLUDED_FRAC, _D, "Share of response tokens left out of reverse_kl, teacher_log_prob and advantage_abs: missing, q = 0 (the floor; such tokens stay in the training term with |log π − log q| clamped to 20) or π_old unknown.",
              "≥ missing_frac; the gap is the share of sampled tokens the guidance rules out."),
    MetricDoc(M.DISTILL_ADVANTAGE_ABS, _D, "Reward mode: mean |β·k_t| over the same tokens as reverse_kl, the size of the dense term added to the advantages.",
              "Comparable to or below the outcome advantages' scale."),
    MetricDoc(M.ACTOR_DISTILL_LOSS, _D, "Loss mode: β·agg(w·k_t(π_θ, q)) (or the top-K forward KL), averaged over micro-batches.",
              "Falls over training."),
    # ---------------------------------------------------------------- Actor
    MetricDoc(M.ACTOR_PG_LOSS, _A, "Policy-gradient loss of the update (mean over micro-batches).", "Noisy around 0."),
    MetricDoc(M.ACTOR_PPO_KL, _A, "mean(log π_old − log π_θ) over updated tokens: how far the update moved.", "Small, < 1e-2."),
    MetricDoc(M.ACTOR_PG_CLIPFRAC, _A, "Share of tokens where the PPO (or trust-region) clip is active.", "A few percent."),
    MetricDoc(M.ACTOR_PG_CLIPFRAC_LOWER, _A, "Share of tokens clipped by the dual-clip lower bound (A < 0).", "Near 0."),
    MetricDoc(M.ACTOR_GRAD_NORM, _A, "Gradient norm before clipping to `max_grad_norm`.", "Finite; spikes precede instability."),
    MetricDoc(M.ACTOR_LR, _A, "Learning rate of the step.", "Follows the warm-up/decay schedule."),
    MetricDoc(M.ACTOR_ENTROPY, _A, "Mean token entropy of π_θ (when `entropy_coeff` > 0).", "Falls slowly; a collapse to 0 stops exploration."),
    MetricDoc(M.ACTOR_KL_LOSS, _A, "KL(π_θ ‖ π_ref) loss term (`use_kl_loss`).", "Small and slowly growing."),
    MetricDoc(M.ACTOR_REWARD_KL_PENALTY, _A, "KL in the reward (`algorithm.use_kl_loss: false`): the batch's mean per-response Σ_t KL(π_old ‖ π_ref) estimate, before the coefficient.", "Small and slowly growing; a jump means the policy left the reference fast."),
    MetricDoc(M.ACTOR_REWARD_KL_COEF, _A, "β of the KL in the reward (`algorithm.kl_coef`).", "Constant (no adaptive controller)."),
    MetricDoc(M.ACTOR_SKIPPED_STEPS, _A, "Optimizer steps skipped because the gradient was not finite.", "0."),
    # ---------------------------------------------------------------- Rewards
    MetricDoc(M.CRITIC_SCORE_MEAN, _R, "Mean outcome reward of the batch's responses (guided ones included).", "Rises."),
    MetricDoc(M.CRITIC_SCORE_MAX, _R, "Largest response reward.", "—"),
    MetricDoc(M.CRITIC_SCORE_MIN, _R, "Smallest response reward.", "—"),
    MetricDoc(M.CRITIC_SCORE_GROUP_ANY_SUCCESS, _R, "Share of prompts whose trained group holds a response scoring at or above `offpolicy_guidance.fail_below` (0.5 by default): under 0/1 rewards, the groups with a nonzero GRPO advantage (with guide_when group_fails: after guidance; before it: guidance/first_stage_any_success).",
              "Rises as the draft learns; near 0 means GRPO learns from almost no prompt (where guide_when group_fails is meant to help)."),
    MetricDoc("critic/score/<component>", _R, "Mean of one component the reward function returns besides `overall` (e.g. accuracy, format).", "—"),
    MetricDoc(M.CRITIC_ADVANTAGES_MEAN, _R, "Mean advantage over response tokens.", "Near 0 with group baselines."),
    MetricDoc(M.CRITIC_ADVANTAGES_MAX, _R, "Largest advantage.", "—"),
    MetricDoc(M.CRITIC_ADVANTAGES_MIN, _R, "Smallest advantage.", "—"),
    MetricDoc(M.RESPONSE_LENGTH_MEAN, _R, "Mean response length in tokens.", "—"),
    MetricDoc(M.RESPONSE_LENGTH_MAX, _R, "Longest response.", "—"),
    MetricDoc(M.RESPONSE_LENGTH_MIN, _R, "Shortest response.", "—"),
    MetricDoc(M.RESPONSE_LENGTH_CLIP_RATIO, _R, "Share of responses cut at `max_response_length`.", "Near 0; raise the limit if not."),
    MetricDoc(M.VAL_REWARD_SCORE, _R, "Mean reward of the draft alone on the validation set (no guidance).", "Rises: the number guidance must improve."),
    MetricDoc(M.VAL_RESPONSE_LENGTH, _R, "Mean validation response length.", "—"),
    MetricDoc("val/score/<component>", _R, "Validation mean of one reward component.", "—"),
    MetricDoc(M.VAL_GENERATIONS, _R, "wandb table of validation samples (`trainer.val_generations_to_log`): prompt, response, ground truth, score, step; the file logger writes them to `<run>/val_generations.jsonl`.", "Read the responses: a rising score with degenerate text is reward hacking."),
    # ---------------------------------------------------------------- Timing
    MetricDoc(M.TIMING_GEN, _T, "Rollout: draft (and guidance) generation.", "The largest stage."),
    MetricDoc(M.TIMING_OLD_LOG_PROB, _T, "Actor forward for π_old (and Σπ²); not logged with `algorithm.proximal=rollout`.", "—"),
    MetricDoc(M.TIMING_REF, _T, "Reference forward (KL).", "—"),
    MetricDoc(M.TIMING_REWARD, _T, "Reward function.", "—"),
    MetricDoc(M.TIMING_OFF_POLICY, _T, "Behavior log-probs, importance weights, masks and the guidance metrics.", "Small."),
    MetricDoc(M.TIMING_ADV, _T, "Advantage estimation (and the distillation reward).", "Small."),
    MetricDoc(M.TIMING_UPDATE_ACTOR, _T, "Actor update.", "—"),
    MetricDoc(M.TIMING_SYNC_WEIGHTS, _T, "Actor → rollout weight sync.", "Small."),
    MetricDoc(M.PERF_TIME_PER_STEP, _T, "Wall seconds of the whole step.", "—"),
    MetricDoc(M.PERF_TOTAL_NUM_TOKENS, _T, "Prompt + response tokens of the batch.", "—"),
    MetricDoc(M.PERF_THROUGHPUT, _T, "Tokens per second per actor rank.", "—"),
    # ---------------------------------------------------------------- Multi-turn
    MetricDoc(M.MULTITURN_TURNS_MEAN, _MT, "Mean policy turns per episode (`worker.rollout.multi_turn`).", "Between 1 and `max_turns`; 1 means the policy never calls a tool."),
    MetricDoc(M.MULTITURN_TOOL_CALLS_MEAN, _MT, "Mean tool calls run per episode.", "—"),
    MetricDoc(M.MULTITURN_TOOL_ERROR_FRAC, _MT, "Share of the tool calls run whose status is not ok (a raising tool, a timeout, an unknown tool, a malformed call, a call not run because every tool slot is held by a hung call).", "Low, and falling as the policy learns the call format."),
    MetricDoc(M.MULTITURN_TRUNCATED_FRAC, _MT, "Share of episodes cut: the response budget ran out, or `max_turns` was reached with calls left unanswered.", "Near 0; raise `response_length` or `max_turns` if not."),
    MetricDoc(M.MULTITURN_TOOL_TOKEN_FRAC, _MT, "Tool tokens (response_mask 0: context, never trained on) over all kept response tokens.", "—"),
    MetricDoc(M.MULTITURN_RETOKENIZED_FRAC, _MT, "Diagnostic: share of kept response tokens that a text round trip (decode the episode, tokenize it again) would change; what an agent loop that re-tokenizes its history would train on instead of the sampled tokens. Training never uses the re-encoded ids.", "Any value: token-in/token-out keeps the sampled ids whatever it is; `mismatch/kl_v1`, `kl_v2` stay small."),
    # ---------------------------------------------------------------- Asynchronous
    MetricDoc(M.ASYNC_STALENESS_MEAN, _AS, "Mean over the step's responses of the weight versions by which the policy that sampled a response lags the actor that trains on it (`async_training.staleness` >= 1; 0 in a synchronous run).", "At the bound k in the steady state (the producer stays k batches ahead); less while the trainer is the faster side."),
    MetricDoc(M.ASYNC_STALENESS_MAX, _AS, "Largest staleness of the step's responses.", "Never above `async_training.staleness`."),
    MetricDoc(M.ASYNC_DROPPED_FRAC, _AS, "Share of the step's responses older than the bound, masked out of the loss.", "0: the producer waits instead of generating a batch that would arrive too late."),
    MetricDoc(M.ASYNC_TRAINER_IDLE_S, _AS, "Seconds the trainer waited for the producer's next batch.", "Near 0 when the rollout keeps up; large when generation is the slower side."),
    MetricDoc(M.ASYNC_PRODUCER_IDLE_S, _AS, "Seconds the producer waited, since its previous batch, for the staleness bound or for a weight sync.", "Large when training is the slower side."),
    MetricDoc(M.ASYNC_QUEUED_BATCHES, _AS, "Batches generated and waiting when the step took its batch.", "Between 0 and the bound."),
)  # fmt: skip

METRIC_DOCS: dict[str, MetricDoc] = {doc.name: doc for doc in _DOCS}
"""Reference entry of every name in `metric_names.ALL_FIXED` and every family in `FAMILIES`."""


def in_section(section: str) -> list[MetricDoc]:
    """The reference entries of one dashboard section, in reference order."""
    if section not in SECTIONS:
        raise ValueError(f"unknown section '{section}'; valid: {', '.join(SECTIONS)}")
    return [doc for doc in _DOCS if doc.section == section]
