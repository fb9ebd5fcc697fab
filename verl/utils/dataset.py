"""Prompt datasets for RL: jsonl, parquet, Hugging Face `datasets`, and the embedded task.

`data.train_files` / `data.val_files` accept:
- `path/to/file.jsonl` (or `.json`), `path/to/file.parquet`;
- a local folder written by `datasets.save_to_disk`, or any folder `datasets.load_dataset` reads;
- `name@split` for a Hugging Face dataset: its snapshot in the local hub cache, downloaded first
  when missing and the hub may be reached (as models are: `verl.utils.model_path.hub_snapshot`);
- `embedded://arithmetic@train` / `@test`, built by `verl/utils/embedded.py`.

Each prompt is wrapped in the format-prompt template (a Jinja file with `{{ content }}`) when one
is given, then in the tokenizer's chat template unless `data.apply_chat_template` is false, and
left-padded to `max_prompt_length`; longer prompts are dropped and counted (or refused).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from verl.utils.embedded import EMBEDDED_SCHEME, load_embedded

if TYPE_CHECKING:  # imported where a batch is made: a dry run never loads tensordict (about 2 s)
    from verl.protocol import DataProto

DATA_FORMS = (
    "valid: a .jsonl/.json/.parquet file, a dataset folder, embedded://<task>@train|test, or "
    "name@split of a Hugging Face dataset in the local cache or reachable on the hub"
)
"""What `data.train_files` / `data.val_files` take, for the one-line errors."""

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""Data file extension -> `datasets` builder."""


def resolve_data(spec: str, key: str = "data", download: bool = True) -> str | None:
    """Where `spec` loads from: itself for a local file (of a known format), a folder or an
    embedded spec (a known task and split), else the local snapshot folder of the hub dataset of
    `name@split`, cached or downloaded as models are (`verl.utils.model_path.hub_snapshot`; with
    `download=False`, None for one a run would download). Raises FileNotFoundError or ValueError
    in one line naming `key`, `spec` and what is valid."""
    if spec.startswith(EMBEDDED_SCHEME):
        try:
            load_embedded(spec)
        except ValueError as error:
            raise ValueError(f"{key}: {error}") from None
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
    if spec.startswith(EMBEDDED_SCHEME):
        try:
            return load_embedded(spec)
        except ValueError as error:
            raise ValueError(f"{key}: {error}") from None
    source = resolve_data(spec, key)
    import datasets

    if os.path.isfile(source):
        kind = FILE_FORMATS[os.path.splitext(source)[1]]
        return list(datasets.load_dataset(kind, data_files=source, split="train"))
    if source == spec:  # a local folder
        if os.path.isfile(os.path.join(spec, "dataset_info.json")):
            loaded = datasets.load_from_disk(spec)
            return list(loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded)
        return list(datasets.load_dataset(spec, split="train"))
    split = spec.partition("@")[2]
    try:  # the snapshot folder of a hub dataset
        return list(datasets.load_dataset(source, split=split))
    except Exception as error:  # an unknown split, files a partial snapshot lacks, ...
        text = (str(error).strip().splitlines() or [""])[0]
        raise ValueError(
            f"{key}: {spec!r} (hub snapshot {source}): {type(error).__name__}: {text}"
        ) from None


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

    def text(self, prompt: str) -> str:
        """The prompt as the model sees it (template and chat template applied)."""
        if self._template is not None:
            prompt = self._template.render(content=prompt)
        if self.apply_chat_template:
            messages = [{"role": "user", "content": prompt}]
            if self.system_prompt:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        return prompt

    def ids(self, prompt: str) -> list[int]:
        """Token ids of the processed prompt (no padding)."""
        return self.tokenizer(self.text(prompt), add_special_tokens=False)["input_ids"]


class RLDataset(torch.utils.data.Dataset):
    """Tokenised prompts with their ground truth; overlong prompts filtered and counted."""

    def __init__(self, spec: str, encoder: PromptEncoder, prompt_key: str, answer_key: str,
                 filter_overlong: bool = True, key: str = "data") -> None:  # fmt: skip
        rows = load_rows(spec, key)
        if not rows:
            raise ValueError(f"{key}: {spec!r} has no rows")
        for column in (prompt_key, answer_key):
            if column not in rows[0]:
                raise KeyError(
                    f"{key}: {spec!r} has no column {column!r}; columns: {', '.join(rows[0])}"
                )
        self.encoder, self.items, self.num_filtered = encoder, [], 0
        for index, row in enumerate(rows):
            ids = encoder.ids(str(row[prompt_key]))
            if len(ids) > encoder.max_prompt_length:
                if not filter_overlong:
                    raise ValueError(
                        f"{key}: {spec!r} row {index}: prompt of {len(ids)} tokens > data.max_prompt_length="
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
        return self.items[index]


def collate(items, max_prompt_length: int, pad_token_id: int) -> DataProto:
    """Left-pad a list of dataset items into a DataProto (+ ground_truth, raw_prompt, index)."""
    from verl.protocol import DataProto

    ids = torch.full((len(items), max_prompt_length), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(items), max_prompt_length, dtype=torch.long)
    for i, (tokens, *_) in enumerate(items):
        ids[i, max_prompt_length - len(tokens) :] = torch.tensor(tokens)
        mask[i, max_prompt_length - len(tokens) :] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0) * mask
    non_tensor = {
        "ground_truth": np.array([it[1] for it in items], dtype=object),
        "raw_prompt": np.array([it[2] for it in items], dtype=object),
        "index": np.array([it[3] for it in items], dtype=np.int64),
    }
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids}, non_tensor
    )


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
