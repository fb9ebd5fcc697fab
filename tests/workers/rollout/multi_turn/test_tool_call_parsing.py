"""Tool-call formats (verl/workers/rollout/multi_turn/parsing.py): hand-written turns with no
call, one call, several calls and every kind of malformed call, in both formats."""

from __future__ import annotations

import json

import pytest

from verl.workers.rollout.multi_turn.parsing import TOOL_CALL_FORMATS, ToolCall, get_format
from verl.workers.rollout.multi_turn.tools import calculator, describe_tool, lookup

HERMES, EMBEDDED = get_format("hermes"), get_format("embedded")


def summary(text: str, fmt=HERMES) -> tuple[list[tuple], bool]:
    calls, malformed = fmt.parse(text)
    return [(c.name, c.arguments, c.error is None) for c in calls], malformed


def test_registry_and_stop_strings():
    assert TOOL_CALL_FORMATS.names() == ["embedded", "hermes"]
    # hermes: no stop string, the turn ends at EOS and all its calls run; embedded: one call per
    # turn, the turn stops at its "]" and a turn ended at EOS is not answered
    assert HERMES.stop_strings == () and HERMES.answers_at_eos
    assert EMBEDDED.stop_strings == ("]",) and not EMBEDDED.answers_at_eos
    with pytest.raises(ValueError, match="unknown tool call format 'xml'; valid: embedded, hermes"):
        get_format("xml")


def test_hermes_no_call_one_call_and_several():
    assert HERMES.parse("The answer is 4.") == ([], False)
    text = (
        'Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "k07"}}\n</tool_call>'
    )
    calls, malformed = HERMES.parse(text)
    assert not malformed and calls == [ToolCall("lookup", {"key": "k07"}, text[13:])]
    two = ('<tool_call>{"name": "lookup", "arguments": {"key": "k01"}}</tool_call>\n'
           '<tool_call> {"name": "calculator", "arguments": "{\\"expression\\": \\"1+2\\"}"} </tool_call>'
           '<tool_call>{"name": "now"}</tool_call>')  # fmt: skip
    assert summary(two) == ([("lookup", {"key": "k01"}, True),
                             ("calculator", {"expression": "1+2"}, True),  # arguments as a JSON string
                             ("now", {}, True)], False)  # fmt: skip


@pytest.mark.parametrize(
    ("text", "error"),
    [('<tool_call>{"name": "lookup", "arguments": {"key": "k07",}}</tool_call>',
      # body {"name": "lookup", "arguments": {"key": "k07",}}: the stray } after the comma is char 46
      "invalid JSON (Expecting property name enclosed in double quotes at character 46)"),
     ("<tool_call>[1, 2]</tool_call>", 'expected a JSON object {"name": ..., "arguments": {...}}'),
     ('<tool_call>{"arguments": {}}</tool_call>', 'the object has no "name" string'),
     ('<tool_call>{"name": "", "arguments": {}}</tool_call>', 'the object has no "name" string'),
     ('<tool_call>{"name": "lookup", "arguments": [1]}</tool_call>', '"arguments" is not a JSON object'),
     ('<tool_call>{"name": "lookup", "arguments": "k07"}</tool_call>', '"arguments" is not a JSON object'),
     ('<tool_call>{"name": "lookup"', "<tool_call> is never closed"),
     ('{"name": "lookup"}</tool_call>', "</tool_call> without <tool_call>")],
)  # fmt: skip
def test_hermes_malformed_calls_are_kept_with_the_reason(text, error):
    calls, malformed = HERMES.parse(text)
    assert malformed and len(calls) == 1 and calls[0].error == error


def test_hermes_two_calls_as_qwen_writes_them():
    """Qwen2.5 / Qwen3 write each call on its own lines, one after the other, then end the turn:
    both calls are read, in order, with their texts."""
    first = '<tool_call>\n{"name": "lookup", "arguments": {"key": "k07"}}\n</tool_call>'
    second = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "70+5"}}\n</tool_call>'
    )
    calls, malformed = HERMES.parse(f"I need two values.\n{first}\n{second}")
    assert not malformed
    assert calls == [ToolCall("lookup", {"key": "k07"}, first),
                     ToolCall("calculator", {"expression": "70+5"}, second)]  # fmt: skip


def test_hermes_a_bad_call_beside_good_ones():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call> then '
            "<tool_call>{oops}</tool_call> and </tool_call>")  # fmt: skip
    assert summary(text) == ([("a", {}, True), ("", {}, False), ("", {}, False)], True)


def test_hermes_render_call_parses_back_and_instructions_list_the_tools():
    text = HERMES.render_call("lookup", {"key": "k07"})
    assert text == '<tool_call>\n{"name": "lookup", "arguments": {"key": "k07"}}\n</tool_call>'
    assert HERMES.parse(text) == ([ToolCall("lookup", {"key": "k07"}, text)], False)
    schemas = [describe_tool(lookup).schema(), describe_tool(calculator).schema()]
    lines = HERMES.instructions(schemas).splitlines()
    tools = lines[lines.index("<tools>") + 1 : lines.index("</tools>")]
    assert [json.loads(line) for line in tools] == schemas
    assert "<tool_call>" in lines and "</tool_call>" in lines
    assert "You may write several calls, one after the other" in HERMES.instructions(schemas)


def test_embedded_calls():
    assert EMBEDDED.parse("75") == ([], False)
    assert summary("[lookup:k07]", EMBEDDED) == ([("lookup", ["k07"], True)], False)
    assert summary("x[calculator:12+79]y[pair:1,2][lookup:]", EMBEDDED) == (
        [("calculator", ["12+79"], True), ("pair", ["1", "2"], True), ("lookup", [""], True)], False)  # fmt: skip
    assert EMBEDDED.render_call("calculator", {"expression": "70+5"}) == "[calculator:70+5]"
    assert EMBEDDED.render_call("pair", [1, 2]) == "[pair:1,2]"


@pytest.mark.parametrize(
    ("text", "errors"),
    [("[lookup]", ["expected [name:argument], got '[lookup]'"]),
     ("[:k07]", ["expected [name:argument], got '[:k07]'"]),
     ("[7up:1]", ["expected [name:argument], got '[7up:1]'"]),
     ("[lookup:k0", ["[ is never closed"]),
     ("k07]", ["] without ["]),
     ("[a:[lookup:k07]", ["[ inside a call", None])],
)  # fmt: skip
def test_embedded_malformed_calls(text, errors):
    calls, malformed = EMBEDDED.parse(text)
    assert malformed and [c.error for c in calls] == errors


def test_embedded_instructions_are_one_compact_line():
    schemas = [describe_tool(lookup).schema(), describe_tool(calculator).schema()]
    assert EMBEDDED.instructions(schemas) == (
        "Tools: lookup(key): Look a key up in the task's table and return its value. "
        "calculator(expression): Evaluate an integer expression with + - * // and parentheses. "
        "Call one as [name:argument]; its result follows as =result."
    )
