"""Behavior log-probs of guided rollouts, λ schedules and guidance metrics."""

from __future__ import annotations

import math

import pytest
import torch

from verl.trainer.core_algos.guidance import (
    BEHAVIORS,
    GUIDANCE_MODES,
    LAM_SCHEDULES,
    LOG_PROB_FLOOR,
    compute_behavior_log_probs,
    compute_guidance_metrics,
    guidance_tensors,
    known_log_probs,
    lam_at_step,
    mixture_log_probs,
)
from verl.utils import metric_names as M

D = torch.float64


def logt(values):
    return torch.tensor(values, dtype=D).log()


def test_exact_mixture_hand_values():
    # p = [0.2, 0.0, 0.5], q = [0.6, 0.6, 0.1]
    p, q, off = logt([[0.2, 0.0, 0.5]]), logt([[0.6, 0.6, 0.1]]), torch.tensor([[0, 1, 0]])
    # λ = 0.5: q_λ = 0.5·p + 0.5·q = [0.4, 0.3, 0.3]
    torch.testing.assert_close(
        mixture_log_probs(p, q, off, 0.5), logt([[0.4, 0.3, 0.3]]), rtol=0, atol=1e-12
    )
    # λ = 0.25: [0.75·0.2 + 0.25·0.6, 0.25·0.6, 0.75·0.5 + 0.25·0.1] = [0.3, 0.15, 0.4]
    torch.testing.assert_close(
        mixture_log_probs(p, q, off, 0.25), logt([[0.3, 0.15, 0.4]]), rtol=0, atol=1e-12
    )
    # λ = 0 is the draft, λ = 1 the guidance, exactly (including p = 0 -> -inf)
    assert torch.equal(mixture_log_probs(p, q, off, 0.0), p)
    assert torch.equal(mixture_log_probs(p, q, off, 1.0), q)


def test_exact_mixture_matches_probability_space_random():
    gen = torch.Generator().manual_seed(0)
    p, q = torch.rand(5, 7, generator=gen, dtype=D), torch.rand(5, 7, generator=gen, dtype=D)
    for lam in (0.1, 0.5, 0.9):
        expected = ((1 - lam) * p + lam * q).log()
        torch.testing.assert_close(
            mixture_log_probs(p.log(), q.log(), p > 0, lam), expected, rtol=0, atol=1e-12
        )


def test_provenance_and_modes():
    p, q, off = logt([[0.2, 0.4]]), logt([[0.6, 0.8]]), torch.tensor([[0, 1]])
    prov = compute_behavior_log_probs(p, q, off, 0.5, mode="speculative", behavior="provenance")
    torch.testing.assert_close(prov, logt([[0.2, 0.8]]))
    exact = compute_behavior_log_probs(p, q, off, 0.5, mode="speculative", behavior="exact")
    torch.testing.assert_close(exact, logt([[0.4, 0.6]]))
    # mix mode: each response is wholly from one engine, μ is that engine's log-prob
    mix = compute_behavior_log_probs(p, q, off, 0.5, mode="mix", behavior="exact")
    torch.testing.assert_close(mix, logt([[0.2, 0.8]]))
    assert GUIDANCE_MODES.names() == ["mix", "speculative"]
    assert BEHAVIORS.names() == ["exact", "provenance"]


def test_lam_out_of_range_raises():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        mixture_log_probs(logt([[0.5]]), logt([[0.5]]), torch.tensor([[0]]), 1.2)


# λ from 0.8 to 0.2. Steps are 1-based (the first training step is 1): progress = (s - 1)/S,
# clipped to [0, 1], S = lam_schedule_steps or, unset, the run's steps - 1.
@pytest.mark.parametrize(
    ("schedule", "step", "total", "span", "expected"),
    [
        ("constant", 1, 100, 10, 0.8),
        ("constant", 40, 100, None, 0.8),
        # S = 10 set (a 100-step run): first step, a middle one, the schedule's last, past it
        ("linear", 1, 100, 10, 0.8),  # progress 0
        ("linear", 3, 100, 10, 0.68),  # 0.8 - 0.6·2/10
        ("linear", 6, 100, 10, 0.5),  # 0.8 - 0.6·5/10
        ("linear", 11, 100, 10, 0.2),  # progress 10/10: the schedule's end
        ("linear", 30, 100, 10, 0.2),  # held after it
        ("cosine", 1, 100, 10, 0.8),
        ("cosine", 3, 100, 10, 0.2 + 0.3 * (1 + math.cos(0.2 * math.pi))),  # 0.742705
        ("cosine", 6, 100, 10, 0.5),  # 0.2 + 0.6·(1 + cos(π/2))/2
        ("cosine", 11, 100, 10, 0.2),
        ("cosine", 30, 100, 10, 0.2),
        # unset: a 5-step run has S = 4, so step 5 (the run's last) uses lam_end
        ("linear", 1, 5, None, 0.8),
        ("linear", 3, 5, None, 0.5),  # progress 2/4
        ("linear", 5, 5, None, 0.2),
        ("linear", 6, 5, None, 0.2),
        ("cosine", 1, 5, None, 0.8),
        ("cosine", 2, 5, None, 0.2 + 0.3 * (1 + math.sqrt(0.5))),  # progress 1/4: 0.712132
        ("cosine", 3, 5, None, 0.5),
        ("cosine", 5, 5, None, 0.2),
        ("linear", 1, 1, None, 0.8),  # a 1-step run: S = max(0, 1) = 1, its only step uses lam
    ],
)
def test_lam_schedules(schedule, step, total, span, expected):
    assert lam_at_step(step, total, 0.8, 0.2, schedule, span) == pytest.approx(expected, abs=1e-12)


def test_lam_schedule_names():
    assert LAM_SCHEDULES.names() == ["constant", "cosine", "linear"]


def test_guidance_metrics_hand_values():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=D)
    off = torch.tensor([[0, 1, 0, 1], [0, 0, 0, 1]], dtype=D)  # the 1s in padding must not count
    draft = torch.full((2, 4), math.log(0.5), dtype=D)
    beh = draft + torch.tensor([[0.1, 0.3, 0.2, 5.0], [0.0, 0.4, 9.0, 9.0]], dtype=D)
    missing = torch.tensor([[0, 1, 0, 1], [0, 0, 1, 1]], dtype=D)
    m = compute_guidance_metrics(off, mask, beh, draft, missing, lam=0.3)
    assert m[M.GUIDANCE_OFFPOLICY_TOKEN_RATIO] == pytest.approx(1 / 5)  # 1 guidance of 5 valid
    assert m[M.GUIDANCE_OFFPOLICY_SEQ_RATIO] == pytest.approx(1 / 2)
    assert m[M.GUIDANCE_BEHAVIOR_KL] == pytest.approx((0.1 + 0.3 + 0.2 + 0.0 + 0.4) / 5, abs=1e-12)
    assert m[M.GUIDANCE_BEHAVIOR_KL_EXCLUDED_FRAC] == 0.0
    assert m[M.GUIDANCE_MISSING_LOGPROB_RATIO] == pytest.approx(1 / 5)
    assert m[M.GUIDANCE_LAMBDA] == 0.3


def test_guidance_metrics_leave_out_behavior_kl_without_draft_log_probs():
    mask, off = torch.ones(1, 2, dtype=D), torch.tensor([[0.0, 1.0]], dtype=D)
    m = compute_guidance_metrics(off, mask, logt([[0.5, 0.5]]), None, torch.zeros(1, 2), lam=0.5)
    assert M.GUIDANCE_BEHAVIOR_KL not in m and m[M.GUIDANCE_MISSING_LOGPROB_RATIO] == 0.0
    assert M.GUIDANCE_BEHAVIOR_KL_EXCLUDED_FRAC not in m


def test_known_log_probs():
    a = torch.tensor([[-0.5, LOG_PROB_FLOOR, -1e4 + 1.0, NAN, NEG_INF, 0.0]], dtype=D)
    b = torch.tensor([[-0.1, -0.1, -0.1, -0.1, -0.1, float("inf")]], dtype=D)
    # finite and strictly above the floor in every input
    assert known_log_probs(a).tolist() == [[True, False, True, False, False, True]]
    assert known_log_probs(a, b).tolist() == [[True, False, True, False, False, False]]


def test_behavior_kl_leaves_out_floor_and_unknown_tokens():
    # valid tokens: 0, 1 known; 2 a guidance token outside the draft's top-k (log p = floor);
    # 3 a draft log-prob nobody reported (NaN); 4 μ not known (-inf); 5 padding (floor there too)
    mu = torch.tensor([[math.log(0.4), math.log(0.3), math.log(0.15), math.log(0.5), NEG_INF,
                        LOG_PROB_FLOOR]], dtype=D)  # fmt: skip
    draft = torch.tensor([[math.log(0.2), math.log(0.2), LOG_PROB_FLOOR, NAN, math.log(0.5),
                           LOG_PROB_FLOOR]], dtype=D)  # fmt: skip
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=D)
    off = torch.tensor([[0, 0, 1, 0, 0, 0]], dtype=D)
    m = compute_guidance_metrics(off, mask, mu, draft, None, lam=0.5)
    # known tokens 0, 1: (ln(0.4/0.2) + ln(0.3/0.2))/2 = (ln 2 + ln 1.5)/2 = ln(3)/2 = 0.5493061
    # (averaging token 2 too gave (ln 2 + ln 1.5 + ln 0.15 + 1e4)/3 = 3333.3, the 678 kind)
    assert m[M.GUIDANCE_BEHAVIOR_KL] == pytest.approx(math.log(3.0) / 2, abs=1e-12)
    assert m[M.GUIDANCE_BEHAVIOR_KL_EXCLUDED_FRAC] == pytest.approx(3 / 5, abs=1e-12)  # 2, 3, 4
    # the same two known tokens alone give the same value: the floor token does not move it
    alone = compute_guidance_metrics(off[:, :2], mask[:, :2], mu[:, :2], draft[:, :2], lam=0.5)
    assert alone[M.GUIDANCE_BEHAVIOR_KL] == m[M.GUIDANCE_BEHAVIOR_KL]
    assert alone[M.GUIDANCE_BEHAVIOR_KL_EXCLUDED_FRAC] == 0.0


NAN, NEG_INF = float("nan"), float("-inf")
# five tokens: draft x with q = 0.5; draft x that the guidance's top-k cut (q exactly 0); draft x
# whose q was not reported (NaN); a guidance token outside the draft's list (p counts as 0);
# padding (whatever it holds)
P = logt([[0.25, 0.4, 0.1, 0.0, 0.3]])
Q = torch.tensor([[math.log(0.5), NEG_INF, NAN, math.log(0.3), NAN]], dtype=D)
OFF = torch.tensor([[False, False, False, True, True]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]], dtype=D)


@pytest.mark.parametrize(
    ("lam", "mode", "behavior", "expected_mu"),
    [
        # μ = 0.5·p + 0.5·q: 0.5·0.25 + 0.5·0.5 = 0.375; 0.5·0.4 + 0 = 0.2 (not 0.4: q is an exact
        # zero, not the draft's value); 0.5·0.1 = 0.05 (missing q counts as 0); 0 + 0.5·0.3 = 0.15
        (0.5, "speculative", "exact", [0.375, 0.2, 0.05, 0.15]),
        # λ = 1: μ = q: 0.5, 0 (floor), 0 (floor), 0.3
        (1.0, "speculative", "exact", [0.5, 0.0, 0.0, 0.3]),
        # provenance and mix: μ = p on draft tokens, q on guidance tokens
        (0.5, "speculative", "provenance", [0.25, 0.4, 0.1, 0.3]),
        (0.5, "mix", "exact", [0.25, 0.4, 0.1, 0.3]),
    ],
)
def test_guidance_tensors_hand_values(lam, mode, behavior, expected_mu):
    out = guidance_tensors(P, Q, OFF, MASK, lam, mode, behavior)
    expected = torch.tensor([[*expected_mu, 1.0]], dtype=D).log().clamp(min=LOG_PROB_FLOOR) * MASK
    torch.testing.assert_close(out["behavior_log_probs"], expected, rtol=0, atol=1e-12)
    # q: the real value, the floor for an exact zero and for a missing value, 0 on padding; only
    # the NaN is missing, and padding never is
    guide = [[math.log(0.5), LOG_PROB_FLOOR, LOG_PROB_FLOOR, math.log(0.3), 0.0]]
    torch.testing.assert_close(
        out["guidance_log_probs"], torch.tensor(guide, dtype=D), rtol=0, atol=1e-12
    )
    assert out["guidance_missing_mask"].tolist() == [[False, False, True, False, False]]
    assert out["offpolicy_mask"].tolist() == [[False, False, False, True, False]]
    assert all(torch.isfinite(v.double()).all() for v in out.values())


def test_topk_targets_hand_values():
    """λ' of each top-K target: renormalize keeps λ; draft_tail scales it by Q_S.
    λ = [0.5, 1.0], Q_S = [0.9, 0.25]: draft_tail λ' = [0.45, 0.25]. At state 0 of a chain with
    p = [0.6, 0.3, 0.1], q = [0.1, 0.2, 0.7], S = {2, 1} (Q_S = 0.9), λ = 0.5:
    (1-λ')p + λ'q̃ = 0.55·[0.6, 0.3, 0.1] + 0.45·[0, 2/9, 7/9] = [0.33, 0.265, 0.405]
    = (1 - λQ_S)p + λq·1_S = 0.55·p + 0.5·[0, 0.2, 0.7]."""
    import numpy as np

    from verl.trainer.core_algos.guidance import TOPK_TARGETS

    lam, mass = np.array([0.5, 1.0]), np.array([0.9, 0.25])
    np.testing.assert_array_equal(TOPK_TARGETS.get("renormalize")(lam, mass), lam)
    np.testing.assert_allclose(
        TOPK_TARGETS.get("draft_tail")(lam, mass), [0.45, 0.25], rtol=0, atol=1e-15
    )
    p, q_t = np.array([0.6, 0.3, 0.1]), np.array([0.0, 2 / 9, 7 / 9])
    lam_eff = TOPK_TARGETS.get("draft_tail")(np.array([0.5]), np.array([0.9]))[0]
    np.testing.assert_allclose(
        (1 - lam_eff) * p + lam_eff * q_t, [0.33, 0.265, 0.405], rtol=0, atol=1e-12
    )
    assert set(TOPK_TARGETS.names()) == {"renormalize", "draft_tail"}
