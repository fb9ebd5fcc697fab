"""Which attention kernel the actor's model runs (`worker.actor.model.attn_implementation`), decided
without loading anything heavy: the command line's checks (`--dry-run` included) call it before
any model or torch.distributed is imported, the FSDP worker again where it loads the model."""

from __future__ import annotations

import functools
import sys


def device_type() -> str:
    """ "cuda" when a GPU is visible, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


FLASH_ATTN_MODULES = ("flash_attn", "flash_attn_2_cuda")
"""What a usable flash-attn imports: the package and its compiled CUDA extension (a build for
another torch fails here with an undefined symbol, instead of crashing every rank at load)."""
_WARNED: set[str] = set()


@functools.cache
def flash_attn_import_error() -> str | None:
    """None when flash-attn and its CUDA extension import in this process, else why not, in one
    line. Cached: the import is tried once per process."""
    import importlib

    for name in FLASH_ATTN_MODULES:
        try:
            importlib.import_module(name)
        except Exception as error:  # ImportError, OSError (ABI), RuntimeError (no CUDA), ...
            detail = str(error).strip().splitlines()
            return f"import {name} failed: {type(error).__name__}" + (
                f": {detail[0]}" if detail else ""
            )
    return None


def resolve_attn_implementation(
    requested: str, device: str | None = None, key: str = "worker.actor.model.attn_implementation"
) -> str:
    """auto -> flash_attention_2 on CUDA when flash-attn really imports (`flash_attn_import_error`),
    else sdpa with one warning line (once per process). An explicit flash_attention_2 that cannot
    run here (no CUDA, or flash-attn does not import) raises ValueError in one line."""
    device = device or device_type()
    if requested not in ("auto", "flash_attention_2"):
        return requested
    why = "this process has no CUDA device" if device != "cuda" else flash_attn_import_error()
    if why is None:
        return "flash_attention_2"
    if requested == "flash_attention_2":
        how = (
            ""
            if device != "cuda"
            else " (VERL_FLASH_ATTN=1 bash scripts/setup_env.sh builds flash-attn)"
        )
        raise ValueError(
            f"{key}='flash_attention_2' cannot be used: {why}; valid here: auto, sdpa, eager{how}"
        )
    if device == "cuda" and why not in _WARNED:
        _WARNED.add(why)
        print(f"warning: flash-attn is not usable ({why}); attention uses sdpa", file=sys.stderr)
    return "sdpa"
