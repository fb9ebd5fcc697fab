"""One worker process that holds the actor (FSDP2), the reference policy, and later the rollout.

Started as Ray actors by `RayWorkerGroup`, one per data-parallel rank; torch.distributed is
initialised inside (gloo on CPU, nccl on GPU). Methods take and return DataProto; the group
splits batches across ranks and gathers the results.
"""

from __future__ import annotations

import math
import os
import socket
from typing import Any

import torch

from verl.protocol import DataProto
from verl.utils.checkpoint import FSDPCheckpointManager, export_hf
from verl.utils.fsdp_utils import (
    DTYPES,
    apply_fsdp2,
    device_type,
    free_port,
    full_state_dict,
    init_distributed,
    load_hf_model,
)
from verl.workers.actor.config import OptimConfig
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.config import WorkerConfig

ROLES = ("actor", "ref")


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, optim: OptimConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then constant or cosine decay to `min_lr_ratio`·lr over `training_steps`."""
    total = max(optim.training_steps, 1)
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
    """A data-parallel rank holding the model(s) of its `role`: 'actor' (trained) or 'ref' (frozen)."""

    def __init__(self, config: WorkerConfig, role: str, rank: int, world_size: int) -> None:
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not valid; valid: {', '.join(ROLES)}")
        self.config, self.role, self.rank, self.world_size = config, role, rank, world_size
        self.mesh = None
        self.module = self.optimizer = self.lr_scheduler = self.actor = self.tokenizer = None

    # ------------------------------------------------------------------ set-up
    def master_address(self) -> tuple[str, int]:
        """This host's address and a free port (asked of rank 0)."""
        return socket.gethostbyname(socket.gethostname()), free_port()

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        """Join the process group of the data-parallel ranks."""
        self.mesh = init_distributed(self.rank, self.world_size, master_addr, master_port)

    def init_model(self) -> None:
        """Load the HF model, shard it with FSDP2, and build optimizer + LR scheduler (actor only)."""
        from transformers import AutoTokenizer

        actor_cfg = self.config.actor
        model_cfg = actor_cfg.model
        fsdp_cfg = actor_cfg.fsdp if self.role == "actor" else self.config.ref.fsdp
        default = "float32" if (self.role == "actor" or device_type() == "cpu") else "bfloat16"
        dtype = DTYPES[fsdp_cfg.torch_dtype or default]
        torch.manual_seed(0)
        model = load_hf_model(
            model_cfg.model_path, dtype, model_cfg.attn_implementation, model_cfg.trust_remote_code
        )
        if self.role == "actor" and model_cfg.enable_gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        if self.role == "ref":
            model.requires_grad_(False)
        self.module = apply_fsdp2(
            model, self.mesh, fsdp_cfg.mp_param_dtype, fsdp_cfg.mp_reduce_dtype
        )
        self.tokenizer = AutoTokenizer.from_pretrained(
            model_cfg.tokenizer_path or model_cfg.model_path
        )
        if self.role == "actor":
            optim = actor_cfg.optim
            self.optimizer = torch.optim.AdamW(
                self.module.parameters(),
                lr=optim.lr,
                betas=tuple(optim.betas),
                weight_decay=optim.weight_decay,
            )
            self.lr_scheduler = build_lr_scheduler(self.optimizer, optim)
        ref_cfg = actor_cfg if self.role == "actor" else self._ref_actor_config()
        self.actor = DataParallelPPOActor(ref_cfg, self.module, self.optimizer, self.lr_scheduler)

    def _ref_actor_config(self):
        import dataclasses

        ref = self.config.ref
        return dataclasses.replace(
            self.config.actor,
            micro_batch_size_per_device_for_experience=ref.micro_batch_size_per_device_for_experience,
            padding_free=ref.padding_free,
            calculate_sum_pi_squared=False,
        )

    def _to_device(self, data: DataProto) -> DataProto:
        return data.to("cuda" if device_type() == "cuda" else "cpu")

    # ------------------------------------------------------------------ compute
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """`old_log_probs` (+ `entropy` when meta_info['calculate_entropy'], `sum_pi_squared` when configured)."""
        out = self.actor.compute_log_prob(
            self._to_device(data), data.meta_info.get("calculate_entropy", False)
        )
        return out.to("cpu")

    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """`ref_log_probs` (B, T) under the frozen initial policy."""
        out = self.actor.compute_log_prob(self._to_device(data))
        return DataProto.from_dict({"ref_log_probs": out.batch["old_log_probs"].cpu()})

    def update_actor(self, data: DataProto) -> dict[str, list[float]]:
        """One training step of the policy on this rank's share of the batch; returns metrics."""
        return self.actor.update_policy(self._to_device(data))

    # ------------------------------------------------------------------ state
    def save_checkpoint(self, path: str, export_hf_weights: bool = True) -> str:
        """Atomic sharded checkpoint (+ HF export) at `path`."""
        return FSDPCheckpointManager(
            self.module, self.optimizer, self.lr_scheduler, self.tokenizer
        ).save(path, export_hf_weights)

    def load_checkpoint(self, path: str) -> None:
        """Restore model, optimizer, LR scheduler and RNG states from `path`."""
        FSDPCheckpointManager(self.module, self.optimizer, self.lr_scheduler, self.tokenizer).load(
            path
        )

    def export_hf(self, path: str) -> None:
        """Write the current weights in Hugging Face format (rank 0 writes)."""
        export_hf(self.module, path, self.tokenizer)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The unsharded weights (returned by rank 0, None elsewhere); a collective call."""
        state = full_state_dict(self.module)
        return state if self.rank == 0 else None

    def environment(self) -> dict[str, Any]:
        """Where this rank runs (for logs and tests)."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "device": device_type(),
            "pid": os.getpid(),
        }
