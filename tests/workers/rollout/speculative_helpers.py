"""Helpers shared by the speculative-sampling tests (not a test module)."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare

from verl.workers.rollout.speculative import ListedRows

D = torch.float64
P1 = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05], dtype=D)
"""A draft's next-token distribution over V = 5, for single-position tests."""
Q1 = torch.tensor([0.05, 0.1, 0.2, 0.25, 0.4], dtype=D)
"""A guidance's, far from P1 (TV 0.55)."""


def chi2_counts_pvalue(counts: torch.Tensor, probs: torch.Tensor, pool_below: float = 0.0) -> float:
    """Chi-square p-value of token `counts` against `probs` (cells of probability 0 left out and
    required empty; cells expected fewer than `pool_below` times pooled into one)."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token with zero probability was emitted"
    counts, expected = counts[keep].double(), probs[keep].double() * counts.sum()
    rare = expected < pool_below
    if rare.any():
        counts = torch.cat([counts[~rare], counts[rare].sum()[None]])
        expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
    return chisquare(
        counts.numpy(), expected.numpy() * counts.sum().item() / expected.sum().item()
    ).pvalue


def listed_rows(ids: list[list[int]], probs: list[list[float]]) -> ListedRows:
    """ListedRows from hand-written ids and probabilities."""
    with np.errstate(divide="ignore"):  # a probability 0 is listed as -inf
        return ListedRows(np.array(ids), np.log(np.array(probs)))


class RecordingProbe:
    """A draft probe answering from hand tables {(row, position): {token: p}}, recording calls."""

    def __init__(self, tables: dict):
        self.tables, self.calls = tables, []

    def __call__(self, rows, positions, tokens):
        self.calls.append((rows.tolist(), positions.tolist(), tokens.tolist()))
        table = [
            self.tables[(r, n)] for r, n in zip(rows.tolist(), positions.tolist(), strict=True)
        ]
        return np.log([[t[int(tok)] for tok in row] for t, row in zip(table, tokens, strict=True)])
