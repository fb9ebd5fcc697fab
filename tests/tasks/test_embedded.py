"""The embedded task: answers, splits, and the greedy-accuracy shortcut."""

from __future__ import annotations

import json

import pytest
import torch

from verl.tasks.embedded import (
    PICK_WINDOW,
    TASKS,
    arithmetic_answer,
    arithmetic_split,
    decision_point,
    greedy_accuracy,
    load_embedded,
    off_target,
    pick_snapshot,
    pick_snapshots,
    runsum_row,
    runsum_split,
    target_decided,
)


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
    from verl.tasks.embedded import _encode
    from verl.tasks.tiny_lm import TinyLMSpec, build_char_tokenizer, build_tiny_qwen2

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


def test_pick_snapshot_takes_the_evaluation_nearest_the_target_around_the_first_crossing():
    # pick_snapshot now takes every evaluation seen (a list), not the pair around the crossing;
    # on these pairs the answers are the old rule's.
    # target 0.36: the curve first reaches it at (40, 0.41); the one before, (35, 0.33), is
    # nearer (0.03 < 0.05): step 35
    assert pick_snapshot([(35, 0.33), (40, 0.41)], 0.36) == (35, 0.33)
    # (35, 0.30) is 0.06 away, (40, 0.38) 0.02: step 40
    assert pick_snapshot([(35, 0.30), (40, 0.38)], 0.36) == (40, 0.38)
    # a tie (0.25 and 0.75 both 0.25 from 0.5, exact in binary): the one that reaches the target
    assert pick_snapshot([(35, 0.25), (40, 0.75)], 0.5) == (40, 0.75)
    assert pick_snapshot([(0, 0.5)], 0.36) == (0, 0.5)
    # ties among those reaching it: the earliest (the first crossing); among those short of it:
    # the latest
    assert pick_snapshot([(1, 0.0), (2, 0.0)], 0.0) == (1, 0.0)
    assert pick_snapshot([(1, 0.0), (2, 0.0)], 1.0) == (2, 0.0)
    # whole curves: a dip after the crossing does not matter; a target never reached takes its
    # nearest evaluation, here the last (the curve is too short to close any window: every
    # target is fixed at its end, from the evaluations the old rule chose from too)
    curve = [(0, 0.0), (5, 0.10), (10, 0.16), (15, 0.12), (20, 0.40), (25, 0.90), (30, 0.95)]
    picked = pick_snapshots(curve, {"weak": 0.15, "draft": 0.36, "guidance": 0.97})
    assert picked == {"weak": (10, 0.16), "draft": (20, 0.40), "guidance": (30, 0.95)}


def every_step(start: int, accuracies: list[float]) -> list[tuple[int, float]]:
    """A curve evaluated every step from `start`."""
    return [(start + i, acc) for i, acc in enumerate(accuracies)]


def test_a_curve_that_jumps_past_the_target_takes_the_nearest_evaluation_around_it():
    """The Intel Xeon build: 35.6 % at step 400, 30.4 % at 401, first past 36 % at 402 (42.0 %).
    The old rule took the nearer of 401 and 402 (30.4 %, 5.6 points off); the window around the
    crossing holds step 400, 0.4 points off."""
    curve = every_step(396, [0.28, 0.30, 0.312, 0.338, 0.356, 0.304, 0.42, 0.446, 0.398])
    curve += every_step(405, [0.45 + 0.01 * i for i in range(25)])
    assert pick_snapshots(curve, {"draft": 0.36}) == {"draft": (400, 0.356)}
    assert not off_target(0.356, 0.36) and off_target(0.304, 0.36)  # the old pick warned
    # fixed PICK_WINDOW (20) evaluations after the crossing (index 6): the run goes no further
    assert decision_point(curve, 0.36) == 6 + 1 + PICK_WINDOW
    # one that jumps past and comes back: 30.0, 42.0 (the crossing), 36.4: the last
    curve = every_step(400, [0.30, 0.42, 0.364, 0.45, 0.47])
    assert pick_snapshots(curve, {"draft": 0.36}) == {"draft": (402, 0.364)}


def test_the_run_waits_for_a_snapshot_within_the_tolerance_or_warns_when_none_comes():
    # past the crossing (0.5), the curve falls back below the band (0.25, 0.28): the window (2)
    # is over but nothing lies within 5 points, and the curve may come back: the run goes on
    # and takes 0.37 when it comes
    curve = every_step(0, [0.2, 0.5, 0.25, 0.28, 0.37, 0.6, 0.7])
    assert not target_decided(curve[:4], 0.36, window=2)
    assert decision_point(curve, 0.36, window=2) == 5
    assert pick_snapshots(curve, {"draft": 0.36}, window=2) == {"draft": (4, 0.37)}
    # a curve that never passes within 5 points: 28 % then 45 % and up; once the window's
    # evaluations all lie above the band the run stops waiting, takes the nearest (28 %, 8
    # points off, nearer than 45 %) and the build warns
    curve = every_step(0, [0.0, 0.1, 0.28, 0.45, 0.48, 0.52, 0.55, 0.6])
    assert decision_point(curve, 0.36, window=3) == 3 + 1 + 3
    assert pick_snapshots(curve, {"draft": 0.36}, window=3) == {"draft": (2, 0.28)}
    assert off_target(0.28, 0.36).startswith("warning: 28.0% is 8.0 points from the target 36%")
    # a target never reached waits for the run's end, then takes its nearest evaluation
    assert not target_decided(curve, 0.97, window=3)
    assert pick_snapshots(curve, {"guidance": 0.97}, window=3) == {"guidance": (7, 0.6)}


def test_off_target_warns_only_past_the_tolerance():
    assert off_target(0.36, 0.36) == "" and off_target(0.156, 0.15) == ""
    assert off_target(0.31, 0.36) == ""  # 5.0 points: on the tolerance, no warning
    # 0.572 against 0.36: 21.2 points off, as the AVX2 machine built with fixed steps
    warning = off_target(0.572, 0.36)
    assert warning.startswith("warning: 57.2% is 21.2 points from the target 36% (tolerance 5%)")


def test_runsum_rows_by_hand_and_splits():
    # 7, 3, 9, 4: running sums 7, 10, 19, 23 -> modulo 10: 7, 0, 9, 3
    assert runsum_row([7, 3, 9, 4]) == {"prompt": "7394=", "answer": "7093"}
    test, train = load_embedded("embedded://runsum@test"), load_embedded("embedded://runsum@train")
    assert len(test) == 500 and len(train) > 39_990
    assert not {r["prompt"] for r in test} & {r["prompt"] for r in train}
    assert test == runsum_split("test")  # drawn once, the same every call
    for row in test[:50]:  # the answer follows from the prompt; lengths are fixed
        assert runsum_row([int(c) for c in row["prompt"][:-1]]) == row
        assert len(row["prompt"]) == 21 and len(row["answer"]) == 20
    assert TASKS["runsum"].max_response_length == 21  # 20 digits + EOS


def test_the_pair_is_chosen_by_accuracy_targets_and_cached(tmp_path):
    """A tiny supervised run with targets 0 and 1: the first is the step-0 model (accuracy 0
    reaches 0; the earliest of the ties), the second, never reached in 6 steps, its nearest, the
    last model (the latest of the ties); both are saved with their records, as `pick_snapshots`
    replays them from the curve, and reused on the next call."""
    from safetensors.torch import load_file

    from verl.tasks.embedded import SFTSpec, build_embedded
    from verl.tasks.tiny_lm import TinyLMSpec, build_char_tokenizer, build_tiny_qwen2

    spec = SFTSpec(TinyLMSpec(hidden_size=64, num_hidden_layers=1, vocab_size=128, seed=3),
                   {"start": 0.0, "end": 1.0}, max_steps=6, eval_every=2, batch_size=8)  # fmt: skip
    logs = []
    pair = build_embedded(str(tmp_path / "pair"), spec, log=logs.append)
    assert pair["start_accuracy"] == 0.0 and any("below its target" in line for line in logs)
    records = {}
    for name in spec.targets:
        with open(tmp_path / "pair" / name / "embedded.json") as f:
            records[name] = json.load(f)
    assert records["start"]["step"] == 0 and records["end"]["step"] == 6
    curve = [tuple(evaluation) for evaluation in records["end"]["curve"]]
    assert pick_snapshots(curve, spec.targets) == {
        name: (r["step"], r["test_accuracy"]) for name, r in records.items()
    }
    start = load_file(str(tmp_path / "pair" / "start" / "model.safetensors"))
    fresh = build_tiny_qwen2(spec.model, build_char_tokenizer()).state_dict()
    assert all(torch.equal(start[k], fresh[k]) for k in start)  # the untrained model, step 0
    logs.clear()
    assert build_embedded(str(tmp_path / "pair"), spec, log=logs.append) == pair
    assert not logs  # reused, not rebuilt


def test_runsum_reward_reads_the_final_answer_in_its_format():
    from verl.workers.reward.function import runsum_reward

    answer = runsum_row([7, 3, 9, 4])["answer"]  # "7093"
    score = lambda text: runsum_reward({"response": text, "ground_truth": answer})["overall"]  # noqa: E731
    assert score("7093") == 1.0 and score(" 7093 ") == 1.0
    assert score("7193") == 1.0  # two wrong steps that cancel: the final answer is right
    assert score("7092") == 0.0  # a wrong last step
    assert score("3") == 0.0 and score("709 3") == 0.0 and score("") == 0.0  # not its format


def test_all_fail_share_hand_values():
    from verl.tasks.embedded import all_fail_share

    # rows succeeding with 0.5 and 0.0, groups of 2: (0.5² + 1²) / 2 = (0.25 + 1) / 2 = 0.625
    assert all_fail_share(torch.tensor([0.5, 0.0]), 2) == pytest.approx(0.625, abs=1e-12)
    # a 3 % row, groups of 8: 0.97^8 = 0.783743...
    assert all_fail_share(torch.tensor([0.03], dtype=torch.float64), 8) == pytest.approx(
        0.97**8, abs=1e-12
    )
