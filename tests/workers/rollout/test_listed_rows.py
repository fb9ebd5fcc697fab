"""`ListedRows` at engine scale: the sorted lookup against a brute-force comparison, and
`verify_listed` at a real vocabulary's top-K within O(N·K) memory."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from verl.workers.rollout.speculative import ListedRows, verify_listed

NEG_INF = float("-inf")


def _brute_lookup(ids: np.ndarray, values: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """values[n, j] where ids[n, j] == tokens[n, m], the largest over repeats, -inf if absent:
    the (N, M, K) comparison the sorted search replaces."""
    hit = tokens[:, :, None] == ids[:, None, :]
    return np.where(hit, values[:, None, :], NEG_INF).max(-1, initial=NEG_INF)


def _random_listed(
    gen: np.random.Generator, rows: int, top: int, vocab: int, pad: bool
) -> ListedRows:
    """Engine-like rows: column 0 a token (repeating a top-K entry in about half the rows, at
    the same value, at -inf as a de-duplicated row has it, or at another value), then `top`
    distinct tokens; with `pad`, some rows end in -1 ids at -inf (padding)."""
    top_ids = np.stack([gen.choice(vocab, top, replace=False) for _ in range(rows)])
    values = np.log(gen.dirichlet(np.ones(top + 1), rows))
    first = gen.integers(0, vocab, rows)
    repeat = gen.random(rows) < 0.5
    col = gen.integers(0, top, rows)
    first[repeat] = top_ids[repeat, col[repeat]]
    ids = np.concatenate([first[:, None], top_ids], axis=1)
    kind = gen.integers(0, 3, rows)
    same = repeat & (kind == 0)
    values[same, 0] = values[same, 1 + col[same]]
    values[repeat & (kind == 1), 1 + col[repeat & (kind == 1)]] = NEG_INF
    if pad:
        cut = gen.integers(1, top + 2, rows)  # columns >= cut are padding (some rows none)
        padding = np.arange(top + 1) >= cut[:, None]
        ids[padding], values[padding] = -1, NEG_INF
    return ListedRows(ids, values)


@pytest.mark.parametrize("seed", range(6))
def test_lookup_equals_brute_force(seed):
    """`lookup` and `knows` equal the (N, M, K) comparison on random rows with repeats of column
    0 (same value, -inf, or another value: the larger wins), -1 padding, and queried tokens
    that are listed, unlisted, -1, or past every listed id."""
    gen = np.random.default_rng(seed)
    vocab = int(gen.integers(8, 60))
    for _ in range(20):
        rows, top, m = int(gen.integers(1, 40)), int(gen.integers(1, 12)), int(gen.integers(0, 10))
        top = min(top, vocab)
        listed = _random_listed(gen, rows, top, vocab, pad=bool(gen.integers(0, 2)))
        tokens = gen.integers(-1, vocab + 5, (rows, m))
        # half the queries are the rows' own ids, so most of them hit
        take = gen.integers(0, top + 1, (rows, m))
        mine = gen.random((rows, m)) < 0.5
        tokens[mine] = np.take_along_axis(listed.ids, take, 1)[mine]
        values = listed.log_probs.astype(np.float64)
        expected = _brute_lookup(listed.ids, values, tokens)
        np.testing.assert_array_equal(listed.lookup(tokens), expected)
        hit = (tokens[:, :, None] == listed.ids[:, None, :]).any(-1)
        np.testing.assert_array_equal(listed.knows(tokens), hit | listed.lists_support()[:, None])
        if m:
            one = tokens[:, 0]
            np.testing.assert_array_equal(listed.lookup_one(one), expected[:, 0])
            np.testing.assert_array_equal(
                listed.in_topk(one), (one[:, None] == listed.ids[:, 1:]).any(-1)
            )


def test_lookup_hand_values_with_repeats_and_padding():
    ids = np.array([[4, 2, 4, 9], [7, 7, -1, -1], [3, 1, 2, 5]])
    values = np.log(np.array([[0.1, 0.5, 0.3, 0.2], [0.6, 0.6, 1.0, 1.0], [0.2, 0.4, 0.3, 0.3]]))
    values[1, 2:] = NEG_INF  # padding
    rows = ListedRows(ids, values)
    tokens = np.array([[4, 9, 3], [7, -1, 0], [5, 3, 11]])
    # row 0: token 4 at 0.1 (column 0) and 0.3 (top-K): the larger, 0.3; row 1: the padding id
    # -1 reads -inf; token 11 is past every id
    with np.errstate(divide="ignore"):
        expected = np.log(np.array([[0.3, 0.2, 0.0], [0.6, 0.0, 0.0], [0.3, 0.2, 0.0]]))
    np.testing.assert_array_equal(rows.lookup(tokens), expected)
    assert rows.lookup(np.zeros((3, 0), dtype=np.int64)).shape == (3, 0)
    empty = ListedRows(np.zeros((0, 4), dtype=np.int64), np.zeros((0, 4)))
    assert empty.lookup(np.zeros((0, 2), dtype=np.int64)).shape == (0, 2)


def _rows_at_scale(gen, log_probs: np.ndarray, first: np.ndarray, top: int) -> ListedRows:
    """Rows listing `first` (N,) then the `top` most likely tokens of each row of `log_probs`."""
    best = np.argsort(-log_probs, axis=-1)[:, :top]
    ids = np.concatenate([first[:, None], best], axis=1)
    return ListedRows(ids, np.take_along_axis(log_probs, ids, 1).astype(np.float32))


@pytest.mark.parametrize("draft_top", [49_153, 20])
def test_verify_listed_at_a_real_vocabulary_stays_within_o_nk_memory(draft_top):
    """K = 49,153 (every token of a real vocabulary) in the guidance rows, 8 sequences whose
    one proposal is always rejected (λ = 1, the guidance's least likely token proposed at the
    draft's most likely): the residual runs over all K tokens of S. The draft rows list all of
    them (no probe) or only a top-20 (the probe gives the rest). Peak extra memory (numpy,
    traced) stays O(N·K), under 50 MB for the 8 rows (an (N, K, K) comparison is 19 GB)."""
    gen = np.random.default_rng(0)
    n, vocab = 8, 49_153
    log_p = np.log(gen.dirichlet(np.full(vocab, 0.3), n))
    log_q = np.log(gen.dirichlet(np.full(vocab, 0.3), n))
    x = log_p.argmax(-1)
    log_q[np.arange(n), x] = log_q.min() - 5.0  # q(x) ≈ 0 << p(x): rejected at any uniform
    draft = _rows_at_scale(gen, log_p, x, draft_top)
    guide = _rows_at_scale(gen, log_q, x, vocab)
    calls = []

    def probe(rows, positions, tokens):
        calls.append((rows.copy(), positions.copy(), tokens.shape))
        return np.take_along_axis(log_p[rows], tokens, 1)

    num, u = torch.ones(n, dtype=torch.long), torch.full((n, 2), 0.5, dtype=torch.float64)
    tracemalloc.start()
    try:
        out = verify_listed(num, draft, guide, 1.0, u, probe)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.offpolicy[:, 0].all() and (out.num_emitted == 1).all()
    assert peak < 50 * 2**20, f"peak {peak / 2**20:.1f} MB"
    if draft_top == vocab:
        assert not calls
    else:
        assert (
            len(calls) == 1 and calls[0][0].tolist() == list(range(n)) and calls[0][2] == (n, vocab)
        )
    # the residual token is drawn from max(0, q̃ - p) over S: q̃(y) > p(y), its recorded values exact
    y = out.tokens[:, 0].numpy()
    rows = np.arange(n)
    log_q_t = log_q.astype(np.float32).astype(np.float64)  # the rows' float32 values
    log_mass = np.log(np.exp(log_q_t).sum(-1))
    assert (log_q_t[rows, y] - log_mass > log_p.astype(np.float32)[rows, y]).all()
    np.testing.assert_allclose(
        out.target_log_probs[:, 0].numpy(), log_q_t[rows, y] - log_mass, rtol=1e-12
    )
    np.testing.assert_allclose(
        out.draft_log_probs[:, 0].numpy(), log_p[rows, y].astype(np.float32), rtol=1e-6
    )
