"""Where the worker loads and offloads (`worker.actor.offload`, `worker.ref.offload`): each stage
loads the parts it computes with before it runs and offloads them after, and no stage touches a
part it does not use; and which `fsdp.enable_full_shard` each model is sharded with. Pure logic:
the worker holds stand-in actors and recording offloaders (what the real `Offloader` moves and
what the sharding changes are tested in tests/utils/test_fsdp_sharding_offload.py)."""

from __future__ import annotations

import pytest
import torch

from verl.protocol import DataProto
from verl.workers import fsdp_workers
from verl.workers.fsdp_workers import FSDPWorker


class StandInActor:
    def __init__(self, events: list[str], name: str) -> None:
        self.events, self.name = events, name

    def compute_log_prob(self, data: DataProto, calculate_entropy: bool = False) -> DataProto:
        self.events.append(f"{self.name}.compute_log_prob")
        return DataProto.from_dict({"old_log_probs": torch.zeros(len(data), 3)})

    def update_policy(self, data: DataProto) -> dict[str, list[float]]:
        self.events.append(f"{self.name}.update_policy")
        return {"actor/pg_loss": [0.0]}


class RecordingOffloader:
    def __init__(self, events: list[str], name: str) -> None:
        self.events, self.name = events, name

    def load(self) -> None:
        self.events.append(f"{self.name}.load")

    def offload(self) -> None:
        self.events.append(f"{self.name}.offload")


class StandInCheckpoints:
    def __init__(self, events: list[str], *args) -> None:
        self.events = events

    def save(self, path: str, export_hf_weights: bool) -> str:
        self.events.append("save")
        return path

    def load(self, path: str) -> None:
        self.events.append("restore")


def _worker(monkeypatch, events: list[str]) -> FSDPWorker:
    monkeypatch.setattr(fsdp_workers, "device_type", lambda: "cpu")
    monkeypatch.setattr(fsdp_workers, "FSDPCheckpointManager",
                        lambda *args: StandInCheckpoints(events, *args))  # fmt: skip
    monkeypatch.setattr(fsdp_workers, "full_tensors",
                        lambda module, names: events.append("gather") or {})  # fmt: skip
    worker = FSDPWorker.__new__(FSDPWorker)  # no process group, no model: stand-ins only
    worker.role, worker.rank, worker.module, worker.tokenizer = "actor_ref", 1, None, None
    worker.optimizer = worker.lr_scheduler = None
    worker.actor, worker.ref = StandInActor(events, "actor"), StandInActor(events, "ref")
    worker._offloaders = {part: RecordingOffloader(events, part) for part in ("actor", "ref")}
    return worker


def test_each_stage_loads_what_it_computes_with_and_offloads_it_after(monkeypatch):
    events: list[str] = []
    worker = _worker(monkeypatch, events)
    data = DataProto.from_dict({"input_ids": torch.zeros(4, 5, dtype=torch.long)})
    stages = {
        "old log-probs": lambda: worker.compute_log_prob(data),
        "ref log-probs": lambda: worker.compute_ref_log_prob(data),
        "update": lambda: worker.update_actor(data),
        "weight bucket": lambda: worker.weight_bucket(["lm_head.weight"]),
        "save": lambda: worker.save_checkpoint("/unused"),
        "restore": lambda: worker.load_checkpoint("/unused"),
    }
    seen = {}
    for name, stage in stages.items():
        events.clear()
        stage()
        seen[name] = list(events)
    assert seen == {
        "old log-probs": ["actor.load", "actor.compute_log_prob", "actor.offload"],
        "ref log-probs": ["ref.load", "ref.compute_log_prob", "ref.offload"],
        "update": ["actor.load", "actor.update_policy", "actor.offload"],
        # the sync gathers offloaded shards tensor by tensor (`full_tensors`): nothing loads
        "weight bucket": ["gather"],
        "save": ["actor.load", "save", "actor.offload"],
        "restore": ["actor.load", "restore", "actor.offload"],
    }


def test_a_lora_reference_loads_the_actors_weights(monkeypatch):
    """LoRA in `actor_ref`: the reference is the actor's module with the adapters off, so its
    stage loads and offloads the actor's parts (it has no offloader of its own)."""
    events: list[str] = []
    worker = _worker(monkeypatch, events)
    worker._ref_is_actor = True
    del worker._offloaders["ref"]
    worker.compute_ref_log_prob(
        DataProto.from_dict({"input_ids": torch.zeros(2, 5, dtype=torch.long)})
    )
    assert events == ["actor.load", "ref.compute_log_prob", "actor.offload"]


def test_a_failing_stage_leaves_its_part_resident(monkeypatch):
    """An error inside a stage skips the offload: the offloader's record (resident) stays true."""
    events: list[str] = []
    worker = _worker(monkeypatch, events)

    def broken(data, calculate_entropy=False):
        raise RuntimeError("boom")

    worker.actor.compute_log_prob = broken
    data = DataProto.from_dict({"input_ids": torch.zeros(2, 5, dtype=torch.long)})
    with pytest.raises(RuntimeError, match=r"^boom$"):
        worker.compute_log_prob(data)
    assert events == ["actor.load"]


def test_without_offloading_no_stage_moves_anything(monkeypatch):
    events: list[str] = []
    worker = _worker(monkeypatch, events)
    del worker._offloaders  # the class default: none held (a CPU worker, or offload off)
    data = DataProto.from_dict({"input_ids": torch.zeros(2, 5, dtype=torch.long)})
    worker.compute_log_prob(data)
    worker.update_actor(data)
    assert events == ["actor.compute_log_prob", "actor.update_policy"]


def test_actor_and_reference_are_sharded_with_their_own_full_shard_key(monkeypatch):
    from verl.workers.config import WorkerConfig

    calls = []
    monkeypatch.setattr(fsdp_workers, "load_hf_model", lambda *args: torch.nn.Linear(2, 2))
    monkeypatch.setattr(fsdp_workers, "apply_fsdp2",
                        lambda model, mesh, *dtypes, full_shard, plain_on_one_rank: calls.append(full_shard))  # fmt: skip
    worker = FSDPWorker.__new__(FSDPWorker)
    worker.config, worker.mesh = WorkerConfig(), None
    worker.config.actor.model.model_path = "/unused"
    worker.config.actor.model.enable_gradient_checkpointing = False
    worker.config.actor.fsdp.enable_full_shard, worker.config.ref.fsdp.enable_full_shard = (
        False,
        True,
    )
    worker._load_sharded(trainable=True)
    worker._load_sharded(trainable=False)
    assert calls == [False, True]
