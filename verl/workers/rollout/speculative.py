"""Speculative guidance, the pure algorithm (DESIGN.md §3): emitted tokens follow q_λ exactly.

Notation: p the draft's processed next-token distribution, q the guidance's, λ in [0, 1],
q_λ = (1-λ)·p + λ·q. One round for a batch of sequences:
  1. the draft proposes up to k tokens x_1..x_n ~ p (with the tables p(·) at each position);
  2. the guidance gives q(·) at the same positions;
  3. x_i is accepted with probability min(1, q_λ(x_i)/p(x_i)) = min(1, (1-λ) + λ·q(x_i)/p(x_i));
  4. at the first rejection a token y ~ r(y) ∝ max(0, q(y) - p(y)) is emitted instead, marked
     off-policy, and the remaining proposals are dropped.
  5. after a fully accepted round, a bonus token of q_λ when the draft already drafted one token
     x ~ p past its proposals (while the guidance scored them) and the guidance reports q there:
     with probability λ a draw y ~ q (marked off-policy), otherwise x (`draw_bonus`).
This is speculative sampling with target q_λ and proposal p, so every emitted token is an exact
sample of q_λ given its prefix (Leviathan et al., https://arxiv.org/abs/2211.17192); the bonus
is that paper's extra token, drawn from the mixture by its two components.

This module imports neither vLLM nor torch.distributed: it works on token ids and log-prob
tables (dense (B, k, V), or the engines' top-K lists as `TopK`), so it is tested exactly on
CPU with toy models. The engine driver feeds it the engines' lists as flat `ListedRows`, which
`verify_listed` verifies in numpy with the same decisions as `verify_proposals` on a `TopK`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from verl.workers.rollout.log_prob_tables import (  # noqa: F401  (process_log_probs re-exported for callers)
    NEG_INF,
    ListedRows,
    TopK,
    as_topk,
    listed_entropy,
    process_log_probs,
)

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
    """(B, k) λ_t of each emitted token's position (the round's λ, or its per-position values)."""


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
        q_at = q.at(rows, pos)
        candidates = q_at.listed()  # (R, 1, K): only tokens with q̃ > 0 can have q̃ > p
        p_at = p.at(rows, pos)
        p_c = p_at.lookup(candidates).squeeze(1)
        candidates = candidates.squeeze(1)
        q_c = q_at.log_probs.squeeze(1) - log_mass[rows, pos].unsqueeze(-1)  # log q̃ on S
        if p_at.ids is not None and ((p_c == NEG_INF) & (q_c > NEG_INF)).any():
            raise ValueError("verify_proposals: the draft list does not give p on the guidance's S")
        residual = (q_c.exp() - p_c.exp()).clamp(min=0.0)
        empty = residual.sum(-1, keepdim=True) <= 0  # only reachable through rounding: use q
        residual = torch.where(empty, q_c.exp(), residual)
        cdf = residual.cumsum(-1)
        below = cdf <= (uniforms[rows, -1] * cdf[:, -1]).unsqueeze(-1)
        pick = below.sum(-1, keepdim=True).clamp(max=residual.shape[-1] - 1)
        tokens[rows, pos] = candidates.gather(-1, pick).squeeze(-1)
        log_p_emitted[rows, pos] = p_c.gather(-1, pick).squeeze(-1)
        log_t_emitted[rows, pos] = q_c.gather(-1, pick).squeeze(-1)
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
    )


def verify_listed(
    num_proposed: torch.Tensor,
    draft: ListedRows,
    guidance: ListedRows,
    lam: float | np.ndarray,
    uniforms: torch.Tensor,
    probe: DraftProbe | None = None,
) -> VerifyResult:
    """Accept / reject the engines' flat rows so each emitted token follows the round's target
    t = (1-λ)·p + λ·q̃ exactly, q̃ = q renormalised over the guidance's listed set S:
    accept x w.p. min(1, t(x)/p(x)), else draw y ∝ max(0, q̃(y) - p(y)) over S.

    p(x) and q(x) of each proposal are column 0 of its rows (N, K+1); S is the guidance row's
    top-K columns (never column 0: S must not depend on the proposal), Q_S their mass, and
    q̃(y) = q(y)/Q_S on S, 0 elsewhere, so t = q_λ wherever S holds all of q's mass (K = V, or
    top-k/top-p cut inside the list) and TV(t, q_λ) = λ·(1 - Q_S) otherwise (`target_tv`).
    At a rejected position p is needed on all of S: read from the draft's row where it lists
    them (or its whole support), else from `probe` (the draft engine's lookup); without a probe
    an unknown p raises. Every per-row operation is O(K) memory. `lam`: a float, or λ_t per
    flat row (N,) (a function of what is known at that position before its token is drawn, e.g.
    the draft's row: the target stays known; the residual does not depend on λ_t > 0).
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
    out = {name: np.zeros((batch, k)) for name in ("log_p", "log_q", "log_t", "tv", "lam")}
    tokens = np.full((batch, k), -1, dtype=np.int64)
    tokens[at_seq, at_pos] = proposals[kept]
    tv = lam * np.clip(1.0 - np.exp(log_mass), 0.0, None)
    for name, values in (
        ("log_p", log_p_x),
        ("log_q", log_q_x),
        ("log_t", log_t_x),
        ("tv", tv),
        ("lam", lam),
    ):
        out[name][at_seq, at_pos] = values[kept]
    offpolicy = np.zeros((batch, k), dtype=bool)
    rows = np.flatnonzero(has_reject)
    if len(rows):
        at = starts[rows] + first[rows]  # the rejected positions' row indices
        candidates = guidance.ids[at, 1:]  # (R, K): S; only tokens with q̃ > 0 can have q̃ > p
        log_t_c = guidance.log_probs[at, 1:].astype(np.float64) - log_mass[at, None]
        log_p_c = _draft_at(draft.take(at), candidates, probe, rows, first[rows])
        residual = np.clip(np.exp(log_t_c) - np.exp(log_p_c), 0.0, None)
        empty = residual.sum(-1, keepdims=True) <= 0  # only reachable through rounding: use q̃
        residual = np.where(empty, np.exp(log_t_c), residual)
        pick = _inverse_cdf(residual, u[rows, -1])
        r, cols = np.arange(len(rows)), first[rows]
        tokens[rows, cols] = candidates[r, pick]
        out["log_p"][rows, cols], out["log_t"][rows, cols] = log_p_c[r, pick], log_t_c[r, pick]
        out["log_q"][rows, cols] = log_t_c[r, pick] + log_mass[at]
        out["tv"][rows, cols], out["lam"][rows, cols] = tv[at], lam[at]
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
    )


def _draft_at(
    draft: ListedRows,
    tokens: np.ndarray,
    probe: DraftProbe | None,
    rows: np.ndarray,
    positions: np.ndarray,
) -> np.ndarray:
    """log p of `tokens` (R, M) at the draft rows `draft` (R, K+1): listed values, and for rows
    that do not give them all, the whole row from `probe(rows, positions, tokens)`."""
    found = draft.lookup(tokens)
    unknown = ~draft.knows(tokens).all(-1)
    if unknown.any():
        if probe is None:
            raise RuntimeError(
                f"{int(unknown.sum())} residual row(s) need the draft's p at guidance tokens its "
                "top-K does not list, and no draft probe was given"
            )
        found[unknown] = probe(rows[unknown], positions[unknown], tokens[unknown])
    return found


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
) -> dict[str, np.ndarray]:
    """The token past a fully accepted round, from the target t = (1-λ)p + λq̃ by its components:
    if u < λ a draw y ~ q̃ (q renormalised over the guidance row's top-K set S; inverse CDF in
    listed order with u/λ, which is uniform given u < λ), marked off-policy; otherwise the
    draft's lookahead x ~ p (column 0).

    Rows (R, K+1) as in `ListedRows`, uniforms (R,), `lam` a float or λ_t per row (R,); returns
    (R,) arrays by name: tokens, offpolicy, log_p, log_q, log_t (log q̃), tv (λ·(1 - Q_S)), lam. A y the draft's row does not give
    gets its log p from `probe(row indices (R',), tokens (R', 1))`; without a probe it raises.
    log q of a lookahead x outside S is -inf where the guidance row lists its whole support and
    NaN where it does not (not reported; its q̃ is exactly 0 either way).
    Paper: https://arxiv.org/abs/2211.17192 (the extra token after k accepted proposals).
    """
    _check_lam(lam)
    u = np.asarray(uniforms, dtype=np.float64)
    lam = np.broadcast_to(np.asarray(lam, dtype=np.float64), u.shape)
    from_q = u < lam
    with np.errstate(divide="ignore", invalid="ignore"):  # λ = 0: no row draws from q
        v = np.where(from_q, u / lam, 0.0)
    listed_q = guidance.log_probs[:, 1:].astype(np.float64)
    y = guidance.ids[np.arange(len(u)), 1 + _inverse_cdf(np.exp(listed_q), v)]
    tokens = np.where(from_q, y, draft.ids[:, 0])
    log_p = draft.lookup_one(tokens)
    unknown = ~draft.knows(tokens[:, None])[:, 0]
    if unknown.any():
        if probe is None:
            raise RuntimeError(
                f"{int(unknown.sum())} bonus token(s) need the draft's p and no probe was given"
            )
        log_p[unknown] = probe(np.flatnonzero(unknown), tokens[unknown, None])[:, 0]
    log_mass = np.log(guidance.topk_mass())
    in_s = guidance.in_topk(tokens)
    log_q = guidance.lookup_one(tokens, unknown=np.nan)
    return {"tokens": tokens, "offpolicy": from_q, "log_p": log_p, "log_q": log_q,
            "log_t": np.where(in_s, log_q - log_mass, NEG_INF), "tv": lam * np.clip(1.0 - np.exp(log_mass), 0.0, None),
            "lam": lam.copy()}  # fmt: skip


def _inverse_cdf(weights: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Per row of `weights` (R, M) >= 0 (unnormalised), the index drawn by inverse CDF in listed
    order with `uniforms` (R,) in [0, 1): the first entry whose cumulative weight exceeds u·total."""
    cdf = weights.cumsum(-1)
    return (cdf <= (uniforms * cdf[:, -1])[:, None]).sum(-1).clip(max=cdf.shape[-1] - 1)


def _check_lam(lam: float | np.ndarray | torch.Tensor) -> None:
    values = np.asarray(lam.cpu() if isinstance(lam, torch.Tensor) else lam, dtype=np.float64)
    if values.size and not ((values >= 0.0) & (values <= 1.0)).all():
        raise ValueError(f"lam must lie in [0, 1], got {lam}")


@dataclass
class GuidedSequence:
    """One generated response with provenance and both log-probs of every token."""

    tokens: list[int] = field(default_factory=list)
    offpolicy: list[bool] = field(default_factory=list)
    draft_log_probs: list[float] = field(default_factory=list)
    guidance_log_probs: list[float] = field(default_factory=list)
    """log q of each token: -inf where q is exactly 0 after processing, NaN where the guidance
    did not report it (`guidance_tensors` turns NaN into `guidance_missing_mask`)."""
    finished: bool = False
    guidance_topk: tuple[np.ndarray, np.ndarray] | None = None
    """(len, K) token ids and processed log-probs of the guidance's top-K at each position, when
    the rollout keeps them (`offpolicy_guidance.keep_topk`)."""
    target_log_probs: list[float] = field(default_factory=list)
    """log q̃ of each token, the guidance part of the target it was sampled from (`verify_listed`;
    empty where the response was not sampled speculatively: μ then uses `guidance_log_probs`)."""
    target_tv: list[float] = field(default_factory=list)
    """TV(target, q_λ) at each token's position (empty as `target_log_probs`)."""
    lam: list[float] = field(default_factory=list)
    """λ_t of each token's position (empty as `target_log_probs`)."""
    draft_entropy: list[float] = field(default_factory=list)
    """The draft's entropy at each token's position, from its listed log-probs (`listed_entropy`;
    empty as `target_log_probs`)."""


ProposeFn = Callable[
    [list[int], list[list[int]], list[int]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]
ScoreFn = Callable[[list[int], list[list[int]], torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class RoundStats:
    """Counters over a whole generation."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    bonus: int = 0

    def add(self, other: RoundStats) -> None:
        """Accumulate the counters of another generation (e.g. the next wave of sequences)."""
        self.rounds += other.rounds
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.emitted += other.emitted
        self.bonus += other.bonus

    @property
    def accept_rate(self) -> float:
        """Accepted / proposed draft tokens."""
        return self.accepted / self.proposed if self.proposed else 0.0


class SpeculativeBatch:
    """Speculative generation of a batch of prompts, advanced one round at a time.

    `next_round()` gives the active sequences' (ids, prefixes, budget); the draft proposes and
    the guidance scores them; `apply(...)` verifies the round and appends the emitted tokens.
    `ids` are the engines' names for the prompts (default: their positions); engines may keep
    per-sequence state under them (vLLM sessions). With `bonus`, a round may also hand `apply`
    the draft's lookahead tokens (`BonusRows`): a fully accepted sequence then emits one token
    more (`draw_bonus`). `generator`: one shared, or one per prompt (see `_uniforms`).
    Per-position λ_t = lam · lam_scale[sequence] · gate(H_t), H_t the draft's entropy at the
    position (`listed_entropy` of its row; `gate` maps (N,) entropies to factors in [0, 1]):
    `lam_scale` 0 makes a sequence draft-only (exactly p), `gate` None means 1.
    """

    def __init__(
        self,
        prompts: list[list[int]],
        lam: float,
        num_speculative_tokens: int,
        max_new_tokens: int,
        eos_token_id: int | None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        ids: list[int] | None = None,
        bonus: bool = False,
        lam_scale: list[float] | None = None,
        gate: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        self.prompts, self.lam, self.generator, self.bonus = prompts, lam, generator, bonus
        self.gate = gate
        self.lam_scale = (
            np.ones(len(prompts)) if lam_scale is None else np.asarray(lam_scale, dtype=np.float64)
        )
        self.k, self.max_new_tokens, self.eos_token_id = (
            num_speculative_tokens,
            max_new_tokens,
            eos_token_id,
        )
        self.ids = list(range(len(prompts))) if ids is None else list(ids)
        self.seqs = [GuidedSequence() for _ in prompts]
        self.stats = RoundStats()
        self._rows: list[int] = []
        self._budget: list[int] = []
        self.lookahead: list[bool] = []
        """Per active sequence of the open round: the draft may draft one token past its budget
        (for a bonus token; only with `bonus` and room for one more token)."""

    @property
    def done(self) -> bool:
        """Every sequence ended (EOS or `max_new_tokens`)."""
        return all(s.finished for s in self.seqs)

    def next_round(self) -> tuple[list[int], list[list[int]], list[int]]:
        """(ids, prefixes, budget) of the active sequences: prompt + emitted tokens, and how many
        tokens the draft may propose for each (at most k, never past `max_new_tokens`)."""
        self._rows = [r for r, s in enumerate(self.seqs) if not s.finished]
        room = [self.max_new_tokens - len(self.seqs[r].tokens) for r in self._rows]
        self._budget = [min(self.k, left) for left in room]
        self.lookahead = [self.bonus and left > self.k for left in room]
        prefixes = [self.prompts[r] + self.seqs[r].tokens for r in self._rows]
        return [self.ids[r] for r in self._rows], prefixes, list(self._budget)

    def apply(
        self,
        proposals: torch.Tensor,
        num_proposed: torch.Tensor,
        draft_tables: torch.Tensor | TopK | ListedRows,
        guidance_tables: torch.Tensor | TopK | ListedRows,
        bonus: BonusRows | None = None,
        probe: Callable | None = None,
    ) -> None:
        """Verify the round that `next_round()` opened (tensors as in `verify_proposals`, one row
        per active sequence, or both tables as `ListedRows`) and append what it emits, with a
        bonus token after each fully accepted proposal run that `bonus` has a lookahead for.
        `probe(ids, prefixes, tokens (R, M)) -> (R, M)`: the draft's log p of `tokens` after
        each prefix (engine ids as in `next_round`), for those its listed rows do not give."""
        uniforms = self._uniforms(proposals.shape[0])
        at = self._probe_at(proposals, probe)
        num = num_proposed.numpy()
        seq = np.repeat(np.arange(len(num)), num)  # the sequence of each flat proposal row
        pos = np.arange(len(seq)) - np.repeat(np.cumsum(num) - num, num)
        entropy = _row_entropy(draft_tables, num_proposed)  # (N,) H_t at each proposal
        lam = self._lam(entropy, seq)
        if isinstance(draft_tables, ListedRows) and isinstance(guidance_tables, ListedRows):
            result = verify_listed(num_proposed, draft_tables, guidance_tables, lam, uniforms, at)
        else:
            if not isinstance(lam, float):  # λ_t per position, (B, k)
                lam = torch.from_numpy(_scatter(lam, seq, pos, proposals.shape))
            result = verify_proposals(proposals, num_proposed, draft_tables, guidance_tables,
                                      lam, uniforms=uniforms)  # fmt: skip
        self.stats.rounds += 1
        self.stats.proposed += int(num_proposed.sum())
        self.stats.accepted += int(result.num_accepted.sum())
        extra = self._bonus(result, num_proposed, bonus, uniforms[:, -1].numpy(), at)
        entropy_bk = torch.from_numpy(_scatter(entropy, seq, pos, result.tokens.shape))
        fields = (result.tokens, result.offpolicy, result.draft_log_probs, result.guidance_log_probs,
                  result.target_log_probs, result.target_tv, result.lam, entropy_bk)  # fmt: skip
        columns = zip(*(f.tolist() for f in fields), result.num_emitted.tolist(), strict=True)
        for i, (r, budget, (*values, emitted)) in enumerate(
            zip(self._rows, self._budget, columns, strict=True)
        ):
            if emitted == 0:
                raise RuntimeError(
                    f"sequence {self.ids[r]}: the draft proposed no token (budget {budget})"
                )
            self._append(r, *(v[:emitted] for v in values))
            if i in extra and not self.seqs[r].finished:
                self._append(r, *([value] for value in extra[i]))
                self.stats.bonus += 1

    def _lam(self, entropy: np.ndarray, rows: np.ndarray) -> float | np.ndarray:
        """λ_t at positions with draft entropies `entropy` (N,) of round rows `rows` (N,): the
        float λ when neither a gate nor a guided subset applies, else (N,) values."""
        scale = (
            self.lam_scale[np.asarray(self._rows, dtype=np.int64)[rows]]
            if len(rows)
            else np.zeros(0)
        )
        if self.gate is None and (scale == 1.0).all():
            return float(self.lam)
        gate = np.ones(len(rows)) if self.gate is None else self.gate(entropy)
        return self.lam * scale * gate

    def _probe_at(self, proposals: torch.Tensor, probe: Callable | None) -> DraftProbe | None:
        """`probe` as a `DraftProbe` of this round: round rows and proposal counts to prefixes."""
        if probe is None:
            return None

        def at(rows: np.ndarray, positions: np.ndarray, tokens: np.ndarray) -> np.ndarray:
            seqs = [self._rows[i] for i in rows]
            prefixes = [self.prompts[r] + self.seqs[r].tokens + proposals[i, :n].tolist()
                        for r, i, n in zip(seqs, rows, positions, strict=True)]  # fmt: skip
            return probe([self.ids[r] for r in seqs], prefixes, tokens)

        return at

    def _uniforms(self, rows: int) -> torch.Tensor:
        """(rows, k + 1) uniforms of the open round: from each sequence's own generator when
        `generator` is a list (a sequence's tokens then do not depend on which batch, wave or
        replica it runs in), else from the shared one."""
        if isinstance(self.generator, (list, tuple)):
            return torch.stack([torch.rand(self.k + 1, generator=self.generator[r], dtype=torch.float64)
                                for r in self._rows]) if rows else torch.zeros(0, self.k + 1, dtype=torch.float64)  # fmt: skip
        return torch.rand(rows, self.k + 1, generator=self.generator, dtype=torch.float64)

    def _bonus(
        self,
        result: VerifyResult,
        num: torch.Tensor,
        bonus: BonusRows | None,
        u: np.ndarray,
        probe: DraftProbe | None,
    ) -> dict[int, tuple]:
        """Bonus tokens by round row: (token, off-policy, log p, log q, log q̃, tv, λ_t, H_t) where every
        proposal was accepted and the draft drafted a lookahead. The uniform is the residual's
        column, which a round without rejection leaves unused."""
        if bonus is None or not bonus.has.any():
            return {}
        full = bonus.has & (result.num_accepted == num).numpy()
        rows = np.flatnonzero(full)
        if not len(rows):
            return {}
        at = (np.cumsum(bonus.has) - 1)[rows]  # the lookahead rows of those sequences
        n = num.numpy()
        lookahead = bonus.draft.take(at)
        entropy = lookahead.entropy()
        drawn = draw_bonus(lookahead, bonus.guidance.take(rows), self._lam(entropy, rows), u[rows],
                           None if probe is None else lambda i, t: probe(rows[i], n[rows[i]], t))  # fmt: skip
        drawn["entropy"] = entropy
        names = ("tokens", "offpolicy", "log_p", "log_q", "log_t", "tv", "lam", "entropy")
        return {
            int(r): values
            for r, *values in zip(rows, *(drawn[k].tolist() for k in names), strict=True)
        }

    def _append(self, r: int, tokens: list, *values: list) -> None:
        """Append emitted tokens and their (off-policy, log p, log q, log q̃, tv, λ_t, H_t) to
        sequence r, ending it at EOS or `max_new_tokens`."""
        seq = self.seqs[r]
        if self.eos_token_id in tokens:
            end = tokens.index(self.eos_token_id) + 1
            tokens, values = tokens[:end], tuple(v[:end] for v in values)
            seq.finished = True
        seq.tokens += tokens
        off, lp, lq, lt, tv, lam, entropy = values
        seq.offpolicy += off
        seq.draft_log_probs += lp
        seq.guidance_log_probs += lq
        seq.target_log_probs += lt
        seq.target_tv += tv
        seq.lam += lam
        seq.draft_entropy += entropy
        self.stats.emitted += len(tokens)
        if len(seq.tokens) >= self.max_new_tokens:
            seq.finished = True


def _row_entropy(tables: torch.Tensor | TopK | ListedRows, num: torch.Tensor) -> np.ndarray:
    """(N,) the draft's entropy at each proposal position in sequence order (`listed_entropy`):
    of a flat row's top-K columns, or of a (B, k, V) / `TopK` (B, k, K) table's valid rows."""
    if isinstance(tables, ListedRows):
        return tables.entropy()
    values = tables.log_probs if isinstance(tables, TopK) else tables
    valid = (torch.arange(values.shape[1]) < num.unsqueeze(-1)).numpy()
    return listed_entropy(values.double().cpu().numpy()[valid])


def _scatter(values: np.ndarray, seq: np.ndarray, pos: np.ndarray, shape: tuple) -> np.ndarray:
    """Flat per-position `values` (N,) into a (B, k) array (0 elsewhere)."""
    out = np.zeros(tuple(shape), dtype=np.float64)
    out[seq, pos] = values
    return out


def speculative_generate(
    prompts: list[list[int]],
    propose: ProposeFn,
    score: ScoreFn,
    lam: float,
    num_speculative_tokens: int,
    max_new_tokens: int,
    eos_token_id: int | None,
    generator: torch.Generator | None = None,
) -> tuple[list[GuidedSequence], RoundStats]:
    """Generate responses whose tokens follow q_λ, round by round, for a batch of prompts.

    `propose(ids, prefixes, n)` returns (proposals (B, k) with -1 padding, num_proposed (B,),
    draft log-prob tables (B, k, V) or `TopK`): up to n[b] draft tokens per prefix, stopping
    after EOS. `score(ids, prefixes, proposals, num_proposed)` returns the guidance tables
    (B, k, V) or `TopK` at the same positions. Both get only the still-active sequences, with
    `ids` their indices in `prompts` (engines keep per-sequence state). Stops at EOS or
    `max_new_tokens`.
    """
    batch = SpeculativeBatch(
        prompts, lam, num_speculative_tokens, max_new_tokens, eos_token_id, generator
    )
    while not batch.done:
        ids, prefixes, budget = batch.next_round()
        proposals, num, draft_tables = propose(ids, prefixes, budget)
        batch.apply(proposals, num, draft_tables, score(ids, prefixes, proposals, num))
    return batch.seqs, batch.stats


class DraftStepper(Protocol):
    """The draft engine one step at a time: rounds of several batches may run in the same step."""

    def start(
        self,
        key: int,
        ids: list[int],
        prefixes: list[list[int]],
        budget: list[int],
        lookahead: list[bool],
    ) -> None:
        """Begin batch `key`'s proposals (up to budget[b] tokens per prefix), and where
        lookahead[b] one token more, drafted after the round is returned (may be ignored)."""

    @property
    def busy(self) -> bool:
        """Some round is still proposing or drafting its lookahead."""

    def step(
        self,
    ) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | TopK | ListedRows]]:
        """One engine step; returns (key, proposals, num_proposed, draft tables) of the rounds
        whose proposals all finished in it (shapes as `ProposeFn`'s)."""

    def drafting(self, key: int) -> bool:
        """Round `key` was returned and its lookahead tokens are still being drafted."""

    def lookahead(self, key: int) -> tuple[np.ndarray, ListedRows] | None:
        """Round `key`'s lookahead once drafted, as `BonusRows`' (has, draft); None if none."""

    def probe(self, ids: list[int], prefixes: list[list[int]], tokens: np.ndarray) -> np.ndarray:
        """The draft's processed log p of `tokens` (R, M) as the next token after each prefix of
        sequences `ids` (R): (R, M), for tokens its listed rows do not give."""


class AsyncScorer(Protocol):
    """The guidance engine working on its own: answers come back in submission order."""

    def submit(
        self, ids: list[int], prefixes: list[list[int]], proposals: torch.Tensor, num: torch.Tensor
    ) -> None:
        """Start scoring a round's proposals; returns at once."""

    def ready(self) -> bool:
        """The oldest submitted round's tables can be collected without waiting."""

    def collect(self) -> torch.Tensor | TopK | ListedRows | tuple[ListedRows, ListedRows]:
        """The guidance tables (B, k, V), `TopK` or `ListedRows` of the oldest submitted round
        (waits if needed), or `ListedRows` paired with the rows one position past each
        sequence's last proposal (`BonusRows.guidance`)."""


def overlapped_generate(
    batches: list[SpeculativeBatch], draft: DraftStepper, guidance: AsyncScorer, stagger: int
) -> None:
    """Run several batches so the engines overlap: while the guidance scores one batch's round,
    the draft keeps stepping the rounds of the others (and that round's lookahead tokens), and
    never waits while it has work.

    Batch g starts after g * `stagger` draft steps, so the batches' rounds fall out of phase and
    a draft step usually holds more than one batch. Each batch still runs its rounds in order
    with its own generator, so its tokens are exactly those it gets alone with the same engines
    and follow q_λ as with `speculative_generate` (plus bonus tokens, see `SpeculativeBatch`).
    """
    pending = deque(range(len(batches)))  # not started yet
    rounds: dict[int, tuple[list[int], list[list[int]]]] = {}
    in_flight: deque = deque()
    steps = 0

    def start(key: int) -> None:
        ids, prefixes, budget = batches[key].next_round()
        rounds[key] = (ids, prefixes)
        draft.start(key, ids, prefixes, budget, batches[key].lookahead)

    def verifiable() -> bool:  # the oldest round's answer is in (or nothing else can happen)
        if draft.drafting(in_flight[0][0]):
            return False
        return guidance.ready() or not (draft.busy or pending)

    while pending or draft.busy or in_flight:
        while pending and (steps >= pending[0] * stagger or not draft.busy):
            key = pending.popleft()
            if not batches[key].done:
                start(key)
        if draft.busy:
            steps += 1
            for key, proposals, num, draft_tables in draft.step():
                guidance.submit(*rounds[key], proposals, num)
                in_flight.append((key, proposals, num, draft_tables))
        # verify what the guidance answered; wait for it only when the draft has nothing to do
        while in_flight and verifiable():
            key, proposals, num, draft_tables = in_flight.popleft()
            tables, following = _split_answer(guidance.collect())
            extra = draft.lookahead(key)
            bonus = None if extra is None or following is None else BonusRows(*extra, following)
            batches[key].apply(proposals, num, draft_tables, tables, bonus, draft.probe)
            if not batches[key].done:
                start(key)


def _split_answer(answer) -> tuple:
    """(tables, rows past the proposals or None) from `AsyncScorer.collect`'s answer."""
    return answer if isinstance(answer, tuple) else (answer, None)
