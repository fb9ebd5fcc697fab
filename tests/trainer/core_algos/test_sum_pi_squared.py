"""Σπ² from logits, the per-token score energy and the gradient-variance proxy metrics."""

from __future__ import annotations

import math

import pytest
import torch

from verl.trainer.core_algos.sum_pi_squared import (
    compute_sum_pi_squared,
    compute_variance_proxy_metrics,
    score_energy,
)
from verl.utils import metric_names as M

F64 = torch.float64
# filler on padding: energy would be 1 - 2*0.1 + 0.9 = 1.7 if it were counted
PAD_P, PAD_S = 0.1, 0.9


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def _naive_sum_pi_squared(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits / temperature, dim=-1).pow(2).sum(-1)


# --------------------------------------------------------------------------------------------
# compute_sum_pi_squared
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sum_pi_squared_matches_naive_softmax(temperature, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 11, generator=gen, dtype=F64) * 3.0
    got = compute_sum_pi_squared(logits, temperature=temperature)
    expected = _naive_sum_pi_squared(logits, temperature)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sum_pi_squared_chunk_size_does_not_change_result(temperature):
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 5, 11, generator=gen, dtype=F64)
    results = [
        compute_sum_pi_squared(logits, temperature=temperature, chunk_size=c) for c in (1, 4, 1000)
    ]
    # 15 rows: chunk 1 -> 15 chunks, chunk 4 -> 4 chunks (last one of 3 rows), 1000 -> 1 chunk
    for other in results[1:]:
        assert torch.equal(other, results[0])
    torch.testing.assert_close(
        results[0], _naive_sum_pi_squared(logits, temperature), rtol=1e-12, atol=0
    )


def test_sum_pi_squared_hand_computed_two_tokens():
    # logits [0, ln 3] -> exp = [1, 3], Z = 4 -> π = [1/4, 3/4]
    # Σπ² = 1/16 + 9/16 = 10/16 = 0.625
    logits = _t([[0.0, math.log(3.0)]])
    got = compute_sum_pi_squared(logits)
    assert got.shape == (1,)
    assert got.item() == pytest.approx(0.625, abs=1e-15)


def test_sum_pi_squared_hand_computed_with_temperature():
    # logits [0, 2 ln 3] at T = 2 -> z = [0, ln 3] -> π = [1/4, 3/4] -> Σπ² = 0.625
    # at T = 1 instead: exp = [1, 9], π = [1/10, 9/10] -> Σπ² = 1/100 + 81/100 = 0.82
    logits = _t([0.0, 2.0 * math.log(3.0)])
    assert compute_sum_pi_squared(logits, temperature=2.0).item() == pytest.approx(0.625, abs=1e-15)
    assert compute_sum_pi_squared(logits, temperature=1.0).item() == pytest.approx(0.82, abs=1e-15)


def test_sum_pi_squared_uniform_and_one_hot_limits():
    # uniform over V = 4: π = 1/4 each -> Σπ² = 4 * 1/16 = 0.25
    # nearly one-hot: [0, -1000] -> π ≈ [1, e^-1000] -> Σπ² = 1 (to double precision)
    logits = _t([[2.5, 2.5, 2.5, 2.5], [0.0, -1000.0, -1000.0, -1000.0]])
    got = compute_sum_pi_squared(logits)
    torch.testing.assert_close(got, _t([0.25, 1.0]), atol=1e-15, rtol=0)


def test_sum_pi_squared_is_stable_for_huge_logits():
    # shift invariance: [1000, 1000 + ln 3] is the same distribution as [0, ln 3] -> 0.625
    # (a naive exp would overflow to inf)
    logits = _t([1000.0, 1000.0 + math.log(3.0)])
    got = compute_sum_pi_squared(logits)
    assert math.isfinite(got.item())
    assert got.item() == pytest.approx(0.625, abs=1e-12)


def test_sum_pi_squared_neg_inf_logits_contribute_zero():
    # [0, 0, -inf] -> π = [1/2, 1/2, 0] -> Σπ² = 1/4 + 1/4 = 0.5 exactly
    # [3, -inf, -inf] -> π = [1, 0, 0] -> Σπ² = 1 exactly
    # [-inf, 0, ln 3] -> π = [0, 1/4, 3/4] -> 0.625
    inf = float("inf")
    logits = _t([[0.0, 0.0, -inf], [3.0, -inf, -inf], [-inf, 0.0, math.log(3.0)]])
    got = compute_sum_pi_squared(logits)
    assert got[0].item() == pytest.approx(0.5, abs=1e-15)  # via ‖e‖² = (√2)²: one ulp of rounding
    assert got[1].item() == pytest.approx(1.0, abs=1e-15)
    assert got[2].item() == pytest.approx(0.625, abs=1e-15)
    assert torch.isfinite(got).all()


def test_sum_pi_squared_neg_inf_with_temperature():
    # -inf / 0.7 is still -inf: [0, 0, -inf] at T = 0.7 -> 0.5 ; single finite logit -> 1
    inf = float("inf")
    got = compute_sum_pi_squared(_t([[0.0, 0.0, -inf], [-inf, -inf, 1.3]]), temperature=0.7)
    assert got[0].item() == pytest.approx(0.5, abs=1e-15)
    assert got[1].item() == 1.0


@pytest.mark.parametrize(
    ("in_dtype", "out_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
    ],
)
def test_sum_pi_squared_dtype(in_dtype, out_dtype):
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0)).to(in_dtype)
    got = compute_sum_pi_squared(logits)
    assert got.dtype == out_dtype
    expected = _naive_sum_pi_squared(logits.double(), 1.0)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("shape", [(7,), (4, 7), (2, 3, 7), (2, 3, 4, 7)])
def test_sum_pi_squared_output_shape(shape):
    logits = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    got = compute_sum_pi_squared(logits, chunk_size=3)
    assert got.shape == logits.shape[:-1]
    torch.testing.assert_close(got, _naive_sum_pi_squared(logits, 1.0), rtol=1e-12, atol=0)


def test_sum_pi_squared_bounds():
    # 1/V <= Σπ² <= 1 for any distribution over V tokens
    logits = torch.randn(50, 9, generator=torch.Generator().manual_seed(5), dtype=F64) * 4
    got = compute_sum_pi_squared(logits)
    assert (got >= 1.0 / 9 - 1e-15).all()
    assert (got <= 1.0 + 1e-15).all()


def test_sum_pi_squared_does_not_modify_input():
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(2), dtype=F64)
    before = logits.clone()
    compute_sum_pi_squared(logits, temperature=0.5, chunk_size=2)
    assert torch.equal(logits, before)


# --------------------------------------------------------------------------------------------
# score_energy
# --------------------------------------------------------------------------------------------


def test_score_energy_hand_computed():
    # e = 1 - 2p + s on valid tokens, 0 on padding
    #   p=.5, s=.5   -> 1 - 1 + .5   = .5
    #   p=.25, s=.25 -> 1 - .5 + .25 = .75
    #   p=.9, s=.82  -> 1 - 1.8 + .82 = .02   (π = [.9, .1]: Σπ² = .81 + .01 = .82)
    old_lp = torch.log(_t([[0.5, 0.25, 0.9], [0.5, PAD_P, PAD_P]]))
    spi2 = _t([[0.5, 0.25, 0.82], [0.5, PAD_S, PAD_S]])
    mask = _t([[1, 1, 1], [1, 0, 0]])
    got = score_energy(old_lp, spi2, mask)
    torch.testing.assert_close(got, _t([[0.5, 0.75, 0.02], [0.5, 0.0, 0.0]]), atol=1e-15, rtol=0)
    assert torch.all(got[mask == 0] == 0)


def test_score_energy_importance_weights_multiply_by_w_squared():
    # e·w²: .5*2² = 2 ; .75*.5² = .1875 ; .02*1 = .02 ; row 1: .5*3² = 4.5, padding stays 0
    old_lp = torch.log(_t([[0.5, 0.25, 0.9], [0.5, PAD_P, PAD_P]]))
    spi2 = _t([[0.5, 0.25, 0.82], [0.5, PAD_S, PAD_S]])
    mask = _t([[1, 1, 1], [1, 0, 0]])
    weights = _t([[2.0, 0.5, 1.0], [3.0, 10.0, 10.0]])
    got = score_energy(old_lp, spi2, mask, importance_weights=weights)
    torch.testing.assert_close(got, _t([[2.0, 0.1875, 0.02], [4.5, 0.0, 0.0]]), atol=1e-15, rtol=0)


def test_score_energy_equals_squared_distance_to_one_hot():
    # ‖e_y - π‖² = 1 - 2π_y + Σπ², checked against the explicit vector norm
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 4, 6, generator=gen, dtype=F64)
    probs = torch.softmax(logits, -1)
    tokens = torch.randint(0, 6, (3, 4), generator=gen)
    one_hot = torch.nn.functional.one_hot(tokens, 6).to(F64)
    explicit = (one_hot - probs).pow(2).sum(-1)
    old_lp = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log()
    got = score_energy(old_lp, compute_sum_pi_squared(logits), torch.ones(3, 4, dtype=F64))
    torch.testing.assert_close(got, explicit, atol=1e-14, rtol=0)


# --------------------------------------------------------------------------------------------
# compute_variance_proxy_metrics
# --------------------------------------------------------------------------------------------


def _proxy_case():
    """Three responses plus one fully padded row (B=4, T=3, N=3 valid responses).

    row 0: mask [1,1,1], adv [1,2,3]      -> A = 6/3 = 2,  e = [.5,.5,.5]  -> W = 1.5
    row 1: mask [1,1,0], adv [-1,-1,100]  -> A = -1,       e = [.75,.25]   -> W = 1.0
    row 2: mask [1,0,0], adv [.5,7,7]     -> A = .5,       e = [.5]        -> W = .5
    row 3: mask [0,0,0], adv [9,9,9]      -> ignored
    e = 1 - 2p + s: (p,s) = (.5,.5) -> .5 ; (.25,.25) -> .75 ; (.5,.25) -> .25
    """
    advantages = _t([[1.0, 2.0, 3.0], [-1.0, -1.0, 100.0], [0.5, 7.0, 7.0], [9.0, 9.0, 9.0]])
    mask = _t([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]])
    old_lp = torch.log(
        _t([[0.5, 0.5, 0.5], [0.25, 0.5, PAD_P], [0.5, PAD_P, PAD_P], [PAD_P, PAD_P, PAD_P]])
    )
    spi2 = _t([[0.5, 0.5, 0.5], [0.25, 0.25, PAD_S], [0.5, PAD_S, PAD_S], [PAD_S, PAD_S, PAD_S]])
    return advantages, mask, old_lp, spi2


def test_variance_proxies_hand_computed_without_grad_norm():
    advantages, mask, old_lp, spi2 = _proxy_case()
    metrics = compute_variance_proxy_metrics(advantages, mask, old_lp, spi2)
    # A² W: 4*1.5 = 6 ; 1*1 = 1 ; .25*.5 = .125 -> proxy2 = 7.125/3 = 2.375
    # E[A²] = (4 + 1 + .25)/3 = 1.75 ; E[W] = (1.5 + 1 + .5)/3 = 1.0
    assert set(metrics) == {
        M.VARIANCE_PROXY_TOTAL_POWER,
        M.VARIANCE_PROXY_EXPECTED_A2,
        M.VARIANCE_PROXY_EXPECTED_W,
    }
    assert M.VARIANCE_PROXY_SIGNAL not in metrics
    assert M.VARIANCE_PROXY_PURE_NOISE not in metrics
    assert metrics[M.VARIANCE_PROXY_TOTAL_POWER] == pytest.approx(2.375, abs=1e-12)
    assert metrics[M.VARIANCE_PROXY_EXPECTED_A2] == pytest.approx(1.75, abs=1e-12)
    assert metrics[M.VARIANCE_PROXY_EXPECTED_W] == pytest.approx(1.0, abs=1e-12)
    assert all(isinstance(v, float) for v in metrics.values())


def test_variance_proxies_hand_computed_with_grad_norm():
    advantages, mask, old_lp, spi2 = _proxy_case()
    metrics = compute_variance_proxy_metrics(advantages, mask, old_lp, spi2, grad_norm=0.5)
    # proxy1 = ‖ḡ‖² = .5² = .25 ; proxy3 = (proxy2 - proxy1)/(N - 1) = (2.375 - .25)/2 = 1.0625
    assert metrics[M.VARIANCE_PROXY_SIGNAL] == pytest.approx(0.25, abs=1e-15)
    assert metrics[M.VARIANCE_PROXY_PURE_NOISE] == pytest.approx(1.0625, abs=1e-12)
    assert metrics[M.VARIANCE_PROXY_TOTAL_POWER] == pytest.approx(2.375, abs=1e-12)
    assert len(metrics) == 5


def test_variance_proxies_with_importance_weights():
    advantages, mask, old_lp, spi2 = _proxy_case()
    weights = _t([[2.0, 1.0, 1.0], [1.0, 0.5, 5.0], [3.0, 4.0, 4.0], [6.0, 6.0, 6.0]])
    metrics = compute_variance_proxy_metrics(
        advantages, mask, old_lp, spi2, importance_weights=weights, grad_norm=0.5
    )
    # e·w²: row 0 [.5*4, .5, .5] -> W = 3 ; row 1 [.75*1, .25*.25] = [.75, .0625] -> W = .8125
    #       row 2 [.5*9] -> W = 4.5 (padding weights 5, 4, 6 never count)
    # A² W: 4*3 = 12 ; 1*.8125 = .8125 ; .25*4.5 = 1.125 -> proxy2 = 13.9375/3 = 4.6458333
    # E[W] = (3 + .8125 + 4.5)/3 = 8.3125/3 = 2.7708333 ; E[A²] unchanged 1.75
    # proxy3 = (13.9375/3 - .25)/2 = 2.1979167
    assert metrics[M.VARIANCE_PROXY_TOTAL_POWER] == pytest.approx(13.9375 / 3, abs=1e-12)
    assert metrics[M.VARIANCE_PROXY_EXPECTED_W] == pytest.approx(8.3125 / 3, abs=1e-12)
    assert metrics[M.VARIANCE_PROXY_EXPECTED_A2] == pytest.approx(1.75, abs=1e-12)
    assert metrics[M.VARIANCE_PROXY_PURE_NOISE] == pytest.approx(
        (13.9375 / 3 - 0.25) / 2, abs=1e-12
    )


def test_variance_proxies_ignore_fully_padded_rows():
    # dropping the padded row (whatever it holds) gives the same metrics
    advantages, mask, old_lp, spi2 = _proxy_case()
    full = compute_variance_proxy_metrics(advantages, mask, old_lp, spi2, grad_norm=0.5)
    trimmed = compute_variance_proxy_metrics(
        advantages[:3], mask[:3], old_lp[:3], spi2[:3], grad_norm=0.5
    )
    assert full.keys() == trimmed.keys()
    for key in full:
        assert full[key] == pytest.approx(trimmed[key], abs=1e-15)


def test_variance_proxies_single_response_divides_by_one():
    # N = 1: row 0 alone -> proxy2 = 6, proxy3 = (6 - .25)/max(0, 1) = 5.75
    advantages, mask, old_lp, spi2 = _proxy_case()
    metrics = compute_variance_proxy_metrics(
        advantages[:1], mask[:1], old_lp[:1], spi2[:1], grad_norm=0.5
    )
    assert metrics[M.VARIANCE_PROXY_TOTAL_POWER] == pytest.approx(6.0, abs=1e-12)
    assert metrics[M.VARIANCE_PROXY_PURE_NOISE] == pytest.approx(5.75, abs=1e-12)


def test_variance_proxies_all_padding_returns_empty_dict():
    advantages, _, old_lp, spi2 = _proxy_case()
    assert (
        compute_variance_proxy_metrics(advantages, torch.zeros_like(advantages), old_lp, spi2) == {}
    )


def test_variance_proxy_metric_names_are_in_the_namespace():
    names = [
        M.VARIANCE_PROXY_SIGNAL,
        M.VARIANCE_PROXY_TOTAL_POWER,
        M.VARIANCE_PROXY_PURE_NOISE,
        M.VARIANCE_PROXY_EXPECTED_A2,
        M.VARIANCE_PROXY_EXPECTED_W,
    ]
    assert all(name.startswith("variance_proxy/") for name in names)
    assert len(set(names)) == 5
    assert M.VARIANCE_PROXY_SIGNAL == "variance_proxy/proxy1_signal_strength"
    assert M.VARIANCE_PROXY_TOTAL_POWER == "variance_proxy/proxy2_total_power"
    assert M.VARIANCE_PROXY_PURE_NOISE == "variance_proxy/proxy3_pure_noise"
