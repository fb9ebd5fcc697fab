"""vLLM log records that mean nothing for the rollout, dropped by name (nothing else is filtered)."""

from __future__ import annotations

import logging

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
}


class _DropFragment(logging.Filter):
    def __init__(self, fragment: str) -> None:
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


def drop_harmless_vllm_records() -> None:
    """Install a filter per `HARMLESS` entry on its logger (idempotent)."""
    for logger_name, fragment in HARMLESS:
        logger = logging.getLogger(logger_name)
        if not any(getattr(f, "fragment", None) == fragment for f in logger.filters):
            logger.addFilter(_DropFragment(fragment))
