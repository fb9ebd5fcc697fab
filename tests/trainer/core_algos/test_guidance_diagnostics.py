"""Hand-worked values of the guided-step diagnostics (what the update gets from guidance tokens)."""

from __future__ import annotations

import math

import pytest
import torch

from verl.trainer.core_algos import compute_guidance_diagnostics
from verl.trainer.core_algos.guidance import LOG_PROB_FLOOR
from verl.utils import metric_names as M

# 4 responses x 3 positions, groups a = rows 0-1 and b = rows 2-3; row 1's last position is padding.
OFF = torch.tensor([[0, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
OLD = torch.full((4, 3), math.log(0.5))  # π_old(y) = 0.5 everywhere
RATIO = torch.ones(4, 3)
RATIO[0, 1], RATIO[2, 0] = 3.0, 0.5  # π_old/μ on the two guidance tokens
BEHAVIOR = OLD - RATIO.log()
ADV = torch.tensor([[1.0, 1, 1], [-1, -1, 0], [-1, -1, -1], [1, 1, 1]])
SCORES = torch.tensor([1.0, 0.0, 0.0, 0.0])
INDEX = ["a", "a", "b", "b"]
WEIGHTS = RATIO.clamp(0.0, 2.0) * MASK  # the trainer's truncated weights: 2 and 0.5 there
SUM_PI2 = torch.full((4, 3), 0.5)  # E_t = 1 - 2·0.5 + 0.5 = 0.5 everywhere


def diagnose(**kw):
    args = dict(importance_weights=WEIGHTS, sum_pi_squared=SUM_PI2) | kw
    return compute_guidance_diagnostics(
        OFF, MASK, OLD, BEHAVIOR, ADV, SCORES, INDEX, (0.0, 2.0), **args
    )


def test_hand_values():
    m = diagnose()
    # guidance tokens' weights: clamp(3, 0, 2) = 2 and 0.5 -> mean 1.25; one of two clipped
    assert m[M.GUIDANCE_GUIDED_IS_WEIGHT_MEAN] == pytest.approx(1.25, abs=1e-6)
    assert m[M.GUIDANCE_GUIDED_IS_CLIP_FRAC] == pytest.approx(0.5)
    assert m[M.GUIDANCE_GUIDED_EXCLUDED_FRAC] == 0.0
    # (w·A)²·E per valid token, E = 0.5:
    # row 0: 0.5 + (2·1)²·0.5 = 2 + 0.5 = 3.0; row 1: 0.5 + 0.5 = 1.0 (padding left out)
    # row 2: (0.5·1)²·0.5 = 0.125 + 0.5 + 0.5 = 1.125; row 3: 1.5. Total 6.625, guided 2 + 0.125
    assert m[M.GUIDANCE_GUIDED_GRAD_SHARE] == pytest.approx(2.125 / 6.625, rel=1e-6)
    # responses with guidance tokens: rows 0, 2 -> (1 + 0)/2; without: rows 1, 3 -> 0
    assert m[M.GUIDANCE_GUIDED_SEQ_SCORE] == pytest.approx(0.5)
    assert m[M.GUIDANCE_UNGUIDED_SEQ_SCORE] == pytest.approx(0.0)
    # group a: 1 - 0 = 1; group b: 0 - 0 = 0 -> mean 0.5
    assert m[M.GUIDANCE_GUIDED_SCORE_GAP] == pytest.approx(0.5)
    assert all(M.is_known(k) for k in m)


def test_guidance_token_with_unknown_behavior_moves_no_metric():
    # a third guidance token (row 3, position 0) whose μ was never reported: floor in μ, so its raw
    # ratio exp(log 0.5 + 1e4) would count as clipped with weight 2, as the trainer's clamp makes it
    off, behavior, weights = OFF.clone(), BEHAVIOR.clone(), WEIGHTS.clone()
    off[3, 0], behavior[3, 0], weights[3, 0] = 1, LOG_PROB_FLOOR, 2.0
    m = compute_guidance_diagnostics(off, MASK, OLD, behavior, ADV, SCORES, INDEX, (0.0, 2.0),
                                     importance_weights=weights, sum_pi_squared=SUM_PI2)  # fmt: skip
    # as in test_hand_values: (2 + 0.5)/2 = 1.25, 1 clipped of 2 (with it: 4.5/3 = 1.5, 2 of 3)
    assert m[M.GUIDANCE_GUIDED_IS_WEIGHT_MEAN] == pytest.approx(1.25, abs=1e-6)
    assert m[M.GUIDANCE_GUIDED_IS_CLIP_FRAC] == pytest.approx(0.5)
    assert m[M.GUIDANCE_GUIDED_EXCLUDED_FRAC] == pytest.approx(1 / 3)  # 1 of 3 guidance tokens
    # grad share: row 3 loses its first token (power 0.5): total 3.0 + 1.0 + 1.125 + 1.0 = 6.125,
    # guided 2 + 0.125 = 2.125 (with it: (2·1)²·0.5 = 2 more guided power, 4.125 / 8.125)
    assert m[M.GUIDANCE_GUIDED_GRAD_SHARE] == pytest.approx(2.125 / 6.125, rel=1e-6)


def test_without_weights_or_sum_pi_squared():
    m = diagnose(importance_weights=None)
    # w = 1: the guided tokens' power is 0.5 each; total = 1.5 + 1.0 + 1.5 + 1.5 = 5.5
    assert m[M.GUIDANCE_GUIDED_GRAD_SHARE] == pytest.approx(1.0 / 5.5, rel=1e-6)
    assert M.GUIDANCE_GUIDED_GRAD_SHARE not in diagnose(sum_pi_squared=None)


def test_names_left_out_when_nothing_qualifies():
    none = torch.zeros_like(OFF)
    m = compute_guidance_diagnostics(none, MASK, OLD, BEHAVIOR, ADV, SCORES, INDEX, (0.0, 2.0))
    assert set(m) == {M.GUIDANCE_UNGUIDED_SEQ_SCORE}  # no guidance token, no mixed group
    # a group whose responses are all guided gives no gap: only group a counts here
    both = OFF.clone()
    both[3, 2] = 1
    m = compute_guidance_diagnostics(both, MASK, OLD, BEHAVIOR, ADV, SCORES, INDEX, (0.0, 2.0))
    assert m[M.GUIDANCE_GUIDED_SCORE_GAP] == pytest.approx(1.0)


def test_group_gap_loop_matches_a_vectorised_reference():
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        off = (torch.rand(12, 6, generator=gen) < 0.1).long()
        scores = torch.rand(12, generator=gen).round()
        index = [i // 4 for i in range(12)]
        m = compute_guidance_diagnostics(off, torch.ones(12, 6), OLD.new_full((12, 6), -1.0),
                                         OLD.new_full((12, 6), -1.0), torch.zeros(12, 6), scores,
                                         index, (0.0, 2.0))  # fmt: skip
        g = off.bool().any(-1).view(3, 4).float()
        s = scores.view(3, 4)
        with_, without = g.sum(-1), (1 - g).sum(-1)
        ok = (with_ > 0) & (without > 0)
        gaps = (s * g).sum(-1) / with_.clamp(min=1) - (s * (1 - g)).sum(-1) / without.clamp(min=1)
        if ok.any():
            assert m[M.GUIDANCE_GUIDED_SCORE_GAP] == pytest.approx(gaps[ok].mean().item(), abs=1e-6)
        else:
            assert M.GUIDANCE_GUIDED_SCORE_GAP not in m
