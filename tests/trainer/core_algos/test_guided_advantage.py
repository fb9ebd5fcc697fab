"""Guided-response advantages (GUIDED_ADVANTAGES): hand-computed values and a loop reference.

`mentor` (https://arxiv.org/abs/2510.04140): the unguided responses of a group get GRPO among
themselves; a guided response gets max(R - mean_unguided, 0) x w, never std-normalised, with
w(s) = 0.5 * (1 + cos(pi s / S)). Hand-computed cases are float64 and show their arithmetic in
comments; the loop reference at the bottom is a per-group Python loop over lists.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from verl.trainer.core_algos.advantage import (
    GUIDED_ADVANTAGES,
    compute_grpo_outcome_advantage,
    guided_advantage_weight,
    mentor_guided_advantage,
    standard_guided_advantage,
)

F64 = torch.float64
EPS = 1e-6  # default epsilon (as GRPO)


def _t(values, dtype=F64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def _uids(*names: str) -> np.ndarray:
    return np.array(names, dtype=object)


def _mentor(rewards, mask, index, guided, weight, **kwargs) -> torch.Tensor:
    return mentor_guided_advantage(
        advantages=torch.full_like(rewards, float("nan")),  # ignored by mentor
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        guided=guided,
        weight=weight,
        **kwargs,
    )


# --------------------------------------------------------------------------------------------
# registry and the cosine weight
# --------------------------------------------------------------------------------------------


def test_registry_holds_standard_and_mentor():
    assert set(GUIDED_ADVANTAGES.names()) == {"standard", "mentor"}
    assert GUIDED_ADVANTAGES.get("standard") is standard_guided_advantage
    assert GUIDED_ADVANTAGES.get("mentor") is mentor_guided_advantage


def test_standard_returns_its_input():
    advantages = _t([[0.5, -0.25, 0.0], [1.0, 1.0, 0.0]])
    out = GUIDED_ADVANTAGES.get("standard")(
        advantages=advantages,
        token_level_rewards=torch.ones_like(advantages),
        response_mask=torch.ones_like(advantages),
        index=_uids("a", "a"),
        guided=torch.tensor([True, False]),
        weight=0.3,
    )
    assert out is advantages


@pytest.mark.parametrize(
    ("step", "decay_steps", "expected"),
    [
        (0, 100, 1.0),  # 0.5 * (1 + cos 0) = 1
        (50, 100, 0.5),  # 0.5 * (1 + cos(pi/2)) = 0.5
        (25, 100, 0.5 * (1 + math.sqrt(0.5))),  # 0.5 * (1 + cos(pi/4)) = 0.853553390593...
        (75, 100, 0.5 * (1 - math.sqrt(0.5))),  # 0.5 * (1 + cos(3pi/4)) = 0.146446609406...
        (1, 2, 0.5),  # S = 2, s = S/2
        (100, 100, 0.0),  # s = S: decayed
        (101, 100, 0.0),  # s > S
        (10_000, 100, 0.0),
        (0, 1, 1.0),  # S = 1: one guided step at full weight
        (1, 1, 0.0),
    ],
)
def test_guided_advantage_weight_hand_values(step, decay_steps, expected):
    assert guided_advantage_weight(step, decay_steps) == pytest.approx(expected, abs=1e-15)


def test_guided_advantage_weight_quarter_value_literal():
    assert guided_advantage_weight(30, 120) == pytest.approx(0.8535533905932737, abs=1e-15)


def test_guided_advantage_weight_is_decreasing_and_in_unit_interval():
    values = [guided_advantage_weight(s, 37) for s in range(40)]
    assert all(0.0 <= v <= 1.0 for v in values)
    assert all(a > b for a, b in itertools.pairwise(values[:37]))
    assert values[37:] == [0.0, 0.0, 0.0]


# --------------------------------------------------------------------------------------------
# mentor: hand-computed groups
# --------------------------------------------------------------------------------------------

# Two groups of 5 (3 unguided + 2 guided), rows interleaved; T = 3, reward on the last valid
# token, padding after it carries a large reward that must not count.
#   row  uid  guided  mask      score
#   0    a    no      1 1 1     1.0
#   1    b    no      1 1 0     0.25
#   2    a    no      1 0 0     0.0
#   3    a    yes     1 1 1     1.0
#   4    b    no      1 1 1     0.25
#   5    a    no      1 1 0     0.5
#   6    b    yes     1 1 1     1.0
#   7    b    no      1 0 0     1.0
#   8    a    yes     1 1 0     0.0
#   9    b    yes     1 1 1     0.75
HAND_UIDS = _uids("a", "b", "a", "a", "b", "a", "b", "b", "a", "b")
HAND_GUIDED = torch.tensor([0, 0, 0, 1, 0, 0, 1, 0, 1, 1], dtype=torch.bool)
HAND_MASK = _t(
    [
        [1, 1, 1],
        [1, 1, 0],
        [1, 0, 0],
        [1, 1, 1],
        [1, 1, 1],
        [1, 1, 0],
        [1, 1, 1],
        [1, 0, 0],
        [1, 1, 0],
        [1, 1, 1],
    ]
)
HAND_REWARDS = _t(
    [
        [0.0, 0.0, 1.0],
        [0.0, 0.25, 9.0],
        [0.0, 9.0, 9.0],
        [0.0, 0.0, 1.0],
        [0.0, 0.0, 0.25],
        [0.0, 0.5, 9.0],
        [0.0, 0.0, 1.0],
        [1.0, 9.0, 9.0],
        [0.0, 0.0, 9.0],
        [0.0, 0.0, 0.75],
    ]
)
# group a, unguided {1, 0, 0.5}: mean 0.5, deviations 0.5, -0.5, 0
#   sq 0.25 + 0.25 + 0 = 0.5, unbiased var 0.5 / 2 = 0.25, std 0.5
#   guided 1.0 -> max(1 - 0.5, 0) = 0.5; guided 0.0 -> max(-0.5, 0) = 0
STD_A = 0.5
# group b, unguided {0.25, 0.25, 1.0}: mean 1.5 / 3 = 0.5, deviations -0.25, -0.25, 0.5
#   sq 0.0625 + 0.0625 + 0.25 = 0.375, unbiased var 0.1875, std sqrt(0.1875) = 0.4330127...
#   guided 1.0 -> 0.5; guided 0.75 -> 0.25
STD_B = math.sqrt(0.1875)


def _expected(per_row: list[float]) -> torch.Tensor:
    return _t(per_row).unsqueeze(-1) * HAND_MASK


def test_mentor_hand_groups_with_std():
    w = 0.5
    out = _mentor(HAND_REWARDS, HAND_MASK, HAND_UIDS, HAND_GUIDED, w)
    expected = _expected(
        [
            0.5 / (STD_A + EPS),  # a unguided 1.0: 0.5 / 0.500001 = 0.999998...
            -0.25 / (STD_B + EPS),  # b unguided 0.25: -0.25 / 0.4330137 = -0.577349...
            -0.5 / (STD_A + EPS),  # a unguided 0.0
            0.5 * w,  # a guided 1.0: max(0.5, 0) * 0.5 = 0.25, no std
            -0.25 / (STD_B + EPS),  # b unguided 0.25
            0.0,  # a unguided 0.5: at the mean
            0.5 * w,  # b guided 1.0: max(0.5, 0) * 0.5 = 0.25
            0.5 / (STD_B + EPS),  # b unguided 1.0: 0.5 / 0.4330137 = 1.154698...
            0.0,  # a guided 0.0: max(-0.5, 0) = 0
            0.25 * w,  # b guided 0.75: max(0.25, 0) * 0.5 = 0.125
        ]
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    assert out[0, 0].item() == pytest.approx(0.999998000004, abs=1e-12)
    assert out[7, 0].item() == pytest.approx(1.1546978, abs=1e-6)
    assert out[9, 2].item() == 0.125


def test_mentor_hand_groups_without_std():
    # Dr. GRPO form: unguided = score - mean_u, guided unchanged (never std-normalised)
    w = guided_advantage_weight(25, 100)  # 0.853553...
    out = _mentor(HAND_REWARDS, HAND_MASK, HAND_UIDS, HAND_GUIDED, w, norm_adv_by_std_in_grpo=False)
    expected = _expected([0.5, -0.25, -0.5, 0.5 * w, -0.25, 0.0, 0.5 * w, 0.5, 0.0, 0.25 * w])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-15)
    assert out[3, 0].item() == pytest.approx(0.42677669529663687, abs=1e-15)  # 0.5 * 0.853553


def test_mentor_ignores_the_estimators_advantages():
    out = mentor_guided_advantage(
        advantages=torch.full_like(HAND_REWARDS, 123.0),
        token_level_rewards=HAND_REWARDS,
        response_mask=HAND_MASK,
        index=HAND_UIDS,
        guided=HAND_GUIDED,
        weight=0.5,
    )
    assert torch.equal(out, _mentor(HAND_REWARDS, HAND_MASK, HAND_UIDS, HAND_GUIDED, 0.5))


def test_mentor_weight_zero_silences_guided_rows_only():
    out = _mentor(HAND_REWARDS, HAND_MASK, HAND_UIDS, HAND_GUIDED, 0.0)
    assert torch.equal(out[HAND_GUIDED], torch.zeros(4, 3, dtype=F64))
    full = _mentor(HAND_REWARDS, HAND_MASK, HAND_UIDS, HAND_GUIDED, 1.0)
    assert torch.equal(out[~HAND_GUIDED], full[~HAND_GUIDED])
    # w = 1: guided rows are the raw positive gaps 0.5, 0, 0.5, 0.25 (rows 3, 8, 6, 9)
    torch.testing.assert_close(full[[3, 8, 6, 9], 0], _t([0.5, 0.0, 0.5, 0.25]), rtol=0, atol=0)


def test_mentor_guided_below_the_unguided_mean_gets_zero_not_negative():
    # one group: unguided {1, 1} (mean 1, std 0), guided {0, 2}
    #   unguided: (1 - 1) / (0 + eps) = 0; guided 0 -> max(-1, 0) = 0; guided 2 -> 1 * 0.7
    rewards, mask = _t([[1.0], [1.0], [0.0], [2.0]]), torch.ones(4, 1, dtype=F64)
    guided = torch.tensor([False, False, True, True])
    out = _mentor(rewards, mask, _uids("g", "g", "g", "g"), guided, 0.7)
    torch.testing.assert_close(out, _t([[0.0], [0.0], [0.0], [0.7]]), rtol=0, atol=0)


def test_mentor_single_unguided_response_has_no_baseline():
    # GRPO's convention on the unguided subset: a lone unguided response has no baseline, so it
    # keeps its raw score; guided ones still compare with the unguided mean (here 0.3).
    #   unguided 0.3 -> 0.3; guided 0.8 -> max(0.8 - 0.3, 0) * 0.5 = 0.25; guided -0.2 -> 0
    rewards = _t([[0.3, 0.0], [0.8, 0.0], [-0.2, 0.0]])
    mask = _t([[1, 0], [1, 1], [1, 1]])
    guided = torch.tensor([False, True, True])
    for norm in (True, False):
        out = _mentor(
            rewards, mask, _uids("c", "c", "c"), guided, 0.5, norm_adv_by_std_in_grpo=norm
        )
        torch.testing.assert_close(
            out, _t([[0.3, 0.0], [0.25, 0.25], [0.0, 0.0]]), rtol=0, atol=1e-15
        )


def test_mentor_accepts_integer_and_list_guided_flags():
    expected = _mentor(HAND_REWARDS, HAND_MASK, HAND_UIDS, HAND_GUIDED, 0.5)
    for flags in (HAND_GUIDED.long(), HAND_GUIDED.tolist(), HAND_GUIDED.float()):
        assert torch.equal(_mentor(HAND_REWARDS, HAND_MASK, HAND_UIDS, flags, 0.5), expected)


def test_mentor_rejects_guided_of_wrong_length():
    with pytest.raises(ValueError, match="9 entries for 10 responses"):
        _mentor(HAND_REWARDS, HAND_MASK, HAND_UIDS, HAND_GUIDED[:9], 0.5)


def test_mentor_rejects_a_group_without_unguided_responses():
    # group "x" is all guided, groups "a" and "y" are fine
    rewards, mask = _t([[1.0], [0.0], [1.0], [0.5], [0.0]]), torch.ones(5, 1, dtype=F64)
    guided = torch.tensor([True, True, False, True, False])
    with pytest.raises(ValueError, match="1 of 3 group"):
        _mentor(rewards, mask, _uids("x", "x", "a", "a", "y"), guided, 0.5)
    # two such groups are both counted
    with pytest.raises(ValueError, match="2 of 2 group"):
        _mentor(rewards, mask, _uids("x", "x", "z", "z", "z"), torch.ones(5, dtype=torch.bool), 1.0)


# --------------------------------------------------------------------------------------------
# mentor: padding, GRPO equivalence, loop reference
# --------------------------------------------------------------------------------------------


def _random_batch(seed: int, dtype=F64, max_group: int = 7, width: int = 6):
    """Groups of varying size (1..max_group) with at least one unguided response each."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, max_group + 1, (6,), generator=gen).tolist()
    uids = [f"u{g}" for g, n in enumerate(sizes) for _ in range(n)]
    guided = []
    for n in sizes:
        flags = (torch.rand(n, generator=gen) < 0.4).tolist()
        flags[int(torch.randint(0, n, (1,), generator=gen))] = False  # keep one unguided
        guided.extend(flags)
    order = torch.randperm(len(uids), generator=gen).tolist()  # interleave the groups
    batch = len(uids)
    lengths = torch.randint(1, width + 1, (batch,), generator=gen)
    mask = (torch.arange(width) < lengths.unsqueeze(-1)).to(dtype)
    rewards = torch.randn(batch, width, generator=gen).to(dtype)
    rewards = torch.where(torch.rand(batch, width, generator=gen) < 0.5, rewards.round(), rewards)
    index = np.array([uids[i] for i in order], dtype=object)
    return rewards, mask, index, torch.tensor([guided[i] for i in order], dtype=torch.bool)


def ref_mentor(rewards, mask, index, guided, weight, eps=EPS, norm=True, cap=None) -> torch.Tensor:
    r, m, flags = rewards.tolist(), mask.tolist(), guided.tolist()
    scores = [sum(a * b for a, b in zip(rr, mm)) for rr, mm in zip(r, m)]
    groups: dict[str, list[int]] = defaultdict(list)
    for i, uid in enumerate(index):
        groups[str(uid)].append(i)
    adv = [[0.0] * len(row) for row in m]
    for members in groups.values():
        plain = [i for i in members if not flags[i]]
        n = len(plain)
        mean = sum(scores[i] for i in plain) / n
        total = sum(max(scores[i] - mean, 0.0) for i in members if flags[i])
        scale = cap / total if cap is not None and total > cap else 1.0
        std = math.sqrt(sum((scores[i] - mean) ** 2 for i in plain) / (n - 1)) if n > 1 else None
        for i in members:
            gap = scores[i] - mean
            if flags[i]:
                value = max(gap, 0.0) * scale * weight
            elif std is None:  # a lone unguided response: no baseline
                value = scores[i]
            elif norm:
                value = gap / (std + eps)
            else:
                value = gap
            adv[i] = [value * mk for mk in m[i]]
    return torch.tensor(adv, dtype=rewards.dtype)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("norm", [True, False])
def test_mentor_matches_loop_reference(seed, norm):
    rewards, mask, index, guided = _random_batch(seed)
    weight = guided_advantage_weight(seed, 10)
    out = _mentor(rewards, mask, index, guided, weight, norm_adv_by_std_in_grpo=norm)
    expected = ref_mentor(rewards, mask, index, guided, weight, norm=norm)
    assert out.shape == rewards.shape
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_mentor_without_guided_responses_is_exactly_grpo(seed, norm, dtype):
    rewards, mask, index, _ = _random_batch(seed, dtype=dtype)
    unguided = torch.zeros(rewards.shape[0], dtype=torch.bool)
    out = _mentor(rewards, mask, index, unguided, 0.9, norm_adv_by_std_in_grpo=norm)
    grpo, _ = compute_grpo_outcome_advantage(
        token_level_rewards=rewards, response_mask=mask, index=index, norm_adv_by_std_in_grpo=norm
    )
    assert out.dtype == dtype
    assert torch.equal(out, grpo)


@pytest.mark.parametrize("seed", range(4))
def test_mentor_padding_is_exactly_zero_and_ignored(seed):
    rewards, mask, index, guided = _random_batch(seed)
    out = _mentor(rewards, mask, index, guided, 0.6)
    assert torch.all(out[mask == 0] == 0)
    assert torch.all(out == out[:, :1] * mask)  # one value per response, broadcast
    noisy = torch.where(mask.bool(), rewards, torch.full_like(rewards, 1e6))
    assert torch.equal(_mentor(noisy, mask, index, guided, 0.6), out)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cap", [0.05, 0.5, 99.0])
def test_mentor_cap_matches_loop_reference(seed, cap):
    rewards, mask, index, guided = _random_batch(seed)
    out = _mentor(rewards, mask, index, guided, 0.7, cap=cap)
    torch.testing.assert_close(out, ref_mentor(rewards, mask, index, guided, 0.7, cap=cap),
                               rtol=0, atol=1e-10)  # fmt: skip


def test_mentor_cap_hand_values():
    """MENTOR's expert_cap: a group's guided advantages summing above the cap are scaled to it,
    then weighted. Group a: unguided scores 0 and 1 (mean 0.5), guided 1 and 1: gaps 0.5 + 0.5 =
    1.0 > cap 0.6, so each becomes 0.5 x 0.6/1.0 = 0.3, x w 0.5 = 0.15. Group b: unguided 0 and 0
    (mean 0), guided 0.25: sum 0.25 <= 0.6, unchanged: 0.25 x 0.5 = 0.125."""
    rewards = _t([[0.0], [1.0], [1.0], [1.0], [0.0], [0.0], [0.25]])
    mask = torch.ones_like(rewards)
    index = _uids("a", "a", "a", "a", "b", "b", "b")
    guided = torch.tensor([False, False, True, True, False, False, True])
    out = _mentor(rewards, mask, index, guided, 0.5, cap=0.6, norm_adv_by_std_in_grpo=False)
    # unguided, Dr. GRPO form: a: 0 - 0.5, 1 - 0.5; b: 0, 0
    expected = _t([[-0.5], [0.5], [0.15], [0.15], [0.0], [0.0], [0.125]])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-15)
    uncapped = _mentor(rewards, mask, index, guided, 0.5, norm_adv_by_std_in_grpo=False)
    assert uncapped[2, 0].item() == 0.25 and uncapped[6, 0].item() == 0.125  # 0.5 x 0.5; cap off
