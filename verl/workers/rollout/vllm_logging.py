"""vLLM log records that mean nothing for the rollout, dropped by name (nothing else is filtered)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

# (vLLM logger, message fragment) -> why the record is harmless here
HARMLESS = {
    ("vllm.renderers.base", "Chat template warmup failed"): (
        "every engine renders a chat prompt at start-up to warm up its chat template; the "
        "rollout passes token ids and never renders chat, and with a short max_model_len (the "
        "tiny models) the warm-up prompt does not fit, so vLLM logs a traceback"
    ),
    ("vllm.model_executor.model_loader.reload.layerwise", "RotaryEmbedding"): (
        "every weight sync warns that RotaryEmbedding 'failed to load weights': the actor's "
        "state dict has no rotary buffers (not trained) and vLLM keeps its own, which is right"
    ),
    ("vllm.model_executor.model_loader.reload.layerwise", "FusedMMInputNorm"): (
        "a vision-language model's weight sync warns that FusedMMInputNorm 'failed to load "
        "weights': it holds the image processor's mean and std (no checkpoint tensor, not "
        "trained), which vLLM keeps, which is right"
    ),
}


class _DropFragment(logging.Filter):
    def __init__(self, fragment: str) -> None:
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


PARTIAL_RELOAD = {
    ("vllm.model_executor.model_loader.reload.layerwise", "Failed to load weights"),
    ("vllm.model_executor.model_loader.reload.inplace", "were not loaded from checkpoint"),
}
"""What vLLM logs for the layers a partial weight sync leaves as they are (LoRA's: the frozen
ones), dropped during such a sync only (`quiet_partial_reload`)."""


@contextmanager
def quiet_partial_reload() -> Iterator[None]:
    """Inside the block, vLLM's records of layers a reload left untouched are dropped."""
    installed = []
    for logger_name, fragment in PARTIAL_RELOAD:
        installed.append((logging.getLogger(logger_name), _DropFragment(fragment)))
        installed[-1][0].addFilter(installed[-1][1])
    try:
        yield
    finally:
        for logger, dropper in installed:
            logger.removeFilter(dropper)


def drop_harmless_vllm_records() -> None:
    """Install a filter per `HARMLESS` entry on its logger (idempotent)."""
    for logger_name, fragment in HARMLESS:
        logger = logging.getLogger(logger_name)
        if not any(getattr(f, "fragment", None) == fragment for f in logger.filters):
            logger.addFilter(_DropFragment(fragment))
