"""Streamed weight sync: the FSDP actor's weights reach every rollout replica in buckets, never
as one object, and each replica's log-probs then equal the updated HF model's."""

from __future__ import annotations

import itertools

import pytest
import ray
import torch
from test_fsdp_workers import _update_data, start_group

from verl.protocol import DataProto
from verl.tasks.tiny_lm import TinyLMSpec, save_tiny_lm
from verl.workers.rollout.config import RolloutConfig
from verl.workers.rollout.worker import PeakMemory, RolloutGroup

pytestmark = pytest.mark.e2e
BUCKET_MB = 8
MiB = 2**20


def test_bucket_plan_covers_the_state_dict_in_order_within_the_size(tmp_path):
    from transformers import AutoModelForCausalLM

    from verl.utils.fsdp_utils import bucket_plan

    path = save_tiny_lm(str(tmp_path / "m"), TinyLMSpec(hidden_size=128, num_hidden_layers=2))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sizes = {k: v.numel() * 4 for k, v in model.state_dict().items()}
    limit = max(sizes.values())  # the largest tensor fills a bucket alone
    plan = bucket_plan(model, limit)
    assert [n for bucket in plan for n in bucket] == list(sizes)  # every name once, in order
    assert all(sum(sizes[n] for n in b) <= limit for b in plan)
    # greedy: a bucket closes only when the next tensor would not fit
    assert all(sum(sizes[n] for n in a) + sizes[b[0]] > limit for a, b in itertools.pairwise(plan))
    assert bucket_plan(model, 1) == [[n] for n in sizes]  # tiny buckets: one tensor each


def test_streamed_sync_reaches_both_replicas_with_two_buckets_of_memory(tmp_path, rollout_gpus):
    """An 83 MiB model in 8 MiB buckets from 2 FSDP ranks to 2 replicas, synced twice: the driver
    and each replica hold at most about two buckets more than before a sync (a replica maps each
    bucket from the object store and copies it only into its engine's weights), and both
    replicas' sampled log-probs equal the updated model's (HF forward, 1e-4)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = save_tiny_lm(str(tmp_path / "m"), TinyLMSpec(hidden_size=512, num_hidden_layers=10,
                                                         intermediate_size=1024, vocab_size=100, seed=5))  # fmt: skip
    tok = AutoTokenizer.from_pretrained(path)
    config = RolloutConfig(n=2, temperature=1.0, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.02,
                           prompt_length=16, response_length=6, seed=0)  # fmt: skip
    # A fixed mmap threshold makes glibc hand every freed tensor of 1 MiB or more back at once, so
    # that a worker's resident memory measures what it holds (with the default, adaptive threshold
    # freed buckets linger in the heap and the peak depends on allocation history).
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
             runtime_env={"env_vars": {"MALLOC_MMAP_THRESHOLD_": str(MiB)}})  # fmt: skip
    actor = rollout = None
    try:
        actor = start_group(path, 2)  # lr 1e-3
        actor.execute_dp("update_actor", _update_data(actor, seed=3))
        rollout = RolloutGroup(2, path, config, **rollout_gpus(2))
        plan = actor.execute_all("weight_bucket_plan", BUCKET_MB)[0]

        def sync() -> tuple[PeakMemory, list[int]]:
            with PeakMemory() as driver:
                replicas = rollout.sync_weights(
                    plan, lambda names: actor.submit_all("weight_bucket", names)[0]
                )
            return driver, replicas

        first = sync()
        actor.execute_dp("update_actor", _update_data(actor, seed=4))
        driver, replica_peaks = sync()
        state = actor.execute_all("full_state_dict")[0]
        ids = [tok(t)["input_ids"] for t in ("1+2=", "33+4=", "5+55=", "7+8=")]
        width = max(map(len, ids))
        batch = DataProto.from_dict(
            {"input_ids": torch.tensor([[tok.pad_token_id] * (width - len(i)) + i for i in ids]),
             "attention_mask": torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])},
            meta_info={"n": 2})  # fmt: skip
        out = rollout.generate_sequences(batch)
    finally:
        for group in (rollout, actor):
            if group is not None:
                group.shutdown()
        ray.shutdown()
    model_bytes = sum(v.numel() * v.element_size() for v in state.values())
    assert len(plan) >= 8 and model_bytes > 64 * MiB
    bound = 2 * BUCKET_MB * MiB + 4 * MiB  # two buckets, and 4 MiB for everything else
    print(f"model {model_bytes / MiB:.1f} MiB in {len(plan)} buckets; peak extra MiB of the first sync: "
          f"driver {first[0].extra / MiB:.1f}, replicas {[round(p / MiB, 1) for p in first[1]]}; of the next: "
          f"driver {driver.extra / MiB:.1f}, replicas {[round(p / MiB, 1) for p in replica_peaks]}")  # fmt: skip
    for d, replicas in (first, (driver, replica_peaks)):
        assert d.extra <= bound and max(replicas) <= bound, (d.extra, replicas)
    # both replicas (rows 0-3 on one, 4-7 on the other) sample from the updated weights
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    assert any(not torch.equal(before[k], state[k]) for k in state)  # the update changed weights
    b = out.batch
    for i in range(len(out)):
        seq = b["input_ids"][i][b["attention_mask"][i].bool()].unsqueeze(0)
        n = int(b["response_mask"][i].sum())
        with torch.no_grad():
            logp = torch.log_softmax(model(seq).logits[0, -n - 1 : -1], -1)
        expected = logp.gather(-1, seq[0, -n:].unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(b["rollout_log_probs"][i, :n], expected, rtol=0, atol=1e-4)
