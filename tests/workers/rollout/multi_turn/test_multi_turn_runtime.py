"""MultiTurnRuntime (verl/workers/rollout/multi_turn/runtime.py): the engine-free half of the
turn loop on scripted turns, an embedded episode packed end to end, and the hermes format on the
real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from verl.tasks.tiny_lm import build_char_tokenizer
from verl.workers.rollout.multi_turn import (
    MultiTurnConfig,
    MultiTurnRuntime,
    Trajectory,
    get_format,
    pack,
    tool_delta_ids,
)

EMBEDDED = MultiTurnConfig(enable=True, tools=["lookup", "calculator"], tool_call_format="embedded",
                           max_turns=3, max_tool_response_length=6)  # fmt: skip


@pytest.fixture(scope="module")
def char():
    return build_char_tokenizer()


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_one_step_over_a_batch_of_turns(char):
    runtime = MultiTurnRuntime(EMBEDDED, char, use_chat_template=False)
    assert runtime.stop_strings == ["]"]
    texts = ["[lookup:k07]", "75", "[lookup:k07]", "[lookup]", "[calculator:999*999]",
             "[calculator:9999*999]", "[lookup:k01"]  # fmt: skip
    reasons = ["tool_call", "eos", "tool_call", "tool_call", "tool_call", "tool_call", "length"]
    outcomes = runtime.step(texts, reasons, turns_done=[1, 2, 3, 1, 1, 2, 1])
    assert [o.continues for o in outcomes] == [True, False, False, True, True, True, False]
    assert [o.malformed for o in outcomes] == [False, False, False, True, False, False, True]
    assert [[r.status for r in o.results] for o in outcomes] == [
        ["ok"], [], [], ["malformed"], ["ok"], ["ok"], []]  # fmt: skip
    # outcome 2: the call of the last allowed turn is read but not run
    assert outcomes[2].calls[0].name == "lookup" and outcomes[2].delta is None
    deltas = [decode(char, o.delta.ids) if o.delta else None for o in outcomes]
    # 6 tokens (characters) of a result at most: "error: malformed ..." -> "error:",
    # 9999*999 = 9989001 -> "998900"
    assert deltas == ["=70\n", None, None, "=error:\n", "=998001\n", "=998900\n", None]
    assert [o.delta.truncated for o in outcomes if o.delta] == [[False], [True], [False], [True]]
    # counted as truncated: the cut result 998900, not the cut error text
    counts = []
    for outcome in outcomes:
        if outcome.delta is not None:
            trajectory = Trajectory([0])
            trajectory.add_turn([1])
            outcome.append_to(trajectory)
            counts.append(trajectory.tool_truncated)
    assert counts == [0, 0, 0, 1]
    # a turn ended at EOS is not answered in the embedded format
    assert not runtime.step(["[lookup:k07"], ["eos"], [1])[0].continues
    with pytest.raises(
        ValueError, match="finish reason 'stop' is not valid; valid: tool_call, eos, length"
    ):
        runtime.step(["x"], ["stop"], [1])


def test_an_embedded_episode_packs_by_hand(char):
    """k07+5=  [lookup:k07] =70\\n  [calculator:70+5] =75\\n  75<eos>: three turns, two calls."""
    runtime = MultiTurnRuntime(EMBEDDED, char, use_chat_template=False)
    encode = lambda text: char(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    trajectory = Trajectory(encode("k07+5="))
    turns = [("[lookup:k07]", "tool_call"), ("[calculator:70+5]", "tool_call"), ("75", "eos")]
    for done, (text, reason) in enumerate(turns, start=1):
        ids = encode(text) + ([char.eos_token_id] if reason == "eos" else [])
        trajectory.add_turn(ids, lp=[-float(done)] * len(ids))
        (outcome,) = runtime.step([text], [reason], [done])
        outcome.append_to(trajectory)
        assert outcome.continues == (reason == "tool_call")
    out = pack([trajectory], response_length=40, pad_id=char.pad_token_id)
    assert decode(char, trajectory.context_ids()) == (
        "k07+5=[lookup:k07]=70\n[calculator:70+5]=75\n75<|im_end|>")  # fmt: skip
    # lengths: [lookup:k07] 12, =70\n 4, [calculator:70+5] 17, =75\n 4, 75<eos> 3 = 40
    assert out["response_mask"][0].tolist() == [1] * 12 + [0] * 4 + [1] * 17 + [0] * 4 + [1] * 3
    assert out["turn_index"][0].tolist() == [0] * 16 + [1] * 21 + [2] * 3
    assert out["lp"][0].tolist() == [-1.0] * 12 + [0] * 4 + [-2.0] * 17 + [0] * 4 + [-3.0] * 3
    assert out["truncated"].tolist() == [False] and out["num_turns"].tolist() == [3]
    assert (out["num_tool_calls"].tolist(), out["num_tool_errors"].tolist()) == ([2], [0])


def test_the_calls_of_a_whole_batch_run_together(char, tmp_path):
    """Two episodes whose calls each wait for the other's: both finish only when `step` runs the
    batch's calls at the same time."""
    (tmp_path / "meet.py").write_text(
        "import threading\nBARRIER = threading.Barrier(2, timeout=60)\n\n\n"
        'def meet(name: str) -> str:\n    """Wait for the other call."""\n'
        "    BARRIER.wait()\n    return name\n"
    )
    config = MultiTurnConfig(enable=True, tools=[f"{tmp_path / 'meet.py'}:meet"],
                             tool_call_format="embedded", max_parallel_tools=2)  # fmt: skip
    runtime = MultiTurnRuntime(config, char, use_chat_template=False)
    outcomes = runtime.step(["[meet:a]", "[meet:b]"], ["tool_call"] * 2, [1, 1])
    assert [(o.results[0].status, o.results[0].text) for o in outcomes] == [
        ("ok", "a"),
        ("ok", "b"),
    ]


def test_hermes_two_calls_in_one_turn_on_the_smollm2_template(real_pair):
    """A hermes turn ends at EOS: both its calls run and their results follow in call order (one
    ChatML tool turn each), after the turn's own `<|im_end|>`. The same turn cut by the length
    limit, or as the `max_turns`-th, is not answered."""
    from transformers import AutoTokenizer

    smol = AutoTokenizer.from_pretrained(real_pair.guidance)
    config = MultiTurnConfig(enable=True, tools=["lookup", "calculator"], max_turns=2)
    runtime = MultiTurnRuntime(config, smol)
    assert runtime.stop_strings == []
    instructions = runtime.instructions()
    assert '"name": "lookup"' in instructions and '"name": "calculator"' in instructions
    hermes = get_format("hermes")
    calc = hermes.render_call("calculator", {"expression": "(12+79)//7"})
    text = f"Let me compute. {calc}\n{hermes.render_call('lookup', {'key': 'k07'})}"
    answered, cut, last = runtime.step([text] * 3, ["eos", "length", "eos"], [1, 1, 2])
    # (12+79)//7 = 13; k07 -> (37·7 + 11) mod 100 = 70
    assert answered.continues and [(r.status, r.text) for r in answered.results] == [
        ("ok", "13"), ("ok", "70")]  # fmt: skip
    assert decode(smol, answered.delta.ids) == (
        "\n<|im_start|>tool\n13<|im_end|>\n"
        "<|im_start|>tool\n70<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
    assert not cut.continues and not cut.unanswered and len(cut.calls) == 2
    assert not last.continues and last.unanswered and last.delta is None
    trajectory = Trajectory([1])
    trajectory.add_turn(smol(text, add_special_tokens=False)["input_ids"] + [smol.eos_token_id])
    answered.append_to(trajectory)
    assert trajectory.tool_statuses == ["ok", "ok"] and trajectory.tool_truncated == 0


def test_a_prompt_that_ends_inside_a_call_does_not_make_the_turn_a_call(char):
    """Calls are read from the turn's own text: a prompt ending "[lookup:k0" followed by a turn
    "7]" gives a malformed call ("] without ["), answered with that error."""
    runtime = MultiTurnRuntime(EMBEDDED, char, use_chat_template=False)
    (outcome,) = runtime.step(["7]"], ["tool_call"], [1])
    assert [c.error for c in outcome.calls] == ["] without ["]
    assert [(r.status, r.text) for r in outcome.results] == [
        ("malformed", "error: malformed tool call: ] without [")]  # fmt: skip


def test_turn_end_is_where_the_engine_would_stop(char):
    """A guided turn is sampled without stop strings and cut at `turn_end`: the fewest tokens
    whose text holds a stop string; `turn_text` as vLLM reports a turn stopped there."""
    runtime = MultiTurnRuntime(EMBEDDED, char, use_chat_template=False)
    ids = char("ab[lookup:k07]xy]z", add_special_tokens=False)["input_ids"]
    assert len(ids) == 18  # one token per character
    # "ab[lookup:k07]" is 14 characters: the 14th token completes the first "]"
    assert runtime.turn_end(ids) == 14
    assert runtime.turn_end(ids[:13]) is None and runtime.turn_end(ids[:14]) == 14
    assert runtime.turn_text(ids) == "ab[lookup:k07]"
    assert runtime.turn_text(ids[:13]) == "ab[lookup:k07"  # no stop string: the whole text


def test_stop_token_ids_end_a_turn_where_the_stop_string_does(char, real_pair):
    """`stop_token_ids`: the ids whose text holds a one-character stop string. On the char
    tokenizer exactly `]`; on SmolLM2's byte-level BPE every token holding a `]` (`]`, `])`,
    `"]` ...), and on text of such tokens the first of them ends the turn where `turn_end` (the
    engine's stop-string rule) does. hermes has no stop string (none); a stop string longer
    than one character leaves the engine matching text (None)."""
    from transformers import AutoTokenizer

    runtime = MultiTurnRuntime(EMBEDDED, char, use_chat_template=False)
    assert runtime.stop_token_ids == (char.convert_tokens_to_ids("]"),)
    smol = AutoTokenizer.from_pretrained(real_pair.guidance)
    bpe = MultiTurnRuntime(EMBEDDED, smol, use_chat_template=False)
    assert len(bpe.stop_token_ids) > 10  # merged tokens holding `]` too
    assert all("]" in bpe.decode([i]) for i in bpe.stop_token_ids)
    texts = ['Look: ["a"] then', "x = f(a[0]) + b[1]]", "[lookup:k07]\n[lookup:k01]", "no call"]
    for text in texts:
        ids = smol(text, add_special_tokens=False)["input_ids"]
        first = next((n + 1 for n, i in enumerate(ids) if i in bpe.stop_token_ids), None)
        assert first == bpe.turn_end(ids), text
    assert (
        MultiTurnRuntime(MultiTurnConfig(enable=True, tools=["calculator"]), smol).stop_token_ids
        == ()
    )

    class LongStop(MultiTurnRuntime):
        stop_strings = ("</call>",)  # a multi-character stop string (no built-in format has one)

    assert LongStop(EMBEDDED, char, use_chat_template=False).stop_token_ids is None


def test_a_hermes_turn_has_no_stop_string(real_pair):
    """hermes has no stop string: a guided turn runs to EOS (`turn_end` None) and its text is
    the whole text, calls and what follows them."""
    from transformers import AutoTokenizer

    smol = AutoTokenizer.from_pretrained(real_pair.guidance)
    runtime = MultiTurnRuntime(MultiTurnConfig(enable=True, tools=["calculator"]), smol)
    call = get_format("hermes").render_call("calculator", {"expression": "1+2"})
    ids = smol(f"Sure. {call} and more text", add_special_tokens=False)["input_ids"]
    assert runtime.turn_end(ids) is None
    assert runtime.turn_text(ids) == f"Sure. {call} and more text"


def test_retokenized_tokens_counts_what_a_text_round_trip_changes(real_pair):
    """On SmolLM2's tokenizer: sampled ids that are the tokenizer's own encoding survive a text
    round trip (and so does the ChatML tool delta); the same text sampled one character at a
    time ("Ġanswer" as Ġ, a, n, s, w, e, r: 7 ids) re-encodes to the one token, so all 7 are
    counted."""
    from transformers import AutoTokenizer

    from verl.workers.rollout.multi_turn import retokenized_tokens

    smol = AutoTokenizer.from_pretrained(real_pair.guidance)
    prompt = smol("Say it.", add_special_tokens=False)["input_ids"]
    canonical = smol(" The answer", add_special_tokens=False)["input_ids"]
    assert smol.convert_ids_to_tokens(canonical) == ["ĠThe", "Ġanswer"]
    clean = Trajectory(prompt)
    clean.add_turn(canonical)
    clean.add_tool(tool_delta_ids(smol, ["42"]).ids)
    assert retokenized_tokens(smol, clean) == 0
    chars = smol.convert_tokens_to_ids(list("Ġanswer"))
    split = Trajectory(prompt)
    split.add_turn([canonical[0], *chars])
    split.add_tool(tool_delta_ids(smol, ["42"]).ids)
    assert smol.decode(split.response_ids) == smol.decode(clean.response_ids)  # the same text
    assert retokenized_tokens(smol, split) == 7
    assert retokenized_tokens(smol, split, limit=1) == 0  # only "ĠThe" kept: nothing changes


def test_runs_inline_when_no_call_needs_a_thread(char, tmp_path):
    """`runs_inline`: a turn whose calls are the built-ins', malformed or of no tool of the run
    starts no thread (`ToolRuns.start` then answers it at once); one call of a file's tool does."""
    (tmp_path / "t.py").write_text('def sq(n: int) -> int:\n    """Square."""\n    return n * n\n')
    config = MultiTurnConfig(enable=True, tools=["lookup", f"{tmp_path / 't.py'}:sq"],
                             tool_call_format="embedded")  # fmt: skip
    runtime = MultiTurnRuntime(config, char, use_chat_template=False)
    fmt = get_format("embedded")
    builtin, malformed, unknown, mine = (fmt.parse(t)[0][0] for t in
                                         ("[lookup:k07]", "[lookup]", "[nope:1]", "[sq:3]"))  # fmt: skip
    assert runtime.runs_inline([builtin, malformed, unknown])
    assert not runtime.runs_inline([builtin, mine])
