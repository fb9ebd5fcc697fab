"""verl.utils.vision: images of a row in each form EasyR1 accepts, the one-line errors of a
missing or unreadable image, placeholders to chat parts, and the engine prompt's check."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from verl.utils.vision import (
    ImagePrompt,
    check_engine_prompt,
    image_messages,
    load_image,
    mm_token_type_ids,
)


@pytest.fixture
def png(tmp_path):
    """(folder, file name, bytes) of a 4 x 3 red PNG."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 3), "red").save(buffer, format="PNG")
    (tmp_path / "red.png").write_bytes(buffer.getvalue())
    return tmp_path, "red.png", buffer.getvalue()


def test_every_form_of_an_image_loads_as_the_same_rgb_picture(png):
    from PIL import Image

    folder, name, data = png
    forms = [str(folder / name), data, {"bytes": data, "path": None}, {"bytes": None, "path": str(folder / name)},
             Image.open(io.BytesIO(data)).convert("L")]  # fmt: skip
    for form in forms:
        image = load_image(form, "row 0")
        assert image.mode == "RGB" and image.size == (4, 3)
    assert load_image(name, "row 0", image_dir=str(folder)).getpixel((0, 0)) == (255, 0, 0)
    assert load_image(forms[-1], "row 0").getpixel((0, 0)) == (
        76,
        76,
        76,
    )  # grey of red: 0.299 x 255


def test_a_missing_unreadable_or_odd_image_is_refused_naming_the_row(png):
    folder = png[0]
    (folder / "bad.png").write_text("not an image")
    with pytest.raises(
        FileNotFoundError, match=r"^data row 3: image file '.*/nope\.png' not found$"
    ):
        load_image("nope.png", "data row 3", image_dir=str(folder))
    with pytest.raises(ValueError, match=r"^data row 4: '.*/bad\.png' is not a readable image \("):
        load_image(str(folder / "bad.png"), "data row 4")
    with pytest.raises(
        ValueError, match=r"^data row 5: the row's image bytes is not a readable image"
    ):
        load_image(b"\x00\x01", "data row 5")
    with pytest.raises(
        TypeError, match=r"^data row 6: an image must be a path, bytes, .* got int$"
    ):
        load_image(7, "data row 6")


def test_placeholders_become_image_parts_in_place_or_images_go_first():
    assert image_messages("<image>How many? <image>", 2, "row 0") == [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "How many? "}, {"type": "image"}]}]  # fmt: skip
    assert image_messages("Count.", 2, "row 1", system_prompt="Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Count."}]}]  # fmt: skip
    with pytest.raises(
        ValueError, match=r"^row 2: the prompt has 2 <image> placeholders for 1 images; valid"
    ):
        image_messages("<image><image>", 1, "row 2")


def test_the_engine_prompt_takes_one_pad_per_image():
    check_engine_prompt([1, 9, 2, 9, 3], 2, 9, "row 0")
    with pytest.raises(
        ValueError, match=r"^row 1: the engine's prompt has 3 image pads for 1 images"
    ):
        check_engine_prompt([1, 9, 9, 9, 3], 1, 9, "row 1")
    assert mm_token_type_ids(torch.tensor([[1, 9, 9, 2]]), 9).tolist() == [[0, 1, 1, 0]]


@pytest.fixture(scope="module")
def vlm_folder(tmp_path_factory):
    from verl.tasks.tiny_vlm import TinyVLMSpec, save_tiny_vlm

    return save_tiny_vlm(
        str(tmp_path_factory.mktemp("vlm") / "model"),
        TinyVLMSpec(num_hidden_layers=1, vision_depth=1),
    )


def image_dataset(folder, data, **kwargs):
    from transformers import AutoTokenizer

    from verl.utils.dataset import ImageSettings, PromptEncoder, RLDataset

    encoder = PromptEncoder(
        AutoTokenizer.from_pretrained(folder), kwargs.pop("max_prompt_length", 64)
    )
    images = ImageSettings(folder, image_dir=str(data.parent), **kwargs)
    return RLDataset(str(data), encoder, "prompt", "answer", key="data.train_files", images=images)


def test_an_image_prompt_opens_on_the_raw_tokens_then_the_same_continuation():
    """The caller speaks expanded tokens (pad 9 three times for one image); the engine opens on the
    raw prompt (one pad) followed by whatever came after the expanded prompt; tokens that do not
    start with the expanded prompt are refused in one line."""
    opening = ImagePrompt(raw=[1, 9, 2], expanded=[1, 9, 9, 9, 2], data={"image": []})
    assert opening.engine_tokens([1, 9, 9, 9, 2]) == [1, 9, 2]
    assert opening.engine_tokens([1, 9, 9, 9, 2, 7, 8]) == [1, 9, 2, 7, 8]
    with pytest.raises(ValueError, match=r"^a session with images must open on its prompt's expanded tokens \(5 of them\); these 4 tokens start otherwise$"):  # fmt: skip
        opening.engine_tokens([1, 9, 2, 7])


def test_a_dataset_with_images_gives_the_engine_and_the_model_their_prompts(vlm_folder, tmp_path):
    """Rows as EasyR1 writes them (write_count_data): the model's prompt is the engine's with the
    image pad expanded to 4 (56 px: 2 x 2 merged patches), the counted length is the model's, and
    collate gives the engine's ids, the images and the pixel inputs per row."""
    from verl.tasks.tiny_vlm import write_count_data
    from verl.utils.dataset import collate

    data = image_dataset(vlm_folder, Path(write_count_data(str(tmp_path / "d"), 3)))
    pad = data.images.processor.image_token_id
    ids, _, prompt, row, vision = data[1]
    assert prompt == "<image>How many squares?" and row == 1
    assert ids == vision.raw_prompt_ids and ids.count(pad) == 1
    assert vision.input_ids.count(pad) == 4 and len(vision.input_ids) == len(ids) + 3
    batch = collate([data[i] for i in range(3)], 64, 0)
    assert batch["attention_mask"].sum(-1).tolist() == [len(ids) + 3] * 3
    assert [len(x) for x in batch["raw_prompt_ids"]] == [len(ids)] * 3
    assert [len(m["image"]) for m in batch["multi_modal_data"]] == [1, 1, 1]
    assert [tuple(m["pixel_values"].shape) for m in batch["multi_modal_inputs"]] == [(16, 1176)] * 3


def test_a_missing_image_or_a_text_model_is_refused_before_anything_runs(vlm_folder, tmp_path):
    from verl.tasks.tiny_lm import TinyLMSpec, save_tiny_lm
    from verl.tasks.tiny_vlm import draw_shapes

    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "<image>Hi", "images": ["gone.png"], "answer": "1"}\n')
    with pytest.raises(FileNotFoundError, match=r"^data.train_files: '.*data.jsonl' row 0: image file '.*/gone.png' not found$"):  # fmt: skip
        image_dataset(vlm_folder, data)
    text = save_tiny_lm(str(tmp_path / "lm"), TinyLMSpec(hidden_size=64, num_hidden_layers=1))
    draw_shapes(1).save(tmp_path / "gone.png")
    with pytest.raises(ValueError, match=r"^data.image_key: the data has a 'images' column but .* has no image processor"):  # fmt: skip
        image_dataset(text, data)
