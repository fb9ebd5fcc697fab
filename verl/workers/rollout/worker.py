"""The rollout as a Ray actor: owns the vLLM engines (draft here; guidance, when enabled, in a child process)."""

from __future__ import annotations

import os

import torch

from verl.protocol import DataProto
from verl.workers.rollout.config import RolloutConfig


class RolloutWorker:
    """Generates sequences with `VLLMRollout` and takes weight updates from the actor."""

    def __init__(self, model_path: str, config: RolloutConfig) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from transformers import AutoTokenizer

        from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.rollout = VLLMRollout(
            model_path, config, tokenizer.eos_token_id, tokenizer.pad_token_id
        )

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """`VLLMRollout.generate_sequences` (EasyR1 layout, guidance tensors when enabled)."""
        return self.rollout.generate_sequences(prompts)

    def sync_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the actor's current weights into the draft engine."""
        self.rollout.sync_weights(state_dict)

    def shutdown(self) -> None:
        """Stop the guidance engine's process (it also exits on its own if this actor dies)."""
        self.rollout.shutdown()
