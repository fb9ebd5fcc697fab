"""GPU tier (skipped without CUDA): `free_cache_engine` puts the draft engine and its guidance
engine to sleep between generations, freeing their KV caches and weights on the device, and after
waking they sample exactly what they sampled before (same seeds)."""

from __future__ import annotations

import pytest
import torch
from test_vllm_rollout import PROMPTS, VOCAB, assert_same_sequences, prompt_batch, rollout_config

from verl.tasks.tiny_lm import TinyLMSpec, save_tiny_lm

pytestmark = pytest.mark.gpu
GiB = 2**30


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@pytest.mark.parametrize("guided", [False, True])
def test_sleep_frees_the_engines_memory_and_waking_samples_the_same(tmp_path, guided):
    from transformers import AutoTokenizer

    from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout

    draft = save_tiny_lm(str(tmp_path / "d"), TinyLMSpec(hidden_size=128, num_hidden_layers=2, vocab_size=VOCAB, seed=1))  # fmt: skip
    guide = save_tiny_lm(str(tmp_path / "g"), TinyLMSpec(hidden_size=256, num_hidden_layers=2, vocab_size=VOCAB, seed=2))  # fmt: skip
    config = rollout_config(guide if guided else None)
    config.gpu_memory_utilization = 0.1  # KV caches of about 8 GB on an 80 GB card
    config.offpolicy_guidance.gpu_memory_utilization = 0.1
    assert config.free_cache_engine
    tok = AutoTokenizer.from_pretrained(draft)
    rollout = VLLMRollout(draft, config, tok.eos_token_id, tok.pad_token_id)
    try:
        assert rollout.sleep_mode
        batch = prompt_batch(tok, PROMPTS, n=4, temperature=1.0, global_step=1, lam=0.5)
        first = rollout.generate_sequences(batch)
        awake = _free()
        rollout.sleep()
        asleep = _free()
        total = torch.cuda.mem_get_info()[1]
        engines = 2 if guided else 1
        # each engine's KV cache (most of its 10 % share) is given back
        assert asleep - awake > 0.8 * engines * 0.1 * total - 2 * GiB, (awake / GiB, asleep / GiB)
        rollout.wake_up(("weights",))  # what a weight sync does first; the KV cache still sleeps
        assert rollout._awake == {"weights"}
        again = rollout.generate_sequences(batch)
        assert _free() < asleep  # awake again
        assert_same_sequences(first, again)
    finally:
        rollout.shutdown()
