"""Advantage estimators: hand-computed values, properties over seeds, loop references.

Every hand-computed case is float64 and shows its arithmetic in comments. The loop references
at the bottom are deliberately naive (per group / per position Python loops over lists) so that
the vectorized registry functions are checked against an independent implementation.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from verl.trainer.core_algos.advantage import (
    ADV_ESTIMATORS,
    get_adv_estimator_fn,
    is_grouped,
    needs_sum_pi_squared,
)

F64 = torch.float64
OTB_EPS = 1e-8  # default otb_epsilon
GRPO_EPS = 1e-6  # default GRPO epsilon
CANONICAL = [
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
    "none",
]
# filler for padding / tool-output positions: energy would be 1 - 2*0.1 + 0.9 = 1.7 if counted
PAD_P, PAD_S = 0.1, 0.9


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def _uids(*names: str) -> np.ndarray:
    return np.array(names, dtype=object)


def _policy_stats(p_rows, s_rows) -> tuple[torch.Tensor, torch.Tensor]:
    """old_log_probs = log π(y), sum_pi_squared = Σπ², so the per-token energy is 1 - 2p + s."""
    return torch.log(_t(p_rows)), _t(s_rows)


# --------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------


def test_registry_lists_all_estimators_and_aliases():
    assert sorted(ADV_ESTIMATORS) == sorted(CANONICAL)
    assert set(ADV_ESTIMATORS.names()) == {*CANONICAL, "otb", "tir_otb"}
    assert set(ADV_ESTIMATORS.names(with_aliases=False)) == set(CANONICAL)


@pytest.mark.parametrize("name", CANONICAL)
def test_get_adv_estimator_fn_returns_callable(name):
    fn = get_adv_estimator_fn(name)
    assert callable(fn)
    assert fn is ADV_ESTIMATORS.get(name)


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [("otb", "optimal_token_baseline"), ("tir_otb", "tir_optimal_token_baseline")],
)
def test_aliases_resolve_to_the_same_function(alias, canonical):
    assert get_adv_estimator_fn(alias) is get_adv_estimator_fn(canonical)
    assert ADV_ESTIMATORS.canonical(alias) == canonical


def test_plain_and_tir_otb_are_different_functions():
    assert get_adv_estimator_fn("otb") is not get_adv_estimator_fn("tir_otb")


def test_unknown_estimator_raises_value_error_listing_valid_names():
    with pytest.raises(ValueError) as excinfo:
        get_adv_estimator_fn("gae_typo")
    message = str(excinfo.value)
    assert "gae_typo" in message
    names = ADV_ESTIMATORS.names()
    assert len(names) == 8
    for name in names:
        assert name in message


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("grpo", False),
        ("rloo", False),
        ("reinforce_plus_plus", False),
        ("optimal_token_baseline", True),
        ("otb", True),
        ("tir_optimal_token_baseline", True),
        ("tir_otb", True),
    ],
)
def test_needs_sum_pi_squared(name, expected):
    assert needs_sum_pi_squared(name) is expected


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("grpo", True),
        ("rloo", True),
        ("reinforce_plus_plus", False),
        ("optimal_token_baseline", True),
        ("otb", True),
        ("tir_optimal_token_baseline", True),
        ("tir_otb", True),
        ("none", False),
    ],
)
def test_is_grouped(name, expected):
    assert is_grouped(name) is expected


@pytest.mark.parametrize("query", [needs_sum_pi_squared, is_grouped])
def test_capability_queries_reject_unknown_names(query):
    with pytest.raises(ValueError, match="grpo"):
        query("not_an_estimator")


def test_none_estimator_gives_zero_advantages_and_raw_returns():
    rewards, mask = _t([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]]), _t([[1, 1, 1], [1, 1, 0]])
    advantages, returns = get_adv_estimator_fn("none")(
        token_level_rewards=rewards, response_mask=mask, index=_uids("a", "a")
    )
    assert torch.equal(advantages, torch.zeros_like(rewards))
    # returns-to-go: [1, 1, 1] and [2, 2, 0] (padding zero)
    torch.testing.assert_close(returns, _t([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))


# --------------------------------------------------------------------------------------------
# GRPO / RLOO: hand-computed
# --------------------------------------------------------------------------------------------

# Five responses, T=3, two interleaved groups. Scores are Σ_t reward·mask:
#   row 0 (a): len 3, rewards [0, 0, 1]            -> 1
#   row 1 (b): len 1, rewards [0.5, 0, 0]          -> 0.5
#   row 2 (a): len 2, rewards [0, 0, 5]            -> 0   (the 5 sits on padding: ignored)
#   row 3 (b): len 3, rewards [0, 0, 2]            -> 2
#   row 4 (a): len 3, rewards [0.25, 0, 0.75]      -> 1   (rewards at several tokens are summed)
HAND_REWARDS = [
    [0.0, 0.0, 1.0],
    [0.5, 0.0, 0.0],
    [0.0, 0.0, 5.0],
    [0.0, 0.0, 2.0],
    [0.25, 0.0, 0.75],
]
HAND_MASK = [
    [1.0, 1.0, 1.0],
    [1.0, 0.0, 0.0],
    [1.0, 1.0, 0.0],
    [1.0, 1.0, 1.0],
    [1.0, 1.0, 1.0],
]
HAND_INDEX = ("a", "b", "a", "b", "a")


def _broadcast(per_row, mask) -> torch.Tensor:
    return _t(per_row).unsqueeze(-1) * _t(mask)


def test_grpo_hand_computed_with_std_normalisation():
    # group a scores 1,0,1 -> mean 2/3, deviations 1/3,-2/3,1/3,
    #   unbiased var (1/9 + 4/9 + 1/9)/2 = 1/3, std sqrt(1/3) = 0.5773502692
    #   A = (1/3)/(0.5773502692 + 1e-6) = 0.5773492692..., (-2/3)/(...) = -1.1546985384...
    std_a = math.sqrt(1 / 3)
    a_hi = (1 / 3) / (std_a + GRPO_EPS)
    a_lo = (-2 / 3) / (std_a + GRPO_EPS)
    # group b scores 0.5,2 -> mean 1.25, deviations -0.75,+0.75,
    #   unbiased var (0.5625 + 0.5625)/1 = 1.125, std 1.0606601718
    #   A = ∓0.75/(1.0606601718 + 1e-6) = ∓0.7071061144...
    std_b = math.sqrt(1.125)
    b_lo = -0.75 / (std_b + GRPO_EPS)
    b_hi = 0.75 / (std_b + GRPO_EPS)
    assert a_hi == pytest.approx(0.57734926919, abs=1e-10)
    assert b_hi == pytest.approx(0.70710611444, abs=1e-10)

    adv, ret = get_adv_estimator_fn("grpo")(
        token_level_rewards=_t(HAND_REWARDS),
        response_mask=_t(HAND_MASK),
        index=_uids(*HAND_INDEX),
        norm_adv_by_std_in_grpo=True,
    )
    expected = _broadcast([a_hi, b_lo, a_lo, b_hi, a_hi], HAND_MASK)
    torch.testing.assert_close(adv, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(ret, expected, atol=1e-12, rtol=0)
    assert adv.dtype == F64


def test_grpo_hand_computed_without_std_normalisation():
    # Dr. GRPO: A = R - mean_g R
    # group a: mean 2/3 -> 1 - 2/3 = 1/3, 0 - 2/3 = -2/3
    # group b: mean 1.25 -> 0.5 - 1.25 = -0.75, 2 - 1.25 = 0.75
    adv, _ = get_adv_estimator_fn("grpo")(
        token_level_rewards=_t(HAND_REWARDS),
        response_mask=_t(HAND_MASK),
        index=_uids(*HAND_INDEX),
        norm_adv_by_std_in_grpo=False,
    )
    expected = _broadcast([1 / 3, -0.75, -2 / 3, 0.75, 1 / 3], HAND_MASK)
    torch.testing.assert_close(adv, expected, atol=1e-12, rtol=0)


def test_grpo_custom_epsilon_is_used():
    # group a with epsilon 0.5: (1/3)/(sqrt(1/3) + 0.5) = 0.3094010768
    adv, _ = get_adv_estimator_fn("grpo")(
        token_level_rewards=_t(HAND_REWARDS),
        response_mask=_t(HAND_MASK),
        index=_uids(*HAND_INDEX),
        epsilon=0.5,
    )
    assert adv[0, 0].item() == pytest.approx((1 / 3) / (math.sqrt(1 / 3) + 0.5), abs=1e-12)
    assert adv[0, 0].item() == pytest.approx(0.3094010768, abs=1e-10)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_singleton_group_gets_raw_score_exactly(norm):
    # row 0 alone in group "solo": score 0.25 + 0.5 = 0.75 -> advantage exactly 0.75 on its tokens
    # rows 1,2 in group "pair": scores 1, 3 -> they must not leak into "solo"
    rewards = _t([[0.25, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.0, 3.0, 0.0, 0.0]])
    mask = _t([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    adv, _ = get_adv_estimator_fn("grpo")(
        token_level_rewards=rewards,
        response_mask=mask,
        index=_uids("solo", "pair", "pair"),
        norm_adv_by_std_in_grpo=norm,
    )
    assert torch.equal(adv[0], _t([0.75, 0.75, 0.0, 0.0]))


def test_grpo_accepts_integer_uids():
    # uids may be any hashable; int 7 and int 7 form one group: scores 1, 0 -> mean 0.5,
    # unbiased std sqrt(0.5) = 0.70710678 -> A = ±0.5/(0.70710678 + 1e-6)
    rewards = _t([[1.0, 0.0], [0.0, 0.0]])
    mask = _t([[1, 1], [1, 1]])
    adv, _ = get_adv_estimator_fn("grpo")(
        token_level_rewards=rewards, response_mask=mask, index=np.array([7, 7], dtype=object)
    )
    a = 0.5 / (math.sqrt(0.5) + GRPO_EPS)
    torch.testing.assert_close(adv, _t([[a, a], [-a, -a]]), atol=1e-12, rtol=0)


def test_rloo_hand_computed():
    # A_i = R_i - (Σ_g R - R_i)/(n - 1)
    # group a scores 1,0,1 (n=3, Σ=2): 1 - (2-1)/2 = 0.5 ; 0 - (2-0)/2 = -1 ; 1 - 1/2 = 0.5
    # group b scores 0.5,2 (n=2, Σ=2.5): 0.5 - 2 = -1.5 ; 2 - 0.5 = 1.5
    adv, ret = get_adv_estimator_fn("rloo")(
        token_level_rewards=_t(HAND_REWARDS),
        response_mask=_t(HAND_MASK),
        index=_uids(*HAND_INDEX),
    )
    expected = _broadcast([0.5, -1.5, -1.0, 1.5, 0.5], HAND_MASK)
    torch.testing.assert_close(adv, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(ret, expected, atol=1e-12, rtol=0)


def test_rloo_singleton_group_gets_raw_score_exactly():
    # row 1 alone: score -0.5 + 2 = 1.5 -> advantage exactly 1.5 on its 2 valid tokens
    # rows 0,2 ("g"): scores 1, 0 -> 1 - 0 = 1, 0 - 1 = -1
    rewards = _t([[0.0, 1.0, 0.0], [-0.5, 2.0, 0.0], [0.0, 0.0, 0.0]])
    mask = _t([[1, 1, 0], [1, 1, 0], [1, 1, 1]])
    adv, _ = get_adv_estimator_fn("rloo")(
        token_level_rewards=rewards, response_mask=mask, index=_uids("g", "solo", "g")
    )
    assert torch.equal(adv[1], _t([1.5, 1.5, 0.0]))
    torch.testing.assert_close(adv[0], _t([1.0, 1.0, 0.0]), atol=1e-12, rtol=0)
    torch.testing.assert_close(adv[2], _t([-1.0, -1.0, -1.0]), atol=1e-12, rtol=0)


# --------------------------------------------------------------------------------------------
# REINFORCE++: hand-computed
# --------------------------------------------------------------------------------------------


def test_reinforce_plus_plus_discounted_returns_and_batch_whitening():
    # gamma = 0.5
    # row 0 (len 3) rewards [1, 0, 2]: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5
    # row 1 (len 2) rewards [0, 4, 9(pad)]: G1 = 4, G0 = 0 + 0.5*4 = 2 (the 9 is padding)
    # valid returns 1.5, 1, 2, 2, 4 -> mean 10.5/5 = 2.1
    # deviations -0.6, -1.1, -0.1, -0.1, 1.9 -> squares 0.36 + 1.21 + 0.01 + 0.01 + 3.61 = 5.2
    # unbiased var 5.2/4 = 1.3 -> A = dev / sqrt(1.3 + 1e-8)   (whitening eps 1e-8)
    rewards = _t([[1.0, 0.0, 2.0], [0.0, 4.0, 9.0]])
    mask = _t([[1, 1, 1], [1, 1, 0]])
    index = _uids("x", "y")  # REINFORCE++ ignores groups
    adv, ret = get_adv_estimator_fn("reinforce_plus_plus")(
        token_level_rewards=rewards, response_mask=mask, index=index, gamma=0.5
    )
    torch.testing.assert_close(ret, _t([[1.5, 1.0, 2.0], [2.0, 4.0, 0.0]]), atol=1e-12, rtol=0)
    scale = 1.0 / math.sqrt(1.3 + 1e-8)
    expected = _t([[-0.6, -1.1, -0.1], [-0.1, 1.9, 0.0]]) * scale
    torch.testing.assert_close(adv, expected, atol=1e-12, rtol=0)
    assert adv[1, 2].item() == 0.0
    # whitened valid tokens: mean 0, unbiased var 1.3/(1.3 + 1e-8)
    valid = adv[mask.bool()]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert valid.var(unbiased=True).item() == pytest.approx(1.3 / (1.3 + 1e-8), abs=1e-12)


def test_reinforce_plus_plus_gamma_one_is_undiscounted_reward_to_go():
    # gamma = 1: row 0 rewards [1, 0, 2] -> G = [3, 2, 2]; row 1 rewards [0, 4] -> G = [4, 4]
    rewards = _t([[1.0, 0.0, 2.0], [0.0, 4.0, 0.0]])
    mask = _t([[1, 1, 1], [1, 1, 0]])
    _, ret = get_adv_estimator_fn("reinforce_plus_plus")(
        token_level_rewards=rewards, response_mask=mask, index=_uids("x", "x")
    )
    torch.testing.assert_close(ret, _t([[3.0, 2.0, 2.0], [4.0, 4.0, 0.0]]), atol=1e-12, rtol=0)


def test_reinforce_plus_plus_is_not_grouped():
    # the same batch with different uid labelling gives the same result
    gen = torch.Generator().manual_seed(3)
    rewards = torch.randn(4, 5, generator=gen, dtype=F64)
    mask = _t([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    fn = get_adv_estimator_fn("reinforce_plus_plus")
    a1, _ = fn(token_level_rewards=rewards, response_mask=mask, index=_uids("a", "a", "b", "b"))
    a2, _ = fn(token_level_rewards=rewards, response_mask=mask, index=_uids("p", "q", "r", "s"))
    assert torch.equal(a1, a2)


# --------------------------------------------------------------------------------------------
# OTB: hand-computed
# --------------------------------------------------------------------------------------------


def _otb_outcome_case():
    """Group "g" of three responses (lengths 2, 3, 4) plus a singleton group "s".

    energy e = 1 - 2p + s per valid token:
      row 0 p=[.5,.5]         s=[.5,.5]          -> e=[.5,.5]          W=[.5, 1.0]
      row 1 p=[.25,.5,.25]    s=[.25,.5,.25]     -> e=[.75,.5,.75]     W=[.75, 1.25, 2.0]
      row 2 p=[.5,.25,.5,.5]  s=[.5,.25,.5,.5]   -> e=[.5,.75,.5,.5]   W=[.5, 1.25, 1.75, 2.25]
      row 3 (singleton, len 2) p=[.5,.5] s=[.5,.5] -> W=[.5, 1.0]
    outcome rewards at the last valid token: row0 1, row1 0, row2 1, row3 0.7
      -> returns G: row0 [1,1,0,0], row1 [0,0,0,0], row2 [1,1,1,1], row3 [.7,.7,0,0]
    """
    rewards = _t(
        [
            [0.0, 1.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 1.0],
            [0.0, 0.7, 0.0, 0.0],
        ]
    )
    mask = _t([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    p = [
        [0.5, 0.5, PAD_P, PAD_P],
        [0.25, 0.5, 0.25, PAD_P],
        [0.5, 0.25, 0.5, 0.5],
        [0.5, 0.5, PAD_P, PAD_P],
    ]
    s = [
        [0.5, 0.5, PAD_S, PAD_S],
        [0.25, 0.5, 0.25, PAD_S],
        [0.5, 0.25, 0.5, 0.5],
        [0.5, 0.5, PAD_S, PAD_S],
    ]
    old_lp, spi2 = _policy_stats(p, s)
    return rewards, mask, _uids("g", "g", "g", "s"), old_lp, spi2


def test_otb_outcome_reward_hand_computed_with_zero_tail():
    rewards, mask, index, old_lp, spi2 = _otb_outcome_case()
    # t=0: alive rows 0,1,2: Σ G W = 1*.5 + 0*.75 + 1*.5 = 1.0 ; Σ W = 1.75
    #      B = 1.0/(1.75 + eps) ≈ 4/7 = 0.5714 -> A = 3/7, -4/7, 3/7
    b0 = 1.0 / (1.75 + OTB_EPS)
    # t=1: alive rows 0,1,2: Σ G W = 1*1 + 0*1.25 + 1*1.25 = 2.25 ; Σ W = 3.5
    #      B = 2.25/3.5 ≈ 9/14 = 0.6429 -> A = 5/14, -9/14, 5/14
    b1 = 2.25 / (3.5 + OTB_EPS)
    # t=2: alive rows 1,2: Σ G W = 0*2 + 1*1.75 = 1.75 ; Σ W = 3.75
    #      B = 1.75/3.75 ≈ 7/15 = 0.4667 -> A = -7/15, 8/15
    b2 = 1.75 / (3.75 + OTB_EPS)
    # t=3: only row 2 alive (unique longest) -> zero tail: B = 0 -> A = G = 1
    # singleton row 3: no baseline -> A = G = 0.7, 0.7
    expected = _t(
        [
            [1 - b0, 1 - b1, 0.0, 0.0],
            [0 - b0, 0 - b1, 0 - b2, 0.0],
            [1 - b0, 1 - b1, 1 - b2, 1.0],
            [0.7, 0.7, 0.0, 0.0],
        ]
    )
    adv, ret = get_adv_estimator_fn("optimal_token_baseline")(
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        old_log_probs=old_lp,
        sum_pi_squared=spi2,
        otb_handle_zero_tail=True,
    )
    torch.testing.assert_close(adv, expected, atol=1e-12, rtol=0)
    # the readable fractions, to the eps level
    torch.testing.assert_close(
        adv[:3, :2], _t([[3 / 7, 5 / 14], [-4 / 7, -9 / 14], [3 / 7, 5 / 14]]), atol=1e-7, rtol=0
    )
    torch.testing.assert_close(adv[1:3, 2], _t([-7 / 15, 8 / 15]), atol=1e-7, rtol=0)
    assert adv[2, 3].item() == 1.0
    expected_ret = _t([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0.7, 0.7, 0, 0]])
    torch.testing.assert_close(ret, expected_ret, atol=1e-12, rtol=0)


def test_otb_outcome_reward_hand_computed_without_zero_tail():
    rewards, mask, index, old_lp, spi2 = _otb_outcome_case()
    adv, _ = get_adv_estimator_fn("otb")(
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        old_log_probs=old_lp,
        sum_pi_squared=spi2,
        otb_handle_zero_tail=False,
    )
    # t=3: row 2 alone with G=1, W=2.25: B = 1*2.25/(2.25 + 1e-8) -> A = 1 - B = 1e-8/2.25 ≈ 4.4e-9
    b3 = 2.25 / (2.25 + OTB_EPS)
    assert adv[2, 3].item() == pytest.approx(1.0 - b3, abs=1e-15)
    assert abs(adv[2, 3].item()) < 1e-8
    # t=0..2 are unchanged by the flag (more than one sample alive)
    b2 = 1.75 / (3.75 + OTB_EPS)
    assert adv[2, 2].item() == pytest.approx(1 - b2, abs=1e-12)
    # a group of one still collapses to the returns, whatever the flag
    assert torch.equal(adv[3], _t([0.7, 0.7, 0.0, 0.0]))


def test_otb_custom_epsilon_is_used():
    rewards, mask, index, old_lp, spi2 = _otb_outcome_case()
    adv, _ = get_adv_estimator_fn("otb")(
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        old_log_probs=old_lp,
        sum_pi_squared=spi2,
        otb_epsilon=0.25,
    )
    # t=0 with eps 0.25: B = 1.0/(1.75 + 0.25) = 0.5 -> row 0: 1 - 0.5 = 0.5, row 1: -0.5
    torch.testing.assert_close(adv[:3, 0], _t([0.5, -0.5, 0.5]), atol=1e-12, rtol=0)


def test_otb_returns_to_go_with_rewards_at_several_positions():
    # group of two: row 0 len 3 rewards [0.5, 0, 1] -> G = [1.5, 1, 1]
    #               row 1 len 2 rewards [1, -1, 3(pad)] -> G = [0, -1] (padding reward ignored)
    # energies: row 0 e = .5 each (p=.5, s=.5)  -> W = [.5, 1.0, 1.5]
    #           row 1 e = .75 each (p=.25, s=.25) -> W = [.75, 1.5]
    # t=0: Σ G W = 1.5*.5 + 0*.75 = .75 ; Σ W = 1.25 -> B = .6  -> A = .9, -.6
    # t=1: Σ G W = 1*1 + (-1)*1.5 = -.5 ; Σ W = 2.5 -> B = -.2 -> A = 1.2, -.8
    # t=2: row 0 alone -> zero tail: A = G = 1
    rewards = _t([[0.5, 0.0, 1.0], [1.0, -1.0, 3.0]])
    mask = _t([[1, 1, 1], [1, 1, 0]])
    old_lp, spi2 = _policy_stats(
        [[0.5, 0.5, 0.5], [0.25, 0.25, PAD_P]], [[0.5] * 3, [0.25, 0.25, PAD_S]]
    )
    adv, ret = get_adv_estimator_fn("otb")(
        token_level_rewards=rewards,
        response_mask=mask,
        index=_uids("q", "q"),
        old_log_probs=old_lp,
        sum_pi_squared=spi2,
    )
    b0 = 0.75 / (1.25 + OTB_EPS)
    b1 = -0.5 / (2.5 + OTB_EPS)
    expected = _t([[1.5 - b0, 1 - b1, 1.0], [0 - b0, -1 - b1, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(adv, _t([[0.9, 1.2, 1.0], [-0.6, -0.8, 0.0]]), atol=1e-7, rtol=0)
    torch.testing.assert_close(ret, _t([[1.5, 1.0, 1.0], [0.0, -1.0, 0.0]]), atol=1e-12, rtol=0)


def _otb_importance_case():
    # group of two, both len 2, e = 1 - 2*.5 + .5 = .5 on every token
    # row 0 reward 1 at the end -> G = [1, 1]; row 1 reward 0 -> G = [0, 0]
    rewards = _t([[0.0, 1.0], [0.0, 0.0]])
    mask = _t([[1, 1], [1, 1]])
    old_lp, spi2 = _policy_stats([[0.5, 0.5], [0.5, 0.5]], [[0.5, 0.5], [0.5, 0.5]])
    return rewards, mask, _uids("g", "g"), old_lp, spi2


def test_otb_importance_weights_scale_energy_by_w_squared():
    rewards, mask, index, old_lp, spi2 = _otb_importance_case()
    weights = _t([[2.0, 1.0], [1.0, 2.0]])
    # weighted energy e·w²: row 0 [.5*4, .5*1] = [2, .5]  -> W = [2, 2.5]
    #                       row 1 [.5*1, .5*4] = [.5, 2]  -> W = [.5, 2.5]
    # t=0: B = (1*2 + 0*.5)/(2.5) = .8   -> A = .2, -.8
    # t=1: B = (1*2.5 + 0*2.5)/5 = .5    -> A = .5, -.5
    # (with linear weights e·w: W0 = [1, 1.5], W1 = [.5, 1.5] -> t=0 B = 1/1.5 = .667, not .8)
    adv, _ = get_adv_estimator_fn("otb")(
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        old_log_probs=old_lp,
        sum_pi_squared=spi2,
        rollout_is_weights=weights,
    )
    b0 = 2.0 / (2.5 + OTB_EPS)
    b1 = 2.5 / (5.0 + OTB_EPS)
    torch.testing.assert_close(adv, _t([[1 - b0, 1 - b1], [-b0, -b1]]), atol=1e-12, rtol=0)
    torch.testing.assert_close(adv, _t([[0.2, 0.5], [-0.8, -0.5]]), atol=1e-7, rtol=0)


def test_otb_without_importance_weights_differs_from_weighted():
    rewards, mask, index, old_lp, spi2 = _otb_importance_case()
    # unweighted: W = [.5, 1] for both rows
    #   t=0: B = (1*.5 + 0*.5)/(.5 + .5) = .5 ; t=1: B = (1*1 + 0*1)/(1 + 1) = .5
    #   -> A row 0 = [.5, .5], row 1 = [-.5, -.5]
    fn = get_adv_estimator_fn("otb")
    kwargs = dict(
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        old_log_probs=old_lp,
        sum_pi_squared=spi2,
    )
    plain, _ = fn(**kwargs)
    ones, _ = fn(**kwargs, rollout_is_weights=torch.ones_like(rewards))
    b0 = 0.5 / (1.0 + OTB_EPS)
    b1 = 1.0 / (2.0 + OTB_EPS)
    torch.testing.assert_close(plain, _t([[1 - b0, 1 - b1], [-b0, -b1]]), atol=1e-12, rtol=0)
    torch.testing.assert_close(ones, plain, atol=1e-15, rtol=0)
    weighted, _ = fn(**kwargs, rollout_is_weights=_t([[2.0, 1.0], [1.0, 2.0]]))
    assert (weighted[:, 0] - plain[:, 0]).abs().min().item() > 0.25


# --------------------------------------------------------------------------------------------
# TIR-OTB: hand-computed
# --------------------------------------------------------------------------------------------


def _tir_case():
    """Group of two, T=5.

    row 0 mask [1,1,0,0,1] (tool output at columns 2,3), outcome reward 1 at column 4
          -> G = [1,1,1,1,1] (only columns 0,1,4 are model tokens)
          e = .5 at model tokens (p=.5, s=.5); the tool columns carry p=.1, s=.9 (e would be 1.7)
          W by column = [.5, 1.0, 1.0, 1.0, 1.5]  (no accumulation on the hole)
          model-token rank: col0 -> 0, col1 -> 1, col4 -> 2
    row 1 mask [1,1,1,0,0], outcome reward .5 at column 2 -> G = [.5,.5,.5,0,0]
          e = [.25, .75, .25] (p=.5,s=.25 ; p=.25,s=.25 ; p=.5,s=.25) -> W = [.25, 1.0, 1.25]
          rank: col0 -> 0, col1 -> 1, col2 -> 2
    """
    rewards = _t([[0.0, 0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.5, 0.0, 0.0]])
    mask = _t([[1, 1, 0, 0, 1], [1, 1, 1, 0, 0]])
    old_lp, spi2 = _policy_stats(
        [[0.5, 0.5, PAD_P, PAD_P, 0.5], [0.5, 0.25, 0.5, PAD_P, PAD_P]],
        [[0.5, 0.5, PAD_S, PAD_S, 0.5], [0.25, 0.25, 0.25, PAD_S, PAD_S]],
    )
    return rewards, mask, _uids("g", "g"), old_lp, spi2


def test_tir_otb_hand_computed_mask_hole_pools_by_generated_rank():
    rewards, mask, index, old_lp, spi2 = _tir_case()
    # rank 0: (G,W) = (1,.5) and (.5,.25): Σ G W = .5 + .125 = .625, Σ W = .75
    #         B = 5/6 = .8333 -> A = 1/6, -1/3
    b0 = 0.625 / (0.75 + OTB_EPS)
    # rank 1: (1,1.0) and (.5,1.0): Σ G W = 1.5, Σ W = 2 -> B = .75 -> A = .25, -.25
    b1 = 1.5 / (2.0 + OTB_EPS)
    # rank 2: row 0 col 4 (1,1.5) and row 1 col 2 (.5,1.25): Σ G W = 1.5 + .625 = 2.125,
    #         Σ W = 2.75 -> B = 17/22 = .772727 -> A = 5/22 = .227273 (row 0), -3/11 = -.272727
    #         (if the hole accumulated, row 0's W at col 4 would be 1.5 + 2*1.7 = 4.9)
    b2 = 2.125 / (2.75 + OTB_EPS)
    expected = _t([[1 - b0, 1 - b1, 0.0, 0.0, 1 - b2], [0.5 - b0, 0.5 - b1, 0.5 - b2, 0.0, 0.0]])
    adv, ret = get_adv_estimator_fn("tir_optimal_token_baseline")(
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        old_log_probs=old_lp,
        sum_pi_squared=spi2,
    )
    torch.testing.assert_close(adv, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(
        adv,
        _t([[1 / 6, 0.25, 0.0, 0.0, 5 / 22], [-1 / 3, -0.25, -3 / 11, 0.0, 0.0]]),
        atol=1e-7,  # eps = 1e-8 in the denominator shifts B by up to ~1.1e-8
        rtol=0,
    )
    # returns on model tokens are the rewards-to-go
    torch.testing.assert_close(ret[mask.bool()], _t([1, 1, 1, 0.5, 0.5, 0.5]), atol=1e-12, rtol=0)


def test_tir_otb_differs_from_plain_otb_on_mask_hole():
    rewards, mask, index, old_lp, spi2 = _tir_case()
    kwargs = dict(
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        old_log_probs=old_lp,
        sum_pi_squared=spi2,
    )
    plain, _ = get_adv_estimator_fn("otb")(**kwargs)
    tir, _ = get_adv_estimator_fn("tir_otb")(**kwargs)
    # plain OTB pools by column: columns 0,1 match TIR (ranks equal columns there), but
    #   col 2: only row 1 alive -> zero tail -> A = G = .5
    #   col 4: only row 0 alive -> zero tail -> A = G = 1   (W still 1.5: no accumulation on hole)
    torch.testing.assert_close(plain[:, :2], tir[:, :2], atol=1e-15, rtol=0)
    assert plain[1, 2].item() == 0.5
    assert plain[0, 4].item() == 1.0
    assert tir[1, 2].item() == pytest.approx(-3 / 11, abs=1e-7)
    assert tir[0, 4].item() == pytest.approx(5 / 22, abs=1e-7)
    assert not torch.allclose(plain, tir)


def test_tir_otb_equals_plain_otb_without_holes():
    rewards, mask, index, old_lp, spi2 = _otb_outcome_case()
    kwargs = dict(
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        old_log_probs=old_lp,
        sum_pi_squared=spi2,
    )
    plain, plain_ret = get_adv_estimator_fn("otb")(**kwargs)
    tir, tir_ret = get_adv_estimator_fn("tir_otb")(**kwargs)
    assert torch.equal(plain, tir)
    assert torch.equal(plain_ret, tir_ret)


def test_tir_otb_hole_does_not_accumulate_energy():
    # changing p, s on the tool-output columns must not change anything
    rewards, mask, index, old_lp, spi2 = _tir_case()
    fn = get_adv_estimator_fn("tir_otb")
    base, _ = fn(
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        old_log_probs=old_lp,
        sum_pi_squared=spi2,
    )
    hole = ~mask.bool()
    lp2 = torch.where(hole, torch.full_like(old_lp, math.log(0.9)), old_lp)
    s2 = torch.where(hole, torch.full_like(spi2, 0.05), spi2)
    w = torch.where(hole, torch.full_like(spi2, 7.0), torch.ones_like(spi2))
    other, _ = fn(
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        old_log_probs=lp2,
        sum_pi_squared=s2,
        rollout_is_weights=w,
    )
    assert torch.equal(base, other)


def test_returns_flow_through_tool_output_holes_and_are_zero_on_them():
    # multi-turn response: 2 model tokens, 2 tool-output tokens (mask 0), 1 model token with reward 1
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    # γ = 0.5: G_4 = 1, G_3 = 0.5, G_2 = 0.25 (holes, zeroed), G_1 = 0.125, G_0 = 0.0625
    _, ret = get_adv_estimator_fn("reinforce_plus_plus")(
        token_level_rewards=rewards, response_mask=mask, index=None, gamma=0.5
    )
    torch.testing.assert_close(
        ret, torch.tensor([[0.0625, 0.125, 0.0, 0.0, 1.0]], dtype=torch.float64)
    )
    lp = torch.full_like(rewards, -1.0)
    spi2 = torch.full_like(rewards, 0.3)
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        adv, ret = get_adv_estimator_fn(name)(
            token_level_rewards=rewards,
            response_mask=mask,
            index=np.array(["a"], dtype=object),
            old_log_probs=lp,
            sum_pi_squared=spi2,
        )
        # group of one: advantage = return = 1 on model tokens, exactly 0 on the tool output
        torch.testing.assert_close(ret, mask.clone())
        torch.testing.assert_close(adv, mask.clone())
