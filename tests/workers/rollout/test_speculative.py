"""The pure speculative algorithm: emitted tokens follow q_λ exactly (statistical tests, fixed seeds)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from verl.trainer.core_algos.guidance import mixture_log_probs
from verl.workers.rollout.speculative import (
    ListedRows,
    SpeculativeBatch,
    TopK,
    draw_bonus,
    overlapped_generate,
    process_log_probs,
    speculative_generate,
    verify_listed,
    verify_proposals,
)

D = torch.float64


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


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token with zero probability was emitted"
    expected = probs[keep] * counts.sum()
    return chisquare(
        counts[keep].numpy(), expected.numpy() * counts[keep].sum().item() / expected.sum().item()
    ).pvalue


P1 = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05], dtype=D)
Q1 = torch.tensor([0.05, 0.1, 0.2, 0.25, 0.4], dtype=D)


@pytest.mark.parametrize("lam", [0.0, 0.3, 0.5, 1.0])
def test_single_step_emits_q_lambda(lam):
    n = 40_000
    gen = torch.Generator().manual_seed(int(lam * 100) + 1)
    proposals = torch.multinomial(P1, n, replacement=True, generator=gen).unsqueeze(-1)
    result = verify_proposals(
        proposals,
        torch.ones(n, dtype=torch.long),
        P1.log().expand(n, 1, 5),
        Q1.log().expand(n, 1, 5),
        lam,
        gen,
    )
    assert torch.all(result.num_emitted == 1)
    counts = torch.bincount(result.tokens[:, 0], minlength=5).to(D)
    target = (1 - lam) * P1 + lam * Q1
    assert _chi2_ok(counts, target) > 1e-3
    # provenance: λ = 0 never emits a guidance token; the off-policy share is TV(q_λ, p) = λ·TV(q, p)
    tv = 0.5 * (target - P1).abs().sum().item()
    share = result.offpolicy.double().mean().item()
    assert share == pytest.approx(tv, abs=4 * math.sqrt(max(tv * (1 - tv), 1e-12) / n) + 1e-12)
    if lam == 0.0:
        assert not result.offpolicy.any()
    # recorded log-probs are those of the emitted tokens
    torch.testing.assert_close(result.draft_log_probs[:, 0], P1.log()[result.tokens[:, 0]])
    torch.testing.assert_close(result.guidance_log_probs[:, 0], Q1.log()[result.tokens[:, 0]])


def test_offpolicy_marks_exactly_the_residual_token():
    # proposal token 0 has q = 0 and λ = 1: always rejected; the residual max(0, q - p) has
    # support only where q > p, i.e. tokens 2, 3, 4
    n = 2000
    p = torch.tensor([0.6, 0.3, 0.1, 0.0, 0.0], dtype=D)
    q = torch.tensor([0.0, 0.2, 0.3, 0.25, 0.25], dtype=D)
    proposals = torch.tensor([[0, 1]]).expand(n, 2)
    result = verify_proposals(
        proposals, torch.full((n,), 2), p.log().expand(n, 2, 5), q.log().expand(n, 2, 5), 1.0
    )
    assert torch.all(result.num_accepted == 0) and torch.all(result.num_emitted == 1)
    assert torch.all(result.offpolicy[:, 0]) and not result.offpolicy[:, 1].any()
    assert set(result.tokens[:, 0].tolist()) <= {2, 3, 4}
    assert torch.all(result.tokens[:, 1] == -1)  # the second proposal is dropped
    # a proposal the guidance likes at least as much (q/p >= 1) is always accepted, never marked
    good = verify_proposals(torch.tensor([[2, 3]]).expand(n, 2), torch.full((n,), 2),
                            p.clamp(min=1e-9).log().expand(n, 2, 5), q.log().expand(n, 2, 5), 0.7)  # fmt: skip
    assert torch.all(good.num_accepted == 2) and not good.offpolicy.any()


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


def _listed(probs: torch.Tensor, first: torch.Tensor, top: int) -> TopK:
    """What an engine reports at one position per row: the given token, then the `top` most
    likely tokens (the given one may repeat), with their unnormalised log-probs."""
    best = probs.topk(top).indices.expand(first.shape[0], top)
    ids = torch.cat([first.unsqueeze(-1), best], dim=-1).unsqueeze(1)  # (n, 1, top + 1)
    return TopK.dedupe(ids, probs.log()[ids])


@pytest.mark.parametrize("lam", [0.5, 1.0])
def test_topk_lists_emit_the_same_distribution_as_dense_tables(lam):
    """Truncated lists (the proposal + top-2 of each model over V = 6) and the equal dense tables
    (-inf where unlisted) accept the same proposals with the same uniforms, and the emitted token
    follows the per-proposal mixture computed by hand from the dense tables (chi-square)."""
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], dtype=D)
    q = torch.tensor([0.05, 0.1, 0.2, 0.3, 0.05, 0.3], dtype=D)
    n = 40_000
    x = torch.multinomial(p, n, replacement=True, generator=torch.Generator().manual_seed(5))
    draft, guide = _listed(p, x, 2), _listed(q, x, 2)

    def dense(table: TopK) -> torch.Tensor:  # (n, 1, 6): the listed log-prob of every token
        return table.lookup(torch.arange(6).expand(n, 1, 6))

    args = (x.unsqueeze(-1), torch.ones(n, dtype=torch.long))
    sparse = verify_proposals(*args, draft, guide, lam, torch.Generator().manual_seed(9))
    full = verify_proposals(
        *args, dense(draft), dense(guide), lam, torch.Generator().manual_seed(9)
    )
    assert torch.equal(sparse.offpolicy, full.offpolicy) and sparse.offpolicy.any()
    accepted = ~sparse.offpolicy[:, 0]
    assert torch.equal(sparse.tokens[accepted], full.tokens[accepted])
    # emitted(y) = sum_x p(x) [a(x) 1{y = x} + (1 - a(x)) r_x(y)], with a(x) = min(1, 1-λ + λ q/p)
    # and r_x ∝ max(0, q̃_x - p̃_x), where p̃_x, q̃_x are the tables listed when x was proposed
    expected = torch.zeros(6, dtype=D)
    for token in range(6):
        p_row, q_row = dense(draft)[x == token][0, 0].exp(), dense(guide)[x == token][0, 0].exp()
        accept = min(1.0, (1 - lam) + lam * q[token].item() / p[token].item())
        residual = (q_row - p_row).clamp(min=0)
        expected += p[token] * (
            accept * torch.eye(6, dtype=D)[token] + (1 - accept) * residual / residual.sum()
        )
    counts = torch.bincount(sparse.tokens[:, 0], minlength=6).to(D)
    assert _chi2_ok(counts, expected) > 1e-3
    # the residual token's recorded log-probs are its listed values (-inf when the draft did not list it)
    off = sparse.offpolicy[:, 0]
    torch.testing.assert_close(sparse.guidance_log_probs[off, 0], q.log()[sparse.tokens[off, 0]])
    listed_p = draft.lookup(sparse.tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(sparse.draft_log_probs[off, 0], listed_p[off, 0])


def _rows(ids: list[list[int]], probs: list[list[float]]) -> ListedRows:
    with np.errstate(divide="ignore"):  # a probability 0 is listed as -inf
        return ListedRows(np.array(ids), np.log(np.array(probs)))


def test_listed_rows_tail_mass_and_processing_hand_values():
    rows = _rows([[3, 1, 3, 0]], [[0.2, 0.5, 0.2, 0.1]])  # token 3 listed twice (sampled + top-K)
    # listed mass 0.2 + 0.5 + 0.1 = 0.8 (the repeat counts once): tail 0.2
    np.testing.assert_allclose(rows.tail_mass(), [0.2], rtol=1e-12)
    # temperature 0.5 squares the listed probabilities: [.04, .25, -, .01] / .30
    expected = np.array([[0.04, 0.25, 0.0, 0.01]]) / 0.30
    np.testing.assert_allclose(
        np.exp(rows.processed(temperature=0.5).log_probs), expected, rtol=1e-12
    )


def test_listed_rows_top_p_cuts_on_true_probabilities_at_temperature_1():
    """Raw rows list tokens 0-2 with p = [0.5, 0.3, 0.1] (tail 0.1). True mass before each:
    0, 0.5, 0.8, all < 0.85, so top-p 0.85 keeps all three: [0.5, 0.3, 0.1] / 0.9. Renormalised
    over the list first ([.556, .333, .111], mass before token 2 = .889 >= .85) it would drop
    token 2. With top_p = 0.75 token 2 goes (0.8 >= 0.75): [0.5, 0.3] / 0.8. At temperature 0.5
    the cut is on the listed renormalisation (the true one is unknown): .25, .09, .01 over .35 ->
    mass before token 2 = .971 >= .85, dropped: [.25, .09] / .34."""
    rows = _rows([[0, 0, 1, 2]], [[0.5, 0.5, 0.3, 0.1]])
    np.testing.assert_allclose(
        np.exp(rows.processed(top_p=0.85).log_probs),
        [[0.5 / 0.9, 0, 0.3 / 0.9, 0.1 / 0.9]],
        rtol=1e-12,
    )
    np.testing.assert_allclose(
        np.exp(rows.processed(top_p=0.75).log_probs), [[0.5 / 0.8, 0, 0.3 / 0.8, 0]], rtol=1e-12
    )
    np.testing.assert_allclose(
        np.exp(rows.processed(temperature=0.5, top_p=0.85).log_probs),
        [[0.25 / 0.34, 0, 0.09 / 0.34, 0]], rtol=1e-12, atol=1e-15,
    )  # fmt: skip
    # a cut row lists its support: token 2's zero is a real one (top-p), so unlisted 7 is 0 too
    assert rows.processed(top_p=0.75).lists_support().tolist() == [True]
    assert rows.processed(top_p=0.85).lists_support().tolist() == [False]


def test_listed_rows_topk_reads_a_repeat_at_its_value():
    # row 0 lists token 3 first (0.2) and again in its top-3; topk gives the top-3 columns with
    # token 3 at 0.2 even after processing set its repeat to -inf
    # (processing renormalises row 0 over its listed mass 0.8: [.5, .2, .1] / .8)
    rows = _rows([[3, 1, 3, 0], [2, 5, 1, 4]], [[0.2, 0.5, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]])
    for listed, mass in ((rows, 1.0), (rows.processed(temperature=1.0), 0.8)):
        ids, values = listed.topk()
        assert ids.tolist() == [[1, 3, 0], [5, 1, 4]]
        expected = [[0.5 / mass, 0.2 / mass, 0.1 / mass], [0.3, 0.2, 0.1]]
        np.testing.assert_allclose(np.exp(values), expected, rtol=1e-12)


def test_listed_rows_take_and_lookup_one_hand_values():
    rows = _rows([[3, 1, 3, 0], [2, 2, 5, 1]], [[0.2, 0.5, 0.2, 0.1], [0.4, 0.4, 0.3, 0.2]])
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
    # token 7 reads NaN; after processing, a repeat of column 0 reads -inf but is no zero
    assert rows.lists_support().tolist() == [False, False]
    assert rows.processed(temperature=1.0).lists_support().tolist() == [False, False]
    assert np.isnan(rows.lookup_one(tokens, unknown=np.nan)[1])
    assert rows.lookup_one(tokens, unknown=np.nan)[0] == pytest.approx(math.log(0.2))
    zero = _rows([[3, 1, 0, 3]], [[0.2, 0.8, 0.0, 0.2]])  # lists token 0 with probability 0
    assert zero.lists_support().tolist() == [True]
    assert np.isneginf(zero.lookup_one(np.array([7]), unknown=np.nan)).all()
    # take: the chosen rows, their de-duplicated values carried over
    taken = rows.take(np.array([1]))
    assert taken.ids.tolist() == [[2, 2, 5, 1]]
    np.testing.assert_array_equal(taken.deduped(), deduped[[1]])
    np.testing.assert_array_equal(
        _rows([[2, 2, 5, 1]], [[0.4, 0.4, 0.3, 0.2]]).deduped(), taken.deduped()
    )


def test_verify_listed_hand_values():
    """Two sequences, k = 3, λ = 0.5; rows hold the proposal first, then a top-3 (repeats kept)."""
    num = torch.tensor([2, 3])
    draft = _rows(
        [[4, 4, 7, 1], [7, 7, 1, 0], [2, 0, 5, 2], [0, 0, 1, 2], [9, 3, 9, 1]],
        [[0.5, 0.5, 0.3, 0.1], [0.6, 0.6, 0.2, 0.1], [0.2, 0.5, 0.3, 0.2],
         [0.7, 0.7, 0.1, 0.1], [0.1, 0.6, 0.1, 0.2]],
    )  # fmt: skip
    guide = _rows(
        [[4, 2, 4, 0], [7, 1, 3, 7], [2, 2, 9, 0], [0, 0, 8, 1], [9, 9, 3, 2]],
        [[0.3, 0.4, 0.3, 0.2], [0.1, 0.5, 0.3, 0.1], [0.4, 0.4, 0.1, 0.3],
         [0.7, 0.7, 0.2, 0.05], [0.2, 0.2, 0.5, 0.1]],
    )  # fmt: skip
    # seq 0: token 4 ratio 0.5 + 0.5 * 0.3/0.5 = 0.8 > u = 0.79, accepted; token 7 ratio
    # 0.5 + 0.5 * 0.1/0.6 = 0.5833 <= u = 0.6, rejected. Residual over the guidance's list
    # [7, 1, 3]: 7 -> 0 (q < p), 1 -> 0.5 - 0.2 = 0.3, 3 -> 0.3 - 0 (the draft does not list it);
    # CDF [0, 0.3, 0.6, 0.6]; last uniform 0.6 * 0.6 = 0.36 passes 2 entries -> token 3.
    # seq 1: ratios 1.5, 1.0, 1.5 >= 1: all accepted whatever the uniforms.
    u = torch.tensor([[0.79, 0.6, 0.5, 0.6], [0.99, 0.99, 0.99, 0.5]], dtype=D)
    out = verify_listed(num, draft, guide, 0.5, u)
    assert out.tokens.tolist() == [[4, 3, -1], [2, 0, 9]]
    assert out.num_emitted.tolist() == [2, 3] and out.num_accepted.tolist() == [1, 3]
    assert out.offpolicy.tolist() == [[False, True, False], [False, False, False]]
    log = math.log
    expected_p = [[log(0.5), float("-inf"), 0.0], [log(0.2), log(0.7), log(0.1)]]
    expected_q = [[log(0.3), log(0.3), 0.0], [log(0.4), log(0.7), log(0.2)]]
    torch.testing.assert_close(out.draft_log_probs, torch.tensor(expected_p, dtype=D))
    torch.testing.assert_close(out.guidance_log_probs, torch.tensor(expected_q, dtype=D))
    # a smaller last uniform, 0.4 * 0.6 = 0.24, stops at the second entry: token 1 (q 0.5, p 0.2)
    u[0, -1] = 0.4
    out = verify_listed(num, draft, guide, 0.5, u)
    assert out.tokens[0, 1] == 1 and out.draft_log_probs[0, 1].item() == pytest.approx(log(0.2))


def _random_rows(gen: np.random.Generator, tokens: np.ndarray, vocab: int, top: int) -> ListedRows:
    """One engine row per token: the token, then the `top` most likely of a random distribution
    (the token may repeat among them), with their log-probs."""
    probs = gen.dirichlet(np.full(vocab, 0.3), len(tokens))
    best = np.argsort(-probs, axis=-1)[:, :top]
    ids = np.concatenate([tokens[:, None], best], axis=-1)
    return ListedRows(ids, np.log(np.take_along_axis(probs, ids, -1)).astype(np.float32))


@pytest.mark.parametrize("lam", [0.3, 1.0])
def test_verify_listed_equals_verify_proposals_on_topk(lam):
    """The flat-rows path and `verify_proposals` on the same lists padded to a `TopK` give the
    same tokens, provenance and log-probs for the same uniforms (300 sequences, k = 4)."""
    gen = np.random.default_rng(3)
    batch, k, vocab = 300, 4, 12
    num = torch.from_numpy(gen.integers(1, k + 1, batch))
    tokens = gen.integers(0, vocab, int(num.sum()))
    draft, guide = _random_rows(gen, tokens, vocab, 5), _random_rows(gen, tokens, vocab, 5)
    u = torch.from_numpy(gen.random((batch, k + 1)))
    fast = verify_listed(num, draft, guide, lam, u)
    proposals = torch.full((batch, k), -1, dtype=torch.long)
    proposals[torch.arange(k) < num.unsqueeze(-1)] = torch.from_numpy(tokens)
    ref = verify_proposals(
        proposals, num, draft.as_topk(num, k), guide.as_topk(num, k), lam, uniforms=u
    )
    assert fast.offpolicy.any() and (fast.num_accepted > 1).any()
    for name in ("tokens", "num_emitted", "num_accepted", "offpolicy"):
        assert torch.equal(getattr(fast, name), getattr(ref, name)), name
    for name in ("draft_log_probs", "guidance_log_probs"):
        torch.testing.assert_close(getattr(fast, name), getattr(ref, name), rtol=0, atol=1e-12)


def test_verify_listed_refuses_rows_of_different_proposals():
    rows = _rows([[1, 2]], [[0.5, 0.5]])
    other = _rows([[2, 1]], [[0.5, 0.5]])
    with pytest.raises(RuntimeError, match="same proposals"):
        verify_listed(torch.tensor([1]), rows, other, 0.5, torch.zeros(1, 2, dtype=D))


def test_draw_bonus_hand_values():
    """λ = 0.5; rows 0 and 1 draw from q (u < λ), row 2 keeps the draft's lookahead token."""
    draft = _rows([[4, 4, 2, 9], [4, 4, 2, 9], [5, 1, 5, 3]],
                  [[0.5, 0.5, 0.3, 0.1], [0.5, 0.5, 0.3, 0.1], [0.2, 0.4, 0.2, 0.1]])  # fmt: skip
    guide = _rows([[2, 2, 4, 7], [2, 2, 4, 7], [1, 1, 3, 0]],
                  [[0.6, 0.6, 0.3, 0.1], [0.6, 0.6, 0.3, 0.1], [0.7, 0.7, 0.2, 0.05]])  # fmt: skip
    # row 0: u = 0.2 -> u/λ = 0.4; the guidance's CDF over [2, (repeat), 4, 7] is
    # [0.6, 0.6, 0.9, 1.0] and 0.4 * 1.0 passes no entry -> token 2 (q 0.6, p 0.3 from the list)
    # row 1: u = 0.4 -> 0.8 passes 2 entries -> token 4 (q 0.3, p 0.5)
    # row 2: u = 0.7 >= λ -> the lookahead token 5 (p 0.2), which the guidance does not list:
    # its q was not reported (the row lists no zero, 0.05 of its mass is elsewhere): NaN
    tokens, off, log_p, log_q = draw_bonus(draft, guide, 0.5, np.array([0.2, 0.4, 0.7]))
    assert tokens.tolist() == [2, 4, 5] and off.tolist() == [True, True, False]
    log = math.log
    np.testing.assert_allclose(log_p, [log(0.3), log(0.5), log(0.2)], rtol=1e-12)
    np.testing.assert_allclose(log_q, [log(0.6), log(0.3), float("nan")], rtol=1e-12)
    # the same row after a top-k cut lists a zero (token 0): unlisted token 5 is an exact 0
    cut = _rows([[1, 1, 3, 0]], [[0.7, 0.7, 0.3, 0.0]])
    assert np.isneginf(draw_bonus(draft.take([2]), cut, 0.5, np.array([0.7]))[3]).all()
    # λ = 0 always keeps the lookahead; λ = 1 always draws from q: row 2's 0.7 * 0.95 = 0.665
    # passes no entry of [0.7, 0.7, 0.9, 0.95] -> token 1
    assert draw_bonus(draft, guide, 0.0, np.array([0.0, 0.4, 0.7]))[0].tolist() == [4, 4, 5]
    assert draw_bonus(draft, guide, 1.0, np.array([0.2, 0.4, 0.7]))[0].tolist() == [2, 2, 1]


# ---------------------------------------------------------------------------------------- loop

V = 3
P_CHAIN = torch.tensor(
    [[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.3, 0.3, 0.4]], dtype=D
)  # p(next | prev)
Q_CHAIN = torch.tensor([[0.1, 0.2, 0.7], [0.6, 0.1, 0.3], [0.25, 0.5, 0.25]], dtype=D)


def toy_engines(gen: torch.Generator):
    """Vectorised toy draft / guidance 'models': Markov chains over V tokens."""

    def propose(ids, prefixes, budget):
        k = max(budget)
        last = torch.tensor([p[-1] for p in prefixes])
        proposals = torch.full((len(prefixes), k), -1, dtype=torch.long)
        tables = torch.zeros(len(prefixes), k, V, dtype=D)
        for j in range(k):
            tables[:, j] = P_CHAIN[last].log()
            nxt = torch.multinomial(P_CHAIN[last], 1, generator=gen).squeeze(-1)
            proposals[:, j] = nxt
            last = nxt
        num = torch.tensor(budget)
        proposals[torch.arange(k) >= num.unsqueeze(-1)] = -1
        return proposals, num, tables

    def score(ids, prefixes, proposals, num):
        prev = torch.cat(
            [torch.tensor([[p[-1]] for p in prefixes]), proposals[:, :-1].clamp(min=0)], dim=1
        )
        return Q_CHAIN[prev].log()

    return propose, score


def chain_prob(seq, lam, start=0, eos=None):
    prob, prev = 1.0, start
    mix = (1 - lam) * P_CHAIN + lam * Q_CHAIN
    for tok in seq:
        prob *= mix[prev, tok].item()
        prev = tok
    return prob


def chain_pvalue(seqs: list, lam: float, length: int) -> float:
    """Chi-square p-value of `length`-token sequences from token 0 against the chain mixture."""
    outcomes = list(itertools.product(range(V), repeat=length))
    index = {o: i for i, o in enumerate(outcomes)}
    counts = torch.zeros(len(outcomes), dtype=D)
    for s in seqs:
        counts[index[tuple(s.tokens)]] += 1
    probs = torch.tensor([chain_prob(o, lam) for o in outcomes], dtype=D)
    return _chi2_ok(counts, probs)


@pytest.mark.parametrize(("lam", "k"), [(0.5, 1), (0.5, 2), (0.5, 4), (1.0, 3), (0.0, 2), (0.8, 3)])
def test_generated_sequences_follow_q_lambda(lam, k):
    n, length = 30_000, 3
    gen = torch.Generator().manual_seed(k * 10 + int(lam * 10))
    propose, score = toy_engines(gen)
    seqs, stats = speculative_generate([[0]] * n, propose, score, lam, k, length, None, gen)
    assert chain_pvalue(seqs, lam, length) > 1e-3
    assert stats.emitted == n * length
    if lam == 0.0:
        assert stats.accept_rate == 1.0 and not any(any(s.offpolicy) for s in seqs)
    # every token's recorded log-probs are the chains' values, and the exact behavior is log q_λ
    s = seqs[0]
    prevs = [0, *s.tokens[:-1]]
    for tok, prev, lp, lq in zip(
        s.tokens, prevs, s.draft_log_probs, s.guidance_log_probs, strict=True
    ):
        assert lp == pytest.approx(math.log(P_CHAIN[prev, tok]))
        assert lq == pytest.approx(math.log(Q_CHAIN[prev, tok]))
    behavior = mixture_log_probs(
        torch.tensor(s.draft_log_probs, dtype=D),
        torch.tensor(s.guidance_log_probs, dtype=D),
        None,
        lam,
    )
    expected = [
        math.log(chain_prob([t], lam, start=p)) for t, p in zip(s.tokens, prevs, strict=True)
    ]
    torch.testing.assert_close(behavior, torch.tensor(expected, dtype=D))


def test_eos_ends_a_sequence_and_lengths_follow_q_lambda():
    # token 2 is EOS: sequences are 1..3 tokens long, probability of each from the chain
    n, lam, eos = 30_000, 0.5, 2
    gen = torch.Generator().manual_seed(7)
    base_propose, score = toy_engines(gen)

    def propose(ids, prefixes, budget):  # the draft stops after proposing EOS, like vLLM
        proposals, num, tables = base_propose(ids, prefixes, budget)
        for b in range(len(prefixes)):
            hits = (proposals[b, : num[b]] == eos).nonzero()
            if hits.numel():
                num[b] = int(hits[0]) + 1
                proposals[b, num[b] :] = -1
        return proposals, num, tables

    seqs, _ = speculative_generate([[0]] * n, propose, score, lam, 3, 3, eos, gen)
    outcomes = [o for length in (1, 2, 3) for o in itertools.product(range(V), repeat=length)
                if (eos not in o[:-1]) and (len(o) == 3 or o[-1] == eos)]  # fmt: skip
    index = {o: i for i, o in enumerate(outcomes)}
    counts = torch.zeros(len(outcomes), dtype=D)
    for s in seqs:
        counts[index[tuple(s.tokens)]] += 1
    probs = torch.tensor([chain_prob(o, lam) for o in outcomes], dtype=D)
    assert probs.sum().item() == pytest.approx(1.0)
    assert _chi2_ok(counts, probs) > 1e-3


def test_engines_get_the_index_of_each_active_sequence():
    """propose/score receive `ids`: the positions in `prompts` of the sequences still running, so
    engines can keep per-sequence state (vLLM sessions). Prompts here are distinct."""
    gen = torch.Generator().manual_seed(3)
    base_propose, base_score = toy_engines(gen)
    prompts = [[0], [1, 2], [2, 2, 1], [1]]
    seen: list[list[int]] = []
    eos = 2

    def propose(ids, prefixes, budget):
        seen.append(list(ids))
        for i, prefix in zip(ids, prefixes, strict=True):
            assert prefix[: len(prompts[i])] == prompts[i]
        proposals, num, tables = base_propose(ids, prefixes, budget)
        for row in range(len(ids)):  # stop proposing after EOS, like vLLM
            hits = (proposals[row, : num[row]] == eos).nonzero()
            if hits.numel():
                num[row] = int(hits[0]) + 1
                proposals[row, num[row] :] = -1
        return proposals, num, tables

    def score(ids, prefixes, proposals, num):
        assert list(ids) == seen[-1]
        return base_score(ids, prefixes, proposals, num)

    seqs, _ = speculative_generate(prompts, propose, score, 0.5, 2, 6, eos, gen)
    assert seen[0] == [0, 1, 2, 3]
    for before, after in itertools.pairwise(seen):  # finished sequences drop out, order is kept
        assert set(after) <= set(before) and after == sorted(after)
    for i, s in enumerate(seqs):  # every sequence ended at EOS or at the length limit
        assert s.finished
        assert (s.tokens[-1] == eos) or len(s.tokens) == 6, i


class ToyStepper:
    """Draft engine at step granularity: a round's proposals (from its group's toy chain) are
    ready after as many steps as its longest budget; records which groups shared each step."""

    def __init__(self, engines, group_of):
        self.engines, self.group_of = engines, group_of
        self.running: dict[int, list] = {}
        self.shared: list[tuple[int, ...]] = []

    def start(self, key, ids, prefixes, budget, lookahead):
        assert key == self.group_of[ids[0]] and key not in self.running
        assert not any(lookahead)  # the batches here run without bonus tokens
        self.running[key] = [max(budget), self.engines[key][0](ids, prefixes, budget)]

    @property
    def busy(self):
        return bool(self.running)

    def drafting(self, key):
        return False

    def lookahead(self, key):
        return None

    def step(self):
        self.shared.append(tuple(sorted(self.running)))
        done = []
        for key in list(self.running):
            self.running[key][0] -= 1
            if self.running[key][0] == 0:
                done.append((key, *self.running.pop(key)[1]))
        return done


class ToyScorer:
    """Guidance answering in order; `ready()` says no every other time (the driver must cope)."""

    def __init__(self, engines, group_of):
        self.engines, self.group_of, self.queue, self.polls = engines, group_of, [], 0

    def submit(self, ids, prefixes, proposals, num):
        self.queue.append(self.engines[self.group_of[ids[0]]][1](ids, prefixes, proposals, num))

    def ready(self):
        self.polls += 1
        return bool(self.queue) and self.polls % 2 == 0

    def collect(self):
        return self.queue.pop(0)


@pytest.mark.parametrize("stagger", [1, 2, 5])
def test_overlapped_batches_equal_each_batch_alone(stagger):
    """Batches whose rounds overlap across the two engines give exactly the tokens each batch
    gives alone (speculative_generate) with the same engines and generators: the overlap changes
    when work happens, never what is sampled. Later batches start `stagger` draft steps apart."""
    prompts = [[0], [1, 2], [2, 2, 1], [1], [0, 1], [2], [1, 1]]
    groups = [[0, 3, 6], [1, 4], [2, 5]]
    group_of = {i: n for n, g in enumerate(groups) for i in g}

    def make():  # per group: toy engines and a batch, each with its own generator
        engines = [toy_engines(torch.Generator().manual_seed(11 + n)) for n in range(len(groups))]
        batches = [SpeculativeBatch([prompts[i] for i in g], 0.5, 3, 7, None, torch.Generator().manual_seed(20 + n), ids=g)
                   for n, g in enumerate(groups)]  # fmt: skip
        return engines, batches

    engines, alone = make()
    for n, batch in enumerate(alone):
        seqs, stats = speculative_generate(
            batch.prompts, engines[n][0], engines[n][1], 0.5, 3, 7, None, batch.generator
        )
        batch.seqs, batch.stats = seqs, stats  # fmt: skip
    engines, together = make()
    draft, scorer = ToyStepper(engines, group_of), ToyScorer(engines, group_of)
    overlapped_generate(together, draft, scorer, stagger)
    assert not draft.running and not scorer.queue
    for one, two in zip(alone, together, strict=True):
        assert [s.tokens for s in one.seqs] == [s.tokens for s in two.seqs]
        assert [s.offpolicy for s in one.seqs] == [s.offpolicy for s in two.seqs]
        assert [s.guidance_log_probs for s in one.seqs] == [s.guidance_log_probs for s in two.seqs]
        assert one.stats == two.stats and one.stats.rounds > 1
        assert all(s.finished for s in two.seqs)
    # batch 1 joined at step `stagger` (unless batch 0's first round ended sooner), and some
    # draft steps carried rounds of two batches at once
    first_step_of_1 = next(i for i, keys in enumerate(draft.shared) if 1 in keys)
    assert first_step_of_1 == min(stagger, 3)
    assert any(len(keys) >= 2 for keys in draft.shared)


def test_overlapped_generate_follows_q_lambda():
    """Distribution check through the overlapped driver: 3-token sequences of 2 x 10,000 prompts
    follow the chain mixture q_λ (chi-square), as with the synchronous loop."""
    n, lam, length = 10_000, 0.5, 3
    engines = [toy_engines(torch.Generator().manual_seed(31 + g)) for g in range(2)]
    group_of = {i: i // n for i in range(2 * n)}
    batches = [SpeculativeBatch([[0]] * n, lam, 2, length, None, torch.Generator().manual_seed(41 + g),
                                ids=list(range(g * n, (g + 1) * n))) for g in range(2)]  # fmt: skip
    overlapped_generate(batches, ToyStepper(engines, group_of), ToyScorer(engines, group_of), 1)
    assert chain_pvalue([s for b in batches for s in b.seqs], lam, length) > 1e-3


def chain_rows(table: torch.Tensor, prev: np.ndarray, tokens: np.ndarray) -> ListedRows:
    """Rows of a chain at states `prev` (N,): column 0 the token, then every token of V."""
    ids = np.concatenate([tokens[:, None], np.tile(np.arange(V), (len(prev), 1))], axis=1)
    return ListedRows(ids, np.log(table.numpy()[prev[:, None], ids]))


class ListedChainStepper:
    """The chain draft as a `DraftStepper` with flat rows and lookahead tokens: a round's
    proposals come after max(budget) steps, its lookahead one step later. Every round draws
    k + 1 tokens per sequence from its batch's generator, used or not, so what is drawn never
    depends on timing."""

    def __init__(self, seeds: dict[int, int]):
        self.gens = {key: np.random.default_rng(seed) for key, seed in seeds.items()}
        self.running: dict[int, list] = {}

    def start(self, key, ids, prefixes, budget, lookahead):
        gen, k = self.gens[key], max(budget)
        states, last = [], np.array([p[-1] for p in prefixes])
        for _ in range(k + 1):  # inverse CDF of the chain's row at each sequence's last token
            states.append(last)
            u = gen.random(len(last))
            last = (P_CHAIN.numpy()[last].cumsum(-1) <= u[:, None]).sum(-1).clip(max=V - 1)
        states.append(last)
        drawn = np.stack(states[1:], axis=1)  # (B, k + 1) tokens
        prev = np.stack(states[:-1], axis=1)
        num = torch.tensor(budget)
        used = np.arange(k) < np.array(budget)[:, None]
        rows = chain_rows(P_CHAIN, prev[:, :k][used], drawn[:, :k][used])
        proposals = torch.from_numpy(np.where(used, drawn[:, :k], -1))
        has = np.array(lookahead)
        at = np.array(budget)[has]
        extra = (has, chain_rows(P_CHAIN, prev[has, at], drawn[has, at])) if has.any() else None
        self.running[key] = [k, (proposals, num, rows), extra, 1 if has.any() else 0]

    @property
    def busy(self):
        return any(r[0] > 0 or r[3] > 0 for r in self.running.values())

    def step(self):
        done = []
        for key, r in self.running.items():
            if r[0] > 0:
                r[0] -= 1
                if r[0] == 0:
                    done.append((key, *r[1]))
            elif r[3] > 0:
                r[3] -= 1
        return done

    def drafting(self, key):
        return self.running[key][3] > 0

    def lookahead(self, key):
        return self.running.pop(key)[2]


class ListedChainScorer(ToyScorer):
    """The chain guidance with flat rows, and one row past each sequence's last proposal."""

    def __init__(self):
        super().__init__(None, None)

    def submit(self, ids, prefixes, proposals, num):
        num_np = num.numpy()
        last = np.array([p[-1] for p in prefixes])
        prev = np.concatenate([last[:, None], proposals[:, :-1].clamp(min=0).numpy()], axis=1)
        used = np.arange(proposals.shape[1]) < num_np[:, None]
        rows = chain_rows(Q_CHAIN, prev[used], proposals.numpy()[used])
        end = proposals.numpy()[np.arange(len(num_np)), num_np - 1]
        following = chain_rows(Q_CHAIN, end, Q_CHAIN.numpy()[end].argmax(-1))
        self.queue.append((rows, following))


def run_bonus_batches(lam: float, k: int, n: int, length: int, stagger: int):
    """Two batches of n prompts [0] with bonus tokens through `overlapped_generate`."""
    batches = [SpeculativeBatch([[0]] * n, lam, k, length, None, torch.Generator().manual_seed(41 + g),
                                ids=list(range(g * n, (g + 1) * n)), bonus=True) for g in range(2)]  # fmt: skip
    stepper, scorer = ListedChainStepper({0: 51, 1: 52}), ListedChainScorer()
    overlapped_generate(batches, stepper, scorer, stagger)
    assert not stepper.running and not scorer.queue
    return batches


@pytest.mark.parametrize(("lam", "k"), [(0.5, 1), (0.5, 2), (0.0, 2), (1.0, 1), (0.8, 2)])
def test_bonus_tokens_follow_q_lambda(lam, k):
    """With the draft's lookahead tokens, fully accepted rounds emit a bonus token, and 3-token
    sequences of 2 x 10,000 prompts still follow the chain mixture q_λ (chi-square); every
    token's recorded log-probs are the chains' values, and λ = 0 never emits a guidance token."""
    n, length = 10_000, 3
    batches = run_bonus_batches(lam, k, n, length, 1)
    assert chain_pvalue([s for b in batches for s in b.seqs], lam, length) > 1e-3
    stats = [b.stats for b in batches]
    assert all(st.bonus > 0 for st in stats)  # each batch emitted bonus tokens
    assert sum(st.emitted for st in stats) == 2 * n * length
    seqs = [s for b in batches for s in b.seqs]
    if lam == 0.0:
        assert not any(any(s.offpolicy) for s in seqs)
    tokens = np.array([s.tokens for s in seqs])
    prevs = np.concatenate([np.zeros((len(seqs), 1), dtype=int), tokens[:, :-1]], axis=1)
    np.testing.assert_allclose(
        np.array([s.draft_log_probs for s in seqs]), np.log(P_CHAIN.numpy()[prevs, tokens])
    )
    np.testing.assert_allclose(
        np.array([s.guidance_log_probs for s in seqs]), np.log(Q_CHAIN.numpy()[prevs, tokens])
    )


def test_bonus_tokens_do_not_depend_on_timing():
    """The same batches with bonus tokens, their rounds overlapping differently (stagger 1 or
    3), emit the same tokens, provenance and counters: bonus tokens change what is drawn only
    through the batches' own generators."""
    one, two = run_bonus_batches(0.5, 2, 50, 7, 1), run_bonus_batches(0.5, 2, 50, 7, 3)
    for a, b in zip(one, two, strict=True):
        assert [s.tokens for s in a.seqs] == [s.tokens for s in b.seqs]
        assert [s.offpolicy for s in a.seqs] == [s.offpolicy for s in b.seqs]
        assert a.stats == b.stats and a.stats.bonus > 0 and a.stats.rounds > 2
