"""Guidance math shared by rollout and trainer: behavior log-probs, λ schedules, guidance metrics.

Notation (docs/design.md#guidance-math): p the draft's processed next-token distribution, q the guidance's, λ the
guidance strength; speculative mode emits tokens from q_λ = (1-λ)·p + λ·q exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from verl.utils import metric_names as M
from verl.utils.registry import Registry
from verl.utils.torch_functional import masked_mean, selected_mean

LOG_PROB_FLOOR = -1e4
"""Stands for log 0 in tensors handed to the trainer (never -inf, never mistaken for a real
log-prob: exp(-1e4) underflows to 0 in float32 and float64)."""


def known_log_probs(*log_probs: torch.Tensor) -> torch.Tensor:
    """known_t = every log-prob at t is finite and above LOG_PROB_FLOOR, as bool (B, T).

    The floor stands for log 0 or for a value nobody reported, so no metric may average it: a
    metric reads only the known tokens of its inputs and reports the share it left out.
    """
    known = torch.ones_like(log_probs[0], dtype=torch.bool)
    for log_prob in log_probs:
        known = known & log_prob.isfinite() & (log_prob > LOG_PROB_FLOOR)
    return known


BehaviorFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
BEHAVIORS: Registry[BehaviorFn] = Registry("guidance behavior rule")


@BEHAVIORS.register("exact")
def mixture_log_probs(
    draft_log_probs: torch.Tensor,
    guidance_log_probs: torch.Tensor,
    offpolicy_mask: torch.Tensor,
    lam: float | torch.Tensor,
) -> torch.Tensor:
    """log q_λ(x) = logsumexp(log(1-λ) + log p(x), log λ + log q(x)), for every token. (B, T).

    The exact behavior of speculative guidance whatever the provenance of x. λ = 0 gives log p,
    λ = 1 gives log q; `lam` a float, or λ_t per token (B, T) (a gated or partly guided rollout). Paper: https://arxiv.org/abs/2211.17192 (speculative sampling: the accepted
    / residual construction emits the target mixture exactly).
    """
    if isinstance(lam, torch.Tensor):  # per-token λ_t (an entropy gate, a guided subset)
        if ((lam < 0.0) | (lam > 1.0)).any():
            raise ValueError(f"lam must lie in [0, 1], got values in [{lam.min()}, {lam.max()}]")
        lam = lam.to(torch.float64)
        keep, mix = torch.log1p(-lam), torch.log(lam)  # -inf at λ = 1 and λ = 0
        return torch.logaddexp(draft_log_probs + keep, guidance_log_probs + mix).to(
            draft_log_probs.dtype
        )
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must lie in [0, 1], got {lam}")
    log_keep = math.log1p(-lam) if lam < 1.0 else -math.inf
    log_lam = math.log(lam) if lam > 0.0 else -math.inf
    return torch.logaddexp(draft_log_probs + log_keep, guidance_log_probs + log_lam)


@BEHAVIORS.register("provenance")
def provenance_log_probs(
    draft_log_probs: torch.Tensor,
    guidance_log_probs: torch.Tensor,
    offpolicy_mask: torch.Tensor,
    lam: float,
) -> torch.Tensor:
    """μ(x) = q(x) where offpolicy_mask else p(x): the original patch's rule, for ablations. (B, T).

    Exact for mix mode, where each response comes entirely from one engine.
    Paper: https://arxiv.org/abs/2504.14945 (LUFFY: off-policy guidance).
    """
    return torch.where(offpolicy_mask.bool(), guidance_log_probs, draft_log_probs)


GuidanceModeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, str], torch.Tensor]
GUIDANCE_MODES: Registry[GuidanceModeFn] = Registry("guidance mode")


@GUIDANCE_MODES.register("speculative")
def speculative_behavior(
    draft_lp, guidance_lp, offpolicy_mask, lam, behavior="exact"
) -> torch.Tensor:
    """Token-level guidance: tokens follow q_λ; μ per `behavior` (exact mixture by default). (B, T)."""
    return BEHAVIORS.get(behavior)(draft_lp, guidance_lp, offpolicy_mask, lam)


@GUIDANCE_MODES.register("mix")
def mix_behavior(draft_lp, guidance_lp, offpolicy_mask, lam, behavior="exact") -> torch.Tensor:
    """Sequence-level (LUFFY-style) mixing: guidance responses have μ = q, draft responses μ = p. (B, T)."""
    return provenance_log_probs(draft_lp, guidance_lp, offpolicy_mask, lam)


def compute_behavior_log_probs(
    draft_log_probs: torch.Tensor,
    guidance_log_probs: torch.Tensor,
    offpolicy_mask: torch.Tensor,
    lam: float,
    mode: str = "speculative",
    behavior: str = "exact",
) -> torch.Tensor:
    """Behavior log-probs μ(y_t) of emitted tokens for guidance `mode` and `behavior` rule. (B, T)."""
    return GUIDANCE_MODES.get(mode)(
        draft_log_probs, guidance_log_probs, offpolicy_mask, lam, behavior
    )


def guidance_tensors(
    draft_log_probs: torch.Tensor,
    guidance_log_probs: torch.Tensor,
    offpolicy_mask: torch.Tensor,
    response_mask: torch.Tensor,
    lam: float,
    mode: str = "speculative",
    behavior: str = "exact",
    target_log_probs: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The rollout's guidance tensors from per-token log p and log q, all (B, T).

    μ_t = `compute_behavior_log_probs`(p, q) with q = 0 wherever log q is -inf or NaN. With
    `target_log_probs` (log q̃, the guidance part of the target the speculative rollout actually
    sampled, e.g. q renormalised over its listed set) the rule `exact` uses q̃ in place of q:
    μ = (1-λ)·p + λ·q̃, the probability of the procedure run; q̃ is known for every token, so
    nothing is missing from μ.
    log q reads -inf where q is exactly 0 after the sampling settings' processing (top-k, top-p)
    and NaN where the guidance did not report it. Both give `guidance_log_probs` =
    `LOG_PROB_FLOOR` and a behavior computed with q = 0, so (rule `exact`) a draft token outside
    the guidance's support has μ = (1-λ)·p(x), not p(x); only NaN sets `guidance_missing_mask`.
    For a missing q(x) (x outside the guidance's top-K) the truth lies in [0, q_K], q_K the
    smallest listed guidance probability, so log μ is at most log(1 + λ·q_K / ((1-λ)·p(x))) too
    low. Returns guidance_log_probs, guidance_missing_mask, offpolicy_mask and
    behavior_log_probs, zero (False) on padding.
    Paper: https://arxiv.org/abs/2211.17192 (speculative sampling: tokens follow q_λ exactly).
    """
    valid = response_mask.bool()
    missing = guidance_log_probs.isnan() & valid
    guide = guidance_log_probs.nan_to_num(nan=LOG_PROB_FLOOR, neginf=LOG_PROB_FLOOR)
    guide = guide.clamp(min=LOG_PROB_FLOOR)
    draft = draft_log_probs.nan_to_num(neginf=LOG_PROB_FLOOR).clamp(min=LOG_PROB_FLOOR)
    off = offpolicy_mask.bool() & valid
    if target_log_probs is not None and mode == "speculative" and behavior == "exact":
        target = target_log_probs.nan_to_num(neginf=LOG_PROB_FLOOR).clamp(min=LOG_PROB_FLOOR)
        mu = mixture_log_probs(draft, target, off, lam)
    else:
        mu = compute_behavior_log_probs(draft, guide, off, lam, mode, behavior)
    mask = valid.to(guide.dtype)
    return {
        "guidance_log_probs": guide * mask,
        "guidance_missing_mask": missing,
        "offpolicy_mask": off,
        "behavior_log_probs": mu.clamp(min=LOG_PROB_FLOOR) * mask,
    }


TargetFn = Callable[[np.ndarray, np.ndarray], np.ndarray]
TOPK_TARGETS: Registry[TargetFn] = Registry("top-K target")
"""What the speculative rollout samples where the guidance is known only on its listed set S
(mass Q_S): each rule maps λ_t (N,) and Q_S (N,) to the λ'_t (N,) of t = (1-λ'_t)·p + λ'_t·q̃, so
the same verify step, residual and μ serve every rule (μ uses the λ'_t recorded per token)."""


@TOPK_TARGETS.register("renormalize")
def target_renormalize(lam: np.ndarray, mass: np.ndarray) -> np.ndarray:
    """t = (1-λ)·p + λ·q̃, q̃ = q·1_S/Q_S: the guidance renormalised over S takes all of λ.
    TV(t, q_λ) = λ·(1 - Q_S) exactly. lam, mass (N,) -> (N,)."""
    return lam


@TOPK_TARGETS.register("draft_tail")
def target_draft_tail(lam: np.ndarray, mass: np.ndarray) -> np.ndarray:
    """t = (1 - λQ_S)·p + λ·q·1_S = (1-λ')·p + λ'·q̃ with λ' = λ·Q_S: the unlisted mass goes to the
    draft. TV(t, q_λ) ≤ λ·(1 - Q_S) (computable only with q off S: logged as that bound), and
    acceptance ≥ 1 - λ·Q_S. lam, mass (N,) -> (N,). Same algebra as arXiv:2211.17192."""
    return lam * np.clip(mass, 0.0, 1.0)


ScheduleFn = Callable[[float, float, float], float]
LAM_SCHEDULES: Registry[ScheduleFn] = Registry("lam schedule")


@LAM_SCHEDULES.register("constant")
def lam_constant(start: float, end: float, progress: float) -> float:
    """λ(s) = λ_0."""
    return start


@LAM_SCHEDULES.register("linear")
def lam_linear(start: float, end: float, progress: float) -> float:
    """λ(s) = λ_0 + (λ_end - λ_0)·s, s the schedule's progress in [0, 1] (`lam_at_step`)."""
    return start + (end - start) * progress


@LAM_SCHEDULES.register("cosine")
def lam_cosine(start: float, end: float, progress: float) -> float:
    """λ(s) = λ_end + (λ_0 - λ_end)·(1 + cos(π s))/2."""
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lam_at_step(
    step: int,
    total_steps: int,
    lam: float,
    lam_end: float,
    schedule: str = "constant",
    schedule_steps: int | None = None,
) -> float:
    """λ of training step `step` under `schedule`: λ(s) = f(lam, lam_end, clip((s - 1)/S, 0, 1)).

    Steps are counted as the trainer counts them: `step` is the 1-based number of the step being
    run (the first step is 1; checkpoint global_step_<n> is saved after step n). The first step
    uses `lam` exactly and step 1 + S and every later one `lam_end`, S = `schedule_steps`, or
    S = total_steps - 1 when it is None so that the run's last step uses `lam_end` (S >= 1).
    """
    span = schedule_steps if schedule_steps is not None else total_steps - 1
    progress = min(max((step - 1) / max(span, 1), 0.0), 1.0)
    return LAM_SCHEDULES.get(schedule)(lam, lam_end, progress)


GateFn = Callable[[np.ndarray, float], np.ndarray]
LAM_GATES: Registry[GateFn] = Registry("lam gate")


@LAM_GATES.register("none")
def gate_none(entropy: np.ndarray, tau: float) -> np.ndarray:
    """g_t = 1: λ_t = λ at every position. entropy (N,) -> (N,)."""
    return np.ones_like(entropy, dtype=np.float64)


@LAM_GATES.register("entropy")
def gate_entropy(entropy: np.ndarray, tau: float) -> np.ndarray:
    """g_t = min(1, H_t/τ): the guidance steps in where the draft is uncertain. (N,) -> (N,).

    λ_t = λ·g_t is a function of the draft's distribution at position t alone (never of the token
    sampled there), so the speculative target stays known and μ exact.
    Paper: https://arxiv.org/abs/2510.04140 (MENTOR: entropy-gated expert guidance).
    """
    if tau <= 0:
        raise ValueError(f"entropy threshold τ must be > 0, got {tau}")
    return np.clip(np.asarray(entropy, dtype=np.float64) / tau, 0.0, 1.0)


def entropy_threshold(entropies: np.ndarray, floor: float, percentile: float | None) -> float:
    """τ = max(the `percentile`-th percentile of `entropies` (N,), `floor`); `floor` when
    `percentile` is None or there are no entropies (MENTOR: 95th percentile, floor 1.5)."""
    if percentile is None or len(entropies) == 0:
        return float(floor)
    return max(
        float(np.percentile(np.asarray(entropies, dtype=np.float64), percentile)), float(floor)
    )


def compute_guidance_metrics(
    offpolicy_mask: torch.Tensor,
    response_mask: torch.Tensor,
    behavior_log_probs: torch.Tensor,
    draft_log_probs: torch.Tensor | None,
    guidance_missing_mask: torch.Tensor | None = None,
    lam: float | None = None,
) -> dict[str, float]:
    """behavior_kl = mean(log μ - log p) over valid tokens with both known, and provenance shares.

    offpolicy_token_ratio = guidance tokens / valid tokens; offpolicy_seq_ratio = share of
    responses with at least one guidance token; behavior_kl is the k1 estimate of KL(μ ‖ p)
    (tokens are drawn from μ) over the valid tokens whose log μ and log p are both known
    (`known_log_probs`: a draft log-prob at LOG_PROB_FLOOR, p = 0 or unreported, would add ~1e4);
    behavior_kl_excluded_frac = the share of valid tokens it left out. Both are left out when
    `draft_log_probs` is None (mix mode: the draft never scores the guidance's responses);
    missing_logprob_ratio = share of valid tokens without a guidance log-prob. Inputs (B, T).
    """
    valid = response_mask.to(behavior_log_probs.dtype)
    guided = offpolicy_mask.to(valid.dtype) * valid
    has_tokens = valid.sum(dim=-1) > 0
    metrics = {
        M.GUIDANCE_OFFPOLICY_TOKEN_RATIO: masked_mean(guided, valid).item(),
        M.GUIDANCE_OFFPOLICY_SEQ_RATIO: (guided.sum(dim=-1) > 0)[has_tokens].float().mean().item()
        if has_tokens.any()
        else 0.0,
    }
    if draft_log_probs is not None:
        known = valid.bool() & known_log_probs(behavior_log_probs, draft_log_probs)
        kl = selected_mean(behavior_log_probs - draft_log_probs, known)
        metrics[M.GUIDANCE_BEHAVIOR_KL] = kl.item()
        metrics[M.GUIDANCE_BEHAVIOR_KL_EXCLUDED_FRAC] = _excluded(known, valid)
    if guidance_missing_mask is not None:
        metrics[M.GUIDANCE_MISSING_LOGPROB_RATIO] = masked_mean(
            guidance_missing_mask.to(valid.dtype), valid
        ).item()
    if lam is not None:
        metrics[M.GUIDANCE_LAMBDA] = float(lam)
    return metrics


def _excluded(known: torch.Tensor, among: torch.Tensor) -> float:
    """Share of the tokens of `among` that `known` leaves out (0 when `among` is empty)."""
    total = among.bool().sum().item()
    return 1.0 - (known.bool() & among.bool()).sum().item() / total if total else 0.0


def _group_gap(scores: torch.Tensor, guided_seq: torch.Tensor, index: list) -> float | None:
    """Mean over groups holding both kinds of (mean guided score - mean unguided score)."""
    gaps = []
    for uid in dict.fromkeys(index):
        rows = torch.tensor([u == uid for u in index])
        guided, unguided = rows & guided_seq, rows & ~guided_seq
        if guided.any() and unguided.any():
            gaps.append(scores[guided].mean().item() - scores[unguided].mean().item())
    return sum(gaps) / len(gaps) if gaps else None


def compute_guidance_diagnostics(
    offpolicy_mask: torch.Tensor,
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    behavior_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    scores: torch.Tensor,
    index: list,
    clamp: tuple[float, float],
    importance_weights: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
) -> dict[str, float]:
    """What a guided step's update gets from its guidance tokens. Inputs (B, T); scores, index (B,).

    guided_is_weight_mean / guided_is_clip_frac: clamp(π_old/μ) and the share outside `clamp`,
    over the guidance tokens whose π_old and μ are known (`known_log_probs`);
    guided_excluded_frac = the share of guidance tokens left out. guided_grad_share =
    Σ_guided (w·A)²·E / Σ_valid (w·A)²·E over the tokens with π_old and μ known, with
    E_t = ‖e_y - π_old‖² = 1 - 2π_old(y_t) + Σπ² the squared norm of token t's policy-gradient
    term in logit space (needs Σπ²; cross-token terms ignored; w = 1 without weights).
    guided_score_gap: over the groups (`index`) holding responses with and without guidance
    tokens, the mean of (their mean score with - without). A name is left out when no token or
    group qualifies. Paper: https://arxiv.org/abs/2602.07078 (the logit-space gradient energy).
    """
    valid = response_mask.bool()
    guided = offpolicy_mask.bool() & valid
    known = valid & known_log_probs(old_log_probs, behavior_log_probs)
    metrics: dict[str, float] = {}
    if guided.any():
        metrics[M.GUIDANCE_GUIDED_EXCLUDED_FRAC] = _excluded(known, guided)
    if (guided & known).any():
        raw = (old_log_probs - behavior_log_probs)[guided & known].clamp(max=50.0).exp()
        metrics[M.GUIDANCE_GUIDED_IS_WEIGHT_MEAN] = raw.clamp(*clamp).mean().item()
        outside = (raw < clamp[0]) | (raw > clamp[1])
        metrics[M.GUIDANCE_GUIDED_IS_CLIP_FRAC] = outside.float().mean().item()
    if sum_pi_squared is not None:
        energy = (1.0 - 2.0 * old_log_probs.exp() + sum_pi_squared).clamp(min=0.0)
        w = importance_weights if importance_weights is not None else torch.ones_like(energy)
        power = torch.where(known, (w * advantages) ** 2 * energy, torch.zeros_like(energy))
        total = power.sum().item()
        if total > 0:
            metrics[M.GUIDANCE_GUIDED_GRAD_SHARE] = power[guided].sum().item() / total
    guided_seq = guided.any(dim=-1)
    has_tokens = valid.any(dim=-1)
    if (guided_seq & has_tokens).any():
        metrics[M.GUIDANCE_GUIDED_SEQ_SCORE] = scores[guided_seq & has_tokens].mean().item()
    if (~guided_seq & has_tokens).any():
        metrics[M.GUIDANCE_UNGUIDED_SEQ_SCORE] = scores[~guided_seq & has_tokens].mean().item()
    gap = _group_gap(scores, guided_seq & has_tokens, list(index))
    if gap is not None:
        metrics[M.GUIDANCE_GUIDED_SCORE_GAP] = gap
    return metrics


def unguided_entropies(
    draft_entropy: torch.Tensor, guided: torch.Tensor, response_mask: torch.Tensor
) -> np.ndarray:
    """The draft's entropies (finite ones) at the response tokens of the unguided responses, or
    of every response when all are guided: the sample `entropy_threshold`'s percentile reads
    (MENTOR's choice). draft_entropy, response_mask (B, T); guided (B,) -> (N,)."""
    valid = response_mask.bool() & draft_entropy.isfinite()
    unguided = valid & ~guided.bool().unsqueeze(-1)
    return draft_entropy[unguided if unguided.any() else valid].double().numpy()


def compute_gate_metrics(
    lam_tokens: torch.Tensor,
    draft_entropy: torch.Tensor,
    guided: torch.Tensor,
    response_mask: torch.Tensor,
    lam: float,
    tau: float | None,
    target_lam_tokens: torch.Tensor | None = None,
) -> dict[str, float]:
    """Per-position λ of a speculative rollout. lam_tokens (λ_t = λ·g_t as set), draft_entropy,
    response_mask, target_lam_tokens (λ'_t, the guidance's weight in the sampled target) (B, T);
    guided (B,). lambda_mean = mean λ_t over response tokens, target_lambda_mean = mean λ'_t
    there; draft_entropy_mean = mean H_t over those the rollout gave one; with a gate (`tau` not
    None): entropy_threshold = τ, and over the guided responses' tokens gate_mean = mean λ_t / λ
    and gate_open_frac = share with H_t ≥ τ."""
    valid = response_mask.bool()
    metrics: dict[str, float] = {}
    if valid.any():
        metrics[M.GUIDANCE_LAMBDA_MEAN] = lam_tokens[valid].double().mean().item()
        if target_lam_tokens is not None:
            metrics[M.GUIDANCE_TARGET_LAMBDA_MEAN] = target_lam_tokens[valid].double().mean().item()
    known = valid & draft_entropy.isfinite()
    if known.any():
        metrics[M.GUIDANCE_DRAFT_ENTROPY_MEAN] = draft_entropy[known].double().mean().item()
    if tau is None:
        return metrics
    metrics[M.GUIDANCE_ENTROPY_THRESHOLD] = float(tau)
    at = known & guided.bool().unsqueeze(-1)
    if at.any() and lam > 0:
        metrics[M.GUIDANCE_GATE_MEAN] = (lam_tokens[at].double().mean() / lam).item()
        metrics[M.GUIDANCE_GATE_OPEN_FRAC] = (draft_entropy[at] >= tau).double().mean().item()
    return metrics
