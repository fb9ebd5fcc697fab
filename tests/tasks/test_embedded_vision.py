"""The embedded vision task `count`: its pictures hold as many squares as the answer says, one per
image patch; its supervised sequences are the RL dataset's prompts with the processor's image
inputs; a batched forward with per-row pictures equals one forward per row; a tiny build writes a
pair that transformers and our processor load, and is reused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from verl.tasks.embedded import (
    SFTSpec,
    _encoded,
    _logits,
    build_embedded,
    load_embedded,
    sampled_row_accuracy,
    snapshot_report,
)
from verl.tasks.embedded_vision import (
    COUNT_IMAGE_SIZE,
    COUNT_MAX,
    COUNT_PROMPT,
    COUNT_PROMPT_LENGTH,
    COUNT_TEST_SIZE,
    COUNT_TRAIN_SIZE,
    count_encode,
    count_split,
)
from verl.tasks.tiny_vlm import (
    PATCH,
    TinyVLMSpec,
    build_processor,
    build_tiny_qwen2_5_vl,
    draw_shapes,
)
from verl.utils.vision import mm_token_type_ids

SMALL = TinyVLMSpec(
    hidden_size=64, num_hidden_layers=1, vision_hidden_size=32, vision_depth=1, seed=3
)


def patches_in_use(image) -> tuple[int, bool]:
    """(patches holding a coloured pixel, whether every coloured pixel keeps 2 pixels from its
    patch's edges): a square that straddled two patches would break the second."""
    pixels = np.asarray(image)
    coloured = (pixels != 255).any(-1)
    cells = coloured.reshape(4, PATCH, 4, PATCH).transpose(0, 2, 1, 3)  # (row, col, y, x)
    inner = np.zeros((PATCH, PATCH), dtype=bool)
    inner[2 : PATCH - 2, 2 : PATCH - 2] = True
    return int(cells.any((-1, -2)).sum()), bool((cells & ~inner).sum() == 0)


def test_every_picture_holds_its_answer_one_square_per_patch():
    test, train = count_split("test"), count_split("train")
    assert test == count_split("test")  # drawn once from the seed (PIL images compare by pixels)
    assert len(test) == COUNT_TEST_SIZE and len(train) == COUNT_TRAIN_SIZE
    for row in test + train[:500]:
        image = row["images"][0]
        assert image.size == (COUNT_IMAGE_SIZE, COUNT_IMAGE_SIZE) and row["prompt"] == COUNT_PROMPT
        used, inside = patches_in_use(image)
        assert str(used) == row["answer"] and inside
    counts = [int(r["answer"]) for r in train]
    assert set(counts) == set(range(1, COUNT_MAX + 1))
    # each count near 1/9 of the rows: 3,000 draws, a share's standard error is 0.57 points
    assert all(abs(counts.count(k) / len(counts) - 1 / 9) < 0.03 for k in range(1, 10))
    # the splits share pictures of few squares only (1 square: 64 pictures; 4: 1,820 x 4^4)
    held_out = {r["images"][0].tobytes() for r in test}
    shared = [int(r["answer"]) for r in train if r["images"][0].tobytes() in held_out]
    assert shared and max(shared) <= 3
    assert load_embedded("embedded://count@test")[7]["answer"] == test[7]["answer"]


def test_the_patch_cells_keep_the_8_pixel_pictures_as_they_were():
    """`draw_shapes`' default cells (8 pixels, the tests' pictures) draw what they drew before the
    cell size became a parameter: the first square of seed 0 spans (x + 1 .. x + 6)."""
    pixels = np.asarray(draw_shapes(1, seed=0, color="black"))
    ys, xs = np.nonzero((pixels != 255).any(-1))
    assert xs.max() - xs.min() == 5 and ys.max() - ys.min() == 5 and xs.min() % 8 == 1
    with pytest.raises(ValueError, match=r"count must be in \[0, 16\] for a 56-pixel image of 14-pixel cells, got 17"):  # fmt: skip
        draw_shapes(17, cell=PATCH)


def test_supervised_sequences_are_the_rl_datasets_prompts_with_the_processors_images(tmp_path):
    from verl.tasks.tiny_vlm import save_tiny_vlm
    from verl.utils.dataset import ImageSettings, PromptEncoder, RLDataset

    rows = count_split("test")[:6]
    processor = build_processor(SMALL)
    ids, mask, inputs = count_encode(rows, processor)
    assert ids.shape == (6, COUNT_PROMPT_LENGTH + 2)  # the digit and EOS after the prompt
    assert mask.sum(-1).tolist() == [2] * 6 and mask[:, -2:].all()
    assert [processor.tokenizer.decode(i[-2:-1]) for i in ids] == [r["answer"] for r in rows]
    eos = processor.tokenizer.eos_token_id
    assert (ids[:, -1] == eos).all()
    assert torch.equal(
        inputs["mm_token_type_ids"], mm_token_type_ids(ids, processor.image_token_id)
    )
    assert inputs["mm_token_type_ids"].sum(-1).tolist() == [4] * 6  # 2 x 2 merged patches each
    # the RL dataset renders the same prompt (no chat template, as the overlay runs), and the same
    # pixels: its item's VisionPrompt is what the rollout and the actor receive
    path = save_tiny_vlm(str(tmp_path / "vlm"), SMALL)
    encoder = PromptEncoder(processor.tokenizer, COUNT_PROMPT_LENGTH, apply_chat_template=False)
    dataset = RLDataset(
        "embedded://count@test", encoder, "prompt", "answer", images=ImageSettings(path)
    )
    assert (
        len(dataset) == COUNT_TEST_SIZE and dataset.num_filtered == 0
    )  # every prompt is 12 tokens
    for i in range(len(rows)):
        _, answer, _, _, vision = dataset[i]
        assert (
            vision.input_ids == ids[i, :COUNT_PROMPT_LENGTH].tolist()
            and answer == rows[i]["answer"]
        )
        assert len(vision.raw_prompt_ids) == COUNT_PROMPT_LENGTH - 3  # one pad for the 4
        assert torch.equal(vision.pixel_values, inputs["pixel_values"][i])


def test_a_batched_forward_with_per_row_pictures_equals_one_forward_per_row():
    processor = build_processor(SMALL)
    model = build_tiny_qwen2_5_vl(SMALL, processor.tokenizer).eval()
    rows = count_split("test")[:5]
    ids, _, inputs = _encoded(count_encode, rows, processor)
    with torch.no_grad():
        batched = _logits(model, ids, inputs)
        for i, row in enumerate(rows):
            alone = processor.image_processor(images=row["images"], return_tensors="pt")
            single = model(input_ids=ids[i : i + 1], pixel_values=alone["pixel_values"],
                           image_grid_thw=alone["image_grid_thw"],
                           mm_token_type_ids=inputs["mm_token_type_ids"][i : i + 1]).logits  # fmt: skip
            torch.testing.assert_close(batched[i : i + 1], single, rtol=0, atol=1e-5)
        # the measure reads the picture: another row's picture changes a row's answer probability
        swapped = {**inputs, "pixel_values": inputs["pixel_values"].roll(1, 0)}
        assert not torch.allclose(_logits(model, ids, swapped), batched, atol=1e-4)
    accuracy = sampled_row_accuracy(model, rows, processor, encode=count_encode)
    assert accuracy.shape == (5,) and ((accuracy > 0) & (accuracy < 1e-2)).all()  # untrained


def test_a_tiny_build_writes_a_vlm_pair_that_loads_and_is_cached(tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    from verl.utils.vision import load_processor

    spec = SFTSpec(SMALL, {"draft": 0.5, "guidance": 1.0}, max_steps=4, eval_every=2, batch_size=8)
    logs: list[str] = []
    built = build_embedded(str(tmp_path / "count"), spec, log=logs.append, task="count")
    with open(tmp_path / "count" / "guidance" / "embedded.json") as f:
        record = json.load(f)
    assert record["task"] == "count" and record["measure"] == "sampled"
    assert [step for step, _ in record["curve"]] == [0, 2, 4]  # below 1 % of 50 %: every 2
    assert any("below its target" in line for line in logs)
    for name in ("draft", "guidance"):
        folder = str(tmp_path / "count" / name)
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder)
        assert model.config.text_config.hidden_size == SMALL.hidden_size
        assert load_processor(folder).image_token_id == build_processor(SMALL).image_token_id
    logs.clear()
    assert build_embedded(str(tmp_path / "count"), spec, log=logs.append, task="count") == built
    assert not logs
    # the report reads the saved snapshot back: its sampled accuracy is the build's
    report = snapshot_report(built["draft"], "count")
    assert report["sampled"] == pytest.approx(built["draft_accuracy"], abs=1e-6)
    assert set(report["sampled_by_answer"]) == {str(k) for k in range(1, COUNT_MAX + 1)}
    assert 0 <= report["greedy"] <= 1 and 0.9 < report["all_fail_8"] <= 1  # barely trained
