"""The rollout's packing of generated sequences into padded tensors (`packing._padded_rows`): the
vectorized scatter against a plain loop over rows, on random sequences of every kind."""

from __future__ import annotations

import math
import random

import pytest
import torch

from verl.trainer.core_algos.guidance import LOG_PROB_FLOOR
from verl.workers.rollout.packing import _padded_rows, padded
from verl.workers.rollout.speculative import GuidedSequence


def loop_rows(prompts, seqs, p_len, r_len, pad, lam) -> dict[str, torch.Tensor]:
    """The same tensors filled row by row."""
    b = len(seqs)
    rows = {
        "prompts": torch.full((b, p_len), pad, dtype=torch.long),
        "prompt_mask": torch.zeros(b, p_len, dtype=torch.long),
        "responses": torch.full((b, r_len), pad, dtype=torch.long),
        "response_mask": torch.zeros(b, r_len, dtype=torch.long),
        "draft_lp": torch.zeros(b, r_len),
        "guide_lp": torch.zeros(b, r_len),
        "target_lp": torch.zeros(b, r_len),
        "lam_t": torch.full((b, r_len), lam, dtype=torch.float64),
        "strength_t": torch.full((b, r_len), lam, dtype=torch.float64),
        "entropy": torch.full((b, r_len), float("nan")),
        "off": torch.zeros(b, r_len, dtype=torch.bool),
    }
    for i, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
        n = len(s.tokens)
        if p:
            rows["prompts"][i, p_len - len(p) :] = torch.tensor(p)
            rows["prompt_mask"][i, p_len - len(p) :] = 1
        if n:
            rows["responses"][i, :n] = torch.tensor(s.tokens)
            rows["response_mask"][i, :n] = 1
            rows["draft_lp"][i, :n] = torch.tensor(s.draft_log_probs).clamp(min=LOG_PROB_FLOOR)
            rows["guide_lp"][i, :n] = torch.tensor(s.guidance_log_probs)
            rows["target_lp"][i, :n] = torch.tensor(s.target_log_probs or s.guidance_log_probs)
            rows["off"][i, :n] = torch.tensor(s.offpolicy)
        if s.lam:
            rows["lam_t"][i, :n] = torch.tensor(s.lam, dtype=torch.float64)
            rows["strength_t"][i, :n] = torch.tensor(s.strength, dtype=torch.float64)
            rows["entropy"][i, :n] = torch.tensor(s.draft_entropy)
    return rows


def random_sequence(rng: random.Random, r_len: int) -> GuidedSequence:
    """Empty to full length; log q with -inf and NaN; speculative lists present or not."""
    n = rng.choice([0, 1, r_len, rng.randint(0, r_len)])
    special = [-math.inf, math.nan, -2e5]  # q = 0, not reported, below the floor
    speculative = rng.random() < 0.6
    return GuidedSequence(
        tokens=[rng.randint(0, 99) for _ in range(n)],
        offpolicy=[rng.random() < 0.3 for _ in range(n)],
        draft_log_probs=[rng.choice([-rng.random() * 5, -2e5]) for _ in range(n)],
        guidance_log_probs=[rng.choice([-rng.random() * 5, *special]) for _ in range(n)],
        target_log_probs=[-rng.random() * 5 for _ in range(n)] if speculative else [],
        lam=[rng.random() for _ in range(n)] if speculative and n else [],
        strength=[rng.random() for _ in range(n)] if speculative and n else [],
        draft_entropy=[rng.random() * 3 for _ in range(n)] if speculative else [],
    )


@pytest.mark.parametrize("seed", range(5))
def test_padded_rows_equal_a_loop_over_rows(seed):
    rng = random.Random(seed)
    p_len, r_len, b = 7, 9, 23
    prompts = [[rng.randint(0, 99) for _ in range(rng.randint(0, p_len))] for _ in range(b)]
    seqs = [random_sequence(rng, r_len) for _ in range(b)]
    got, want = (
        _padded_rows(prompts, seqs, p_len, r_len, 3, 0.25),
        loop_rows(prompts, seqs, p_len, r_len, 3, 0.25),
    )
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, equal_nan=True, msg=key)


def test_padded_by_hand():
    # rows [5, 6] and [7] in width 3: left-aligned, or right-aligned with left=True; no rows
    assert padded([[5, 6], [7]], 3, 0, "int64").tolist() == [[5, 6, 0], [7, 0, 0]]
    assert padded([[5, 6], [7]], 3, 0, "int64", left=True).tolist() == [[0, 5, 6], [0, 0, 7]]
    assert padded([[], []], 2, 9, "int64").tolist() == [[9, 9], [9, 9]]
    assert padded([], 2, 9, "int64").shape == (0, 2)
