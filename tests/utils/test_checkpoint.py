"""Atomic checkpoints on one in-process gloo rank: an interrupted save leaves the previous one loadable."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from verl.tasks.tiny_lm import TinyLMSpec, build_tiny_qwen2
from verl.utils import checkpoint as ckpt_mod
from verl.utils.checkpoint import FSDPCheckpointManager, is_complete
from verl.utils.fsdp_utils import apply_fsdp2, free_port, init_distributed


@pytest.fixture(scope="module")
def mesh():
    mesh = init_distributed(0, 1, "127.0.0.1", free_port())
    yield mesh
    dist.destroy_process_group()


@pytest.fixture
def sharded(mesh):
    model = apply_fsdp2(
        build_tiny_qwen2(TinyLMSpec(hidden_size=64, num_hidden_layers=1, seed=1)), mesh
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    return model, optimizer, scheduler


def _train_step(model, optimizer, scheduler):
    ids = torch.arange(1, 9).unsqueeze(0)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def _weights(model):
    from verl.utils.fsdp_utils import full_state_dict

    return {k: v.clone() for k, v in full_state_dict(model).items()}


def test_save_load_restores_model_optimizer_scheduler_and_rng(sharded, tmp_path):
    model, optimizer, scheduler = sharded
    _train_step(model, optimizer, scheduler)
    manager = FSDPCheckpointManager(model, optimizer, scheduler)
    path = manager.save(str(tmp_path / "ckpt"))
    assert is_complete(path) and os.path.isfile(os.path.join(path, "hf", "model.safetensors"))
    saved, lr, draw = _weights(model), scheduler.get_last_lr(), torch.rand(3)
    _train_step(model, optimizer, scheduler)
    after_next = _weights(model)
    manager.load(path)
    assert scheduler.get_last_lr() == lr
    torch.testing.assert_close(torch.rand(3), draw)  # RNG restored to the moment of saving
    for key, value in _weights(model).items():
        torch.testing.assert_close(value, saved[key], rtol=0, atol=0)
    _train_step(model, optimizer, scheduler)  # optimizer moments restored: the same next step
    for key, value in _weights(model).items():
        torch.testing.assert_close(value, after_next[key], rtol=0, atol=1e-7)


def test_interrupted_save_leaves_previous_checkpoint_loadable(sharded, tmp_path, monkeypatch):
    model, optimizer, scheduler = sharded
    manager = FSDPCheckpointManager(model, optimizer, scheduler)
    path = str(tmp_path / "latest")
    manager.save(path)
    good = _weights(model)
    _train_step(model, optimizer, scheduler)

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated crash mid-save)")

    monkeypatch.setattr(ckpt_mod, "export_hf", crash)  # dcp shards are written, then the save dies
    with pytest.raises(OSError, match="simulated"):
        manager.save(path)
    assert not is_complete(path + ".partial")  # the half-written attempt is not a checkpoint
    assert is_complete(path)
    manager.load(path)
    for key, value in _weights(model).items():
        torch.testing.assert_close(value, good[key], rtol=0, atol=0)
    monkeypatch.undo()
    manager.save(path)  # a later save cleans up the partial folder and succeeds
    assert is_complete(path) and not os.path.exists(path + ".partial")


def test_loading_an_incomplete_checkpoint_fails_clearly(sharded, tmp_path):
    model, optimizer, scheduler = sharded
    os.makedirs(tmp_path / "half")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        FSDPCheckpointManager(model, optimizer, scheduler).load(str(tmp_path / "half"))


def test_attention_kernel_resolution():
    from verl.utils.attention import resolve_attn_implementation

    assert resolve_attn_implementation("auto", "cpu") == "sdpa"
    with pytest.raises(ValueError, match="no CUDA device"):  # FA2 needs CUDA (more: test_attn_*)
        resolve_attn_implementation("flash_attention_2", "cpu")
    assert resolve_attn_implementation("eager", "cpu") == "eager"
    assert resolve_attn_implementation("sdpa", "cuda") == "sdpa"


def test_missing_model_path_fails_clearly(tmp_path):
    from verl.utils.fsdp_utils import load_hf_model

    with pytest.raises(FileNotFoundError, match="not a local folder"):
        load_hf_model(str(tmp_path / "nope"), torch.float32)


SPEC = TinyLMSpec(hidden_size=64, num_hidden_layers=2, seed=1)


def _rank_model(rank: int, world: int, port: int):
    mesh = init_distributed(rank, world, "127.0.0.1", port)
    model = apply_fsdp2(build_tiny_qwen2(SPEC), mesh, plain_on_one_rank=True)  # as the workers
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _save_on_one_rank(path: str, port: int) -> None:
    model, optimizer = _rank_model(0, 1, port)
    assert not hasattr(model, "unshard")  # one rank: the module unwrapped, plain tensors saved
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    _train_step(model, optimizer, scheduler)
    FSDPCheckpointManager(model, optimizer).save(path, export_hf_weights=False)
    _train_step(model, optimizer, scheduler)  # the step a resumed run must reproduce
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, path + "-next.pt")
    dist.destroy_process_group()


def _resume_on_two_ranks(rank: int, path: str, port: int) -> None:
    from verl.utils.fsdp_utils import full_state_dict

    model, optimizer = _rank_model(rank, 2, port)
    assert hasattr(model, "unshard")  # two ranks: FSDP2, DTensor shards loaded from plain tensors
    FSDPCheckpointManager(model, optimizer).load(path)
    _train_step(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))
    weights = full_state_dict(model)
    if rank == 0:
        for name, tensor in torch.load(path + "-next.pt").items():
            torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-6, msg=name)
    dist.destroy_process_group()


def test_a_one_rank_checkpoint_resumes_on_two_ranks(tmp_path):
    """A run on one CPU rank (its module unwrapped: plain tensors in the checkpoint) resumed on two
    FSDP2 ranks (`trainer.n_gpus_per_node` changed between runs): the model and AdamW's moments
    load into the shards, so the first step after the resume moves every weight as the
    uninterrupted run's next step did (to 1e-6). Each side in fresh processes (spawn)."""
    import torch.multiprocessing as mp

    path = str(tmp_path / "ckpt")
    saver = mp.get_context("spawn").Process(target=_save_on_one_rank, args=(path, free_port()))
    saver.start()
    saver.join(timeout=120)
    assert saver.exitcode == 0, f"the one-rank save failed (exit code {saver.exitcode})"
    mp.spawn(_resume_on_two_ranks, args=(path, free_port()), nprocs=2, join=True)
