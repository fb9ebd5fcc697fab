"""The embedded tool task `toolchain`: rows and transcripts by hand, its reward, its loss mask, the
turn-loop evaluator against scripted policies, and a tiny end-to-end build."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from verl.tasks.embedded import (
    TASKS,
    SFTSpec,
    build_embedded,
    load_embedded,
    pick_snapshots,
    sampled_accuracy,
)
from verl.tasks.embedded_tools import (
    TOOLCHAIN_RESPONSE_LENGTH,
    TOOLCHAIN_TEST_STARTS,
    evaluate_episodes,
    sample_episodes,
    shuffled_lookup,
    tool_dependence,
    toolchain_encode,
    toolchain_parse,
    toolchain_row,
    toolchain_runtime,
    toolchain_split,
    toolchain_transcript,
    transcript_ids,
)
from verl.tasks.tiny_lm import TinyLMSpec, build_char_tokenizer
from verl.workers.reward.function import REWARD_FUNCTIONS, toolchain_reward
from verl.workers.rollout.multi_turn import pack

EOS = "<EOS>"


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_rows_and_transcripts_by_hand():
    # lookup: k_n -> (37 n + 11) mod 100: k07 -> 270 -> 70, k70 -> 2601 -> 1, k01 -> 48
    assert toolchain_row(7, 3) == {"prompt": "k07>3=", "answer": "48"}
    assert toolchain_row(70, 1) == {"prompt": "k70>1=", "answer": "01"}  # 1, two digits
    assert toolchain_row(8, 2)["answer"] == "70"  # k08 -> 307 -> 7, then k07 -> 70
    assert toolchain_parse("k07>3=") == (7, 3)
    assert toolchain_transcript("k07>3=") == [
        ("policy", "[lookup:k07]"), ("tool", "=70\n"),
        ("policy", "[lookup:k70]"), ("tool", "=1\n"),
        ("policy", "[lookup:k01]"), ("tool", "=48\n"), ("policy", "48"),
    ]  # fmt: skip
    assert toolchain_transcript("k08>2=") == [("policy", "[lookup:k08]"), ("tool", "=7\n"),
                                              ("policy", "[lookup:k07]"), ("tool", "=70\n"),
                                              ("policy", "70")]  # fmt: skip


def test_splits_hold_out_their_start_keys():
    test, train = toolchain_split("test"), load_embedded("embedded://toolchain@train")
    assert test == load_embedded("embedded://toolchain@test")
    assert len(test) == 60 and len(train) == 240 and len(TOOLCHAIN_TEST_STARTS) == 20
    starts = lambda rows: {toolchain_parse(r["prompt"])[0] for r in rows}  # noqa: E731
    assert starts(test) == TOOLCHAIN_TEST_STARTS and not starts(test) & starts(train)
    for rows in (test, train):  # every start with each depth: a third of the rows need 1 call
        depths = [toolchain_parse(r["prompt"])[1] for r in rows]
        assert depths.count(1) == depths.count(2) == depths.count(3) == len(rows) // 3
    for row in train[:30]:
        assert row == toolchain_row(*toolchain_parse(row["prompt"]))
    task = TASKS["toolchain"]
    assert (task.reward, task.tools, task.tool_call_format, task.max_turns) == (
        "toolchain", ("lookup",), "embedded", 4)  # fmt: skip
    assert (
        task.max_prompt_length == 6 and task.max_response_length == TOOLCHAIN_RESPONSE_LENGTH == 51
    )
    assert REWARD_FUNCTIONS.get("toolchain") is toolchain_reward


def test_reward_reads_the_answer_after_the_last_tool_result():
    def score(text: str) -> dict[str, float]:
        return toolchain_reward({"response": text, "ground_truth": "48"})

    calls = "[lookup:k07]=70\n[lookup:k70]=1\n[lookup:k01]=48\n"
    assert score(calls + "48") == {"overall": 1.0, "format": 1.0, "tool_calls": 3.0}
    assert score(calls + "48 ")["overall"] == 1.0
    assert score(calls + "84")["overall"] == 0.0  # wrong
    assert score(calls + "048") == {"overall": 0.0, "format": 0.0, "tool_calls": 3.0}
    assert score(calls)["overall"] == 0.0  # no answer (a truncated episode)
    assert score("[lookup:k07]=70\n[lookup:k70]")["overall"] == 0.0  # ends in an unanswered call
    assert score("[lookup:k07]=70\n4 8")["overall"] == 0.0
    assert score("48") == {"overall": 1.0, "format": 1.0, "tool_calls": 0.0}  # a right guess
    assert score("")["overall"] == 0.0


def test_the_loss_mask_keeps_the_policy_tokens_only(tok):
    ids, mask = toolchain_encode([toolchain_row(7, 3), toolchain_row(70, 1)], tok)
    text = "k07>3=[lookup:k07]=70\n[lookup:k70]=1\n[lookup:k01]=48\n48"
    assert tok.decode(ids[0], skip_special_tokens=True) == text
    assert tok.decode(ids[0][mask[0]]) == "[lookup:k07][lookup:k70][lookup:k01]48<|im_end|>"
    assert tok.decode(ids[0][~mask[0]], skip_special_tokens=True) == "k07>3==70\n=1\n=48\n"
    assert tok.decode(ids[1][mask[1]]) == "[lookup:k70]01<|im_end|>"
    assert not mask[1][ids[1] == tok.pad_token_id].any()  # padding is not trained on


Policy = Callable[[str, str], dict[str, float]]
"""(prompt, response so far) -> {next character or EOS: probability}."""


class ScriptedPolicy(torch.nn.Module):
    """A stand-in for a causal LM: a `Policy` of the decoded context gives the next token's
    distribution, at the last position only (`attention_mask` given: the turn loop) or at every
    position (teacher forcing)."""

    def __init__(self, tokenizer, policy: Policy) -> None:
        super().__init__()
        self.tokenizer, self.policy = tokenizer, policy

    def _row(self, ids: list[int]) -> torch.Tensor:
        prompt, _, response = self.tokenizer.decode(ids).partition("=")
        logits = torch.full((128,), -1e9)
        for piece, p in self.policy(prompt + "=", response).items():
            token = self.tokenizer.convert_tokens_to_ids(piece) if piece != EOS else None
            logits[self.tokenizer.eos_token_id if token is None else token] = torch.tensor(p).log()
        return logits

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        b, width = input_ids.shape
        logits = torch.zeros(b, width, 128)
        lengths = attention_mask.sum(-1).tolist() if attention_mask is not None else [width] * b
        for i, n in enumerate(lengths):
            for end in [n] if attention_mask is not None else range(1, width + 1):
                logits[i, end - 1] = self._row(input_ids[i, :end].tolist())
        return SimpleNamespace(logits=logits)


def script(scripts: dict[str, str]) -> Policy:
    """Writes a fixed text per prompt, then EOS, whatever the tool answers."""

    def policy(prompt: str, response: str) -> dict[str, float]:
        emitted = re.sub(r"=[^\n]*\n", "", response)  # its own text: no tool results
        full = scripts[prompt]
        if not full.startswith(emitted) or len(emitted) == len(full):
            return {EOS: 1.0}
        return {full[len(emitted)]: 1.0}

    return policy


def reader(coin: bool = False) -> Policy:
    """Follows the chain from the results it reads (a missing value counts 0), then writes the
    last one. `coin`: the answer's first digit is right with probability 1/2 (else the next)."""

    def policy(prompt: str, response: str) -> dict[str, float]:
        if not re.fullmatch(r"k\d\d>\d=", prompt):  # inside the prompt (teacher forcing)
            return {EOS: 1.0}
        (start, depth), results = toolchain_parse(prompt), re.findall(r"=(\d*)\n", response)
        turn, key = response.rsplit("\n", 1)[-1], int(results[-1] or 0) if results else start
        goal = f"[lookup:k{key:02d}]" if len(results) < depth else f"{key:02d}"
        if coin and len(results) == depth and not turn:
            return {goal[0]: 0.5, str((int(goal[0]) + 1) % 10): 0.5}
        return {goal[len(turn)] if len(turn) < len(goal) else EOS: 1.0}

    return policy


def memoriser(prompt: str, response: str) -> dict[str, float]:
    """Knows the table: answers at once, no call."""
    goal = toolchain_row(*toolchain_parse(prompt))["answer"]
    return {goal[len(response)] if len(response) < 2 else EOS: 1.0}


def test_the_turn_loop_scores_scripted_policies(tok):
    rows = [toolchain_row(7, 3), toolchain_row(12, 2), toolchain_row(70, 1)]
    policy = ScriptedPolicy(tok, script({
        "k07>3=": "[lookup:k07][lookup:k70][lookup:k01]48",  # the canonical episode: right
        "k12>2=": "[lookup:k12][lookup:k55]47",  # two calls, a wrong answer (46)
        "k70>1=": "01",  # no call, a right guess
    }))  # fmt: skip
    stats = evaluate_episodes(policy, rows, tok, samples=2)
    assert stats["accuracy"] == pytest.approx(2 / 3) and stats["stderr"] == 0.0
    assert stats["episodes"] == 6 and stats["canonical_share"] == pytest.approx(1 / 3)
    assert stats["right_without_call"] == pytest.approx(1 / 3)
    assert stats["mean_tool_calls"] == pytest.approx(5 / 3)
    assert [stats[f"accuracy_depth_{d}"] for d in (1, 2, 3)] == [1.0, 0.0, 1.0]
    # the canonical episode is token for token the supervised transcript, and RL's
    # response_mask is its loss mask
    episode = sample_episodes(policy, ["k07>3="], tok, toolchain_runtime(tok))[0]
    prompt, response, policy_mask = transcript_ids("k07>3=", tok)
    assert episode.prompt_ids == prompt and episode.response_ids == response
    packed = pack([episode], TOOLCHAIN_RESPONSE_LENGTH, tok.pad_token_id)
    assert packed["response_mask"][0, : len(response)].bool().tolist() == policy_mask
    assert packed["num_tool_calls"].item() == 3 and packed["num_turns"].item() == 4


def test_an_episode_past_the_budget_ends_truncated(tok):
    # a policy that keeps calling: the 4th turn's call is not run (max_turns), and the reward is 0
    looping = ScriptedPolicy(tok, script({"k07>1=": "[lookup:k07]" * 5}))
    episode = sample_episodes(looping, ["k07>1="], tok, toolchain_runtime(tok))[0]
    assert episode.num_turns == 4 and episode.num_tool_calls == 3
    assert evaluate_episodes(looping, [toolchain_row(7, 1)], tok, samples=1)["accuracy"] == 0.0


def test_the_monte_carlo_accuracy_agrees_with_the_exact_one(tok):
    rows = [toolchain_row(7, 2)]
    coin = ScriptedPolicy(tok, reader(coin=True))
    assert sampled_accuracy(coin, rows, tok, encode=toolchain_encode) == pytest.approx(0.5)
    stats = evaluate_episodes(coin, rows, tok, samples=64, seed=3)
    assert stats["stderr"] == pytest.approx(0.0625, abs=0.002)  # sqrt(1/4 / 64)
    assert abs(stats["accuracy"] - 0.5) < 3 * stats["stderr"]


def test_tool_dependence_tells_a_reader_from_a_memoriser(tok):
    rows = [toolchain_row(7, 3), toolchain_row(12, 2), toolchain_row(66, 1)]
    others = [toolchain_row(*toolchain_parse(r["prompt"]), shuffled_lookup) for r in rows]
    assert all(r["answer"] not in ("00", o["answer"]) for r, o in zip(rows, others, strict=True))
    read = tool_dependence(ScriptedPolicy(tok, reader()), rows, tok, samples=1)
    assert read["disabled_accuracy"] == 0.0 and read["shuffled_follows_accuracy"] == 1.0
    assert read["shuffled_true_accuracy"] == 0.0
    known = tool_dependence(ScriptedPolicy(tok, memoriser), rows, tok, samples=1)
    assert known["disabled_accuracy"] == known["shuffled_true_accuracy"] == 1.0


def test_a_tiny_build_runs_end_to_end_and_is_cached(tmp_path):
    spec = SFTSpec(TinyLMSpec(hidden_size=64, num_hidden_layers=1, vocab_size=128, seed=3),
                   {"draft": 0.5, "guidance": 1.0}, max_steps=4, eval_every=2, batch_size=8)  # fmt: skip
    logs: list[str] = []
    built = build_embedded(str(tmp_path / "toolchain"), spec, log=logs.append, task="toolchain")
    with open(tmp_path / "toolchain" / "guidance" / "embedded.json") as f:
        record = json.load(f)
    assert record["task"] == "toolchain" and record["measure"] == "sampled"
    curve = [tuple(evaluation) for evaluation in record["curve"]]
    assert [step for step, _ in curve] == [0, 2, 4]  # below DENSE_FROM (1 %) of 50 %: every 2 steps
    assert pick_snapshots(curve, spec.targets)["guidance"] == (
        record["step"],
        record["test_accuracy"],
    )
    assert built["guidance_accuracy"] == record["test_accuracy"] < 0.01  # untrained: near 0
    assert any("below its target" in line for line in logs)
    assert (tmp_path / "toolchain" / "draft" / "model.safetensors").is_file()
    logs.clear()
    assert (
        build_embedded(str(tmp_path / "toolchain"), spec, log=logs.append, task="toolchain")
        == built
    )
    assert not logs
