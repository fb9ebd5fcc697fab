"""torch.distributed + FSDP2 helpers shared by the workers (CPU/gloo and GPU/nccl alike)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from verl.utils.attention import device_type, resolve_attn_implementation
from verl.utils.lora import is_lora

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def release_cuda_cache() -> bool:
    """Hand the CUDA caching allocator's unused blocks back to the driver, so that the vLLM engines
    that wake after an actor phase find the memory the phase peaked at (fp32 logits over the whole
    vocabulary in the update, gathered weights in a sync). A no-op without CUDA; True when it ran."""
    if not torch.cuda.is_available():
        return False
    torch.cuda.empty_cache()
    return True


def free_port() -> int:
    """A TCP port free on this host right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int) -> DeviceMesh:
    """Join the process group (nccl on GPU, gloo on CPU) and return a 1-D data-parallel mesh."""
    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    kind = device_type()
    if kind == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    if not dist.is_initialized():
        backend = "nccl" if kind == "cuda" else "gloo"
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(minutes=30)
        )
    return init_device_mesh(kind, (world_size,), mesh_dim_names=("dp",))


def load_hf_model(
    model_path: str,
    dtype: torch.dtype,
    attn_implementation: str = "auto",
    trust_remote_code: bool = False,
):
    """`from_pretrained` of the model's auto class (`auto_model_class`) from a local folder or a
    hub id (`verl.utils.model_path.resolve_model_path`), with a one-line error when neither."""
    from verl.utils.model_path import auto_model_class, resolve_model_path

    model_path = resolve_model_path(model_path, "model path")
    return auto_model_class(model_path).from_pretrained(
        model_path,
        dtype=dtype,
        attn_implementation=resolve_attn_implementation(attn_implementation),
        trust_remote_code=trust_remote_code,
    )


def apply_fsdp2(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: str | None = None,
    reduce_dtype: str = "float32",
    full_shard: bool = True,
    mixed_precision: bool | None = None,
    plain_on_one_rank: bool = False,
) -> nn.Module:
    """Shard every decoder layer, then the root (embeddings, norm, head), with `fully_shard`.

    `full_shard` (`fsdp.enable_full_shard`): True, each layer frees its gathered parameters after
    forward and gathers them again in backward (ZeRO-3); False, `reshard_after_forward=False` on
    the layers: what forward gathered stays until backward has used it (FSDP1's SHARD_GRAD_OP,
    ZeRO-2: one all-gather per layer and step instead of two, the whole unsharded model resident
    during forward/backward). The root keeps FSDP2's own rule either way (not resharded after
    forward). Gradients and optimizer state are sharded in both.

    `mixed_precision`: whether FSDP2 computes in `param_dtype` (the parameters, the gradients'
    shards and the optimizer keep their own dtype) and reduces gradients in `reduce_dtype`; None
    (the workers): on GPU only, CPU computing in the parameters' dtype. True on CPU runs the GPU's
    arithmetic there (tests/workers/test_lora_worker.py compares bfloat16 with float32 so).

    `plain_on_one_rank` (the workers): a mesh of one rank computing in the parameters' dtype gets
    the module back unwrapped. One rank has nothing to shard, and FSDP2's per-layer gathers,
    gradient reductions and DTensor dispatch cost about 8 % of an update at the demo's shape.
    Mixed precision keeps FSDP2 at any size: it is FSDP2 that casts.
    """
    mp = None
    if mixed_precision is None:
        mixed_precision = device_type() == "cuda"
    if mixed_precision and param_dtype is not None:
        mp = MixedPrecisionPolicy(
            param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype]
        )
    if plain_on_one_rank and mp is None and mesh.size() == 1:
        return model
    kwargs = {"mesh": mesh} | ({"mp_policy": mp} if mp is not None else {})
    base = model.get_base_model() if is_lora(model) else model  # LoRA: PEFT's wrap
    for layer in shard_units(base):
        fully_shard(layer, reshard_after_forward=full_shard, **kwargs)
    fully_shard(model, **kwargs)
    return model


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The blocks sharded one by one: a causal LM's decoder layers (`model.layers`); a
    vision-language model's (`model.language_model.layers`) and its vision tower's blocks
    (`model.visual.blocks`, Qwen2.5-VL)."""
    inner = getattr(model, "model", None)
    units = list(getattr(inner, "layers", None) or [])
    units += list(getattr(getattr(inner, "language_model", None), "layers", None) or [])
    units += list(getattr(getattr(inner, "visual", None), "blocks", None) or [])
    return units


def reshard_all(model: nn.Module) -> None:
    """Free every FSDP2 group's gathered parameters (a no-grad forward leaves those of the root,
    and with `full_shard=False` of every layer, gathered until the next backward)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def offload_notice(flags: dict[str, bool], device: str) -> str | None:
    """The one line saying that the offload keys set in `flags` (config key -> value) do nothing
    on `device` "cpu" (None when none is set, or on a GPU)."""
    on = [key for key, value in flags.items() if value]
    if device != "cpu" or not on:
        return None
    return f"{', '.join(on)}: no effect on CPU (tensors already live in host memory)"


class Offloader:
    """Moves one module's parameters (with their gradients) and/or its optimizer's state to host
    memory between stages (`offload`) and back to `device` before use (`load`). Both are
    idempotent. Inactive (nothing moves) on a "cpu" device or with neither flag set."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, params: bool,
                 optimizer_state: bool, device: str | torch.device) -> None:  # fmt: skip
        self.module, self.optimizer, self.device = module, optimizer, torch.device(device)
        self.params = params and self.device.type != "cpu"
        self.optimizer_state = (
            optimizer_state and optimizer is not None and self.device.type != "cpu"
        )
        self.resident = True  # where init left them: on `device`
        self._moved: list[tuple[dict, str]] = []  # optimizer state entries sent to host memory

    @property
    def active(self) -> bool:
        """Whether anything moves."""
        return self.params or self.optimizer_state

    @torch.no_grad()
    def offload(self) -> None:
        """Parameters (sharded, with their gradients) and/or optimizer state to host memory."""
        if not self.active or not self.resident:
            return
        if self.params:
            self.module.to("cpu")  # FSDP2 reshards first; DTensor parameters keep their identity
        if self.optimizer_state:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.device.type == self.device.type:
                        state[key] = value.to("cpu")
                        self._moved.append((state, key))
        self.resident = False

    @torch.no_grad()
    def load(self) -> None:
        """Everything `offload` moved, back on `device`."""
        if not self.active or self.resident:
            return
        if self.params:
            self.module.to(self.device)
        for state, key in self._moved:
            state[key] = state[key].to(self.device)
        self._moved.clear()
        self.resident = True


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict, complete on rank 0 (other ranks may get an empty dict); collective."""
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def bucket_plan(model: nn.Module, bucket_bytes: int) -> list[list[str]]:
    """State-dict names in order, grouped into buckets of at most `bucket_bytes` unsharded bytes
    (a larger tensor is a bucket of its own). The same on every rank (global shapes)."""
    return group_by_size(model.state_dict(), bucket_bytes)


def group_by_size(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """The names of `tensors` in order, in buckets of at most `bucket_bytes` global bytes each
    (a larger tensor is a bucket of its own)."""
    plan, current, size = [], [], 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()  # a DTensor's numel is its global one
        if current and size + nbytes > bucket_bytes:
            plan.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    return plan + ([current] if current else [])


def full_tensors(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """The unsharded CPU tensors of `names`; a collective (every rank calls with the same names).
    Shards offloaded to host memory (`Offloader`) are gathered one tensor at a time on the mesh's
    device, without loading the whole model."""
    from torch.distributed.tensor import DTensor

    state = model.state_dict()
    out = {}
    for name in names:
        tensor = state[name]
        if isinstance(tensor, DTensor):
            mesh = tensor.device_mesh
            if (
                tensor.device.type != mesh.device_type
            ):  # an offloaded shard: gathered on the mesh's device
                tensor = DTensor.from_local(tensor.to_local().to(mesh.device_type), mesh, tensor.placements,
                                            run_check=False, shape=tensor.shape, stride=tensor.stride())  # fmt: skip
            tensor = tensor.full_tensor()
        out[name] = tensor.detach().cpu()
    return out
