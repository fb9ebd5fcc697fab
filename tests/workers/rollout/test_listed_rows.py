"""The engines' tables (`process_log_probs`, `TopK`, `ListedRows`) and `verify_listed` on them:
hand values, the sorted lookup against a brute-force comparison, `verify_listed` against the
torch reference and at a real vocabulary's top-K within O(N·K) memory."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from speculative_helpers import D, RecordingProbe, chi2_counts_pvalue, listed_rows

from verl.workers.rollout import log_prob_tables
from verl.workers.rollout.speculative import (
    ListedRows,
    TopK,
    process_log_probs,
    verify_listed,
    verify_proposals,
)
from verl.workers.rollout.speculative_verify import _more_uniforms

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


@pytest.mark.parametrize("span", [0, 10**9], ids=["sorted", "dense"])
@pytest.mark.parametrize("seed", range(6))
def test_lookup_equals_brute_force(seed, span, monkeypatch):
    """`lookup` and `knows` equal the (N, M, K) comparison on random rows with repeats of column
    0 (same value, -inf, or another value: the larger wins), -1 padding, and queried tokens
    that are listed, unlisted, -1, or past every listed id; by sorted searches and by dense
    tables alike (`DENSE_SPAN` forcing each)."""
    monkeypatch.setattr(log_prob_tables, "DENSE_SPAN", span)
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


def test_process_log_probs_hand_values():
    logits = torch.tensor([math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)], dtype=D)
    # temperature 0.5 squares then renormalises: [.25, .09, .0225, .0025] / .365
    expected_t = torch.tensor([0.25, 0.09, 0.0225, 0.0025], dtype=D) / 0.365
    torch.testing.assert_close(process_log_probs(logits, 0.5).exp(), expected_t)
    # top-k 2: [.5, .3] / .8 = [.625, .375]
    torch.testing.assert_close(
        process_log_probs(logits, top_k=2).exp(), torch.tensor([0.625, 0.375, 0, 0], dtype=D)
    )
    # top-p 0.7: mass before each (descending) = 0, .5, .8, .95 -> keep the first two -> [.625, .375]
    torch.testing.assert_close(
        process_log_probs(logits, top_p=0.7).exp(), torch.tensor([0.625, 0.375, 0, 0], dtype=D)
    )
    # top-p 0.5: only the top token (mass before the second is exactly 0.5)
    torch.testing.assert_close(
        process_log_probs(logits, top_p=0.5).exp(), torch.tensor([1.0, 0, 0, 0], dtype=D)
    )


def test_topk_dedupe_lookup_and_tail_mass_hand_values():
    # vLLM lists the sampled token first and again inside the top-K: token 3 appears twice
    ids = torch.tensor([[[3, 1, 3, 0]]])
    lps = torch.tensor([[[0.2, 0.5, 0.2, 0.1]]], dtype=D).log()
    table = TopK.dedupe(ids, lps)
    assert table.log_probs[0, 0, 2] == float("-inf") and table.log_probs[0, 0, 0] == lps[0, 0, 0]
    found = table.lookup(torch.tensor([[[3, 1, 2]]])).exp()  # token 2 is not listed: p = 0
    torch.testing.assert_close(found, torch.tensor([[[0.2, 0.5, 0.0]]], dtype=D))
    # listed mass 0.2 + 0.5 + 0.1 = 0.8 (the repeat counts once): tail 0.2
    torch.testing.assert_close(table.tail_mass(), torch.tensor([[0.2]], dtype=D))


def test_listed_rows_topk_and_tail_mass_hand_values():
    # S is the top-K columns (1..): column 0 is the row's own token, counted only through a
    # top-K repeat. Row 0: token 3 listed twice (sampled + top-K): Q_S = 0.5 + 0.2 + 0.1 = 0.8,
    # tail 0.2. Row 1: column 0 (token 7, 0.05) is not in S: Q_S = 0.6 + 0.2 + 0.1 = 0.9, tail 0.1
    # (not 1 - 0.95). Row 2 lists more than all the mass (rounding): the tail clips at 0.
    rows = listed_rows([[3, 1, 3, 0], [7, 1, 3, 0], [1, 1, 2, 0]],
                 [[0.2, 0.5, 0.2, 0.1], [0.05, 0.6, 0.2, 0.1], [0.7, 0.7, 0.2, 0.1 + 1e-9]])  # fmt: skip
    np.testing.assert_allclose(rows.topk_mass(), [0.8, 0.9, 1.0 + 1e-9], rtol=1e-12)
    np.testing.assert_allclose(rows.tail_mass(), [0.2, 0.1, 0.0], rtol=1e-12, atol=1e-15)
    # in_topk: token 3 is in row 0's S (its repeat), 7 is only row 1's column 0, 2 is in row 2's S
    assert rows.in_topk(np.array([3, 7, 2])).tolist() == [True, False, True]
    assert rows.in_topk(np.array([4, 1, 0])).tolist() == [False, True, True]


def test_listed_rows_lists_support_only_through_a_real_zero():
    """A row lists its whole support when its top-K lists a token of probability 0 (top-k or
    top-p cut inside the list): then an unlisted token has probability exactly 0. A repeat of
    column 0 read -inf (a de-duplicated row) is no such zero."""
    cut = listed_rows(
        [[0, 0, 1, 2]], [[0.625, 0.625, 0.375, 0.0]]
    )  # top-p 0.7 of [.5, .3, .1, ...]
    whole = listed_rows([[0, 0, 1, 2]], [[0.5, 0.5, 0.3, 0.1]])  # 0.1 of the mass is elsewhere
    repeat = listed_rows([[3, 1, 3, 0]], [[0.2, 0.5, 0.0, 0.1]])  # token 3's repeat at -inf
    assert cut.lists_support().tolist() == [True]
    assert whole.lists_support().tolist() == [False]
    assert repeat.lists_support().tolist() == [False]
    # knows: listed tokens everywhere; an unlisted 7 only where the row lists its support
    queries = np.array([[0, 2, 7]])
    assert cut.knows(queries).tolist() == [[True, True, True]]
    assert whole.knows(queries).tolist() == [[True, True, False]]
    assert repeat.knows(np.array([[3, 0, 7]])).tolist() == [[True, True, False]]


def test_listed_rows_topk_reads_a_repeat_at_its_value():
    # row 0 lists token 3 first (0.2) and again in its top-3; topk gives the top-3 columns with
    # token 3 at 0.2, also where the repeat itself reads -inf (a de-duplicated row)
    rows = listed_rows([[3, 1, 3, 0], [2, 5, 1, 4]], [[0.2, 0.5, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]])
    deduped = ListedRows(rows.ids, rows.deduped())
    assert np.isneginf(deduped.log_probs[0, 2])
    for listed in (rows, deduped):
        ids, values = listed.topk()
        assert ids.tolist() == [[1, 3, 0], [5, 1, 4]]
        np.testing.assert_allclose(np.exp(values), [[0.5, 0.2, 0.1], [0.3, 0.2, 0.1]], rtol=1e-12)
        # lookup reads a repeat at its finite value too (the larger of its two entries)
        np.testing.assert_allclose(listed.lookup(np.array([[3], [2]]))[:, 0], np.log([0.2, 0.4]),
                                   rtol=1e-12)  # fmt: skip


def test_listed_rows_take_and_lookup_one_hand_values():
    rows = listed_rows([[3, 1, 3, 0], [2, 2, 5, 1]], [[0.2, 0.5, 0.2, 0.1], [0.4, 0.4, 0.3, 0.2]])
    # token 3 in row 0 and token 2 in row 1 repeat their column 0: the repeats read -inf
    deduped = rows.deduped()
    assert np.isneginf(deduped[0, 2]) and np.isneginf(deduped[1, 1])
    assert rows.deduped() is deduped  # computed once
    # lookup_one: one token per row, the same values as lookup; 7 is not listed in row 1
    tokens = np.array([3, 7])
    np.testing.assert_array_equal(rows.lookup_one(tokens), rows.lookup(tokens[:, None])[:, 0])
    np.testing.assert_allclose(rows.lookup_one(np.array([0, 5])), np.log([0.1, 0.3]), rtol=1e-12)
    assert np.isneginf(rows.lookup_one(tokens)[1])
    # unknown=NaN keeps "not listed" apart from a zero: neither row lists a zero, so unlisted
    # token 7 reads NaN; a repeat of column 0 read -inf is no zero either
    assert rows.lists_support().tolist() == [False, False]
    assert ListedRows(rows.ids, deduped).lists_support().tolist() == [False, False]
    assert np.isnan(rows.lookup_one(tokens, unknown=np.nan)[1])
    assert rows.lookup_one(tokens, unknown=np.nan)[0] == pytest.approx(math.log(0.2))
    zero = listed_rows([[3, 1, 0, 3]], [[0.2, 0.8, 0.0, 0.2]])  # lists token 0 with probability 0
    assert zero.lists_support().tolist() == [True]
    assert np.isneginf(zero.lookup_one(np.array([7]), unknown=np.nan)).all()
    # take: the chosen rows, their de-duplicated values carried over
    taken = rows.take(np.array([1]))
    assert taken.ids.tolist() == [[2, 2, 5, 1]]
    np.testing.assert_array_equal(taken.deduped(), deduped[[1]])
    np.testing.assert_array_equal(
        listed_rows([[2, 2, 5, 1]], [[0.4, 0.4, 0.3, 0.2]]).deduped(), taken.deduped()
    )


def test_verify_listed_hand_values():
    """Three sequences, k = 3, λ = 0.5; rows hold the proposal first, then a top-3 (repeats
    kept). S is the guidance row's top-3, q̃ = q / Q_S on S; accept x w.p. min(1, 0.5 + 0.5·q̃(x)/p(x))."""
    num = torch.tensor([2, 3, 1])
    draft = listed_rows(
        [[4, 4, 7, 1], [7, 7, 1, 0], [2, 0, 5, 2], [0, 0, 1, 2], [9, 3, 9, 1], [5, 5, 2, 6]],
        [[0.5, 0.5, 0.3, 0.1], [0.6, 0.6, 0.2, 0.1], [0.2, 0.5, 0.3, 0.2],
         [0.7, 0.7, 0.1, 0.1], [0.1, 0.6, 0.1, 0.2], [0.4, 0.4, 0.3, 0.2]],
    )  # fmt: skip
    guide = listed_rows(
        [[4, 2, 4, 0], [7, 1, 3, 7], [2, 2, 9, 0], [0, 0, 8, 1], [9, 9, 3, 2], [5, 6, 2, 5]],
        [[0.3, 0.4, 0.3, 0.2], [0.1, 0.5, 0.3, 0.1], [0.4, 0.4, 0.1, 0.3],
         [0.7, 0.7, 0.2, 0.05], [0.2, 0.2, 0.5, 0.1], [0.05, 0.5, 0.3, 0.05]],
    )  # fmt: skip
    # seq 0: S = {2, 4, 0}, Q_S = 0.9, q̃(4) = 1/3: ratio 0.5 + 0.5 * (1/3)/0.5 = 0.8333 > u = 0.79,
    # accepted. Token 7: S = {1, 3, 7}, Q_S = 0.9, q̃(7) = 1/9: ratio 0.5 + 0.5 * (1/9)/0.6 =
    # 0.5926 <= u = 0.6, rejected. The residual max(0, q̃ - p) over S = [1, 3, 7], q̃ = [5/9,
    # 3/9, 1/9]: the draft row lists 1 (p .2) and 7 (p .6) but not 3 (and no zero, so p(3) is
    # unknown), so y is drawn from the envelope [5/9 - .2, q̃(3), max(0, 1/9 - .6)] = [.35556,
    # .33333, 0], CDF [.35556, .68889, .68889]; last uniform 0.6 * .68889 = .41333 passes 1 entry
    # -> token 3, unknown: the probe gives the row, p = [.2, .05, .6], and 3 is kept if
    # v < 1 - p(3)/q̃(3) = 1 - .05 * 3 = .85, v = .31034 (`_more_uniforms(0.6)`): kept.
    # seq 1: S = {2, 9, 0}, Q_S = .8, q̃(2) = .5: ratio 0.5 + 0.5 * .5/.2 = 1.75; S = {0, 8, 1},
    # Q_S = .95, q̃(0) = .7368: ratio 0.5 + 0.5 * .7368/.7 = 1.026; S = {9, 3, 2}, Q_S = .8,
    # q̃(9) = .25: ratio 0.5 + 0.5 * .25/.1 = 1.75. All >= 1: accepted whatever the uniforms.
    # seq 2: S = {6, 2, 5}, Q_S = .85, q̃(5) = .05/.85 = .05882: ratio 0.5 + 0.5 * .05882/.4 =
    # 0.5735 <= u = 0.9, rejected. The draft row lists all of S (p = [.2, .3, .4]): no probe.
    # q̃ = [.58824, .35294, .05882]; residual [.38824, .05294, 0], CDF [.38824, .44118, .44118];
    # 0.95 * .44118 = .41912 passes 1 entry -> token 2 (p .3, q .3, q̃ .35294).
    u = torch.tensor(
        [[0.79, 0.6, 0.5, 0.6], [0.99, 0.99, 0.99, 0.5], [0.9, 0.0, 0.0, 0.95]], dtype=D
    )
    probe = RecordingProbe({(0, 1): {1: 0.2, 3: 0.05, 7: 0.6}})
    out = verify_listed(num, draft, guide, 0.5, u, probe)
    # only the row that needs it is probed: sequence 0 after 1 proposal, at S of its guidance row
    assert probe.calls == [([0], [1], [[1, 3, 7]])]
    assert out.tokens.tolist() == [[4, 3, -1], [2, 0, 9], [2, -1, -1]]
    assert out.num_emitted.tolist() == [2, 3, 1] and out.num_accepted.tolist() == [1, 3, 0]
    assert out.offpolicy.tolist() == [[False, True, False], [False] * 3, [True, False, False]]
    log = math.log
    expected_p = [[log(0.5), log(0.05), 0.0], [log(0.2), log(0.7), log(0.1)], [log(0.3), 0.0, 0.0]]
    # guidance_log_probs: the true log q (column 0 for proposals, the top-K value for residuals)
    expected_q = [[log(0.3), log(0.3), 0.0], [log(0.4), log(0.7), log(0.2)], [log(0.3), 0.0, 0.0]]
    # target_log_probs: log q̃ = log q - log Q_S; target_tv: λ(1 - Q_S)
    expected_t = [[log(1 / 3), log(1 / 3), 0.0], [log(0.5), log(0.7 / 0.95), log(0.25)],
                  [log(0.3 / 0.85), 0.0, 0.0]]  # fmt: skip
    expected_tv = [[0.05, 0.05, 0.0], [0.1, 0.025, 0.1], [0.075, 0.0, 0.0]]
    for name, expected in (("draft_log_probs", expected_p), ("guidance_log_probs", expected_q),
                           ("target_log_probs", expected_t), ("target_tv", expected_tv)):  # fmt: skip
        torch.testing.assert_close(getattr(out, name), torch.tensor(expected, dtype=D), rtol=1e-12,
                                   atol=1e-12, msg=name)  # fmt: skip
    np.testing.assert_allclose(_more_uniforms(np.array([0.6, 0.65]), 2),
                               [[0.31033615, 0.25463521], [0.90506, 0.41704]], atol=5e-6)  # fmt: skip
    # a smaller last uniform, 0.4 * .68889 = .27556 < .35556, stops at the first entry: token 1,
    # listed (q .5, p .2), so the probe is not asked
    u[0, -1] = 0.4
    out = verify_listed(num, draft, guide, 0.5, u, probe)
    assert out.tokens[0, 1] == 1 and out.draft_log_probs[0, 1].item() == pytest.approx(log(0.2))
    assert len(probe.calls) == 1
    # 0.65 * .68889 = .44778 -> token 3 again, probed, but v = .90506 >= .85: rejected; the exact
    # draw from the residual [.35556, .28333, 0] (CDF .63889) with w = .41704: .41704 * .63889 =
    # .26644 < .35556 -> token 1
    u[0, -1] = 0.65
    out = verify_listed(num, draft, guide, 0.5, u, probe)
    assert out.tokens[0, 1] == 1 and out.draft_log_probs[0, 1].item() == pytest.approx(log(0.2))
    assert len(probe.calls) == 2 and probe.calls[-1] == ([0], [1], [[1, 3, 7]])
    # without a probe, p(3) is unknown: refused
    with pytest.raises(RuntimeError, match="no draft probe"):
        verify_listed(num, draft, guide, 0.5, u)
    # a draft row that lists a zero lists its whole support: p(3) = 0 exactly, no probe needed.
    # Row 1 as [7, 1, 0] with p [.6, .4, 0]: ratio 0.5 + 0.5 * (1/9)/.6 = .5926 still rejects;
    # residual [5/9 - .4, 1/3 - 0, 0] = [.15556, .33333, 0], CDF [.15556, .48889, .48889];
    # 0.4 * .48889 = .19556 passes 1 entry -> token 3 with p = 0 (log -inf)
    probs = np.exp(draft.log_probs)
    probs[1] = [0.6, 0.6, 0.4, 0.0]
    cut = listed_rows(draft.ids.tolist(), probs.tolist())
    out = verify_listed(num, cut, guide, 0.5, u)
    assert out.tokens[0].tolist() == [4, 3, -1] and np.isneginf(out.draft_log_probs[0, 1].item())
    assert out.target_log_probs[0, 1].item() == pytest.approx(log(1 / 3))


def _random_rows(
    gen: np.random.Generator, tokens: np.ndarray, vocab: int, top: int
) -> tuple[ListedRows, np.ndarray]:
    """One engine row per token: the token, then the `top` most likely of a random distribution
    (the token may repeat among them), with their log-probs; and the whole (N, vocab) log-probs
    (float32 as an engine's, the values the rows list)."""
    probs = gen.dirichlet(np.full(vocab, 0.3), len(tokens))
    log_probs = np.log(probs).astype(np.float32)
    best = np.argsort(-probs, axis=-1)[:, :top]
    ids = np.concatenate([tokens[:, None], best], axis=-1)
    return ListedRows(ids, np.take_along_axis(log_probs, ids, -1)), log_probs


@pytest.mark.parametrize("lam", [0.3, 1.0])
def test_verify_listed_equals_verify_proposals_on_topk(lam):
    """The flat-rows path (draft rows listing the proposal and its top-5 of V = 12, the rest
    from a probe) and `verify_proposals` on the draft's whole tables and the guidance's top-5 as
    a `TopK` (its set S) give the same tokens, provenance and log-probs for the same uniforms
    (300 sequences, k = 4)."""
    gen = np.random.default_rng(3)
    batch, k, vocab = 300, 4, 12
    num = torch.from_numpy(gen.integers(1, k + 1, batch))
    tokens = gen.integers(0, vocab, int(num.sum()))
    (draft, draft_full), (guide, _) = (_random_rows(gen, tokens, vocab, 5) for _ in range(2))
    u = torch.from_numpy(gen.random((batch, k + 1)))
    starts = np.cumsum(num.numpy()) - num.numpy()
    calls = []

    def probe(rows, positions, ids):  # the draft's log p at (sequence, position): its full row
        calls.append((rows, positions, ids))
        return np.take_along_axis(draft_full[starts[rows] + positions], ids, -1)

    fast = verify_listed(num, draft, guide, lam, u, probe)
    proposals = torch.full((batch, k), -1, dtype=torch.long)
    used = torch.arange(k) < num.unsqueeze(-1)
    proposals[used] = torch.from_numpy(tokens)
    dense = torch.full((batch, k, vocab), -math.log(vocab), dtype=D)
    dense[used] = torch.from_numpy(draft_full).double()
    ids, values = guide.topk()
    top = TopK(torch.full((batch, k, 5), -1), torch.full((batch, k, 5), float("-inf"), dtype=D))
    top.ids[used], top.log_probs[used] = torch.from_numpy(ids), torch.from_numpy(values).double()
    ref = verify_proposals(proposals, num, dense, top, lam, uniforms=u)
    assert fast.offpolicy.any() and (fast.num_accepted > 1).any()
    for name in ("num_emitted", "num_accepted", "offpolicy"):
        assert torch.equal(getattr(fast, name), getattr(ref, name)), name
    # Where the draft's row lists all of S at the rejected position, the flat path draws the
    # residual token by the same inverse CDF; elsewhere by rejection from an envelope (the
    # probe asked only if the drawn token is unlisted), so only its law is the same (chi-square
    # in test_residual_by_rejection_follows_the_residual); its values must still be exact.
    rejected = fast.offpolicy.any(-1).numpy()
    at = starts + fast.num_accepted.numpy()
    lists_s = np.ones(batch, dtype=bool)
    lists_s[rejected] = draft.take(at[rejected]).knows(guide.ids[at[rejected], 1:]).all(-1)
    assert lists_s.any() and (~lists_s).any()
    same = torch.from_numpy(lists_s)
    assert torch.equal(fast.tokens[same], ref.tokens[same])
    accepted = torch.arange(k) < fast.num_accepted.unsqueeze(-1)
    assert torch.equal(fast.tokens[accepted], ref.tokens[accepted])
    for name in ("draft_log_probs", "target_log_probs", "target_tv"):
        torch.testing.assert_close(
            getattr(fast, name)[same], getattr(ref, name)[same], rtol=0, atol=1e-12
        )
    other = np.flatnonzero(~lists_s)
    y = fast.tokens[other, fast.num_accepted[other]].numpy()
    true_p = draft_full[at[other], y].astype(np.float64)
    np.testing.assert_allclose(fast.draft_log_probs[other, fast.num_accepted[other]].numpy(), true_p,
                               rtol=0, atol=1e-12)  # fmt: skip
    # guidance_log_probs: the same on S; a proposal outside S has q̃ = 0 (the reference's -inf)
    # and the flat path still reports its true q (column 0 of its guidance row); at λ = 1 such
    # a proposal is always rejected (ratio q̃/p = 0)
    outside = torch.isneginf(ref.guidance_log_probs)
    assert bool(outside.any()) == (lam < 1) and not (ref.offpolicy & outside).any()
    both = ~outside & (fast.tokens == ref.tokens)
    torch.testing.assert_close(fast.guidance_log_probs[both], ref.guidance_log_probs[both],
                               rtol=0, atol=1e-12)  # fmt: skip
    b, pos = outside.nonzero(as_tuple=True)
    row = torch.from_numpy(starts)[b] + pos
    torch.testing.assert_close(fast.guidance_log_probs[outside],
                               torch.from_numpy(guide.log_probs[row, 0]).double())  # fmt: skip
    # the probe was asked once, at rejected positions, for the guidance row's S, only where the
    # draft's row does not list all of it, and not at all of those: a row whose envelope draw
    # gave a listed token needs no probe (it emits a listed token)
    assert len(calls) == 1
    rows, positions, asked = calls[0]
    assert len(rows) and fast.offpolicy[rows, positions].all()
    at = starts[rows] + positions
    np.testing.assert_array_equal(asked, guide.ids[at, 1:])
    assert not draft.take(at).knows(asked).all(-1).any()
    unasked = np.setdiff1d(other, rows)
    assert 0 < len(rows) < len(other) and len(unasked)
    y = fast.tokens[unasked, fast.num_accepted[unasked]].numpy()[:, None]
    at_unasked = starts[unasked] + fast.num_accepted[unasked].numpy()
    assert draft.take(at_unasked).knows(y).all()


def test_residual_by_rejection_follows_the_residual():
    """V = 8; the guidance lists S = its top-4 (ids 0-3, q = [.3, .25, .2, .15], Q_S = .9, q̃ =
    [1/3, 5/18, 2/9, 1/6]); the draft lists its top-2 (ids 1 and 4, p = [.35, .3]), so p(0), p(2),
    p(3) are unknown (true p: [.05, .35, .1, .05, .3, .05, .05, .05]). The proposal is token 4,
    q̃(4) = 0: at λ = 1 always rejected. The residual r = max(0, q̃ - p) over S is [1/3 - .05,
    0, 2/9 - .1, 1/6 - .05] = [.28333, 0, .12222, .11667] (sum .52222). The envelope is r on the
    listed token 1 (0) and q̃ on the unlisted ones: [1/3, 0, 2/9, 1/6] (sum .72222), and since
    every token of S with r > 0 is unlisted, every row asks the probe. So a draft that also lists
    token 0 (p .05) makes the envelope [.28333, 0, 2/9, 1/6] (sum .67222) and the probe is asked
    w.p. (2/9 + 1/6)/.67222 = .57851. 40,000 rows each: chi-square of the emitted tokens against
    r, the probe's share within 4 sigma, every emitted token's log p exact."""
    true_p = np.array([0.05, 0.35, 0.1, 0.05, 0.3, 0.05, 0.05, 0.05])
    n = 40_000
    guide_ids, guide_p = [4, 0, 1, 2, 3], [0.0, 0.3, 0.25, 0.2, 0.15]  # column 0: the proposal
    gen = np.random.default_rng(7)
    for listed, asked_share in (([4, 1, 4], 1.0), ([4, 1, 4, 0], (2 / 9 + 1 / 6) / 0.67222222)):
        draft = listed_rows([listed] * n, [true_p[listed].tolist()] * n)
        guide = listed_rows([guide_ids] * n, [guide_p] * n)
        calls = []

        def probe(rows, positions, tokens, calls=calls):
            calls.append(len(rows))
            assert (positions == 0).all()
            return np.log(true_p[tokens])

        u = torch.from_numpy(gen.random((n, 2)))
        out = verify_listed(torch.ones(n, dtype=torch.long), draft, guide, 1.0, u, probe)
        assert out.offpolicy[:, 0].all() and len(calls) == 1
        y = out.tokens[:, 0]
        residual = torch.tensor([0.28333333, 0, 0.12222222, 0.11666667, 0, 0, 0, 0], dtype=D)
        assert (
            chi2_counts_pvalue(torch.bincount(y, minlength=8).double(), residual / residual.sum())
            > 1e-3
        )
        sigma = (asked_share * (1 - asked_share) / n) ** 0.5
        assert calls[0] / n == pytest.approx(asked_share, abs=4 * sigma + 1e-12)
        np.testing.assert_allclose(
            out.draft_log_probs[:, 0].numpy(), np.log(true_p[y.numpy()]), rtol=0, atol=1e-6
        )


def test_verify_listed_with_partial_lists_emits_the_truncated_target():
    """Guidance rows listing the proposal and the top-3 of V = 8, draft rows the proposal and
    its top-2, the draft's p on S from a probe; k = 2, λ = 0.6. The first emitted token follows
    t = (1-λ)p + λq̃ (chi-square, n = 40,000), not q_λ, and the behavior computed from the
    result, log((1-λ)p + λq̃) with p and q̃ its draft_log_probs and target_log_probs, is the hand
    value of every emitted token (1e-12).
    p = [.3, .2, .15, .1, .1, .08, .05, .02], q = [.02, .05, .08, .3, .1, .25, .15, .05]:
    S = {3, 5, 6}, Q_S = .7, q̃ = [0, 0, 0, 3/7, 0, 5/14, 3/14, 0];
    t = .4p + .6q̃ = [.12, .08, .06, .297143, .04, .246286, .148571, .008]
    (q_λ = .4p + .6q = [.132, .11, .108, .22, .1, .182, .11, .038])."""
    lam, n, k = 0.6, 40_000, 2
    p = np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
    q = np.array([0.02, 0.05, 0.08, 0.3, 0.1, 0.25, 0.15, 0.05])
    q_t = np.array([0, 0, 0, 3 / 7, 0, 5 / 14, 3 / 14, 0])
    t = np.array([0.12, 0.08, 0.06, 0.04 + 0.6 * 3 / 7, 0.04,
                  0.032 + 0.6 * 5 / 14, 0.02 + 0.6 * 3 / 14, 0.008])  # fmt: skip
    np.testing.assert_allclose((1 - lam) * p + lam * q_t, t, rtol=1e-12)
    gen = np.random.default_rng(17)
    x = gen.choice(8, size=2 * n, p=p)  # two proposals per sequence, i.i.d. from p
    num = torch.full((n,), k)
    draft_ids = np.stack([x, np.zeros_like(x), np.ones_like(x)], 1)  # x, then p's top-2 {0, 1}
    draft = ListedRows(draft_ids, np.log(p[draft_ids]))
    s_ids = np.array([3, 5, 6])
    guide_ids = np.concatenate([x[:, None], np.tile(s_ids, (2 * n, 1))], 1)  # x, then S
    guide = ListedRows(guide_ids, np.log(q[guide_ids]))
    calls = []

    def probe(rows, positions, tokens):
        calls.append((rows, positions, tokens))
        return np.log(p[tokens])

    u = torch.from_numpy(gen.random((n, k + 1)))
    out = verify_listed(num, draft, guide, lam, u, probe)
    first = out.tokens[:, 0].numpy()
    counts = torch.from_numpy(np.bincount(first, minlength=8)).to(D)
    assert chi2_counts_pvalue(counts, torch.from_numpy(t)) > 1e-3
    q_lam = (1 - lam) * p + lam * q
    assert chisquare(counts.numpy(), q_lam * n).pvalue < 1e-6
    # the second token (where the first was accepted) follows t too
    second = out.tokens[:, 1].numpy()
    second = second[second >= 0]
    counts = torch.from_numpy(np.bincount(second, minlength=8)).to(D)
    assert chi2_counts_pvalue(counts, torch.from_numpy(t)) > 1e-3
    # every rejection was probed (the draft row never lists all of S), at its position, for S
    assert len(calls) == 1
    rows, positions, tokens = calls[0]
    rejected = out.offpolicy.nonzero().numpy()
    np.testing.assert_array_equal(np.stack([rows, positions], 1), rejected)
    np.testing.assert_array_equal(tokens, np.tile(s_ids, (len(rows), 1)))
    # per-token values and the behavior log((1-λ)p + λq̃) against the hand values
    valid = out.tokens >= 0
    y = out.tokens[valid].numpy()
    log_p, log_t = out.draft_log_probs[valid].numpy(), out.target_log_probs[valid].numpy()
    np.testing.assert_allclose(log_p, np.log(p[y]), rtol=1e-12)
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(log_t, np.log(q_t[y]), rtol=1e-12)
    np.testing.assert_allclose(out.guidance_log_probs[valid].numpy(), np.log(q[y]), rtol=1e-12)
    np.testing.assert_allclose(out.target_tv[valid].numpy(), np.full(len(y), lam * 0.3), rtol=1e-12)
    behavior = np.logaddexp(math.log1p(-lam) + log_p, math.log(lam) + log_t)
    np.testing.assert_allclose(behavior, np.log(t[y]), rtol=0, atol=1e-12)


def test_verify_listed_refuses_rows_of_different_proposals():
    rows = listed_rows([[1, 2]], [[0.5, 0.5]])
    other = listed_rows([[2, 1]], [[0.5, 0.5]])
    with pytest.raises(RuntimeError, match="same proposals"):
        verify_listed(torch.tensor([1]), rows, other, 0.5, torch.zeros(1, 2, dtype=D))
