"""Prompt datasets: every input form, keys, templates, overlong filtering, resumable order."""

from __future__ import annotations

import json

import pytest

from verl.tasks.tiny_lm import build_char_tokenizer
from verl.utils.dataset import PromptEncoder, RLDataset, build_dataloader, load_rows

ROWS = [{"q": f"{i}+{i}=", "a": str(2 * i)} for i in range(10)]


@pytest.fixture()
def encoder():
    return PromptEncoder(build_char_tokenizer(), max_prompt_length=8, apply_chat_template=False)


def test_jsonl_parquet_and_datasets_folder_give_the_same_rows(tmp_path):
    import datasets

    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    ds = datasets.Dataset.from_list(ROWS)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "folder"))
    for spec in (str(jsonl), str(tmp_path / "d.parquet"), str(tmp_path / "folder")):
        assert load_rows(spec) == ROWS, spec


def test_unknown_file_type_and_missing_data_are_named(tmp_path):
    (tmp_path / "d.csv").write_text("q,a\n")
    with pytest.raises(ValueError, match=r"d\.csv.*valid: \.jsonl, \.json, \.parquet"):
        load_rows(str(tmp_path / "d.csv"))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_rows("nowhere")


def test_missing_column_lists_the_columns(tmp_path, encoder):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with pytest.raises(KeyError, match="no column 'prompt'; columns: q, a"):
        RLDataset(str(path), encoder, "prompt", "a")


def test_overlong_prompts_are_filtered_and_counted_or_refused(tmp_path, encoder):
    rows = [*ROWS, {"q": "123456789+1=", "a": "x"}]  # 12 characters > 8 tokens
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = RLDataset(str(path), encoder, "q", "a")
    assert len(data) == 10 and data.num_filtered == 1
    with pytest.raises(
        ValueError, match=r"row 10: prompt of 12 tokens > data\.max_prompt_length=8"
    ):
        RLDataset(str(path), encoder, "q", "a", filter_overlong=False)


def test_format_prompt_template_and_chat_template(tmp_path):
    template = tmp_path / "fmt.jinja"
    template.write_text("Q: {{ content }}")
    tok = build_char_tokenizer()
    plain = PromptEncoder(tok, 64, apply_chat_template=False, format_prompt=str(template))
    assert plain.text("1+1=") == "Q: 1+1="
    chat = PromptEncoder(tok, 64, apply_chat_template=True, format_prompt=str(template))
    assert chat.text("1+1=") == "<|im_start|>user\nQ: 1+1=<|im_end|>\n<|im_start|>assistant\n"
    tools = PromptEncoder(tok, 64, apply_chat_template=True, system_prompt="Call add.")
    assert tools.text("1+1=") == ("<|im_start|>system\nCall add.<|im_end|>\n"
                                  "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
    plain_tools = PromptEncoder(tok, 64, apply_chat_template=False, system_prompt="Call add.")
    assert plain_tools.text("1+1=") == "1+1="  # no chat template: no system message


def test_multi_turn_chat_prompts_get_the_tool_instructions():
    from verl.trainer.config import load_config
    from verl.trainer.main import tool_instructions

    config = load_config(
        ["worker.rollout.multi_turn.enable=true", "worker.rollout.multi_turn.tools=[calculator]"]
    )
    text = tool_instructions(config)
    assert '"name": "calculator"' in text and "<tool_call>" in text  # hermes, the default format
    config.data.apply_chat_template = False
    assert tool_instructions(config) is None
    assert tool_instructions(load_config()) is None  # single-turn


def test_batches_are_left_padded_with_ground_truth(encoder):
    data = RLDataset("embedded://arithmetic@test", encoder, "prompt", "answer")
    batch = next(iter(build_dataloader(data, 4, shuffle=False, seed=0, drop_last=True)))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape == (4, 8) and mask[:, -1].all()
    first = data.items[0]
    assert ids[0][mask[0].bool()].tolist() == first[0]
    assert batch["ground_truth"][0] == first[1]
    assert batch["position_ids"][0, -1] == len(first[0]) - 1


def test_dataloader_state_resumes_the_same_order(encoder):
    data = RLDataset("embedded://arithmetic@test", encoder, "prompt", "answer")
    loader = build_dataloader(data, 16, shuffle=True, seed=3, drop_last=True)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    expected = [next(it)["index"].tolist() for _ in range(3)]
    fresh = build_dataloader(data, 16, shuffle=True, seed=3, drop_last=True)
    fresh.load_state_dict(state)
    it2 = iter(fresh)
    assert [next(it2)["index"].tolist() for _ in range(3)] == expected
