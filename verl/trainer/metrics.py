"""Batch statistics the trainer logs: scores, response lengths, throughput, stage timings."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from verl.protocol import DataProto


@contextmanager
def timed(name: str, metrics: dict[str, float]) -> Iterator[None]:
    """Adds the wall time of the block to `metrics['timing_s/<name>']`."""
    start = time.perf_counter()
    try:
        yield
    finally:
        metrics[f"timing_s/{name}"] = (
            metrics.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start
        )


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}  # fmt: skip


def response_lengths(batch: DataProto) -> torch.Tensor:
    """(B,) tokens of each response: policy tokens, and the tool tokens of a multi-turn episode
    (kept, attended to, never trained on)."""
    lengths = batch.batch["response_mask"].sum(-1)
    if "tool_mask" in batch.batch.keys():
        lengths = lengths + batch.batch["tool_mask"].sum(-1)
    return lengths


def compute_data_metrics(batch: DataProto, components: dict[str, list[float]]) -> dict[str, float]:
    """critic/score/* (per-response reward and its components), critic/advantages/*,
    response_length/* (tokens, tool tokens of multi-turn episodes included; clip ratio at the
    length limit)."""
    mask = batch.batch["response_mask"]
    lengths = response_lengths(batch)
    scores = batch.batch["token_level_scores"].sum(-1)
    metrics = {**_stats("critic/score", scores), **_stats("response_length", lengths)}
    metrics["response_length/clip_ratio"] = (lengths >= mask.shape[-1]).float().mean().item()
    for name, values in components.items():
        if name != "overall":
            metrics[f"critic/score/{name}"] = sum(values) / max(len(values), 1)
    valid = mask.bool()
    if "advantages" in batch.batch.keys() and valid.any():
        metrics.update(_stats("critic/advantages", batch.batch["advantages"][valid]))
    return metrics


def compute_throughput_metrics(
    batch: DataProto, step_seconds: float, world_size: int
) -> dict[str, float]:
    """perf/*: tokens (prompt + response) processed per second, overall and per worker."""
    tokens = int(batch.batch["attention_mask"].sum())
    return {"perf/total_num_tokens": float(tokens), "perf/time_per_step": step_seconds,
            "perf/throughput": tokens / max(step_seconds, 1e-9) / world_size}  # fmt: skip
