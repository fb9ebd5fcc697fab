"""Test tiers: plain unit tests, `vllm`, `e2e`, `gpu` (skipped cleanly when CUDA is absent)."""

from __future__ import annotations

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
def real_pair():
    """The real pretrained pair (`verl.utils.real_model.RealPair`): `.guidance` is the folder of
    SmolLM2-135M-Instruct, `.draft` the same model without four middle decoder layers; same
    tokenizer and chat template. Built once under the repository's `.cache/real/` (about 30 s on
    2 cores) and reused by later sessions while the recipe is unchanged."""
    from verl.utils.real_model import build_pair

    return build_pair()
