"""Importance weights, masked IS, geometric mask and OPSM: hand-worked values and properties."""

from __future__ import annotations

import math

import pytest
import torch

from verl.trainer.core_algos.guidance import LOG_PROB_FLOOR
from verl.trainer.core_algos.offpolicy import (
    RATIO_LEVELS,
    compute_geometric_mask,
    compute_importance_weights,
    compute_opsm_mask,
    compute_rejection_mask,
)
from verl.utils import metric_names as M

D = torch.float64


def logt(values):
    return torch.tensor(values, dtype=D).log()


# π_old = [0.5, 0.2, 0.9], μ = [0.25, 0.8, 0.9] -> ratios r = [2, 0.25, 1]; a 4th padded slot
OLD = logt([[0.5, 0.2, 0.9, 0.3]])
BEH = logt([[0.25, 0.8, 0.9, 0.001]])
MASK = torch.tensor([[1, 1, 1, 0]], dtype=D)


def test_token_importance_weights_hand_values():
    w, m = compute_importance_weights(OLD, BEH, MASK, "token", clamp_min=0.0, clamp_max=1.5)
    # clamp([2, 0.25, 1], 0, 1.5) = [1.5, 0.25, 1.0]; padding -> 0
    torch.testing.assert_close(
        w, torch.tensor([[1.5, 0.25, 1.0, 0.0]], dtype=D), rtol=0, atol=1e-12
    )
    assert m[M.GUIDANCE_IS_WEIGHT_MEAN] == pytest.approx(2.75 / 3, abs=1e-12)
    # unbiased std of [1.5, 0.25, 1.0]: deviations .58333, -.66667, .08333 -> Σsq = .791667 / 2 -> .629153
    assert m[M.GUIDANCE_IS_WEIGHT_STD] == pytest.approx(
        math.sqrt(0.7916666666666666 / 2), abs=1e-12
    )
    assert m[M.GUIDANCE_IS_WEIGHT_MIN] == pytest.approx(0.25)
    assert m[M.GUIDANCE_IS_WEIGHT_MAX] == pytest.approx(1.5)
    assert m[M.GUIDANCE_IS_CLIP_FRAC] == pytest.approx(1 / 3)  # only the ratio 2 was truncated
    assert m[M.GUIDANCE_IS_WEIGHT_EXCLUDED_FRAC] == 0.0
    assert not w.requires_grad


def test_importance_weight_metrics_leave_out_unknown_behavior():
    # row 0: the hand-values tokens plus a 4th valid token whose μ is the floor (never reported);
    # row 1: the hand-values tokens alone (r = [2, 0.25, 1], padding after)
    old = logt([[0.5, 0.2, 0.9, 0.6, 0.3], [0.5, 0.2, 0.9, 0.3, 0.3]])
    beh = logt([[0.25, 0.8, 0.9, 1.0, 0.001], [0.25, 0.8, 0.9, 0.001, 0.001]])
    beh[0, 3] = LOG_PROB_FLOOR
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], dtype=D)
    w, m = compute_importance_weights(old, beh, mask, "token", clamp_min=0.0, clamp_max=1.5)
    # the update still gets clamp(exp(20)) = 1.5 there; the statistics read the 6 known tokens,
    # [1.5, 0.25, 1.0] twice: mean 2.75/3, min 0.25, max 1.5, 2 of 6 clipped
    assert w[0, 3].item() == 1.5
    assert m[M.GUIDANCE_IS_WEIGHT_MEAN] == pytest.approx(2.75 / 3, abs=1e-12)
    # unbiased std of the 6: Σ(x - 0.916667)² = 2·0.791667 = 1.583333, / 5 -> sqrt(0.316667)
    assert m[M.GUIDANCE_IS_WEIGHT_STD] == pytest.approx(
        math.sqrt(1.5833333333333333 / 5), abs=1e-12
    )
    assert m[M.GUIDANCE_IS_WEIGHT_MIN] == pytest.approx(0.25)
    assert m[M.GUIDANCE_IS_WEIGHT_MAX] == pytest.approx(1.5)
    assert m[M.GUIDANCE_IS_CLIP_FRAC] == pytest.approx(2 / 6, abs=1e-7)  # a float32 share
    assert m[M.GUIDANCE_IS_WEIGHT_EXCLUDED_FRAC] == pytest.approx(1 / 7, abs=1e-12)
    # sequence level: row 0's weight reads the floor token, so all of row 0 is left out; row 1's
    # Π r = 2·0.25·1 = 0.5 on its 3 tokens
    _, m = compute_importance_weights(old, beh, mask, "sequence", clamp_min=0.0, clamp_max=10.0)
    assert m[M.GUIDANCE_IS_WEIGHT_MEAN] == pytest.approx(0.5, abs=1e-12)
    assert m[M.GUIDANCE_IS_WEIGHT_MAX] == pytest.approx(0.5, abs=1e-12)
    assert m[M.GUIDANCE_IS_WEIGHT_EXCLUDED_FRAC] == pytest.approx(4 / 7, abs=1e-12)


def test_sequence_importance_weights_use_the_product_ratio():
    w, _ = compute_importance_weights(OLD, BEH, MASK, "sequence", clamp_min=0.0, clamp_max=10.0)
    # Π r = 2·0.25·1 = 0.5 on every valid token
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.5, 0.5, 0.0]], dtype=D), rtol=0, atol=1e-12)


def test_geometric_level_weight_is_the_geometric_mean_ratio():
    w, _ = compute_importance_weights(OLD, BEH, MASK, "geometric", clamp_min=0.0, clamp_max=10.0)
    # (Π r)^(1/3) = 0.5^(1/3) = 0.793700526
    torch.testing.assert_close(
        w[0, :3], torch.full((3,), 0.5 ** (1 / 3), dtype=D), rtol=0, atol=1e-12
    )


def test_token_rejection_mask():
    keep = compute_rejection_mask(OLD, BEH, MASK, "token", lower=0.5, upper=2.5)
    # r = [2, 0.25, 1] in [0.5, 2.5]? -> [1, 0, 1]; padding 0
    assert keep.tolist() == [[1.0, 0.0, 1.0, 0.0]]


def test_sequence_rejection_mask():
    # Π r = 0.5
    assert compute_rejection_mask(OLD, BEH, MASK, "sequence", 0.4, 2.5).tolist() == [
        [1.0, 1.0, 1.0, 0.0]
    ]
    assert compute_rejection_mask(OLD, BEH, MASK, "sequence", 0.6, 2.5).tolist() == [
        [0.0, 0.0, 0.0, 0.0]
    ]


def test_geometric_mask_is_length_invariant_while_product_ratio_is_not():
    # doubling the response by repeating each token's ratio: Π r goes 0.5 -> 0.25,
    # the geometric mean stays 0.5^(1/3) = 0.7937
    old2, beh2 = OLD[:, :3].repeat(1, 2), BEH[:, :3].repeat(1, 2)
    mask1, mask2 = MASK[:, :3], torch.ones(1, 6, dtype=D)
    lo, hi = 0.3, 3.0
    assert compute_rejection_mask(
        OLD[:, :3], BEH[:, :3], mask1, "sequence", lo, hi
    ).all()  # 0.5 kept
    assert not compute_rejection_mask(old2, beh2, mask2, "sequence", lo, hi).any()  # 0.25 dropped
    assert compute_geometric_mask(OLD[:, :3], BEH[:, :3], mask1, lo, hi).all()
    assert compute_geometric_mask(old2, beh2, mask2, lo, hi).all()


@pytest.mark.parametrize("seed", range(5))
def test_geometric_decision_unchanged_by_repetition_random(seed):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(16, 7, generator=gen, dtype=D)
    beh = old + 0.4 * torch.randn(16, 7, generator=gen, dtype=D)
    mask = torch.ones(16, 7, dtype=D)
    once = compute_geometric_mask(old, beh, mask, 0.8, 1.25)[:, 0]
    twice = compute_geometric_mask(
        old.repeat(1, 2), beh.repeat(1, 2), mask.repeat(1, 2), 0.8, 1.25
    )[:, 0]
    assert torch.equal(once, twice)


def test_rejection_bounds_validated():
    with pytest.raises(ValueError, match="lower"):
        compute_rejection_mask(OLD, BEH, MASK, "token", lower=2.0, upper=1.0)
    with pytest.raises(ValueError, match="valid: geometric, sequence, token"):
        compute_rejection_mask(OLD, BEH, MASK, "paragraph")
    assert RATIO_LEVELS.names() == ["geometric", "sequence", "token"]


def test_opsm_hand_values():
    # seq 0: A < 0, mean log(μ/π) = (0.3 + 0.5)/2 = 0.4 > 0.25 -> drop
    # seq 1: A > 0, drift 0.4 -> keep (never drops A ≥ 0)
    # seq 2: A < 0, drift (0.1 + 0.2)/2 = 0.15 ≤ 0.25 -> keep
    # seq 3: A = 0, drift 1.0 -> keep
    logp = torch.zeros(4, 3, dtype=D) - 1.0
    drift = torch.tensor(
        [[0.3, 0.5, 9.0], [0.3, 0.5, 9.0], [0.1, 0.2, 9.0], [1.0, 1.0, 1.0]], dtype=D
    )
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 1]], dtype=D)
    adv = torch.tensor([[-1.0], [1.0], [-2.0], [0.0]], dtype=D).expand(4, 3) * mask
    keep = compute_opsm_mask(logp, logp + drift, adv, mask, delta=0.25)
    assert keep.squeeze(-1).tolist() == [0.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("seed", range(5))
def test_opsm_never_drops_non_negative_advantage(seed):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(32, 9, generator=gen, dtype=D) * 4
    beh = logp + torch.randn(32, 9, generator=gen, dtype=D) * 2
    mask = (torch.arange(9) < torch.randint(1, 10, (32, 1), generator=gen)).to(D)
    adv = torch.randn(32, 1, generator=gen, dtype=D).expand(32, 9) * mask
    keep = compute_opsm_mask(logp, beh, adv, mask, delta=0.0).squeeze(-1)
    seq_adv = (adv * mask).sum(-1) / mask.sum(-1)
    assert torch.all(keep[seq_adv >= 0] == 1)
    assert torch.any(keep[seq_adv < 0] == 0)  # with δ = 0 some negative drifted ones go
