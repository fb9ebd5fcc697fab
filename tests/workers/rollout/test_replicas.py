"""Rollout replicas: a step's prompts split by whole groups over several draft engines give the
same sequences as one engine (per-sequence seeds), and the replicas' meta_info merges exactly.
The same tokens from 2 Ray replicas sharing a guidance service as from one engine, on the real
engines, is tests/workers/rollout/test_vision_rollout.py's replica test (prompts with images)."""

from __future__ import annotations

import numpy as np
import pytest

from verl.workers.rollout.vllm_rollout_spmd import sequence_seeds
from verl.workers.rollout.worker import merge_rollout_meta, replica_rows


def test_replica_rows_split_whole_prompts_evenly():
    assert replica_rows(5, 2) == [(0, 3), (3, 5)]  # sizes 3 and 2, larger first
    assert replica_rows(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert replica_rows(1, 3) == [(0, 1), (1, 1), (1, 1)]  # idle replicas get empty ranges


def test_sequence_seeds_depend_on_the_row_in_the_whole_batch_only():
    whole = sequence_seeds(step_seed=11, first_row=0, rows=5, n=3)
    assert whole.shape == (15, 2) and len({tuple(r) for r in whole}) == 15
    parts = [sequence_seeds(11, a, b - a, 3) for a, b in replica_rows(5, 2)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    assert not np.array_equal(sequence_seeds(12, 0, 5, 3), whole)  # another step, other seeds
    assert sequence_seeds(11, 0, 0, 3).shape == (0, 2)


def test_merged_meta_sums_counts_and_recomputes_rates_by_hand():
    a = {"lam": 0.5, "emitted_tokens": 30, "guidance_tokens_computed": 60, "guidance_tokens_submitted": 90,
         "accept_rate": 0.8, "rounds": 4, "proposed_tokens": 40, "accepted_tokens": 32, "bonus_tokens": 5,
         "guidance_tokens_per_emitted": 2.0, "topk_tail_mass": 0.1, "topk_rows": 40}  # fmt: skip
    b = {"lam": 0.5, "emitted_tokens": 10, "guidance_tokens_computed": 40, "guidance_tokens_submitted": 50,
         "accept_rate": 0.4, "rounds": 6, "proposed_tokens": 20, "accepted_tokens": 8, "bonus_tokens": 1,
         "guidance_tokens_per_emitted": 4.0, "topk_tail_mass": 0.4, "topk_rows": 20}  # fmt: skip
    m = merge_rollout_meta([a, b])
    assert m["lam"] == 0.5 and m["emitted_tokens"] == 40 and m["rounds"] == 10
    assert m["accept_rate"] == pytest.approx(40 / 60)  # (32 + 8) / (40 + 20), not (0.8 + 0.4) / 2
    assert m["guidance_tokens_per_emitted"] == pytest.approx(100 / 40)  # (60 + 40) / (30 + 10)
    assert m["topk_tail_mass"] == pytest.approx((0.1 * 40 + 0.4 * 20) / 60)  # = 0.2
    plain = merge_rollout_meta(
        [{"lam": 0.0, "emitted_tokens": 3}, {"lam": 0.0, "emitted_tokens": 4}]
    )
    assert plain == {"lam": 0.0, "emitted_tokens": 7}
