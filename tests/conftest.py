"""Test tiers: plain unit tests, `vllm`, `e2e`, `gpu` (skipped cleanly when CUDA is absent)."""

from __future__ import annotations

import math

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    no_cuda = pytest.mark.skip(reason="needs CUDA (gpu tier)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_cuda)


@pytest.fixture(scope="session")
def rollout_gpus():
    """`rollout_gpus(replicas, services=0)`: the GPU keyword arguments of a test's `RolloutGroup`.
    On CPU none. On a CUDA machine every engine (draft replicas and guidance services) gets an
    equal share of the visible GPUs, at most one each: with Ray's default of no GPU, an actor
    does not see the GPUs at all and vLLM's CUDA build cannot start there."""

    def shares(replicas: int, services: int = 0) -> dict[str, float]:
        if not torch.cuda.is_available():
            return {}
        per_gpu = math.ceil((replicas + services) / torch.cuda.device_count())
        share = 1.0 / per_gpu  # engines that pack evenly, per_gpu of them on each GPU
        return {"num_gpus": share, "guidance_gpus": share if services else 0.0}

    return shares


@pytest.fixture(scope="session")
def real_pair():
    """The real pretrained pair (`verl.utils.real_model.RealPair`): `.guidance` is the folder of
    SmolLM2-135M-Instruct, `.draft` the same model without four middle decoder layers; same
    tokenizer and chat template. Built once under the repository's `.cache/real/` (about 30 s on
    2 cores) and reused by later sessions while the recipe is unchanged."""
    from verl.utils.real_model import build_pair

    return build_pair()
