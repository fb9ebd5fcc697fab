"""One round of speculative guidance, the math: accept or reject the draft's proposals so every
emitted token follows the round's target (`verify_proposals` on tables, `verify_listed` on the
engines' flat rows), and the bonus token past a fully accepted round (`draw_bonus`).

Notation as in `speculative.py`: p the draft's processed next-token distribution, q the
guidance's, q_λ = (1-λ)·p + λ·q. Pure: no vLLM, no torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from verl.workers.rollout.log_prob_tables import NEG_INF, ListedRows, TopK, as_topk

DraftProbe = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
"""probe(rows, positions, ids) -> (R, M) log p: the draft's processed log-probs of ids (R, M) at
the position after positions[r] of round row rows[r]'s proposals (its prefix plus that many
proposals), for tokens the draft's listed rows do not give (an engine lookup)."""


@dataclass
class VerifyResult:
    """What one round emits, per sequence (tensors padded to k)."""

    tokens: torch.Tensor
    """(B, k) emitted token ids, -1 after `num_emitted`."""
    num_emitted: torch.Tensor
    """(B,) tokens emitted this round (accepted proposals + at most one residual token)."""
    num_accepted: torch.Tensor
    """(B,) draft proposals accepted."""
    offpolicy: torch.Tensor
    """(B, k) True for the residual token (emitted by the guidance), False elsewhere."""
    draft_log_probs: torch.Tensor
    """(B, k) log p(emitted token) (processed draft distribution; -inf where p = 0, and for a
    residual token the draft's top-K does not list: its p, at most the draft's tail, counts as 0)."""
    guidance_log_probs: torch.Tensor
    """(B, k) log q(emitted token) (processed guidance distribution; -inf where q = 0 after
    processing, e.g. a proposal that the guidance's top-k or top-p cuts: an exact 0, since every
    proposal's q is reported, column 0 of its row)."""
    target_log_probs: torch.Tensor | None = None
    """(B, k) log q̃(emitted token), the guidance part of the target the round sampled: q
    renormalised over the guidance's listed set S (-inf outside it), μ = (1-λ)p + λq̃."""
    target_tv: torch.Tensor | None = None
    """(B, k) TV(target, q_λ) = λ·(1 - Q_S) at each emitted token's position (0 where S holds
    all of q's mass)."""
    lam: torch.Tensor | None = None
    """(B, k) λ'_t of each emitted token's position: the guidance's weight in the target the round
    sampled (the round's λ, or its per-position values; λ_t·Q_S under `draft_tail`)."""
    strength: torch.Tensor | None = None
    """(B, k) λ_t of each emitted token's position, as set (schedule, gate, subset, prefix) before
    a top-K target turns it into λ'_t (`lam`); equal to `lam` where none does."""


def verify_proposals(
    proposals: torch.Tensor,
    num_proposed: torch.Tensor,
    draft_log_probs: torch.Tensor | TopK,
    guidance_log_probs: torch.Tensor | TopK,
    lam: float | torch.Tensor,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> VerifyResult:
    """Accept / reject a batch of proposals so the emitted tokens follow t = (1-λ)p + λq̃, q̃ = q
    renormalised over the guidance's listed set (q itself for a dense table: t = q_λ); the
    torch reference of `verify_listed` (same decisions and tokens for the same uniforms).
    `lam` a float, or λ_t per position (B, k) (the residual max(0, t - p) ∝ max(0, q̃ - p) does
    not depend on λ_t > 0, so only the acceptance test and the TV change).

    Shapes: proposals (B, k) long, num_proposed (B,); the processed draft / guidance log-probs at
    each proposal position as dense (B, k, V) tables or `TopK` lists (B, k, K). A guidance list
    is its set S (it must not depend on the proposal); the residual max(0, q̃ - p) is drawn over
    S by inverse CDF in listed order, and needs p on S: a draft `TopK` that does not list a
    token of S raises. `uniforms` (B, k'+1) in [0, 1), k' >= k: column i < k
    tests proposal i, the last column draws the residual token (default: from `generator`).
    Returns a `VerifyResult`.
    Paper: https://arxiv.org/abs/2211.17192 (speculative sampling, exact for any target).
    """
    _check_lam(lam)
    p, q = as_topk(draft_log_probs), as_topk(guidance_log_probs)
    batch, k = proposals.shape
    device = proposals.device
    lam = torch.as_tensor(lam, dtype=p.log_probs.dtype, device=device).expand(batch, k)
    log_p_x = p.lookup(proposals.unsqueeze(-1)).squeeze(-1)
    log_q_x = q.lookup(proposals.unsqueeze(-1)).squeeze(-1)
    log_mass = torch.logsumexp(q.log_probs, dim=-1)  # log Q_S (B, k)
    log_t_x = log_q_x - log_mass
    ratio = (1.0 - lam) + lam * torch.exp(log_t_x - log_p_x)
    if uniforms is None:
        uniforms = torch.rand(batch, k + 1, generator=generator, dtype=torch.float64)
    uniforms = uniforms.to(device=device, dtype=p.log_probs.dtype)
    proposed = torch.arange(k, device=device).unsqueeze(0) < num_proposed.unsqueeze(-1)
    rejected = proposed & (uniforms[:, :k] >= ratio.clamp(max=1.0))
    has_reject = rejected.any(dim=-1)
    first_reject = torch.where(has_reject, rejected.float().argmax(dim=-1), num_proposed)
    num_accepted = first_reject
    num_emitted = first_reject + has_reject.long()

    tokens = torch.where(torch.arange(k, device=device) < num_accepted.unsqueeze(-1), proposals, -1)
    offpolicy = torch.zeros(batch, k, dtype=torch.bool, device=device)
    log_p_emitted, log_t_emitted = log_p_x.clone(), log_t_x.clone()
    tv = lam * (1.0 - log_mass.exp()).clamp(min=0.0)  # Q_S sums to 1 + rounding at K = V
    rows = has_reject.nonzero().squeeze(-1)
    if rows.numel():
        pos = first_reject[rows]
        picked = _residual_tables(
            p.at(rows, pos), q.at(rows, pos), log_mass[rows, pos], uniforms[rows, -1]
        )
        tokens[rows, pos], log_p_emitted[rows, pos], log_t_emitted[rows, pos] = picked
        offpolicy[rows, pos] = True
    valid = tokens >= 0
    return VerifyResult(
        tokens=tokens,
        num_emitted=num_emitted,
        num_accepted=num_accepted,
        offpolicy=offpolicy,
        draft_log_probs=torch.where(valid, log_p_emitted, 0.0),
        guidance_log_probs=torch.where(valid, log_t_emitted + log_mass, 0.0),
        target_log_probs=torch.where(valid, log_t_emitted, 0.0),
        target_tv=torch.where(valid, tv, 0.0),
        lam=torch.where(valid, lam, 0.0),
        strength=torch.where(valid, lam, 0.0),
    )


def _residual_tables(
    p_at: TopK, q_at: TopK, log_mass: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The residual token y ~ max(0, q̃(y) - p(y)) over the guidance's set S at each rejected
    position (R): tables (R, 1, K) there, log Q_S (R,), uniforms (R,); inverse CDF in listed
    order. Returns y, log p(y), log q̃(y), (R,) each."""
    candidates = q_at.listed()  # (R, 1, K): only tokens with q̃ > 0 can have q̃ > p
    p_c = p_at.lookup(candidates).squeeze(1)
    candidates = candidates.squeeze(1)
    q_c = q_at.log_probs.squeeze(1) - log_mass.unsqueeze(-1)  # log q̃ on S
    if p_at.ids is not None and ((p_c == NEG_INF) & (q_c > NEG_INF)).any():
        raise ValueError("verify_proposals: the draft list does not give p on the guidance's S")
    residual = (q_c.exp() - p_c.exp()).clamp(min=0.0)
    empty = residual.sum(-1, keepdim=True) <= 0  # only reachable through rounding: use q
    residual = torch.where(empty, q_c.exp(), residual)
    cdf = residual.cumsum(-1)
    below = cdf <= (uniforms * cdf[:, -1]).unsqueeze(-1)
    pick = below.sum(-1, keepdim=True).clamp(max=residual.shape[-1] - 1)
    return tuple(t.gather(-1, pick).squeeze(-1) for t in (candidates, p_c, q_c))


def verify_listed(
    num_proposed: torch.Tensor,
    draft: ListedRows,
    guidance: ListedRows,
    lam: float | np.ndarray,
    uniforms: torch.Tensor,
    probe: DraftProbe | None = None,
    tv_lam: np.ndarray | None = None,
) -> VerifyResult:
    """Accept / reject the engines' flat rows so each emitted token follows the round's target
    t = (1-λ)·p + λ·q̃ exactly, q̃ = q renormalised over the guidance's listed set S:
    accept x w.p. min(1, t(x)/p(x)), else draw y ∝ max(0, q̃(y) - p(y)) over S.

    p(x) and q(x) of each proposal are column 0 of its rows (N, K+1); S is the guidance row's
    top-K columns (never column 0: S must not depend on the proposal), Q_S their mass, and
    q̃(y) = q(y)/Q_S on S, 0 elsewhere, so t = q_λ wherever S holds all of q's mass (K = V, or
    top-k/top-p cut inside the list) and TV(t, q_λ) = λ·(1 - Q_S) otherwise (`target_tv`).
    At a rejected position p is needed on all of S: read from the draft's row where it lists
    them (or its whole support), else from `probe` (the draft engine's lookup), asked only where
    the residual's draw lands on a token the row does not give; without a probe that raises.
    Every per-row operation is O(K) memory. `lam`: a float, or λ_t per flat row (N,) (a
    function of what is known at that position before its token is drawn, e.g. the draft's row:
    the target stays known; the residual does not depend on λ_t > 0).
    `tv_lam` (N,): the λ the reported distance λ·(1 - Q_S) uses (None: `lam`; a `TOPK_TARGETS`
    rule that rescales λ reports its bound against the unscaled λ).
    num_proposed (B,), uniforms (B, k+1) (column i tests proposal i, the last draws the
    residual); returns a `VerifyResult` with (B, k) tensors, k = uniforms.shape[1] - 1.
    Paper: https://arxiv.org/abs/2211.17192 (speculative sampling, exact for any target).
    """
    _check_lam(lam)
    num = num_proposed.numpy()
    u = uniforms.numpy().astype(np.float64, copy=False)
    batch, k = u.shape[0], u.shape[1] - 1
    proposals = draft.ids[:, 0]
    if not np.array_equal(proposals, guidance.ids[:, 0]):
        raise RuntimeError("draft and guidance rows do not list the same proposals in column 0")
    seq = np.repeat(np.arange(batch), num)
    starts = np.cumsum(num) - num
    pos = np.arange(len(seq)) - starts[seq]
    lam = np.broadcast_to(np.asarray(lam, dtype=np.float64), seq.shape)
    log_mass = np.log(guidance.topk_mass())  # log Q_S per row
    log_p_x = draft.log_probs[:, 0].astype(np.float64)
    log_q_x = guidance.log_probs[:, 0].astype(np.float64)
    log_t_x = np.where(guidance.in_topk(proposals), log_q_x - log_mass, NEG_INF)  # log q̃(x)
    with np.errstate(over="ignore", invalid="ignore"):  # p(x) > 0: x was sampled from p
        ratio = (1.0 - lam) + lam * np.exp(log_t_x - log_p_x)
    rejected = u[seq, pos] >= np.minimum(ratio, 1.0)
    first = np.full(batch, k)
    np.minimum.at(first, seq[rejected], pos[rejected])
    has_reject = first < k
    num_accepted = np.where(has_reject, first, num)
    kept = np.flatnonzero(pos < num_accepted[seq])
    at_seq, at_pos = seq[kept], pos[kept]
    tokens = np.full((batch, k), -1, dtype=np.int64)
    tokens[at_seq, at_pos] = proposals[kept]
    tv = (lam if tv_lam is None else tv_lam) * np.clip(1.0 - np.exp(log_mass), 0.0, None)
    strength = lam if tv_lam is None else tv_lam
    per_row = {"log_p": log_p_x, "log_q": log_q_x, "log_t": log_t_x, "tv": tv, "lam": lam,
               "strength": strength}  # fmt: skip
    out = {name: np.zeros((batch, k)) for name in per_row}  # (B, k) per emitted token
    for name, values in per_row.items():
        out[name][at_seq, at_pos] = values[kept]
    offpolicy = np.zeros((batch, k), dtype=bool)
    rows = np.flatnonzero(has_reject)
    if len(rows):
        at, cols = starts[rows] + first[rows], first[rows]  # the rejected positions' rows
        y, log_p_y, log_t_y = _residual_listed(draft, guidance, at, log_mass[at], u[rows, -1],
                                               probe, rows, cols)  # fmt: skip
        tokens[rows, cols] = y
        out["log_p"][rows, cols], out["log_t"][rows, cols] = log_p_y, log_t_y
        out["log_q"][rows, cols] = log_t_y + log_mass[at]
        out["tv"][rows, cols], out["lam"][rows, cols] = tv[at], lam[at]
        out["strength"][rows, cols] = strength[at]
        offpolicy[rows, cols] = True
    return VerifyResult(
        tokens=torch.from_numpy(tokens),
        num_emitted=torch.from_numpy(num_accepted + has_reject),
        num_accepted=torch.from_numpy(num_accepted),
        offpolicy=torch.from_numpy(offpolicy),
        draft_log_probs=torch.from_numpy(out["log_p"]),
        guidance_log_probs=torch.from_numpy(out["log_q"]),
        target_log_probs=torch.from_numpy(out["log_t"]),
        target_tv=torch.from_numpy(out["tv"]),
        lam=torch.from_numpy(out["lam"]),
        strength=torch.from_numpy(out["strength"]),
    )


def _residual_listed(
    draft: ListedRows,
    guidance: ListedRows,
    at: np.ndarray,
    log_mass: np.ndarray,
    uniforms: np.ndarray,
    probe: DraftProbe | None,
    rows: np.ndarray,
    positions: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The residual token y ∝ max(0, q̃(y) - p(y)) over the guidance row's set S at each rejected
    flat row `at` (R,): log Q_S there (R,), uniforms (R,), p on S from the draft's rows or
    `probe` (round rows `rows`, proposal counts `positions`); inverse CDF in listed order.
    Returns y, log p(y), log q̃(y), (R,) each."""
    candidates = guidance.ids[at, 1:]  # (R, K): S; only tokens with q̃ > 0 can have q̃ > p
    log_t_c = guidance.log_probs[at, 1:].astype(np.float64) - log_mass[:, None]
    log_p_c, known = draft.take(at).lookup_known(candidates)  # log p -inf where unknown
    pick = np.zeros(len(at), dtype=np.int64)
    exact = known.all(-1)  # the draft's row gives p on all of S: the residual by inverse CDF
    pick[exact] = _inverse_cdf(_residual(log_t_c[exact], log_p_c[exact]), uniforms[exact])
    bounded = np.flatnonzero(~exact)
    if len(bounded):

        def ask(i: np.ndarray, tokens: np.ndarray) -> np.ndarray:
            if probe is None:
                raise RuntimeError(
                    f"{len(i)} residual row(s) drew a guidance token the draft's top-K does not "
                    "list, whose p is needed, and no draft probe was given"
                )
            return probe(rows[bounded[i]], positions[bounded[i]], tokens)

        sub = log_p_c[bounded]  # filled where the probe is asked
        pick[bounded] = _residual_bounded(candidates[bounded], log_t_c[bounded], sub, known[bounded],
                                          uniforms[bounded], ask)  # fmt: skip
        log_p_c[bounded] = sub
    r = np.arange(len(at))
    return candidates[r, pick], log_p_c[r, pick], log_t_c[r, pick]


def _residual(log_t: np.ndarray, log_p: np.ndarray) -> np.ndarray:
    """max(0, q̃ - p) per row (R, K), q̃ itself where that is all 0 (reachable only by rounding)."""
    residual = np.clip(np.exp(log_t) - np.exp(log_p), 0.0, None)
    empty = residual.sum(-1, keepdims=True) <= 0
    return np.where(empty, np.exp(log_t), residual)


def _residual_bounded(
    candidates: np.ndarray,
    log_t: np.ndarray,
    log_p: np.ndarray,
    known: np.ndarray,
    uniforms: np.ndarray,
    probe: Callable[[np.ndarray, np.ndarray], np.ndarray],
) -> np.ndarray:
    """The residual draw y ∝ r = max(0, q̃ - p) over S at rows whose draft list misses some of S
    (`known` False there), by rejection from the envelope e = r on the known tokens and q̃ on the
    others (e >= r): y ~ e/Σe with u; a known y is kept (e = r there); an unknown y needs p(y)
    (μ needs it anyway): the probe gives the row's whole S (one call for all such rows, filling
    `log_p` in place) and y is kept if v < r(y)/q̃(y) = 1 - p(y)/q̃(y); a rejected row then draws
    from r exactly by inverse CDF with w (after a rejection, a rejection sampler's output is a
    fresh draw from r). The probe is asked only where the drawn token is unknown, not wherever
    S holds one. v, w come from a Philox stream keyed by u's 53 bits: a row's draw depends on
    its own uniform only. Shapes: candidates, log_t, log_p, known (R, K); uniforms (R,).
    Returns the picks (R,).
    Paper: https://arxiv.org/abs/2211.17192 (residual), von Neumann 1951 (rejection sampling)."""
    pick = _inverse_cdf(_residual(log_t, log_p), uniforms)  # e: r with p = 0 where unknown
    ask = np.flatnonzero(~known[np.arange(len(pick)), pick])
    if len(ask):
        log_p[ask] = probe(ask, candidates[ask])
        v, w = _more_uniforms(uniforms[ask], 2).T
        at = pick[ask]
        no = v >= 1.0 - np.exp(log_p[ask, at] - log_t[ask, at])  # 1 - p(y)/q̃(y)
        rejected = ask[no]
        pick[rejected] = _inverse_cdf(_residual(log_t[rejected], log_p[rejected]), w[no])
    return pick


def _more_uniforms(uniforms: np.ndarray, count: int) -> np.ndarray:
    """(R, count) uniforms in [0, 1) from a Philox stream keyed by each of `uniforms` (R,)
    (its 53 bits): independent of the uniform itself and of every other row's."""
    keys = (np.asarray(uniforms, dtype=np.float64) * 2.0**53).astype(np.uint64)
    return np.stack(
        [np.random.Generator(np.random.Philox(key=int(key))).random(count) for key in keys]
    )


@dataclass
class BonusRows:
    """What a fully accepted round's bonus token is drawn from, per sequence of the round (B):
    `has` (B,) whether the draft drafted a lookahead token past its proposals, `draft` (H, K+1)
    one row per such sequence (column 0 the lookahead token x ~ p, then the draft's top-K, H =
    has.sum()), `guidance` (B, K+1) the guidance's listed q one position past each sequence's
    last proposal (column 0 repeats a top-K token), processed like the proposals' rows."""

    has: np.ndarray
    draft: ListedRows
    guidance: ListedRows


def draw_bonus(
    draft: ListedRows,
    guidance: ListedRows,
    lam: float | np.ndarray,
    uniforms: np.ndarray,
    probe: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
    tv_lam: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The token past a fully accepted round, from the target t = (1-λ)p + λq̃ (q̃ = q
    renormalised over the guidance row's top-K set S): the draft's lookahead x ~ p (column 0)
    verified like one more proposal, kept w.p. a = min(1, t(x)/p(x)), else replaced by the
    residual y ∝ max(0, q̃ - p) over S (drawn with (u - a)/(1 - a), uniform given u >= a),
    which is marked off-policy. So a bonus token is off-policy exactly when the guidance overrode the
    draft (probability λ·TV(p, q̃)), as a proposal is, whatever k.

    Rows (R, K+1) as in `ListedRows`, uniforms (R,), `lam` a float or λ_t per row (R,); returns
    (R,) arrays by name: tokens, offpolicy, log_p, log_q, log_t (log q̃), tv (λ·(1 - Q_S), λ from
    `tv_lam` when given), lam (λ'), strength (λ as set: `tv_lam`, else `lam`). p on S where the
    draft's row does not give it comes from `probe(row indices (R',), tokens (R', M))`, asked only
    where the residual's draw needs it (`_residual_bounded`); without a probe it raises.
    log q of a kept x outside S is -inf where the guidance row lists its whole support and NaN
    where it does not (not reported; its q̃ is exactly 0 either way).
    Paper: https://arxiv.org/abs/2211.17192 (speculative sampling, exact for any target).
    """
    _check_lam(lam)
    u = np.asarray(uniforms, dtype=np.float64)
    lam = np.broadcast_to(np.asarray(lam, dtype=np.float64), u.shape)
    tokens = draft.ids[:, 0].copy()
    log_mass = np.log(guidance.topk_mass())
    log_p = draft.log_probs[:, 0].astype(np.float64)  # p(x) > 0: x was sampled from p
    log_q = guidance.lookup_one(tokens, unknown=np.nan)
    log_t = np.where(guidance.in_topk(tokens), log_q - log_mass, NEG_INF)
    with np.errstate(over="ignore", invalid="ignore"):
        keep = np.minimum((1.0 - lam) + lam * np.exp(log_t - log_p), 1.0)
    rows = np.flatnonzero(u >= keep)  # never where a = 1 (λ = 0, or t(x) >= p(x))
    if len(rows):
        v = (u[rows] - keep[rows]) / (1.0 - keep[rows])
        asks = None if probe is None else (lambda r, _positions, t: probe(r, t))
        y, log_p[rows], log_t[rows] = _residual_listed(
            draft,
            guidance,
            rows,
            log_mass[rows],
            v,
            asks,
            rows,
            np.zeros(len(rows), dtype=np.int64),
        )
        tokens[rows], log_q[rows] = y, log_t[rows] + log_mass[rows]
    offpolicy = np.zeros(len(u), dtype=bool)
    offpolicy[rows] = True
    return {"tokens": tokens, "offpolicy": offpolicy, "log_p": log_p, "log_q": log_q,
            "log_t": log_t,
            "tv": (lam if tv_lam is None else tv_lam) * np.clip(1.0 - np.exp(log_mass), 0.0, None),
            "lam": lam.copy(), "strength": (lam if tv_lam is None else np.asarray(tv_lam)).copy()}  # fmt: skip


def _inverse_cdf(weights: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Per row of `weights` (R, M) >= 0 (unnormalised), the index drawn by inverse CDF in listed
    order with `uniforms` (R,) in [0, 1): the first entry whose cumulative weight exceeds u·total."""
    cdf = weights.cumsum(-1)
    return (cdf <= (uniforms * cdf[:, -1])[:, None]).sum(-1).clip(max=cdf.shape[-1] - 1)


def _check_lam(lam: float | np.ndarray | torch.Tensor) -> None:
    values = np.asarray(lam.cpu() if isinstance(lam, torch.Tensor) else lam, dtype=np.float64)
    if values.size and not ((values >= 0.0) & (values <= 1.0)).all():
        raise ValueError(f"lam must lie in [0, 1], got {lam}")
