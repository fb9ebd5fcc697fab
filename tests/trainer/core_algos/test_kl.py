"""KL estimators, KL-in-reward and the sampling/training mismatch diagnostics."""

from __future__ import annotations

import math

import pytest
import torch

from verl.trainer.core_algos.guidance import LOG_PROB_FLOOR
from verl.trainer.core_algos.kl import (
    KL_ESTIMATORS,
    apply_kl_penalty,
    compute_mismatch_metrics,
    kl_penalty,
)
from verl.utils import metric_names as M

D = torch.float64
LN2 = math.log(2)


def logt(values):
    return torch.tensor(values, dtype=D).log()


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("k1", LN2),  # log .5 - log .25 = ln 2 = 0.693147
        ("kl", LN2),
        ("abs", LN2),
        ("k2", 0.5 * LN2**2),  # ½·0.480453 = 0.240227
        ("mse", 0.5 * LN2**2),
        ("k3", 0.5 - math.log(0.5) - 1.0),  # π_ref/π = 0.5: 0.5 + 0.693147 - 1 = 0.193147
        ("low_var_kl", 0.5 - math.log(0.5) - 1.0),
    ],
)
def test_kl_estimators_hand_values(kind, expected):
    value = kl_penalty(logt([[0.5]]), logt([[0.25]]), kind)
    assert value.item() == pytest.approx(expected, abs=1e-12)


def test_k3_is_nonnegative_and_zero_at_equality():
    gen = torch.Generator().manual_seed(0)
    a, b = -torch.rand(50, generator=gen, dtype=D) * 5, -torch.rand(50, generator=gen, dtype=D) * 5
    assert torch.all(kl_penalty(a, b, "k3") >= 0)
    assert torch.all(kl_penalty(a, a, "k3") == 0)


def test_k1_and_k3_are_unbiased_for_kl_by_monte_carlo():
    # π = [0.7, 0.2, 0.1], π_ref = [0.4, 0.4, 0.2]: KL(π‖π_ref) = Σ π log(π/π_ref)
    pi, ref = torch.tensor([0.7, 0.2, 0.1], dtype=D), torch.tensor([0.4, 0.4, 0.2], dtype=D)
    exact = (pi * (pi / ref).log()).sum().item()  # 0.7·ln1.75 + 0.2·ln0.5 + 0.1·ln0.5 = 0.183783
    x = torch.multinomial(pi, 400_000, replacement=True, generator=torch.Generator().manual_seed(1))
    for kind in ("k1", "k3"):
        samples = kl_penalty(pi.log()[x], ref.log()[x], kind)
        # 6 standard errors: fails by chance with probability ~2e-9
        assert abs(samples.mean().item() - exact) < 6 * samples.std().item() / math.sqrt(
            x.numel()
        ), kind


def test_apply_kl_penalty_hand_values():
    scores = torch.tensor([[0.0, 0.0, 1.0]], dtype=D)
    old, ref = logt([[0.5, 0.5, 0.5]]), logt([[0.25, 0.5, 1.0]])
    rewards, metrics = apply_kl_penalty(
        scores, old, ref, torch.ones(1, 3, dtype=D), kl_coef=0.1, kind="k1"
    )
    # k1 = [ln2, 0, -ln2] -> r = s - 0.1·k1 = [-0.0693147, 0, 1.0693147]
    torch.testing.assert_close(rewards, torch.tensor([[-0.1 * LN2, 0.0, 1 + 0.1 * LN2]], dtype=D))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-12)


def test_mismatch_metrics_hand_values():
    # token:     0          1            2          3 (guidance)  4 (pad)
    # μ:        0.5     e^-0.001 (forced) 0.25       0.9           1
    # π_old:    0.25       0.9           0.5        0.1           e^-5
    mu = torch.tensor([[math.log(0.5), -0.001, math.log(0.25), math.log(0.9), 0.0]], dtype=D)
    old = torch.tensor(
        [[math.log(0.25), math.log(0.9), math.log(0.5), math.log(0.1), -5.0]], dtype=D
    )
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=D)
    off = torch.tensor([[0, 0, 0, 1, 0]], dtype=D)
    m = compute_mismatch_metrics(mu, old, mask, off, forced_threshold=-0.01)
    # draft tokens 0,1,2; forced 1 -> ratio 1/3; KL tokens 0, 2 with d = μ - π_old = [ln2, -ln2]
    assert m[M.MISMATCH_FORCED_TOKEN_RATIO] == pytest.approx(1 / 3)
    assert m[M.MISMATCH_KL_V1] == pytest.approx(0.0, abs=1e-12)  # (ln2 - ln2)/2
    assert m[M.MISMATCH_KL_V2] == pytest.approx(0.5 * LN2**2, abs=1e-12)  # ½·mean(ln²2, ln²2)
    # k3 with r = π_old/μ: token 0 r = 0.5 -> 0.5 - 1 + ln2 = 0.193147; token 2 r = 2 -> 2 - 1 - ln2 = 0.306853
    assert m[M.MISMATCH_KL_K3] == pytest.approx(0.25, abs=1e-12)  # mean = (0.193147 + 0.306853)/2
    assert m[M.MISMATCH_EXCLUDED_FRAC] == 0.0


def test_mismatch_metrics_leave_out_floor_and_unknown_tokens():
    # the hand-values batch with three more draft tokens before the padding: one whose sampling
    # log-prob is the floor (reported as 0 probability or not at all), one whose π_old is NaN,
    # one whose μ is -inf; each would add ~1e4, NaN or inf to the KLs
    floor, nan, neg_inf = LOG_PROB_FLOOR, float("nan"), float("-inf")
    mu = torch.tensor([[math.log(0.5), -0.001, math.log(0.25), math.log(0.9), floor,
                        math.log(0.5), neg_inf, 0.0]], dtype=D)  # fmt: skip
    old = torch.tensor([[math.log(0.25), math.log(0.9), math.log(0.5), math.log(0.1),
                         math.log(0.5), nan, math.log(0.5), -5.0]], dtype=D)  # fmt: skip
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]], dtype=D)
    off = torch.tensor([[0, 0, 0, 1, 0, 0, 0, 0]], dtype=D)
    m = compute_mismatch_metrics(mu, old, mask, off, forced_threshold=-0.01)
    # draft tokens 0, 1, 2, 4, 5, 6; known 0, 1, 2 -> excluded 3/6; forced 1 of the 3 known
    assert m[M.MISMATCH_EXCLUDED_FRAC] == pytest.approx(3 / 6, abs=1e-12)
    assert m[M.MISMATCH_FORCED_TOKEN_RATIO] == pytest.approx(1 / 3, abs=1e-12)
    # the KLs are those of test_mismatch_metrics_hand_values (tokens 0 and 2): 0, ½·ln²2, 0.25
    assert m[M.MISMATCH_KL_V1] == pytest.approx(0.0, abs=1e-12)
    assert m[M.MISMATCH_KL_V2] == pytest.approx(0.5 * LN2**2, abs=1e-12)
    assert m[M.MISMATCH_KL_K3] == pytest.approx(0.25, abs=1e-12)


def test_mismatch_without_offpolicy_mask_counts_all_valid_tokens():
    mu = torch.tensor([[math.log(0.5), math.log(0.5)]], dtype=D)
    old = torch.tensor([[math.log(0.25), math.log(0.5)]], dtype=D)
    m = compute_mismatch_metrics(mu, old, torch.ones(1, 2, dtype=D))
    assert m[M.MISMATCH_KL_V1] == pytest.approx(LN2 / 2, abs=1e-12)
    assert m[M.MISMATCH_FORCED_TOKEN_RATIO] == 0.0


def test_unknown_kl_lists_registry():
    with pytest.raises(ValueError, match="valid: " + ", ".join(KL_ESTIMATORS.names())):
        kl_penalty(logt([[0.5]]), logt([[0.5]]), "k9")
