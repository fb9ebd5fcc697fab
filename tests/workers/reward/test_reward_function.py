"""Reward functions: built-ins, a user file, placement on the last token, errors naming the sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.tasks.tiny_lm import build_char_tokenizer
from verl.workers.reward.config import RewardConfig
from verl.workers.reward.function import (
    FunctionRewardManager,
    RewardError,
    arithmetic_reward,
    count_reward,
    load_reward_function,
    math_reward,
)


def batch(tok, responses: list[str], truths: list[str], width: int = 6) -> DataProto:
    ids = torch.full((len(responses), width), tok.pad_token_id)
    mask = torch.zeros(len(responses), width)
    for i, text in enumerate(responses):
        tokens = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids[i, : len(tokens)] = torch.tensor(tokens)
        mask[i, : len(tokens)] = 1
    return DataProto.from_dict({"responses": ids, "response_mask": mask},
                               {"ground_truth": np.array(truths, dtype=object)})  # fmt: skip


def test_arithmetic_is_exact_match_after_strip():
    assert arithmetic_reward({"response": " 19 ", "ground_truth": "19"}) == {"overall": 1.0}
    assert arithmetic_reward({"response": "91", "ground_truth": "19"}) == {"overall": 0.0}
    assert count_reward({"response": "7", "ground_truth": "7"}) == {"overall": 1.0}
    assert count_reward({"response": "77", "ground_truth": "7"}) == {"overall": 0.0}


def test_math_reward_reads_the_boxed_answer():
    right = math_reward({"response": r"so \boxed{\frac{1}{2}}", "ground_truth": "0.5"})
    assert right == {"overall": 1.0, "accuracy": 1.0, "format": 1.0}
    wrong = math_reward({"response": r"\boxed{3}", "ground_truth": "4"}, format_weight=0.1)
    assert wrong["accuracy"] == 0.0 and wrong["overall"] == pytest.approx(0.1)  # 0.9*0 + 0.1*1


def test_scores_land_on_the_last_response_token():
    tok = build_char_tokenizer()
    manager = FunctionRewardManager(RewardConfig(reward_function="arithmetic"), tok)
    scores, parts = manager.compute(batch(tok, ["19", "7"], ["19", "8"]))
    # "19" + EOS = 3 tokens: score 1 at index 2; "7" + EOS = 2 tokens: score 0 at index 1
    assert scores.tolist() == [[0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
    assert parts == {"overall": [1.0, 0.0]}


def test_user_function_from_a_file_batch_and_sequential(tmp_path):
    tok = build_char_tokenizer()
    (tmp_path / "r.py").write_text(
        "def one(x, bonus=0.0):\n    return {'overall': len(x['response']) + bonus}\n"
        "def many(xs):\n    return [{'overall': 2.0, 'extra': 1.0} for _ in xs]\n"
    )
    seq = RewardConfig(reward_function=f"{tmp_path / 'r.py'}:one", reward_type="sequential",
                       reward_function_kwargs={"bonus": 0.5})  # fmt: skip
    scores, _ = FunctionRewardManager(seq, tok).compute(batch(tok, ["123"], ["x"]))
    assert scores.sum().item() == pytest.approx(3.5)
    many = RewardConfig(reward_function=f"{tmp_path / 'r.py'}:many")
    _, parts = FunctionRewardManager(many, tok).compute(batch(tok, ["1", "2"], ["x", "y"]))
    assert parts == {"overall": [2.0, 2.0], "extra": [1.0, 1.0]}


def test_bad_specs_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.py"):
        load_reward_function("nope.py:fn")
    (tmp_path / "r.py").write_text("x = 1\n")
    with pytest.raises(AttributeError, match="defines no function 'fn'"):
        load_reward_function(f"{tmp_path / 'r.py'}:fn")
    with pytest.raises(
        ValueError,
        match="unknown reward function 'no_such_builtin'; valid: arithmetic, count, math, runsum",
    ):
        load_reward_function("no_such_builtin")


def test_a_raising_reward_names_the_sample(tmp_path):
    tok = build_char_tokenizer()
    (tmp_path / "r.py").write_text("def bad(x):\n    raise ValueError('boom')\n")
    cfg = RewardConfig(reward_function=f"{tmp_path / 'r.py'}:bad", reward_type="sequential")
    future = FunctionRewardManager(cfg, tok).compute_async(batch(tok, ["42"], ["7"]))
    with pytest.raises(RewardError, match=r"raised ValueError: boom on sample .*'response': '42'"):
        future.result()


def test_validation_scores_with_its_own_reward_when_given(tmp_path):
    """`val_reward_function` replaces the training reward for validation only (a shaped or a
    diagnostic training reward beside the task's accuracy); unset, validation uses the same."""
    from verl.trainer.main import val_reward_config

    tok = build_char_tokenizer()
    (tmp_path / "r.py").write_text("def half(x):\n    return {'overall': 0.5}\n")
    train = RewardConfig(reward_function=f"{tmp_path / 'r.py'}:half", reward_type="sequential",
                         val_reward_function="arithmetic")  # fmt: skip
    data = batch(tok, ["12", "13"], ["12", "12"])
    assert FunctionRewardManager(train, tok).compute(data)[0].sum().item() == 1.0  # 0.5 + 0.5
    val = FunctionRewardManager(val_reward_config(train), tok).compute(data)[0]
    assert val.sum(-1).tolist() == [1.0, 0.0]  # exact match of the answer
    assert val_reward_config(RewardConfig(reward_function="math")).reward_function == "math"
