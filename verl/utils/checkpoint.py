"""Sharded checkpoints with torch.distributed.checkpoint, plus an HF-format export.

A checkpoint folder holds `dcp/` (model + optimizer shards), `extra_state.pt` (LR scheduler),
`rng_rank{r}.pt` (every rank's RNG states), `hf/` (config, safetensors weights, tokenizer: loads
in transformers and vLLM) and the `COMPLETE` marker. Everything is written to `<path>.partial`
and renamed into place only once complete, so a crash mid-save never leaves a corrupt checkpoint
and the previous one stays loadable.
"""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from verl.utils.fsdp_utils import full_state_dict
from verl.utils.lora import ADAPTER_DIR, is_lora, merged_state, save_adapter, scaling_of

COMPLETE = "COMPLETE"


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def rng_state() -> dict:
    """Python, numpy, torch (and CUDA) RNG states of this process."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def is_complete(path: str) -> bool:
    """True when `path` holds a finished checkpoint."""
    return os.path.isfile(os.path.join(path, COMPLETE))


def export_hf(model: nn.Module, path: str, tokenizer=None) -> None:
    """Write config + safetensors weights (+ tokenizer) loadable by transformers and vLLM (collective).
    A LoRA actor writes its merged weights there, and its adapter alone in `lora_adapter/`. A
    processor given as `tokenizer` writes its tokenizer and image processor (the hub's layout)."""
    from safetensors.torch import save_file

    state = full_state_dict(model)
    if _rank_world()[0] != 0:
        return
    os.makedirs(path, exist_ok=True)
    if is_lora(model):  # the adapter alone (PEFT's format), and the merged model beside it
        save_adapter(model, state, os.path.join(path, ADAPTER_DIR))
        state = merged_state(state, scaling_of(model))
    config = model.config
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        os.path.join(path, "model.safetensors"),
        metadata={"format": "pt"},
    )
    config.save_pretrained(path)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    if tokenizer is not None:
        for part in (
            getattr(tokenizer, "tokenizer", tokenizer),
            getattr(tokenizer, "image_processor", None),
        ):
            if part is not None:
                part.save_pretrained(path)


class FSDPCheckpointManager:
    """Save / load model, optimizer, LR scheduler and RNG states of one (possibly sharded) model."""

    def __init__(self, model: nn.Module, optimizer=None, lr_scheduler=None, tokenizer=None) -> None:
        self.model, self.optimizer, self.lr_scheduler, self.tokenizer = (
            model,
            optimizer,
            lr_scheduler,
            tokenizer,
        )

    def _state(self) -> dict:
        if self.optimizer is None:
            return {"model": get_state_dict(self.model, [])[0]}
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def save(self, path: str, export_hf_weights: bool = True) -> str:
        """Write a complete checkpoint at `path` atomically (all ranks call this)."""
        rank, _ = _rank_world()
        path = os.path.abspath(path)
        partial = path + ".partial"
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        _barrier()
        dcp.save(self._state(), checkpoint_id=os.path.join(partial, "dcp"))
        torch.save(rng_state(), os.path.join(partial, f"rng_rank{rank}.pt"))
        if rank == 0 and self.lr_scheduler is not None:
            torch.save(
                {"lr_scheduler": self.lr_scheduler.state_dict()},
                os.path.join(partial, "extra_state.pt"),
            )
        if export_hf_weights:
            export_hf(self.model, os.path.join(partial, "hf"), self.tokenizer)
        _barrier()
        if rank == 0:
            open(os.path.join(partial, COMPLETE), "w").close()
            previous = path + ".old"
            if os.path.exists(path):
                shutil.rmtree(previous, ignore_errors=True)
                os.replace(path, previous)
            os.replace(partial, path)
            shutil.rmtree(previous, ignore_errors=True)
        _barrier()
        return path

    def load(self, path: str) -> None:
        """Restore a checkpoint written by `save` (all ranks call this)."""
        path = os.path.abspath(path)
        if not is_complete(path):
            raise FileNotFoundError(
                f"no complete checkpoint at {path!r} (missing {COMPLETE} marker)"
            )
        rank, _ = _rank_world()
        state = self._state()
        dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
        if self.optimizer is None:
            set_state_dict(self.model, [], model_state_dict=state["model"], optim_state_dict={})
        else:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
            )
        extra = os.path.join(path, "extra_state.pt")
        if self.lr_scheduler is not None and os.path.isfile(extra):
            self.lr_scheduler.load_state_dict(torch.load(extra, weights_only=False)["lr_scheduler"])
        rng_file = os.path.join(path, f"rng_rank{rank}.pt")
        if os.path.isfile(rng_file):
            set_rng_state(torch.load(rng_file, weights_only=False))
