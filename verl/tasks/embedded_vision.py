"""The embedded vision task `count`: how many squares a picture holds, for a tiny Qwen2.5-VL pair.

A prompt is one 56 x 56 picture and the text `count=`; the answer is the number of squares in the
picture, 1-9, one digit:

    prompt    <|vision_start|><|image_pad|><|vision_end|>count=     (the engine's: one pad)
    model     <|vision_start|> 4 x <|image_pad|> <|vision_end|>count=  (one pad per merged patch)
    response  7<EOS>

The picture is a 4 x 4 grid of 14-pixel cells, Qwen2.5-VL's patch side, and each square fills the
middle of one cell in one of four colours (`tiny_vlm.draw_shapes` with `cell=PATCH`): a square
never straddles two patches, so the count is the number of patches that are not blank. On the
8-pixel grid of the tests' pictures a tiny model stays at chance after 600 supervised steps; on
patch-aligned squares it counts every held-out picture right after about 250 (batch 64).

The data are EasyR1's row form with the pictures in memory: {"prompt": "<image>count=", "images":
[a PIL image], "answer": "7"}; the prompt is rendered as the RL dataset renders it without a chat
template (`PromptEncoder.text`), so the supervised run and the rollouts see the same tokens.
`count_encode` gives the supervised sequences and their image inputs (`embedded.supervised_snapshots`).
"""

from __future__ import annotations

import random

import torch

from verl.tasks.tiny_vlm import PATCH, draw_shapes
from verl.utils.dataset import PromptEncoder
from verl.utils.vision import mm_token_type_ids

COUNT_PROMPT = "<image>count="
"""Every row's prompt: one picture, then the question."""
COUNT_IMAGE_SIZE = 4 * PATCH
"""Side of a picture in pixels: 4 x 4 patches, merged into 2 x 2 image tokens."""
COUNT_MAX = 9
"""Squares per picture at most (at least 1): the answer is one digit."""
COUNT_TEST_SIZE = 500
"""Held-out rows."""
COUNT_TRAIN_SIZE = 3000
"""Training rows, drawn after the test rows. The splits share pictures of few squares (one square
has 16 cells x 4 colours: 64 pictures), never one of 4 squares or more."""
COUNT_PROMPT_LENGTH = 2 + 4 + len("count=")
"""Prompt length in the model's tokens: the two vision markers around 4 image pads, then the text (12)."""
COUNT_RESPONSE_LENGTH = 2
"""The digit and EOS."""


def count_split(split: str, seed: int = 0) -> list[dict]:
    """`COUNT_TEST_SIZE` test rows, then `COUNT_TRAIN_SIZE` train rows, drawn once from `seed`: a
    count uniform in 1..`COUNT_MAX`, then the cells and colours of its squares. Rows: {"prompt", "images": [PIL
    image], "answer": the count as a digit}."""
    if split not in ("train", "test"):
        raise ValueError(f"embedded split {split!r} is not valid; valid: train, test")
    rng = random.Random(seed)
    drawn = [(rng.randint(1, COUNT_MAX), rng.randrange(2**31))
             for _ in range(COUNT_TEST_SIZE + COUNT_TRAIN_SIZE)]  # fmt: skip
    chosen = drawn[:COUNT_TEST_SIZE] if split == "test" else drawn[COUNT_TEST_SIZE:]
    return [{"prompt": COUNT_PROMPT, "images": [_picture(count, layout)], "answer": str(count)}
            for count, layout in chosen]  # fmt: skip


def _picture(count: int, layout: int):
    """The picture of `count` squares whose cells and colours `layout` draws."""
    return draw_shapes(count, COUNT_IMAGE_SIZE, seed=layout, cell=PATCH)


def count_encode(rows: list[dict], processor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(N, L) ids of the model's prompt + answer + EOS (the same L for every row: every picture
    is `COUNT_IMAGE_SIZE` square), the mask of the answer and EOS, and the rows' image inputs,
    each (N, ...): `pixel_values` (N, patches, D), `image_grid_thw` (N, 3) and
    `mm_token_type_ids` (N, L) (`embedded._logits` packs them as the model takes them)."""
    from verl.utils.vision import vision_inputs

    tokenizer = processor.tokenizer
    text = PromptEncoder(tokenizer, COUNT_PROMPT_LENGTH, apply_chat_template=False).text(
        COUNT_PROMPT, 1
    )
    prompt = vision_inputs(processor, text, rows[0]["images"], "embedded count row 0").input_ids
    pictures = processor.image_processor(
        images=[row["images"][0] for row in rows], return_tensors="pt"
    )
    grids = pictures["image_grid_thw"]
    if not (grids == grids[0]).all():
        raise ValueError(f"count_encode: every picture must be {COUNT_IMAGE_SIZE} pixels square; image grids {grids.unique(dim=0).tolist()}")  # fmt: skip
    answers = [tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
               for row in rows]  # fmt: skip
    ids = torch.tensor([prompt + answer for answer in answers])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, len(prompt) :] = True
    inputs = {"pixel_values": pictures["pixel_values"].reshape(len(rows), -1, pictures["pixel_values"].shape[-1]),
              "image_grid_thw": grids, "mm_token_type_ids": mm_token_type_ids(ids, processor.image_token_id)}  # fmt: skip
    return ids, mask, inputs
