"""`fsdp.enable_full_shard` and the `offload` helpers on one in-process rank (gloo on CPU, nccl on
a GPU): what forward leaves gathered under each sharding, the CPU no-op notice, and (GPU tier)
where parameters, gradients and optimizer state live between stages."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from verl.tasks.tiny_lm import TinyLMSpec, build_tiny_qwen2
from verl.utils.fsdp_utils import (
    Offloader,
    apply_fsdp2,
    device_type,
    free_port,
    full_tensors,
    init_distributed,
    offload_notice,
    reshard_all,
)

NOTICE = "no effect on CPU (tensors already live in host memory)"


@pytest.fixture(scope="module")
def mesh():
    mesh = init_distributed(0, 1, "127.0.0.1", free_port())
    yield mesh
    dist.destroy_process_group()


def _model(mesh, full_shard: bool = True):
    spec = TinyLMSpec(hidden_size=64, num_hidden_layers=2, seed=1)
    return apply_fsdp2(build_tiny_qwen2(spec), mesh, full_shard=full_shard)


def _ids() -> torch.Tensor:
    return torch.arange(1, 9, device=device_type()).unsqueeze(0)


def _layer_weights(model) -> list:
    return [p for layer in model.model.layers for p in layer.parameters()]


@pytest.mark.parametrize("full_shard", [True, False])
def test_full_shard_decides_what_forward_leaves_gathered_until_backward(mesh, full_shard):
    """FSDP2 registers sharded parameters as DTensors and gathered ones as plain tensors: with
    full shard every layer is sharded again right after forward (ZeRO-3); without it the layers
    keep what forward gathered until backward (ZeRO-2). After backward and after `reshard_all`
    both are sharded; the loss and the gradients are the same."""
    model = _model(mesh, full_shard)
    loss = model(input_ids=_ids(), labels=_ids(), use_cache=False).loss
    gathered = [not isinstance(p, DTensor) for p in _layer_weights(model)]
    assert all(gathered) if not full_shard else not any(gathered)
    loss.backward()
    assert all(
        isinstance(p, DTensor) and isinstance(p.grad, DTensor) for p in _layer_weights(model)
    )
    with torch.no_grad():  # a log-prob stage: nothing reshards without a backward ...
        model(input_ids=_ids(), use_cache=False)
    assert not isinstance(model.lm_head.weight, DTensor)  # the root never reshards after forward
    reshard_all(model)  # ... so the worker reshards every group at the end of a stage
    assert all(isinstance(p, DTensor) for p in model.parameters())
    reference = _model(mesh, True)
    reference(input_ids=_ids(), labels=_ids(), use_cache=False).loss.backward()
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.grad.full_tensor(), theirs.grad.full_tensor(), msg=name)


def test_one_rank_without_mixed_precision_trains_the_module_unwrapped(mesh):
    """`plain_on_one_rank` (the workers): at one rank computing in the parameters' dtype the
    module comes back as it was (no FSDP group, no DTensor), and an AdamW step on it moves every
    weight as the FSDP2-wrapped copy's step does; with mixed precision FSDP2 stays (it casts)."""
    spec = TinyLMSpec(hidden_size=64, num_hidden_layers=2, seed=1)
    plain_model = build_tiny_qwen2(spec)
    assert apply_fsdp2(plain_model, mesh, plain_on_one_rank=True) is plain_model
    assert not any(isinstance(p, DTensor) for p in plain_model.parameters())
    mixed = apply_fsdp2(build_tiny_qwen2(spec), mesh, "bfloat16", mixed_precision=True,
                        plain_on_one_rank=True)  # fmt: skip
    assert all(isinstance(p, DTensor) for p in mixed.parameters())
    wrapped = _model(mesh)
    for model in (plain_model, wrapped):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(input_ids=_ids(), labels=_ids(), use_cache=False).loss.backward()
        optimizer.step()
    after = full_tensors(wrapped, list(wrapped.state_dict()))
    for name, tensor in plain_model.state_dict().items():
        torch.testing.assert_close(tensor, after[name], rtol=0, atol=1e-6, msg=name)


def test_offload_notice_names_the_keys_set_and_only_on_cpu():
    flags = {"worker.actor.offload.offload_params": True,
             "worker.actor.offload.offload_optimizer": False,
             "worker.ref.offload.offload_params": True}  # fmt: skip
    assert offload_notice(flags, "cpu") == (
        f"worker.actor.offload.offload_params, worker.ref.offload.offload_params: {NOTICE}"
    )
    assert offload_notice(flags, "cuda") is None
    assert offload_notice(dict.fromkeys(flags, False), "cpu") is None


def test_offloader_on_cpu_moves_nothing(mesh):
    model = _model(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=_ids(), labels=_ids(), use_cache=False).loss.backward()
    optimizer.step()
    before = {name: p.to_local().data_ptr() for name, p in model.named_parameters()}
    offloader = Offloader(model, optimizer, params=True, optimizer_state=True, device="cpu")
    assert not offloader.active
    offloader.offload()
    offloader.load()
    assert {name: p.to_local().data_ptr() for name, p in model.named_parameters()} == before


def _devices(model, optimizer) -> set[str]:
    """Device types of the parameters' shards, their gradients and the AdamW moments."""
    found = {p.to_local().device.type for p in model.parameters()}
    found |= {p.grad.to_local().device.type for p in model.parameters() if p.grad is not None}
    for state in optimizer.state.values():
        found |= {state[key].device.type for key in ("exp_avg", "exp_avg_sq")}
    return found


def _step(model, optimizer) -> float:
    loss = model(input_ids=_ids(), labels=_ids(), use_cache=False).loss
    loss.backward()
    optimizer.step()
    return loss.item()


@pytest.mark.gpu
def test_offloaded_parameters_and_optimizer_state_live_in_host_memory_between_stages(mesh):
    """Two identical models trained in step; one offloaded between the steps: its shards,
    gradients and AdamW moments are in host memory (the GPU's allocation drops by about their
    size), the weight sync still gathers them, and after `load` the next step is the same."""
    plain, moved = _model(mesh), _model(mesh)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt_moved = torch.optim.AdamW(moved.parameters(), lr=1e-2)
    assert _step(plain, opt_plain) == pytest.approx(_step(moved, opt_moved), rel=1e-6)
    names = list(moved.state_dict())
    expected = full_tensors(moved, names)
    offloader = Offloader(moved, opt_moved, params=True, optimizer_state=True, device="cuda")
    assert offloader.active and _devices(moved, opt_moved) == {"cuda"}
    allocated = torch.cuda.memory_allocated()
    offloader.offload()
    assert _devices(moved, opt_moved) == {"cpu"} and not offloader.resident
    # float32 weights, gradients and the two AdamW moments of this rank's shards
    shard_bytes = sum(p.to_local().numel() * 4 * 4 for p in moved.parameters())
    assert allocated - torch.cuda.memory_allocated() >= 0.9 * shard_bytes
    for name, tensor in full_tensors(moved, names).items():  # gathered tensor by tensor
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
    assert _devices(moved, opt_moved) == {"cpu"}
    offloader.offload()  # idempotent
    offloader.load()
    assert _devices(moved, opt_moved) == {"cuda"} and offloader.resident
    opt_plain.zero_grad()
    opt_moved.zero_grad()
    assert _step(plain, opt_plain) == pytest.approx(_step(moved, opt_moved), rel=1e-6)
    for (name, a), b in zip(plain.named_parameters(), moved.parameters(), strict=True):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=0, atol=1e-6, msg=name)
