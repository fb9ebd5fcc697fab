"""The image benchmark's text twin: the same prompts and lengths, every image pad a letter."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scripts import load

from verl.protocol import DataProto

B = load("bench_vision_rollout")


def test_the_text_twin_keeps_lengths_and_drops_the_images():
    import numpy as np

    ids = torch.tensor([[0, 5, 9, 9, 9, 6], [0, 0, 5, 9, 9, 6]])  # 9: the image pad, 0: padding
    mask = (ids != 0).long()
    batch = DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, meta_info={"lam": 0.5})
    batch.non_tensor_batch["multi_modal_data"] = np.array([{"image": []}] * 2, dtype=object)
    twin = B.text_twin(batch, image_token_id=9, letter=7)
    assert twin.batch["input_ids"].tolist() == [[0, 5, 7, 7, 7, 6], [0, 0, 5, 7, 7, 6]]
    assert torch.equal(twin.batch["attention_mask"], mask)
    assert twin.non_tensor_batch == {} and twin.meta_info == {"lam": 0.5}
    assert batch.batch["input_ids"][0, 2] == 9  # the image batch itself unchanged
