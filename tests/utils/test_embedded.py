"""The embedded task: answers, splits, and the greedy-accuracy shortcut."""

from __future__ import annotations

import pytest
import torch

from verl.utils.embedded import arithmetic_answer, arithmetic_split, greedy_accuracy, load_embedded


def test_answer_is_the_sum_with_digits_reversed():
    assert arithmetic_answer(12, 79) == "19"  # 12 + 79 = 91 -> "19"
    assert arithmetic_answer(5, 5) == "01"  # 10 -> "01"
    assert arithmetic_answer(99, 99) == "891"  # 198 -> "891"
    assert arithmetic_answer(0, 7) == "7"


def test_splits_are_disjoint_and_cover_every_pair():
    train, test = arithmetic_split("train"), arithmetic_split("test")
    assert len(test) == 500 and len(train) == 10_000 - 500
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert load_embedded("embedded://arithmetic@test") == test
    a, b = map(int, test[0]["prompt"].rstrip("=").split("+"))
    assert test[0]["answer"] == arithmetic_answer(a, b)


def test_bad_task_or_split_is_refused():
    with pytest.raises(ValueError, match="valid: arithmetic"):
        load_embedded("embedded://algebra@train")
    with pytest.raises(ValueError, match="valid: train, test"):
        arithmetic_split("dev")


def test_teacher_forced_accuracy_equals_greedy_decoding():
    """greedy_accuracy's shortcut (argmax right at every answer position, given the right prefix)
    equals exact-match greedy generation. A tiny model memorises 6 rows, so some of the 12 rows
    scored are right and some wrong."""
    from verl.utils.embedded import _encode
    from verl.utils.tiny_lm import TinyLMSpec, build_char_tokenizer, build_tiny_qwen2

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_qwen2(
        TinyLMSpec(hidden_size=64, num_hidden_layers=1, vocab_size=128, seed=3), tok
    )
    rows = arithmetic_split("test")[:12]
    ids, mask = _encode(rows[:6], tok)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        logits = model(ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[mask[:, 1:]], ids[:, 1:][mask[:, 1:]])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    right = []
    for row in rows:
        prompt = tok(row["prompt"], add_special_tokens=False, return_tensors="pt")["input_ids"]
        out = model.generate(prompt, max_new_tokens=5, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)  # fmt: skip
        right.append(
            out[0, prompt.shape[1] :].tolist()
            == tok(row["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        )
    assert 0 < sum(right) < len(rows)  # a mix of right and wrong rows: the check can tell
    assert greedy_accuracy(model, rows, tok) == pytest.approx(sum(right) / len(rows))


def test_snapshot_is_the_pair_runs_model_at_that_step_and_is_cached(tmp_path):
    from safetensors.torch import load_file

    from verl.utils.embedded import SFTSpec, build_embedded, build_snapshot
    from verl.utils.tiny_lm import TinyLMSpec

    spec = SFTSpec(TinyLMSpec(hidden_size=64, num_hidden_layers=1, vocab_size=128, seed=3),
                   draft_steps=2, guidance_steps=3, batch_size=8)  # fmt: skip
    pair = build_embedded(str(tmp_path / "pair"), spec, log=lambda *_: None)
    logs = []
    snap = build_snapshot("early", 2, str(tmp_path / "pair"), spec, log=logs.append)
    assert logs and snap["accuracy"] == pair["draft_accuracy"]
    same = load_file(str(tmp_path / "pair" / "draft" / "model.safetensors"))
    built = load_file(str(tmp_path / "pair" / "early" / "model.safetensors"))
    assert all(torch.equal(same[k], built[k]) for k in same)  # the same run, stopped at step 2
    logs.clear()
    assert build_snapshot("early", 2, str(tmp_path / "pair"), spec, log=logs.append) == snap
    assert not logs  # reused, not rebuilt


def test_three_digit_task_splits_are_disjoint_fixed_and_longer():
    test = load_embedded("embedded://arithmetic3@test")
    train = load_embedded("embedded://arithmetic3@train")
    assert len(test) == 500 and len(train) == 40_000
    assert not {r["prompt"] for r in test} & {r["prompt"] for r in train}
    assert test == arithmetic_split("test", digits=3)  # drawn once, the same every call
    a, b = map(int, test[0]["prompt"][:-1].split("+"))
    assert test[0]["answer"] == str(a + b)[::-1]
    assert max(len(r["answer"]) for r in train) == 4  # up to 999 + 999 = 1998
    assert max(len(r["prompt"]) for r in train) == 8
