"""Where guidance applies (`core_algos/guide_when.py`): the two-stage selection of
`guide_when: group_fails`, the rows its guided responses replace, and the teacher prefix's
lengths, schedule and λ_t, by hand; `DataProto.replace_rows`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.core_algos.guidance import lam_at_step
from verl.trainer.core_algos.guide_when import (
    GUIDE_WHEN,
    PREFIX_DRAWS,
    guide_group_fails,
    prefix_lam,
    prefix_lengths,
    replaced_rows,
    selection_metrics,
)
from verl.trainer.two_stage import group_success, needs_two_stages
from verl.utils import metric_names as M
from verl.workers.rollout.config import OffPolicyGuidanceConfig


def test_group_fails_hand_values():
    # 3 prompts x n = 4, threshold 0.5:
    #   prompt 0: [0, 0, 0, 0]      all below 0.5 -> guided
    #   prompt 1: [0, 1, 0, 0]      a success     -> not guided
    #   prompt 2: [0.4, 0, 0.1, 0]  partial credit, all below 0.5 -> guided
    scores = torch.tensor([0, 0, 0, 0, 0, 1, 0, 0, 0.4, 0, 0.1, 0])
    guided = guide_group_fails(scores, 4, 0.5)
    assert guided.tolist() == [True, False, True]
    # a threshold at 0.4 counts 0.4 as a success (below means strictly below)
    assert guide_group_fails(scores, 4, 0.4).tolist() == [True, False, False]
    assert GUIDE_WHEN.get("always")(scores, 4, 0.5) is None
    assert set(GUIDE_WHEN.names()) == {"always", "group_fails"}
    with pytest.raises(ValueError, match="whole groups"):
        guide_group_fails(torch.zeros(5), 4, 0.5)


def test_replaced_rows_are_the_first_m_of_each_guided_group():
    # prompts 0 and 2 guided, n = 4, m = 2: rows 0, 1 and 8, 9 in prompt order
    guided = torch.tensor([True, False, True])
    assert replaced_rows(guided, 4, 2).tolist() == [0, 1, 8, 9]
    assert replaced_rows(guided, 4, 4).tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert replaced_rows(torch.tensor([False, False]), 4, 2).tolist() == []
    with pytest.raises(ValueError, match=r"expected 1\.\.n"):
        replaced_rows(guided, 4, 5)


def test_selection_and_success_metrics_hand_values():
    scores = torch.tensor([0, 0, 0, 0, 0, 1, 0, 0, 0.4, 0, 0.1, 0])
    guided = guide_group_fails(scores, 4, 0.5)
    got = selection_metrics(scores, 4, guided)
    assert got[M.GUIDANCE_GUIDED_PROMPT_FRAC] == pytest.approx(2 / 3, abs=1e-7)
    # first-stage mean: (1 + 0.4 + 0.1) / 12 = 0.125
    assert got[M.GUIDANCE_FIRST_STAGE_SCORE] == pytest.approx(0.125, abs=1e-7)
    assert got[M.GUIDANCE_FIRST_STAGE_ANY_SUCCESS] == pytest.approx(1 / 3, abs=1e-7)
    # guided prompts' first-stage mean: (0.4 + 0.1) / 8 = 0.0625
    assert got[M.GUIDANCE_GUIDED_PROMPTS_FIRST_SCORE] == pytest.approx(0.0625, abs=1e-7)
    none = selection_metrics(torch.ones(8), 4, torch.tensor([False, False]))
    assert M.GUIDANCE_GUIDED_PROMPTS_FIRST_SCORE not in none
    # after guidance prompt 0 got a success in its first (guided) row: 2 of 3 groups succeed
    after = scores.clone()
    after[0] = 1.0
    got = group_success(after, 4, 0.5)[M.CRITIC_SCORE_GROUP_ANY_SUCCESS]
    assert got == pytest.approx(2 / 3, abs=1e-7)


def test_prefix_lengths_fixed_uniform_and_unguided():
    seeds = np.array([11, 12, 13, 14])
    guided = np.array([True, True, False, True])
    # j = round(0.25 * 21) = round(5.25) = 5 on guided responses, 0 on the others
    np.testing.assert_array_equal(prefix_lengths(0.25, 21, "fixed", seeds, guided), [5, 5, 0, 5])
    np.testing.assert_array_equal(prefix_lengths(0.0, 21, "uniform", seeds, guided), [0, 0, 0, 0])
    # uniform: the response's own seed decides j (the same seed, the same j), within {0..5}
    a = prefix_lengths(0.25, 21, "uniform", seeds, guided)
    np.testing.assert_array_equal(a, prefix_lengths(0.25, 21, "uniform", seeds, guided))
    assert a[2] == 0 and ((a >= 0) & (a <= 5)).all()
    assert set(PREFIX_DRAWS.names()) == {"fixed", "uniform"}


def test_uniform_prefix_lengths_are_uniform():
    """j ~ U{0, ..., 4} over 20,000 seeds: chi-square against 1/5 each."""
    from scipy.stats import chisquare

    draws = PREFIX_DRAWS.get("uniform")(4, np.arange(20_000))
    counts = np.bincount(draws, minlength=5)
    assert len(counts) == 5
    assert chisquare(counts).pvalue > 1e-3


def test_prefix_lam_and_schedule_hand_values():
    # positions 0..3 of a response with j = 2, after λ_t = 0.3: [1, 1, 0.3, 0.3]
    np.testing.assert_array_equal(
        prefix_lam(np.full(4, 0.3), np.arange(4), np.full(4, 2)), [1.0, 1.0, 0.3, 0.3]
    )
    # the prefix fraction shortens linearly 0.5 -> 0.1 over S = 4 steps (the λ span):
    #   step 1: 0.5, step 3: 0.5 + (0.1 - 0.5)·2/4 = 0.3, step 5 and later: 0.1
    fractions = [lam_at_step(s, 10, 0.5, 0.1, "linear", 4) for s in (1, 3, 5, 9)]
    np.testing.assert_allclose(fractions, [0.5, 0.3, 0.1, 0.1], rtol=0, atol=1e-12)


def test_two_stages_only_when_selective_and_guiding():
    g = OffPolicyGuidanceConfig(enable=True, model_path="x", guide_when="group_fails")
    assert needs_two_stages(g, 0.5, 0.0)
    assert needs_two_stages(g, 0.0, 0.2)  # a prefix alone guides
    assert not needs_two_stages(g, 0.0, 0.0)  # nothing to guide with: one draft-only stage
    g.mode = "mix"
    assert needs_two_stages(g, 0.0, 0.0)  # mix's guided samples need no λ
    assert not needs_two_stages(OffPolicyGuidanceConfig(enable=True, model_path="x"), 0.5, 0.0)


def test_replace_rows_overwrites_in_order_and_checks_keys():
    base = DataProto.from_dict({"x": torch.zeros(6, 2), "k": torch.zeros(6, dtype=torch.long)},
                               non_tensors={"uid": np.array(list("aabbcc"), dtype=object)})  # fmt: skip
    new = DataProto.from_dict({"x": torch.ones(2, 2) * torch.tensor([[1.0], [2.0]]),
                               "k": torch.tensor([7, 8])},
                              non_tensors={"uid": np.array(["c", "c"], dtype=object)})  # fmt: skip
    base.replace_rows([4, 5], new)
    assert base.batch["x"][:, 0].tolist() == [0, 0, 0, 0, 1, 2]
    assert base.batch["k"].tolist() == [0, 0, 0, 0, 7, 8]
    assert base.non_tensor_batch["uid"].tolist() == list("aabbcc")
    with pytest.raises(KeyError, match="keys differ"):
        base.replace_rows([0], DataProto.from_dict({"x": torch.zeros(1, 2)}, non_tensors={"uid": np.array(["a"], dtype=object)}))  # fmt: skip
    with pytest.raises(ValueError, match="2 given"):
        base.replace_rows([0], new)
