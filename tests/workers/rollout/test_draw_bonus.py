"""The bonus token past a fully accepted round (`draw_bonus`): the draft's lookahead verified like
one more proposal, by hand and statistically."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from speculative_helpers import P1, Q1, D, chi2_counts_pvalue, listed_rows

from verl.workers.rollout.speculative import ListedRows, draw_bonus


def test_draw_bonus_hand_values():
    """λ = 0.5; the lookahead x is kept w.p. a = min(1, t(x)/p(x)), else the residual over the
    guidance row's top-K set S, drawn with (u - a)/(1 - a), is emitted and marked off-policy;
    row 3's residual token is not in its draft row: probed."""
    draft = listed_rows([[4, 4, 2, 9], [4, 4, 2, 9], [5, 1, 5, 3], [4, 4, 2, 9]],
                  [[0.5, 0.5, 0.3, 0.1], [0.5, 0.5, 0.3, 0.1], [0.2, 0.4, 0.2, 0.1],
                   [0.5, 0.5, 0.3, 0.1]])  # fmt: skip
    guide = listed_rows([[2, 2, 4, 7], [2, 2, 4, 7], [1, 1, 3, 0], [2, 2, 4, 7]],
                  [[0.6, 0.6, 0.3, 0.1], [0.6, 0.6, 0.3, 0.1], [0.7, 0.7, 0.2, 0.05],
                   [0.6, 0.6, 0.3, 0.1]])  # fmt: skip
    # rows 0, 1, 3: x = 4, p(4) = .5; S = [2, 4, 7] (column 0 is no entry of its own), q [.6, .3,
    # .1], Q_S = 1, tv = 0: a = .5 + .5 * .3 / .5 = .8. The residual max(0, q̃ - p) in listed
    # order: 2: .6 - .3 = .3, 4: .3 - .5 -> 0, 7: p(7) unknown (the draft row [4, 2, 9] lists no
    # zero), its envelope q̃(7) = .1; cumulative [.3, .3, .4].
    # row 0: u = .2 < .8: x = 4 kept (q .3, p .5)
    # row 1: u = .9: (.9 - .8) / .2 = .5, .5 * .4 = .2 -> token 2 (q .6, p .3), off-policy
    # row 3: u = .98: (.98 - .8) / .2 = .9, .9 * .4 = .36 -> token 7: the probe is asked for S and
    # says p(7) = 0, so the envelope's draw is kept (w.p. 1 - p(7)/q̃(7) = 1)
    # row 2: x = 5 (p .2) outside S = {1, 3, 0} (Q_S = .95, tv = .5 * .05 = .025): q̃(5) = 0,
    # a = 1 - λ = .5; u = .3: kept, q̃(5) = 0 (log -inf) and q(5) not reported (the row lists no
    # zero, .05 of its mass is elsewhere): NaN
    calls = []

    def probe(rows, tokens):
        calls.append((rows.tolist(), tokens.tolist()))
        with np.errstate(divide="ignore"):
            return np.log(np.where(tokens == 2, 0.3, np.where(tokens == 4, 0.5, 0.0)))

    u = np.array([0.2, 0.9, 0.3, 0.98])
    out = draw_bonus(draft, guide, 0.5, u, probe)
    assert set(out) == {"tokens", "offpolicy", "log_p", "log_q", "log_t", "tv", "lam", "strength"}
    assert out["strength"].tolist() == out["lam"].tolist() == [0.5] * 4  # no target: λ' = λ
    assert calls == [([3], [[2, 4, 7]])]  # row indices of the rows given, S of each (R, K)
    assert out["tokens"].tolist() == [4, 2, 5, 7]
    assert out["offpolicy"].tolist() == [False, True, False, True]
    log, nan, ninf = math.log, float("nan"), float("-inf")
    np.testing.assert_allclose(out["log_p"], [log(0.5), log(0.3), log(0.2), ninf], rtol=1e-12)
    np.testing.assert_allclose(out["log_q"], [log(0.3), log(0.6), nan, log(0.1)], rtol=1e-12)
    np.testing.assert_allclose(out["log_t"], [log(0.3), log(0.6), ninf, log(0.1)], rtol=1e-12)
    np.testing.assert_allclose(out["tv"], [0.0, 0.0, 0.025, 0.0], rtol=1e-12, atol=1e-15)
    # without a probe, row 3's p(7) is unknown: refused
    with pytest.raises(RuntimeError, match="no draft probe"):
        draw_bonus(draft, guide, 0.5, u)
    # the same row 2 after a top-k cut lists a zero (token 0): unlisted token 5 is an exact 0
    cut = listed_rows([[1, 1, 3, 0]], [[0.7, 0.7, 0.3, 0.0]])
    assert np.isneginf(draw_bonus(draft.take([2]), cut, 0.5, np.array([0.3]))["log_q"]).all()
    # a guidance row whose S is not all of q's mass: q̃ renormalises over it. S = [3, 1, 0] with
    # q [.2, .3, .1], Q_S = .6 (column 0, token 8 at .3, is not in S): q̃ = [1/3, 1/2, 1/6].
    # x = 5 is outside S: a = .5; u = .6: (.6 - .5) / .5 = .2. Residual: 3: 1/3 - .1 = .2333,
    # 1: .5 - .4 = .1, 0: unknown, envelope 1/6; cumulative [.2333, .3333, .5], .2 * .5 = .1
    # -> token 3: p .1 (the draft row), q .2, q̃ 1/3, tv = .5 * .4 = .2
    part = listed_rows([[8, 3, 1, 0]], [[0.3, 0.2, 0.3, 0.1]])
    one = draw_bonus(draft.take([2]), part, 0.5, np.array([0.6]))
    assert one["tokens"].tolist() == [3] and one["offpolicy"].tolist() == [True]
    np.testing.assert_allclose([one["log_p"][0], one["log_q"][0], one["log_t"][0], one["tv"][0]],
                               [log(0.1), log(0.2), log(1 / 3), 0.2], rtol=1e-12)  # fmt: skip
    # λ = 0 always keeps the lookahead (a = 1, no probe needed)
    assert draw_bonus(draft, guide, 0.0, u)["tokens"].tolist() == [4, 4, 5, 4]
    assert not draw_bonus(draft, guide, 0.0, u)["offpolicy"].any()
    # λ = 1: a = q̃(x)/p(x): row 0 .3/.5 = .6, u = .2 keeps 4; row 2 q̃(5) = 0, a = 0, u = .3
    # draws the residual over S = [1, 3, 0]: q̃ [.7368, .2105, .0526] less p [.4, .1, unknown]:
    # envelope [.3368, .1105, .0526], total .5, .3 * .5 = .15 -> token 1
    both = draw_bonus(draft.take([0, 2]), guide.take([0, 2]), 1.0, np.array([0.2, 0.3]))
    assert both["tokens"].tolist() == [4, 1] and both["offpolicy"].tolist() == [False, True]


@pytest.mark.parametrize(("lam", "guide_top"), [(0.5, 5), (1.0, 5), (0.3, 3)])
def test_draw_bonus_follows_the_target_and_marks_only_overridden_tokens(lam, guide_top):
    """40,000 lookahead tokens x ~ p (V = 5, the draft's rows listing x and its top 2, the rest
    probed) checked against guidance rows listing their top `guide_top`: the bonus tokens follow
    t = (1-λ)p + λq̃ (chi-square), the off-policy share is TV(t, p) = λ·TV(q̃, p) (the chance the
    guidance overrides the lookahead, within 4 standard errors), and the off-policy tokens follow
    the residual max(0, q̃ - p) (chi-square)."""
    n = 40_000
    gen = torch.Generator().manual_seed(int(lam * 10) + guide_top)
    x = torch.multinomial(P1, n, replacement=True, generator=gen).numpy()
    top_p, top_q = np.argsort(-P1.numpy())[:2], np.argsort(-Q1.numpy())[:guide_top]
    draft = ListedRows(np.column_stack([x, np.tile(top_p, (n, 1))]),
                       np.log(np.column_stack([P1.numpy()[x], np.tile(P1.numpy()[top_p], (n, 1))])))  # fmt: skip
    guide = ListedRows(np.tile(np.r_[top_q[0], top_q], (n, 1)),
                       np.log(np.tile(np.r_[Q1.numpy()[top_q[0]], Q1.numpy()[top_q]], (n, 1))))  # fmt: skip
    q_t = np.zeros(5)
    q_t[top_q] = Q1.numpy()[top_q] / Q1.numpy()[top_q].sum()
    probe = lambda rows, tokens: np.log(P1.numpy()[tokens])  # noqa: E731
    u = torch.rand(n, generator=gen, dtype=D).numpy()
    out = draw_bonus(draft, guide, lam, u, probe)
    p = P1.numpy()
    target = (1 - lam) * p + lam * q_t
    counts = torch.from_numpy(np.bincount(out["tokens"], minlength=5)).to(D)
    assert chi2_counts_pvalue(counts, torch.from_numpy(target)) > 1e-3
    tv = 0.5 * np.abs(target - p).sum()
    share = out["offpolicy"].mean()
    assert share == pytest.approx(tv, abs=4 * math.sqrt(tv * (1 - tv) / n))
    residual = np.clip(q_t - p, 0.0, None)
    over = torch.from_numpy(np.bincount(out["tokens"][out["offpolicy"]], minlength=5)).to(D)
    assert chi2_counts_pvalue(over, torch.from_numpy(residual / residual.sum())) > 1e-3
    np.testing.assert_allclose(out["log_p"], np.log(p[out["tokens"]]), rtol=1e-12)
