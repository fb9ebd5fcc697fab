"""One worker process that holds the actor (FSDP2), the reference policy, and later the rollout.

Started as Ray actors by `RayWorkerGroup`, one per data-parallel rank; torch.distributed is
initialised inside (gloo on CPU, nccl on GPU). Methods take and return DataProto; the group
splits batches across ranks and gathers the results.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from verl.protocol import DataProto
from verl.utils.checkpoint import FSDPCheckpointManager, export_hf
from verl.utils.fsdp_utils import (
    DTYPES,
    Offloader,
    apply_fsdp2,
    bucket_plan,
    device_type,
    free_port,
    full_state_dict,
    full_tensors,
    group_by_size,
    init_distributed,
    load_hf_model,
    offload_notice,
    release_cuda_cache,
    reshard_all,
)
from verl.utils.heap import freeze_heap
from verl.utils.lora import AdaptersOff, apply_lora, is_lora, merge, scaling_of, sync_sources
from verl.utils.shared_tensors import SharedTensors, to_shared
from verl.utils.vision import freeze_vision_tower
from verl.utils.worker_logs import redirect_worker_output
from verl.workers.actor.config import OptimConfig
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.config import WorkerConfig

ROLES = ("actor", "ref", "actor_ref")


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, optim: OptimConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then constant or cosine decay to `min_lr_ratio`·lr over `training_steps`."""
    if optim.training_steps is None:
        raise ValueError(
            "worker.actor.optim.training_steps is unset: the trainer fills it before the workers start"
        )
    total = optim.training_steps
    warmup = (
        optim.lr_warmup_steps
        if optim.lr_warmup_steps is not None
        else int(optim.lr_warmup_ratio * total)
    )

    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if optim.min_lr_ratio is None:
            return 1.0
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (
            1 + math.cos(math.pi * progress)
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class FSDPWorker:
    """A data-parallel rank holding the models of its `role`: 'actor' (trained), 'ref' (frozen
    initial policy) or 'actor_ref' (both in one process, the colocated layout)."""

    _offloaders: dict[str, Offloader] = {}  # noqa: RUF012 (never mutated: init_model assigns its own)
    _ref_is_actor = False
    """Whether the reference runs on the actor's own module, adapters off (LoRA, `actor_ref`)."""

    def __init__(self, config: WorkerConfig, role: str, rank: int, world_size: int) -> None:
        redirect_worker_output(f"{role}{rank}")
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not valid; valid: {', '.join(ROLES)}")
        self.config, self.role, self.rank, self.world_size = config, role, rank, world_size
        if device_type() == "cpu":  # Ray starts actors with OMP_NUM_THREADS=1: the ranks share
            # the cores this process may run on (its affinity: `taskset`, a batch scheduler's)
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
        self.mesh = None
        self._sources: dict[str, tuple[str, ...]] | None = None  # LoRA's sync plan, made once
        self.module = self.optimizer = self.lr_scheduler = self.actor = self.ref = (
            self.tokenizer
        ) = None

    # ------------------------------------------------------------------ set-up
    def master_address(self) -> tuple[str, int]:
        """This host's address and a free port (asked of rank 0)."""
        return socket.gethostbyname(socket.gethostname()), free_port()

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        """Join the process group of the data-parallel ranks."""
        self.mesh = init_distributed(self.rank, self.world_size, master_addr, master_port)

    def _load_sharded(self, trainable: bool):
        model_cfg = self.config.actor.model
        fsdp_cfg = self.config.actor.fsdp if trainable else self.config.ref.fsdp
        default = "float32" if (trainable or device_type() == "cpu") else "bfloat16"
        torch.manual_seed(0)
        model = load_hf_model(
            model_cfg.model_path,
            DTYPES[fsdp_cfg.torch_dtype or default],
            model_cfg.attn_implementation,
            model_cfg.trust_remote_code,
        )
        if trainable and model_cfg.enable_gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        if trainable and model_cfg.freeze_vision_tower:
            freeze_vision_tower(model)
        if trainable and model_cfg.lora.rank:  # base frozen, adapters trained (verl/utils/lora.py)
            model = apply_lora(model, model_cfg.lora)
        if not trainable:
            model.requires_grad_(False)
        return apply_fsdp2(model, self.mesh, fsdp_cfg.mp_param_dtype, fsdp_cfg.mp_reduce_dtype,
                           full_shard=fsdp_cfg.enable_full_shard, plain_on_one_rank=True)  # fmt: skip

    def init_model(self) -> list[str]:
        """Load the HF model(s), shard with FSDP2, build optimizer + LR scheduler for the actor;
        then offload what `offload` asks for (`Offloader`). Returns the notices for the driver to
        print once (rank 0 only: offload keys set on a CPU worker, which have no effect)."""
        from verl.utils.vision import load_tokenizer_or_processor

        model_cfg = self.config.actor.model
        # what an export writes beside the weights (a vision-language model's image processor too)
        self.tokenizer = load_tokenizer_or_processor(
            model_cfg.tokenizer_path or model_cfg.model_path
        )
        if self.role in ("actor", "actor_ref"):
            optim = self.config.actor.optim
            self.module = self._load_sharded(trainable=True)
            # fused: one kernel per step instead of ~10 ops per parameter tensor, each a DTensor
            # dispatch under FSDP2 (the same AdamW update, up to float rounding)
            self.optimizer = torch.optim.AdamW(
                [p for p in self.module.parameters() if p.requires_grad],
                lr=optim.lr,
                betas=tuple(optim.betas),
                weight_decay=optim.weight_decay,
                fused=True,
            )
            self.lr_scheduler = build_lr_scheduler(self.optimizer, optim)
            self.actor = DataParallelPPOActor(
                self.config.actor, self.module, self.optimizer, self.lr_scheduler
            )
        if self.role in ("ref", "actor_ref"):
            # a LoRA actor's reference is its own base model, the adapters switched off
            self._ref_is_actor = self.role == "actor_ref" and bool(
                self.config.actor.model.lora.rank
            )
            ref_module = (
                AdaptersOff(self.module)
                if self._ref_is_actor
                else self._load_sharded(trainable=False)
            )
            self.ref = DataParallelPPOActor(self._ref_actor_config(), ref_module)
        notices = self._init_offload()
        freeze_heap()  # the model's and libraries' objects: no full collection walks them mid-step
        return notices

    def _init_offload(self) -> list[str]:
        """An `Offloader` per model held, everything offloaded until its first stage (the vLLM
        engines built next find the memory free); on CPU one notice line instead (rank 0)."""
        held = {"actor": (self.actor, self.config.actor.offload, "worker.actor.offload"),
                "ref": (self.ref, self.config.ref.offload, "worker.ref.offload")}  # fmt: skip
        self._offloaders, flags = {}, {}
        for part, (model, cfg, key) in held.items():
            if model is None or (part == "ref" and self._ref_is_actor):
                continue
            flags |= {f"{key}.offload_params": cfg.offload_params,
                      f"{key}.offload_optimizer": cfg.offload_optimizer and part == "actor"}  # fmt: skip
            offloader = Offloader(model.actor_module, model.actor_optimizer, cfg.offload_params,
                                  cfg.offload_optimizer, device_type())  # fmt: skip
            if offloader.active:
                self._offloaders[part] = offloader
                offloader.offload()
        release_cuda_cache()
        notice = offload_notice(flags, device_type())
        return [notice] if notice is not None and self.rank == 0 else []

    @contextmanager
    def _resident(self, *parts: str) -> Iterator[None]:
        """A stage: the offloaded parameters/optimizer state of `parts` ('actor', 'ref') on the
        device inside the block; after it every FSDP group resharded and the offloaded parts back
        in host memory (nothing moves where nothing is offloaded, e.g. on CPU)."""
        if self._ref_is_actor:  # the reference's weights are the actor's
            parts = tuple(dict.fromkeys("actor" if p == "ref" else p for p in parts))
        for part in parts:
            if part in self._offloaders:
                self._offloaders[part].load()
        yield  # (an error leaves everything resident, as the offloaders record)
        for part in parts:
            module = getattr(getattr(self, part, None), "actor_module", None)
            if module is not None:
                reshard_all(module)
            if part in self._offloaders:
                self._offloaders[part].offload()

    def _ref_actor_config(self):
        """The actor config with the reference's micro-batching; no Σπ² for the reference."""
        import dataclasses

        ref = self.config.ref
        return dataclasses.replace(
            self.config.actor,
            micro_batch_size_per_device_for_experience=ref.micro_batch_size_per_device_for_experience,
            padding_free=ref.padding_free,
            calculate_sum_pi_squared=False,
        )

    def _to_device(self, data: DataProto) -> DataProto:
        """On CUDA a new DataProto on the GPU (`DataProto.to` moves in place: the caller's `data`
        would keep the GPU copies alive through `release_cuda_cache`); on CPU `data` itself."""
        if device_type() != "cuda" or data.batch is None:
            return data
        return DataProto(data.batch.to("cuda"), data.non_tensor_batch, data.meta_info)

    # ------------------------------------------------------------------ compute
    def _require(self, part: str) -> DataParallelPPOActor:
        held = getattr(self, part)
        if held is None:
            raise RuntimeError(
                f"this worker's role is {self.role!r}; it holds no {part} (roles: {', '.join(ROLES)})"
            )
        return held

    # Every phase below ends with `release_cuda_cache()` (CUDA only): the caching allocator would
    # otherwise keep the phase's peak reserved while the vLLM engines on the same GPU wake up.
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """`old_log_probs` (+ `entropy` when meta_info['calculate_entropy'], `sum_pi_squared` when configured)."""
        entropy = data.meta_info.get("calculate_entropy", False)
        actor = self._require("actor")
        with self._resident("actor"):
            out = actor.compute_log_prob(self._to_device(data), entropy).to("cpu")
        release_cuda_cache()
        return out

    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """`ref_log_probs` (B, T) under the frozen initial policy."""
        ref = self._require("ref")
        with self._resident("ref"):
            out = ref.compute_log_prob(self._to_device(data))
        out = DataProto.from_dict({"ref_log_probs": out.batch["old_log_probs"].cpu()})
        release_cuda_cache()
        return out

    def update_actor(self, data: DataProto) -> dict[str, list[float]]:
        """One training step of the policy on this rank's share of the batch; returns metrics."""
        actor = self._require("actor")
        with self._resident("actor"):
            metrics = actor.update_policy(self._to_device(data))
        release_cuda_cache()
        return metrics

    # ------------------------------------------------------------------ state
    def save_checkpoint(self, path: str, export_hf_weights: bool = True) -> str:
        """Atomic sharded checkpoint (+ HF export) of the actor at `path`."""
        self._require("actor")
        with self._resident("actor"):
            return FSDPCheckpointManager(
                self.module, self.optimizer, self.lr_scheduler, self.tokenizer
            ).save(path, export_hf_weights)

    def load_checkpoint(self, path: str) -> None:
        """Restore model, optimizer, LR scheduler and RNG states from `path`."""
        self._require("actor")
        with self._resident("actor"):
            FSDPCheckpointManager(
                self.module, self.optimizer, self.lr_scheduler, self.tokenizer
            ).load(path)

    def export_hf(self, path: str) -> None:
        """Write the current weights in Hugging Face format (rank 0 writes)."""
        with self._resident("actor"):
            export_hf(self.module, path, self.tokenizer)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The unsharded weights (returned by rank 0, None elsewhere); a collective call. With
        LoRA, the PEFT model's own state dict (base weights and adapters)."""
        with self._resident("actor"):
            state = full_state_dict(self.module)
        return state if self.rank == 0 else None

    def weight_bucket_plan(self, bucket_mb: float) -> list[list[str]]:
        """Parameter names grouped into weight-sync buckets of at most `bucket_mb` MiB each. With
        LoRA the modules holding adapted weights, under the base model's names: nothing else
        ever changes (the engine loaded the same base model; `lora.sync_sources`)."""
        if not is_lora(self.module):
            return bucket_plan(self.module, int(bucket_mb * 2**20))
        state = self.module.state_dict()
        sizes = {name: state[parts[0]] for name, parts in self._sync_sources().items()}
        return group_by_size(sizes, int(bucket_mb * 2**20))

    def _sync_sources(self) -> dict[str, tuple[str, ...]]:
        """`lora.sync_sources` of the actor (its names never change within a run: made once)."""
        if self._sources is None:
            self._sources = sync_sources(self.module.state_dict())
        return self._sources

    def weight_bucket(self, names: list[str]) -> SharedTensors | None:
        """One bucket of unsharded weights as shared arrays (returned by rank 0, None elsewhere,
        read zero-copy by every replica); a collective call. With LoRA, an adapted weight is sent
        merged, W + s·B·A (verl/utils/lora.py)."""
        if is_lora(self.module):
            sources, scaling = self._sync_sources(), scaling_of(self.module)
            parts = full_tensors(self.module, [s for name in names for s in sources[name]])
            bucket = {}
            for name in names:
                got = [parts[s] for s in sources[name]]
                bucket[name] = merge(*got, scaling) if len(got) == 3 else got[0]
        else:
            bucket = full_tensors(self.module, names)
        release_cuda_cache()  # the gathered bucket's GPU copies, before the engines take memory
        return to_shared(bucket) if self.rank == 0 else None

    def environment(self) -> dict[str, Any]:
        """Where this rank runs (for logs and tests)."""
        import ray  # here only: the worker itself runs without Ray (verl/tools/gpu_actor_check.py)

        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "device": device_type(),
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "placement_group": ray.get_runtime_context().get_placement_group_id(),
        }
