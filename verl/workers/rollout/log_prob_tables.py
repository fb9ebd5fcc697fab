"""The engines' next-token tables as the speculative algorithm reads them, O(K) per row.

`TopK` holds tables as padded (B, k, K) tensors (or dense (B, k, V) ones), `ListedRows` as the
engines' flat rows (one per proposal position: the position's own token, then the top-K), read
by sorted searches, or by a table per row where the ids span at most a few times K (a small
vocabulary, or K = V), so nothing builds an (N, M, K) comparison. `process_log_probs` is the
reference of the samplers' processing (temperature, top-k, top-p). Pure: no vLLM, no
torch.distributed (docs/design.md#architecture-and-the-dependency-rule).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

NEG_INF = float("-inf")


def process_log_probs(
    log_probs: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Sampling-processed log-probs: softmax(z / T), then top-k, then top-p (nucleus) truncation.

    `log_probs` are raw log-probs or logits over the last dim (..., V); -inf marks excluded tokens.
    Top-p keeps the smallest set of most likely tokens whose mass reaches `top_p` (the token that
    crosses the threshold is kept); a tensor `top_p` (..., 1) sets it per row. Returns normalised
    log-probs (..., V). (B, T, V) -> (B, T, V).
    """
    z = log_probs / temperature
    if top_k is not None and 0 < top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, NEG_INF)
    z = torch.log_softmax(z, dim=-1)
    if torch.is_tensor(top_p) or top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_z.exp(), dim=-1) - sorted_z.exp()
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = torch.log_softmax(z.masked_fill(drop, NEG_INF), dim=-1)
    return z


@dataclass
class TopK:
    """Log-prob tables as listed tokens: `ids` (B, k, K) token ids and `log_probs` (B, k, K).

    A token not listed has probability 0 (log -inf). What vLLM reports per position (the sampled
    or prompt token, then the top-K) has this shape. `ids=None` is a dense table (B, k, V) that
    lists every token in id order (`TopK.dense`). Entries must not repeat a token with a finite
    log-prob (`dedupe`).
    """

    ids: torch.Tensor | None
    log_probs: torch.Tensor

    @classmethod
    def dense(cls, tables: torch.Tensor) -> TopK:
        """A dense table (..., V): every token listed."""
        return cls(None, tables)

    @classmethod
    def dedupe(cls, ids: torch.Tensor, log_probs: torch.Tensor) -> TopK:
        """vLLM lists the sampled (or prompt) token first and again if it is in the top-K: keep
        each token's first entry, give the repeats log-prob -inf."""
        same = ids.unsqueeze(-1) == ids.unsqueeze(-2)  # (..., K, K)
        earlier = torch.ones(ids.shape[-1], ids.shape[-1], dtype=torch.bool, device=ids.device)
        repeat = (same & earlier.tril(-1)).any(-1)
        return cls(ids, log_probs.masked_fill(repeat, NEG_INF))

    def listed(self) -> torch.Tensor:
        """(B, k, K) token ids of the entries (arange(V) for a dense table)."""
        if self.ids is not None:
            return self.ids
        vocab = torch.arange(self.log_probs.shape[-1], device=self.log_probs.device)
        return vocab.expand(self.log_probs.shape)

    def lookup(self, tokens: torch.Tensor) -> torch.Tensor:
        """log-prob of `tokens` (B, k, M) at each position (B, k): (B, k, M), -inf if unlisted
        (or negative, i.e. padding)."""
        if self.ids is None:
            found = self.log_probs.gather(-1, tokens.clamp(min=0))
            return found.masked_fill(tokens < 0, NEG_INF)
        hit = tokens.unsqueeze(-1) == self.ids.unsqueeze(-2)  # (B, k, M, K)
        values = self.log_probs.unsqueeze(-2).expand(hit.shape)
        return torch.where(hit, values, NEG_INF).amax(-1)

    def at(self, rows: torch.Tensor, pos: torch.Tensor) -> TopK:
        """The tables of positions (rows[i], pos[i]) as a (R, 1, K) `TopK`."""
        ids = None if self.ids is None else self.ids[rows, pos].unsqueeze(1)
        return TopK(ids, self.log_probs[rows, pos].unsqueeze(1))

    def processed(self, **processing) -> TopK:
        """`process_log_probs` over the listed tokens (renormalised over them)."""
        return TopK(self.ids, process_log_probs(self.log_probs, **processing))

    def tail_mass(self) -> torch.Tensor:
        """(B, k) probability mass not listed: 1 - sum of the listed probabilities, >= 0."""
        return (1.0 - self.log_probs.exp().sum(-1)).clamp(min=0.0)


def listed_entropy(log_probs: np.ndarray | torch.Tensor) -> np.ndarray:
    """H_K = -Σ_listed p log p - R log R, R = 1 - Σ_listed p (the unlisted tail counted as one
    atom), over the last axis of `log_probs` (..., K) -> (...). A lower bound of the entropy of
    the full distribution, by at most R·log(V - K); exact when the list holds every token of
    nonzero probability (K = V, or a top-k/top-p cut inside the list)."""
    values = np.asarray(log_probs, dtype=np.float64)
    probs = np.exp(values)
    with np.errstate(invalid="ignore"):  # p = 0: p log p = 0
        listed = -np.where(probs > 0, probs * values, 0.0).sum(-1)
    tail = np.clip(1.0 - probs.sum(-1), 0.0, None)
    with np.errstate(divide="ignore", invalid="ignore"):
        return listed - np.where(tail > 0, tail * np.log(tail), 0.0)


def as_topk(tables: torch.Tensor | TopK) -> TopK:
    """Accept a dense (B, k, V) table or a `TopK`."""
    return tables if isinstance(tables, TopK) else TopK.dense(tables)


@dataclass
class ListedRows:
    """The engines' lists as flat rows, one per proposal position in sequence order (num[b] rows
    for sequence b): `ids` (N, K+1) with column 0 the position's own token (the draft's sample,
    or the proposal the guidance scored) and then the top-K, `log_probs` (N, K+1) processed.

    The same tables as a `TopK` (B, k, K+1) without the padding: `verify_listed` reads them
    without building (B, k, ...) tensors, so a round costs a few numpy calls.
    """

    ids: np.ndarray
    log_probs: np.ndarray
    _deduped: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _mass: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    def deduped(self) -> np.ndarray:
        """`log_probs` (float64) with column 0's repeat among the top-K set to -inf (see
        `TopK.dedupe`): the top-K entries are distinct, so only column 0 can reappear. Computed
        once per rows object; read-only."""
        if self._deduped is None:
            values = self.log_probs.astype(np.float64)
            values[:, 1:][self.ids[:, 1:] == self.ids[:, :1]] = NEG_INF
            self._deduped = values
        return self._deduped

    def take(self, rows: np.ndarray) -> ListedRows:
        """The rows `rows` (indices or mask) as their own `ListedRows`."""
        taken = ListedRows(self.ids[rows], self.log_probs[rows])
        if self._deduped is not None:
            taken._deduped = self._deduped[rows]
        if self._mass is not None:
            taken._mass = self._mass[rows]
        return taken

    def topk_mass(self) -> np.ndarray:
        """(N,) Q = the probability mass of the top-K columns (the listed set S, column 0 left out:
        it is the row's own token, not part of S unless it repeats a top-K entry). Computed once
        per rows object; read-only."""
        if self._mass is None:
            self._mass = np.exp(self.log_probs[:, 1:].astype(np.float64)).sum(-1)
            self._mass.flags.writeable = False
        return self._mass

    def tail_mass(self) -> np.ndarray:
        """(N,) probability mass outside the top-K columns: 1 - Q, >= 0."""
        return np.clip(1.0 - self.topk_mass(), 0.0, None)

    def entropy(self) -> np.ndarray:
        """(N,) the row's entropy from its top-K columns (`listed_entropy`; column 0, the row's
        own token, left out: the value does not depend on which token was sampled there)."""
        return listed_entropy(self.topk()[1])

    def lookup(self, tokens: np.ndarray) -> np.ndarray:
        """Log-probs of `tokens` (N, M) in each row: (N, M), -inf where a token is not listed.
        O((K + M) log) per row (a sorted search, never an (N, M, K) comparison)."""
        return _lookup(self.ids, self.log_probs.astype(np.float64), tokens)[0]

    def lookup_known(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(`lookup(tokens)`, `knows(tokens)`) from one search: (N, M) each."""
        values, listed = _lookup(self.ids, self.log_probs.astype(np.float64), tokens)
        return values, listed | self.lists_support()[:, None]

    def in_topk(self, tokens: np.ndarray) -> np.ndarray:
        """(N,) whether each row's token (N,) is one of its top-K columns (the listed set S)."""
        return (tokens[:, None] == self.ids[:, 1:]).any(-1)

    def lookup_one(self, tokens: np.ndarray, unknown: float = NEG_INF) -> np.ndarray:
        """`lookup` of one token per row: tokens (N,) -> (N,). A token the row does not list reads
        -inf where the row lists its whole support (`lists_support`: its probability is exactly
        0) and `unknown` elsewhere (default -inf too; NaN keeps "not reported" apart from 0)."""
        hit = tokens[:, None] == self.ids  # (N, K+1)
        found = np.where(hit, self.log_probs.astype(np.float64), NEG_INF).max(-1)
        if np.isnan(unknown):
            found[~hit.any(-1) & ~self.lists_support()] = unknown
        return found

    def knows(self, tokens: np.ndarray) -> np.ndarray:
        """(N, M) whether each row gives the probability of `tokens` (N, M): listed, or the row
        lists its whole support (an unlisted token then has probability exactly 0)."""
        if tokens.shape[-1] == 1:  # one token per row: a direct comparison, O(K) per row
            listed = (tokens == self.ids).any(-1, keepdims=True)
        else:
            listed = _lookup(self.ids, np.zeros(self.ids.shape), tokens)[1]
        return listed | self.lists_support()[:, None]

    def topk(self) -> tuple[np.ndarray, np.ndarray]:
        """(N, K) ids and log-probs of the top-K columns, a repeat of column 0 read at column 0's
        value (`deduped` gives it -inf there, to count it once)."""
        values = self.log_probs[:, 1:].copy()
        repeat = self.ids[:, 1:] == self.ids[:, :1]
        values[repeat] = np.broadcast_to(self.log_probs[:, :1], values.shape)[repeat]
        return self.ids[:, 1:], values

    def lists_support(self) -> np.ndarray:
        """(N,) True where every token of nonzero probability is listed, so an unlisted token has
        probability exactly 0: the row's top-K ran past the processed support, i.e. it lists a
        token of probability 0 (one that top-k or top-p cut) that is not a repeat of column 0.
        A row listing the whole vocabulary has no unlisted token at all."""
        cut = np.isneginf(self.log_probs[:, 1:]) & (self.ids[:, 1:] != self.ids[:, :1])
        return cut.any(-1)

    def as_topk(self, num: torch.Tensor, width: int) -> TopK:
        """The same tables padded to a `TopK` (B, width, K+1) (id -1 / log-prob -inf)."""
        valid = torch.arange(width) < num.unsqueeze(-1)
        ids = torch.full((*valid.shape, self.ids.shape[-1]), -1, dtype=torch.long)
        values = torch.full(ids.shape, NEG_INF, dtype=torch.float64)
        ids[valid] = torch.from_numpy(self.ids).long()
        values[valid] = torch.from_numpy(self.log_probs).double()
        return TopK.dedupe(ids, values)


def _flat_keys(ids: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row-offset keys: (sorted keys of `ids` (N, K), their order, keys of `tokens` (N, M))."""
    width = int(max(ids.max(initial=0), tokens.max(initial=0))) + 2
    offset = np.arange(ids.shape[0], dtype=np.int64)[:, None] * width
    keys = (ids.astype(np.int64) + 1 + offset).ravel()  # +1: padding ids of -1 stay in their row
    order = np.argsort(keys, kind="stable")
    return keys[order], order, (tokens.astype(np.int64) + 1 + offset)


def _lookup(
    ids: np.ndarray, values: np.ndarray, tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(values[n, j] where ids[n, j] == tokens[n, m], -inf where absent; whether it is present):
    (N, M) each, for rows `ids` (N, K) whose columns past the first are distinct (or -1 padding
    at -inf). A table per row where the ids span at most a few times K (`_dense_lookup`: a small
    vocabulary, or K = V), else sorted searches (`_sorted_lookup`); both O(K) memory per row."""
    if ids.size == 0 or tokens.size == 0:
        return np.full(tokens.shape, NEG_INF), np.zeros(tokens.shape, dtype=bool)
    width = int(max(ids.max(), tokens.max())) + 2
    if width <= DENSE_SPAN * ids.shape[1] and min(ids.min(), tokens.min()) >= -1:
        return _dense_lookup(ids, values, tokens, width)
    return _sorted_lookup(ids, values, tokens)


DENSE_SPAN = 4
"""`_lookup` scatters rows into tables of their id span when it is at most this many times K."""


def _dense_lookup(
    ids: np.ndarray, values: np.ndarray, tokens: np.ndarray, width: int
) -> tuple[np.ndarray, np.ndarray]:
    """`_lookup` by scattering each row into a table of `width` > every id + 1 (id i at i + 1,
    so -1 padding has a column): column 0 written last, keeping the larger value where it
    repeats a top-K entry. O(N·width) time and memory."""
    rows, first = np.arange(ids.shape[0]), ids[:, 0] + 1
    table = np.full((ids.shape[0], width), NEG_INF)
    listed = np.zeros(table.shape, dtype=bool)
    table[rows[:, None], ids[:, 1:] + 1] = values[:, 1:]
    listed[rows[:, None], ids[:, 1:] + 1] = True
    table[rows, first] = np.maximum(table[rows, first], values[:, 0])
    listed[rows, first] = True
    at = tokens.astype(np.int64) + 1
    return table[rows[:, None], at], listed[rows[:, None], at]


def _sorted_lookup(
    ids: np.ndarray, values: np.ndarray, tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(values[n, j] where ids[n, j] == tokens[n, m], -inf where absent; whether it is present):
    (N, M) each. A token listed twice (column 0 repeating a top-K entry) reads the larger of its
    two values. O((NK + NM) log) time and O(NK + NM) memory."""
    keys, order, queries = _flat_keys(ids, tokens)
    flat = values.ravel()[order]
    # a repeated token (column 0 again in the top-K) has the same value twice: take the larger
    right = np.searchsorted(keys, queries, side="right") - 1
    left = np.searchsorted(keys, queries, side="left").clip(max=len(keys) - 1)
    hit = (right >= 0) & (keys[right.clip(min=0)] == queries)
    found = np.maximum(flat[right.clip(min=0)], flat[left])
    return np.where(hit, found, NEG_INF), hit
