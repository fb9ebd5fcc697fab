"""The rollout drops exactly the vLLM log records listed as harmless, and nothing else."""

import logging

from verl.workers.rollout.vllm_logging import HARMLESS, drop_harmless_vllm_records


def _record(logger: str, message: str) -> logging.LogRecord:
    return logging.LogRecord(logger, logging.WARNING, __file__, 1, message, None, None)


def test_only_the_listed_records_are_dropped():
    drop_harmless_vllm_records()
    drop_harmless_vllm_records()  # idempotent: one filter per entry
    for logger_name, fragment in HARMLESS:
        logger = logging.getLogger(logger_name)
        assert sum(getattr(f, "fragment", None) == fragment for f in logger.filters) == 1
        assert not logger.filter(_record(logger_name, f"{fragment} (details)"))
        assert logger.filter(_record(logger_name, "Model loading took 0.3 s"))
    # the chat warm-up record as vLLM writes it, and a record of another logger
    renderer = logging.getLogger("vllm.renderers.base")
    assert not renderer.filter(_record("vllm.renderers.base", "Chat template warmup failed"))
    assert logging.getLogger("vllm.other").filter(
        _record("vllm.other", "Chat template warmup failed")
    )


def test_a_partial_reload_drops_the_kept_layers_lines_inside_the_block_only():
    from verl.workers.rollout.vllm_logging import PARTIAL_RELOAD, quiet_partial_reload

    layerwise = "vllm.model_executor.model_loader.reload.layerwise"
    inplace = "vllm.model_executor.model_loader.reload.inplace"
    assert {name for name, _ in PARTIAL_RELOAD} == {layerwise, inplace}
    kept = _record(layerwise, "RMSNorm: Failed to load weights")
    missing = _record(
        inplace, "Following weights were not loaded from checkpoint: {'model.norm.weight'}"
    )
    with quiet_partial_reload():
        assert not logging.getLogger(layerwise).filter(kept)
        assert not logging.getLogger(inplace).filter(missing)
        assert logging.getLogger(inplace).filter(_record(inplace, "Reloading weights inplace..."))
    # a whole-model sync that misses a weight is still reported
    assert logging.getLogger(layerwise).filter(kept) and logging.getLogger(inplace).filter(missing)
