"""A tiny Qwen2.5-VL-architecture model, its tokenizer and image processor, and images to look at,
built by the project's own code (no model hub here).

The text side is the char tokenizer of `tiny_lm` plus Qwen2.5-VL's four vision tokens, and a
chat template that renders an image part of a message as `<|vision_start|><|image_pad|>
<|vision_end|>` (one pad per image: the processor expands it to one pad per merged patch). The
image processor is transformers' `Qwen2VLImageProcessorPil` (no torchvision needed) with a small
pixel budget. The model loads in transformers (`Qwen2_5_VLForConditionalGeneration`) and in vLLM
(`verl_patches.qwen_vl_images` where torchvision does not import). vLLM's CPU attention needs
a head size of 32, 64, 80 or more: the language model's heads are 64 wide.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass

import torch

from verl.tasks.tiny_lm import build_char_tokenizer

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")  # fmt: skip
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
PATCH, MERGE, TEMPORAL = 14, 2, 2
"""Qwen2.5-VL's patch side (pixels), spatial merge (patches per side of one image token) and
temporal patch (frames; a still image is repeated)."""
VLM_CHAT_TEMPLATE = (  # tiny_lm's template, with a message's content also a list of parts
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class TinyVLMSpec:
    """Shape of a tiny Qwen2.5-VL model and its image budget."""

    hidden_size: int = 128
    """Language model width; a multiple of 64 (head_dim)."""
    num_hidden_layers: int = 2
    """Language model decoder layers."""
    vocab_size: int = 128
    """Embedding rows; at least the tokenizer's vocabulary."""
    vision_hidden_size: int = 64
    """Vision tower width."""
    vision_depth: int = 2
    """Vision tower blocks (the last one full attention, the others windowed)."""
    min_pixels: int = 4 * (PATCH * MERGE) ** 2
    """Smallest image area after resizing (pixels): at least 4 image tokens."""
    max_pixels: int = 16 * (PATCH * MERGE) ** 2
    """Largest image area after resizing (pixels): at most 16 image tokens."""
    tie_word_embeddings: bool = True
    """The LM head shares the embedding matrix."""
    seed: int = 0
    """Initialisation seed."""


def build_vlm_tokenizer():
    """The char tokenizer with Qwen2.5-VL's vision tokens and the image-aware chat template."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def build_image_processor(spec: TinyVLMSpec):
    """transformers' torchvision-free Qwen2-VL image processor with the spec's pixel budget."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels,
                                    patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL)  # fmt: skip


def build_tiny_qwen2_5_vl(spec: TinyVLMSpec, tokenizer=None):
    """A randomly initialised Qwen2_5_VLForConditionalGeneration of `spec` whose special ids match
    the tokenizer."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = tokenizer or build_vlm_tokenizer()
    if spec.hidden_size % 64:
        raise ValueError(f"hidden_size must be a multiple of 64 (head_dim), got {spec.hidden_size}")
    if spec.vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {spec.vocab_size} is smaller than the tokenizer's {len(tokenizer)}")  # fmt: skip
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in VISION_TOKENS}
    heads = spec.hidden_size // 64
    # multimodal rotary positions: (temporal, height, width) sections of head_dim / 2 = 32
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}
    text = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=2 * spec.hidden_size,
                num_hidden_layers=spec.num_hidden_layers, num_attention_heads=heads, num_key_value_heads=1,
                max_position_embeddings=512, rope_parameters=rope, bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    vision = dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden_size,
                  intermediate_size=2 * spec.vision_hidden_size, num_heads=1, out_hidden_size=spec.hidden_size,
                  patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL,
                  window_size=PATCH * MERGE * 2, fullatt_block_indexes=[spec.vision_depth - 1])  # fmt: skip
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=spec.tie_word_embeddings,
                              image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
                              vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END])  # fmt: skip
    torch.manual_seed(spec.seed)
    return Qwen2_5_VLForConditionalGeneration(config)


def build_processor(spec: TinyVLMSpec):
    """The Qwen2.5-VL processor of `spec` (tokenizer, image processor, chat template) in memory, of
    the class `verl.utils.vision.load_processor` loads a saved one with."""
    from verl.utils.vision import processor_class

    return processor_class()(image_processor=build_image_processor(spec), tokenizer=build_vlm_tokenizer(),
                             chat_template=VLM_CHAT_TEMPLATE)  # fmt: skip


def save_tiny_vlm(path: str, spec: TinyVLMSpec | None = None, model=None) -> str:
    """Write a tiny VLM (built from `spec` unless given), its tokenizer, image processor and chat
    template to `path`: a folder transformers, vLLM and `verl.utils.vision.load_processor` load."""
    spec = spec or TinyVLMSpec()
    tokenizer = build_vlm_tokenizer()
    model = model or build_tiny_qwen2_5_vl(spec, tokenizer)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    build_image_processor(spec).save_pretrained(path)
    with open(os.path.join(path, "tiny_vlm_spec.json"), "w") as f:
        json.dump(asdict(spec), f)
    return path


COLORS = ("red", "blue", "green", "black")


def draw_shapes(count: int, size: int = 56, seed: int = 0, color: str | None = None, cell: int = 8):
    """A white `size` x `size` RGB image with `count` filled squares that do not overlap, one per
    cell of a `cell`-pixel grid, the cells drawn by `seed` (one colour each unless `color`): a
    picture to count. With `cell` = `PATCH` every square fills the middle of one image patch."""
    from PIL import Image, ImageDraw

    cells = [
        (x, y) for x in range(0, size - cell + 1, cell) for y in range(0, size - cell + 1, cell)
    ]
    if not 0 <= count <= len(cells):
        raise ValueError(
            f"count must be in [0, {len(cells)}] for a {size}-pixel image of {cell}-pixel cells, got {count}"
        )
    rng = random.Random(seed)
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    margin = cell // 7  # 1 pixel in an 8-pixel cell, 2 in a 14-pixel one
    for x, y in rng.sample(cells, count):
        draw.rectangle([x + margin, y + margin, x + cell - 1 - margin, y + cell - 1 - margin],
                       fill=color or rng.choice(COLORS))  # fmt: skip
    return image


def write_count_data(folder: str, rows: int, seed: int = 0, max_count: int = 5) -> str:
    """`rows` pictures of 1..`max_count` squares (PNG files) and `data.jsonl` beside them, one row
    each as EasyR1 takes it: `prompt` "<image>How many squares?", `images` [file name, relative
    to the folder: `data.image_dir`], `answer` the count. Returns the jsonl's path."""
    rng = random.Random(seed)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "data.jsonl"), "w") as f:
        for i in range(rows):
            count = rng.randint(1, max_count)
            name = f"count_{i}.png"
            draw_shapes(count, seed=rng.randrange(2**31)).save(os.path.join(folder, name))
            f.write(
                json.dumps(
                    {"prompt": "<image>How many squares?", "images": [name], "answer": str(count)}
                )
                + "\n"
            )
    return os.path.join(folder, "data.jsonl")
