"""Synthetic RL batches in EasyR1's layout, for tests and benchmarks (no rollout needed)."""

from __future__ import annotations

import numpy as np
import torch

from verl.protocol import DataProto


def synthetic_rl_batch(
    batch_size: int,
    prompt_length: int,
    response_length: int,
    vocab_size: int,
    seed: int = 0,
    group_size: int = 1,
    min_prompt: int = 1,
    min_response: int = 1,
) -> DataProto:
    """Random left-padded prompts and right-padded responses of random lengths.

    Tensors: input_ids / attention_mask / position_ids (B, P+T), prompts (B, P), responses and
    response_mask (B, T), token_level_scores (B, T) with a 0/1 outcome on the last valid token.
    Non-tensors: uid (one per group of `group_size` consecutive rows). Token 0 is padding.
    """
    gen = torch.Generator().manual_seed(seed)
    p_len = torch.randint(min_prompt, prompt_length + 1, (batch_size,), generator=gen)
    r_len = torch.randint(min_response, response_length + 1, (batch_size,), generator=gen)
    cols_p, cols_r = torch.arange(prompt_length), torch.arange(response_length)
    prompt_mask = (cols_p >= prompt_length - p_len.unsqueeze(1)).long()
    response_mask = (cols_r < r_len.unsqueeze(1)).long()
    prompts = torch.randint(1, vocab_size, (batch_size, prompt_length), generator=gen) * prompt_mask
    responses = (
        torch.randint(1, vocab_size, (batch_size, response_length), generator=gen) * response_mask
    )
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0) * attention_mask
    scores = torch.zeros(batch_size, response_length)
    scores[torch.arange(batch_size), r_len - 1] = torch.randint(
        0, 2, (batch_size,), generator=gen
    ).float()
    uid = np.array([f"g{i // group_size}" for i in range(batch_size)], dtype=object)
    return DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask.float(),
            "token_level_scores": scores,
        },
        {"uid": uid},
    )
