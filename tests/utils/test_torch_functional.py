"""Masked reductions: padding never contributes."""

from __future__ import annotations

import math

import pytest
import torch

from verl.utils.torch_functional import (
    masked_mean,
    masked_stats,
    masked_sum,
    masked_var,
    masked_whiten,
    selected_mean,
)

D = torch.float64
X = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]], dtype=D)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=D)


def test_masked_sum_and_mean():
    assert masked_sum(X, MASK).item() == 6.0  # 1 + 2 + 3
    assert masked_mean(X, MASK).item() == 2.0  # 6 / 3
    torch.testing.assert_close(masked_mean(X, MASK, dim=-1), torch.tensor([1.5, 3.0], dtype=D))
    assert masked_mean(X, torch.zeros_like(MASK)).item() == 0.0  # empty mask: 0, not NaN


def test_masked_var_and_whiten():
    # values 1, 2, 3: mean 2, unbiased var ((1)+(0)+(1))/2 = 1, biased 2/3
    assert masked_var(X, MASK).item() == pytest.approx(1.0)
    assert masked_var(X, MASK, unbiased=False).item() == pytest.approx(2 / 3)
    white = masked_whiten(X, MASK, eps=0.0)
    torch.testing.assert_close(white, torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=D))


def test_masked_stats():
    s = masked_stats(X, MASK)
    assert s == pytest.approx({"mean": 2.0, "std": 1.0, "min": 1.0, "max": 3.0})
    assert masked_stats(X, torch.zeros_like(MASK)) == {
        "mean": 0.0,
        "std": 0.0,
        "min": 0.0,
        "max": 0.0,
    }
    assert not math.isnan(
        masked_stats(X[:, :1], MASK[:, :1] * torch.tensor([[1.0], [0.0]], dtype=D))["std"]
    )


def test_selected_mean_never_reads_left_out_entries():
    values = torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("-inf"), -1e4]], dtype=D)
    keep = torch.tensor([[True, True, False], [True, False, False]])
    assert selected_mean(values, keep).item() == 2.0  # (1 + 2 + 3)/3
    # masked_mean multiplies by the mask: NaN·0 = NaN leaks in
    assert math.isnan(masked_mean(values, keep.to(D)).item())
    assert selected_mean(values, torch.zeros_like(keep)).item() == 0.0  # empty: 0, not NaN
