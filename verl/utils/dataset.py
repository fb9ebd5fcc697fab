"""Prompt datasets for RL: jsonl, parquet, Hugging Face `datasets`, and the embedded task.

`data.train_files` / `data.val_files` accept:
- `path/to/file.jsonl` (or `.json`), `path/to/file.parquet`;
- a local folder written by `datasets.save_to_disk`, or any folder `datasets.load_dataset` reads;
- `name@split` for a Hugging Face dataset: its snapshot in the local hub cache, downloaded first
  when missing and the hub may be reached (as models are: `verl.utils.model_path.hub_snapshot`);
- `embedded://arithmetic@train` / `@test`, built by `verl/tasks/embedded.py`: a registered
  scheme (`register_row_source`); the package that defines a scheme registers it when imported.

Each prompt is wrapped in the format-prompt template (a Jinja file with `{{ content }}`) when one
is given, then in the tokenizer's chat template unless `data.apply_chat_template` is false, and
left-padded to `max_prompt_length`; longer prompts are dropped and counted (or refused).

Rows with images (a `data.image_key` column, `verl.utils.vision`): every image is read when the
dataset is built (a missing or unreadable one is refused in one line naming the row and the
file) and the prompt's length counted as the model sees it (one pad per merged patch); the pixels
are computed when a row is drawn (`__getitem__`), so a large image set is never held at once.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

DATA_FORMS = (
    "valid: a .jsonl/.json/.parquet file, a dataset folder, embedded://<task>@train|test, or "
    "name@split of a Hugging Face dataset in the local cache or reachable on the hub"
)
"""What `data.train_files` / `data.val_files` take, for the one-line errors."""

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""Data file extension -> `datasets` builder."""

ROW_SOURCES: dict[str, Callable[[str], list[dict]]] = {}
"""A spec's scheme (e.g. `embedded://`) -> the function that gives its rows (raising ValueError
for an unknown one); filled by `register_row_source` in the module that defines the scheme."""


def register_row_source(scheme: str) -> Callable:
    """Decorator: `fn(spec) -> rows` answers every `data.*_files` value that starts with `scheme`."""

    def register(fn: Callable[[str], list[dict]]) -> Callable[[str], list[dict]]:
        ROW_SOURCES[scheme] = fn
        return fn

    return register


def _scheme_rows(spec: str, key: str) -> list[dict] | None:
    """The rows of a spec in a registered scheme (None: not one), errors naming `key`."""
    for scheme, rows in ROW_SOURCES.items():
        if spec.startswith(scheme):
            try:
                return rows(spec)
            except ValueError as error:
                raise ValueError(f"{key}: {error}") from None
    return None


def resolve_data(spec: str, key: str = "data", download: bool = True) -> str | None:
    """Where `spec` loads from: itself for a local file (of a known format), a folder or an
    embedded spec (a known task and split), else the local snapshot folder of the hub dataset of
    `name@split`, cached or downloaded as models are (`verl.utils.model_path.hub_snapshot`; with
    `download=False`, None for one a run would download). Raises FileNotFoundError or ValueError
    in one line naming `key`, `spec` and what is valid."""
    if _scheme_rows(spec, key) is not None:
        return spec
    if os.path.isfile(spec):
        if os.path.splitext(spec)[1] not in FILE_FORMATS:
            raise ValueError(f"{key}: data file {spec!r}: unknown format; valid: .jsonl, .json, .parquet")  # fmt: skip
        return spec
    if os.path.isdir(spec):
        return spec
    from verl.utils.model_path import hub_snapshot, parse_hub_id

    name, sep, split = spec.partition("@")
    hub_id = parse_hub_id(name) if sep and split else None
    if hub_id is None:
        where = "" if os.path.isabs(spec) else f" (relative to {os.getcwd()})"
        raise FileNotFoundError(f"{key}: {spec!r} is not a file or folder{where}; {DATA_FORMS}")
    try:
        return hub_snapshot(hub_id[0], repo_type="dataset", download=download)
    except LookupError as why:
        raise FileNotFoundError(
            f"{key}: {spec!r} is not a file or folder, and as a hub dataset it is {why}; {DATA_FORMS}"
        ) from None


def load_rows(spec: str, key: str = "data") -> list[dict]:
    """The rows of a dataset given in any form listed in the module docstring; `key` (the config
    key it came from) names it in the one-line errors."""
    rows = _scheme_rows(spec, key)
    if rows is not None:
        return rows
    source = resolve_data(spec, key)
    import datasets

    bars, verbosity = datasets.is_progress_bar_enabled(), datasets.logging.get_verbosity()
    datasets.disable_progress_bars()  # "Generating train split" bars: not the run's output
    # its log line of a failed read would come before the error line, which says the same
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        return _read_rows(datasets, spec, source)
    except Exception as error:  # a malformed or unreadable file, an unknown split, ...
        cause = error.__cause__ or error  # datasets wraps the reader's own error
        text = (str(cause).strip().splitlines() or [""])[0]
        where = "" if source == spec else f" (hub snapshot {source})"
        raise ValueError(f"{key}: {spec!r}{where} cannot be read: {type(cause).__name__}: {text}; "
                         f"{DATA_FORMS}") from None  # fmt: skip
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def _read_rows(datasets, spec: str, source: str) -> list[dict]:
    """The rows of a local file, a local folder or a hub snapshot folder (`source`, resolved
    from `spec`) read with `datasets`."""
    if os.path.isfile(source):
        kind = FILE_FORMATS[os.path.splitext(source)[1]]
        return list(datasets.load_dataset(kind, data_files=source, split="train"))
    if source == spec:  # a local folder
        if os.path.isfile(os.path.join(spec, "dataset_info.json")):
            loaded = datasets.load_from_disk(spec)
            return list(loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded)
        return list(datasets.load_dataset(spec, split="train"))
    return list(datasets.load_dataset(source, split=spec.partition("@")[2]))


@dataclass
class PromptEncoder:
    """Turns a raw prompt string into left-padded token ids."""

    tokenizer: object
    max_prompt_length: int
    apply_chat_template: bool = True
    format_prompt: str | None = None
    system_prompt: str | None = None
    """A system message before the prompt (chat template only): a multi-turn run's tool
    instructions (`tool_instructions`)."""

    def __post_init__(self) -> None:
        self._template = None
        if self.format_prompt:
            import jinja2

            if not os.path.isfile(self.format_prompt):
                raise FileNotFoundError(
                    f"data.format_prompt: file {self.format_prompt!r} not found"
                )
            with open(self.format_prompt) as f:
                self._template = jinja2.Template(f.read())

    def format(self, prompt: str) -> str:
        """The prompt in the format-prompt template (as given without one)."""
        return self._template.render(content=prompt) if self._template is not None else prompt

    def text(self, prompt: str, num_images: int = 0, where: str = "prompt") -> str:
        """The prompt as the model sees it (template and chat template applied); with images, each
        `<image>` (or, without placeholders, each image before the text) as the chat template
        renders an image part, one pad per image (without a chat template: Qwen's markers)."""
        from verl.utils.vision import IMAGE_PLACEHOLDER, QWEN_IMAGE, image_messages

        prompt = self.format(prompt)
        if self.apply_chat_template:
            if num_images:
                messages = image_messages(prompt, num_images, where, self.system_prompt)
            else:
                messages = [{"role": "user", "content": prompt}]
                if self.system_prompt:
                    messages.insert(0, {"role": "system", "content": self.system_prompt})
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        if num_images:
            image_messages(prompt, num_images, where)  # the placeholder count, checked
            if IMAGE_PLACEHOLDER not in prompt:
                prompt = IMAGE_PLACEHOLDER * num_images + prompt
            return prompt.replace(IMAGE_PLACEHOLDER, QWEN_IMAGE)
        return prompt

    def ids(self, prompt: str, num_images: int = 0, where: str = "prompt") -> list[int]:
        """Token ids of the processed prompt (no padding; one pad per image)."""
        text = self.text(prompt, num_images, where)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class ImageSettings:
    """How a dataset's images are read: `data.image_key`, `image_dir`, `min_pixels`, `max_pixels`,
    and the processor of the model in `model_path` (loaded when a dataset has images)."""

    model_path: str
    image_key: str = "images"
    image_dir: str | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None

    @functools.cached_property
    def processor(self):
        """The model's processor (`verl.utils.vision.load_processor`); a model without an image
        processor is refused in one line."""
        from verl.utils.vision import load_processor

        if not os.path.isfile(os.path.join(self.model_path, "preprocessor_config.json")):
            raise ValueError(f"data.image_key: the data has a {self.image_key!r} column but {self.model_path!r} has no image processor (preprocessor_config.json); valid: a vision-language model (Qwen2.5-VL family), or data without images")  # fmt: skip
        return load_processor(self.model_path)

    def images(self, row: dict, where: str) -> list:
        """The row's images as RGB PIL images, each resized (aspect kept) into the pixel budget."""
        from verl.utils.vision import fit_pixels, load_image

        value = row.get(self.image_key)
        values = [] if value is None else value if isinstance(value, list | tuple) else [value]
        return [fit_pixels(load_image(v, where, self.image_dir), self.min_pixels, self.max_pixels)
                for v in values]  # fmt: skip

    def model_length(self, ids: list[int], images: list) -> int:
        """Tokens of the prompt as the model sees it: each image pad becomes one per merged patch."""
        if not images:
            return len(ids)
        processor = self.processor.image_processor
        merge = processor.merge_size**2
        patches = [processor.get_number_of_image_patches(im.height, im.width, {}) for im in images]
        return len(ids) - len(images) + sum(n // merge for n in patches)


class RLDataset(torch.utils.data.Dataset):
    """Tokenised prompts with their ground truth; overlong prompts filtered and counted. With
    `images` (and rows that have the image column) an item also carries the row's images."""

    def __init__(self, spec: str, encoder: PromptEncoder, prompt_key: str, answer_key: str,
                 filter_overlong: bool = True, key: str = "data",
                 images: ImageSettings | None = None) -> None:  # fmt: skip
        rows = load_rows(spec, key)
        if not rows:
            raise ValueError(f"{key}: {spec!r} has no rows")
        for column in (prompt_key, answer_key):
            if column not in rows[0]:
                raise KeyError(
                    f"{key}: {spec!r} has no column {column!r}; columns: {', '.join(rows[0])}"
                )
        self.images = images if images is not None and images.image_key in rows[0] else None
        self.rows = rows if self.images else None
        if self.images:
            self.images.processor  # noqa: B018 (loaded now: a model without one is refused first)
        self.encoder, self.items, self.num_filtered = encoder, [], 0
        for index, row in enumerate(rows):
            where = f"{key}: {spec!r} row {index}"
            pictures = self.images.images(row, where) if self.images else []
            ids = encoder.ids(str(row[prompt_key]), len(pictures), where)
            length = self.images.model_length(ids, pictures) if pictures else len(ids)
            if length > encoder.max_prompt_length:
                if not filter_overlong:
                    raise ValueError(
                        f"{where}: prompt of {length} tokens > data.max_prompt_length="
                        f"{encoder.max_prompt_length} (set data.filter_overlong_prompts=true to drop such rows)"
                    )
                self.num_filtered += 1
                continue
            self.items.append((ids, str(row[answer_key]), str(row[prompt_key]), index))
        if not self.items:
            raise ValueError(f"{key}: {spec!r}: every prompt is longer than data.max_prompt_length")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        """(prompt ids, answer, raw prompt, row index), and with images the row's `VisionPrompt`
        (prompt ids then one image pad per image, the engine's)."""
        if self.images is None:
            return self.items[index]
        from verl.utils.vision import vision_inputs

        ids, answer, prompt, row = self.items[index]
        where = f"row {row}"
        pictures = self.images.images(self.rows[row], where)
        text = self.encoder.text(prompt, len(pictures), where)
        return ids, answer, prompt, row, vision_inputs(self.images.processor, text, pictures, where)


def collate(items, max_prompt_length: int, pad_token_id: int) -> dict:
    """Left-pad a list of dataset items into one dict of (B, P) tensors (input_ids,
    attention_mask, position_ids) and (B,) arrays (ground_truth, raw_prompt, index): the trainer
    makes it a DataProto (`DataProto.from_single_dict`). Items with images (`RLDataset` with
    `ImageSettings`) pad the model's prompt (one pad per merged patch) and add, per row, the
    engine's prompt (`raw_prompt_ids`), its images (`multi_modal_data`, {"image": [...]} or
    None) and the model's image inputs (`multi_modal_inputs`, EasyR1's names)."""
    vision = [it[4] if len(it) > 4 else None for it in items]
    prompts = [v.input_ids if v is not None else it[0] for it, v in zip(items, vision)]
    ids = torch.full((len(items), max_prompt_length), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(items), max_prompt_length, dtype=torch.long)
    for i, tokens in enumerate(prompts):
        ids[i, max_prompt_length - len(tokens) :] = torch.tensor(tokens)
        mask[i, max_prompt_length - len(tokens) :] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0) * mask
    out = {
        "input_ids": ids, "attention_mask": mask, "position_ids": position_ids,
        "ground_truth": np.array([it[1] for it in items], dtype=object),
        "raw_prompt": np.array([it[2] for it in items], dtype=object),
        "index": np.array([it[3] for it in items], dtype=np.int64),
    }  # fmt: skip
    if any(v is not None for v in vision):
        out["raw_prompt_ids"] = _objects(
            [v.raw_prompt_ids if v else it[0] for it, v in zip(items, vision)]
        )
        out["multi_modal_data"] = _objects(
            [{"image": v.images} if v and v.images else None for v in vision]
        )
        out["multi_modal_inputs"] = _objects(
            [{"pixel_values": v.pixel_values, "image_grid_thw": v.image_grid_thw} if v and v.images else {}
             for v in vision])  # fmt: skip
    return out


def _objects(values: list) -> np.ndarray:
    """A (B,) object array of `values` (np.array would stack equal-length lists into 2-D)."""
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        array[i] = value
    return array


def build_dataloader(
    dataset: RLDataset, batch_size: int, shuffle: bool, seed: int, drop_last: bool
):
    """A `torchdata` StatefulDataLoader: its state_dict() resumes the same order mid-epoch."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    # torchdata's own call to a deprecated torch API warns at every epoch; nothing a user can act on
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
    tok = dataset.encoder.tokenizer
    return StatefulDataLoader(
        dataset, batch_size=min(batch_size, len(dataset)) if batch_size > 0 else len(dataset),
        shuffle=shuffle, drop_last=drop_last, generator=torch.Generator().manual_seed(seed),
        collate_fn=lambda items: collate(items, dataset.encoder.max_prompt_length, tok.pad_token_id),
    )  # fmt: skip
