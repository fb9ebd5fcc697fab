"""The actor hands its CUDA cache back after every phase (issue 27, item 4), so that the vLLM
engines waking next on the same GPU find the memory the phase peaked at; on CPU nothing is called.

No GPU here: torch.cuda is monkeypatched (is_available, and an empty_cache that records its calls
in the same list as the phases), and the worker holds stand-in actors; the data stays on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from verl.protocol import DataProto
from verl.utils import fsdp_utils
from verl.workers import fsdp_workers
from verl.workers.fsdp_workers import FSDPWorker


class StandInActor:
    """Records each phase in `events`; returns what the real actor would (shapes only)."""

    def __init__(self, events: list[str], name: str) -> None:
        self.events, self.name = events, name

    def compute_log_prob(self, data: DataProto, calculate_entropy: bool = False) -> DataProto:
        self.events.append(f"{self.name}.compute_log_prob")
        return DataProto.from_dict({"old_log_probs": torch.zeros(len(data), 3)})

    def update_policy(self, data: DataProto) -> dict[str, list[float]]:
        self.events.append(f"{self.name}.update_policy")
        return {"actor/pg_loss": [0.0]}


def run_phases(monkeypatch, cuda: bool) -> list[str]:
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr(fsdp_workers, "device_type", lambda: "cpu")  # the data stays here
    monkeypatch.setattr(
        fsdp_workers, "full_tensors", lambda module, names: events.append("gather") or {}
    )
    worker = FSDPWorker.__new__(FSDPWorker)  # no process group, no model: stand-ins only
    worker.role, worker.rank, worker.module = "actor_ref", 1, None
    worker.actor, worker.ref = StandInActor(events, "actor"), StandInActor(events, "ref")
    data = DataProto.from_dict({"input_ids": torch.zeros(4, 5, dtype=torch.long)})
    assert worker.compute_log_prob(data).batch["old_log_probs"].shape == (4, 3)
    assert worker.compute_ref_log_prob(data).keys() == ["ref_log_probs"]
    assert worker.update_actor(data) == {"actor/pg_loss": [0.0]}
    assert worker.weight_bucket(["lm_head.weight"]) is None  # rank 1 returns nothing
    return events


def test_empty_cache_follows_every_actor_phase_on_cuda(monkeypatch):
    assert run_phases(monkeypatch, cuda=True) == [
        "actor.compute_log_prob", "empty_cache",
        "ref.compute_log_prob", "empty_cache",
        "actor.update_policy", "empty_cache",
        "gather", "empty_cache",
    ]  # fmt: skip


def test_empty_cache_is_never_called_on_cpu(monkeypatch):
    assert run_phases(monkeypatch, cuda=False) == [
        "actor.compute_log_prob",
        "ref.compute_log_prob",
        "actor.update_policy",
        "gather",
    ]


def test_release_cuda_cache_says_whether_it_ran(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fsdp_utils.release_cuda_cache() is False and calls == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert fsdp_utils.release_cuda_cache() is True and calls == [1]


@pytest.mark.gpu
def test_update_gives_its_peak_back_on_cuda():
    """On a real GPU: after a phase that peaked at 256 MiB of temporaries, the reservation is
    back near what the live tensors need."""
    keep = torch.zeros(1024, device="cuda")
    big = torch.empty(64 * 2**20, device="cuda")  # 256 MiB, freed below but still reserved
    del big
    assert torch.cuda.memory_reserved() >= 256 * 2**20
    assert fsdp_utils.release_cuda_cache()
    assert torch.cuda.memory_reserved() < 64 * 2**20
    del keep
