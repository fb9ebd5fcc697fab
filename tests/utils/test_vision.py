"""verl.utils.vision: images of a row in each form EasyR1 accepts, the one-line errors of a
missing or unreadable image, placeholders to chat parts, and the engine prompt's check."""

from __future__ import annotations

import io

import pytest
import torch

from verl.utils.vision import check_engine_prompt, image_messages, load_image, mm_token_type_ids


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
