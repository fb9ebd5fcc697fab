"""Rollout replicas: a step's prompts split by whole groups over several draft engines give the
same sequences as one engine (per-sequence seeds), and the replicas' meta_info merges exactly."""

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


@pytest.mark.e2e
def test_two_ray_replicas_give_the_tokens_of_one(tmp_path, rollout_gpus):
    """`RolloutGroup` with 2 draft replicas sharing 1 guidance service against one engine (its
    first replica given the whole batch, as a group of one replica gives it): identical tokens and
    masks, log-probs equal to float rounding, in speculative mode and with the draft alone
    (guidance off for the call, as validation). Sharing is the layout where the service has to
    keep two replicas' sessions apart; a replica with a service of its own runs the same replica
    code (the two-node runs of tests/trainer/test_two_nodes.py train with 2 + 2). Mix mode's split
    is checked on one engine in test_vllm_rollout.py (the same per-replica code)."""
    import dataclasses

    import ray
    from test_vllm_rollout import (
        PROMPTS,
        VOCAB,
        assert_same_sequences,
        prompt_batch,
        rollout_config,
    )
    from transformers import AutoTokenizer

    from verl.tasks.tiny_lm import TinyLMSpec, save_tiny_lm
    from verl.workers.rollout.worker import RolloutGroup

    draft = save_tiny_lm(
        str(tmp_path / "d"),
        TinyLMSpec(hidden_size=64, num_hidden_layers=1, vocab_size=VOCAB, seed=1),
    )
    guide = save_tiny_lm(str(tmp_path / "g"), TinyLMSpec(hidden_size=128, num_hidden_layers=1, vocab_size=VOCAB, seed=2))  # fmt: skip
    tok = AutoTokenizer.from_pretrained(draft)
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, include_dashboard=False)
    outs = {}
    try:
        config = rollout_config(guide)
        config.offpolicy_guidance = dataclasses.replace(config.offpolicy_guidance, num_replicas=1)
        group = RolloutGroup(2, draft, config, **rollout_gpus(2, 1))
        assert len(group.services) == 1
        try:
            for mode, meta in (("spec", {"lam": 0.5}), ("off", {"guidance": False})):
                batch = prompt_batch(tok, PROMPTS, n=3, temperature=1.0, global_step=1, **meta)
                outs[2, 1, mode] = group.generate_sequences(batch)
                one = ray.get(group.replicas[0].generate_sequences.remote(batch))
                one.meta_info = merge_rollout_meta([one.meta_info])
                outs[1, 1, mode] = one
        finally:
            group.shutdown()
    finally:
        if started:
            ray.shutdown()
    for mode in ("spec", "off"):
        assert_same_sequences(outs[1, 1, mode], outs[2, 1, mode])
    one, shared = outs[1, 1, "spec"], outs[2, 1, "spec"]
    a, b = one.meta_info, shared.meta_info  # counts summed over the replicas
    assert a["emitted_tokens"] == b["emitted_tokens"] == int(one.batch["response_mask"].sum())
    assert a["accepted_tokens"] == b["accepted_tokens"] and a["accept_rate"] == b["accept_rate"]
    assert one.batch["offpolicy_mask"].any()
