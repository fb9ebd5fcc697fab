"""Tool-call formats: from a policy turn's decoded text to its calls, and where a turn that
calls tools ends.

A format (`TOOL_CALL_FORMATS`, chosen by `multi_turn.tool_call_format`) gives:
- `stop_strings`: the engine stops a turn there (the stop string kept in the output), or at EOS;
- `answers_at_eos`: whether a turn that ended at EOS has its calls run (else only a turn that
  ended at a stop string is answered);
- `parse(text) -> (calls, malformed)`: every call of the turn in order; a call that cannot be read
  is kept, with `error` set, so the policy is told what was wrong (status `malformed`);
- `render_call(name, arguments)`: the text of a well-formed call (tests, supervised data);
- `instructions(schemas)`: the text telling the policy which tools exist and how to call them.

Formats:
- `hermes` (Qwen2.5 / Qwen3 / Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  the JSON possibly surrounded by whitespace; `arguments` may also be a JSON string of an object.
  No stop string: a turn ends where the assistant's turn ends (EOS, `<|im_end|>` for ChatML), as
  Qwen writes it: any text, then one or more calls, each on its own lines, then `<|im_end|>`. All
  the turn's calls run and their results follow in call order (one tool message each).
- `embedded` (the char-level embedded task, compact): `[name:arg]` or `[name:arg1,arg2]`, the
  arguments positional text (a tool's declared int / float converts them); the turn stops at the
  call's `]` (one call per turn) and the result follows as `=result`
  (`deltas.PLAIN_RESULT_OPEN`). A turn that ended at EOS is not answered.

Only the turn's own text is parsed: a prompt that ends inside a call (`[lookup:k0`) does not
make the turn's `7]` a call (it is malformed: `] without [`).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from verl.utils.registry import Registry

TOOL_CALL_FORMATS = Registry("tool call format")


@dataclass(frozen=True)
class ToolCall:
    """One call read from a policy turn."""

    name: str
    """The tool it names ('' when unreadable)."""
    arguments: dict[str, Any] | list[Any] = field(default_factory=dict)
    """Keyword arguments (hermes) or positional ones (embedded)."""
    text: str = ""
    """The call's text in the turn."""
    error: str | None = None
    """Why the call is malformed; None for a well-formed one."""


class ToolCallFormat(ABC):
    """Base of the formats: a subclass sets `stop_strings` and `answers_at_eos` and implements the
    methods."""

    stop_strings: tuple[str, ...] = ()
    answers_at_eos: bool = False

    @abstractmethod
    def parse(self, text: str) -> tuple[list[ToolCall], bool]:
        """(calls in order, whether any is malformed) of one turn's decoded text."""

    @abstractmethod
    def render_call(self, name: str, arguments: dict[str, Any] | list[Any]) -> str:
        """The text of a well-formed call."""

    @abstractmethod
    def instructions(self, schemas: Sequence[dict[str, Any]]) -> str:
        """System-prompt text: the tools (`Tool.schema()` dicts) and how to call them."""


@TOOL_CALL_FORMATS.register("hermes")
class HermesFormat(ToolCallFormat):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3, Hermes): any
    number of calls per turn, the turn ended at EOS."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    stop_strings = ()
    answers_at_eos = True

    @staticmethod
    def _read(body: str, text: str) -> ToolCall:
        """The call inside one `<tool_call>` block (malformed when not the expected JSON)."""
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as error:
            return ToolCall("", {}, text, f"invalid JSON ({error.msg} at character {error.pos})")
        if not isinstance(obj, dict):
            return ToolCall(
                "", {}, text, 'expected a JSON object {"name": ..., "arguments": {...}}'
            )
        name, arguments = obj.get("name"), obj.get("arguments", {})
        if not isinstance(name, str) or not name:
            return ToolCall("", {}, text, 'the object has no "name" string')
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            return ToolCall(name, {}, text, '"arguments" is not a JSON object')
        return ToolCall(name, arguments, text)

    def parse(self, text: str) -> tuple[list[ToolCall], bool]:
        calls, pos = [], 0
        while True:
            start = text.find(self.OPEN, pos)
            gap = text[pos:] if start == -1 else text[pos:start]
            if self.CLOSE in gap:
                calls.append(ToolCall("", {}, self.CLOSE, f"{self.CLOSE} without {self.OPEN}"))
            if start == -1:
                break
            end = text.find(self.CLOSE, start)
            if end == -1:
                calls.append(ToolCall("", {}, text[start:], f"{self.OPEN} is never closed"))
                break
            pos = end + len(self.CLOSE)
            calls.append(self._read(text[start + len(self.OPEN) : end], text[start:pos]))
        return calls, any(call.error is not None for call in calls)

    def render_call(self, name: str, arguments: dict[str, Any] | list[Any]) -> str:
        body = json.dumps({"name": name, "arguments": arguments})
        return f"{self.OPEN}\n{body}\n{self.CLOSE}"

    def instructions(self, schemas: Sequence[dict[str, Any]]) -> str:
        tools = "\n".join(json.dumps(schema) for schema in schemas)
        return (
            "# Tools\n\nYou may call the tools below. To call one, write\n"
            f'{self.OPEN}\n{{"name": <tool name>, "arguments": <the arguments as a JSON object>}}\n'
            f"{self.CLOSE}\nYou may write several calls, one after the other; then end your turn: "
            "the results come back in the next message, in the order of the calls.\n\n"
            f"<tools>\n{tools}\n</tools>"
        )


@TOOL_CALL_FORMATS.register("embedded")
class EmbeddedFormat(ToolCallFormat):
    """`[name:arg]` / `[name:arg1,arg2]`: short enough for a character-level policy."""

    OPEN, CLOSE, SEP = "[", "]", ":"
    NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
    stop_strings = (CLOSE,)

    def _read(self, text: str) -> ToolCall:
        """The call of one `[...]` block (malformed unless `[name:args]`)."""
        name, sep, args = text[1:-1].partition(self.SEP)
        if not sep or not self.NAME.fullmatch(name):
            return ToolCall("", [], text, f"expected [name:argument], got {text!r}")
        return ToolCall(name, args.split(","), text)

    def parse(self, text: str) -> tuple[list[ToolCall], bool]:
        calls, pos = [], 0
        while True:
            start = text.find(self.OPEN, pos)
            gap = text[pos:] if start == -1 else text[pos:start]
            if self.CLOSE in gap:
                calls.append(ToolCall("", [], self.CLOSE, f"{self.CLOSE} without {self.OPEN}"))
            if start == -1:
                break
            end, reopen = text.find(self.CLOSE, start), text.find(self.OPEN, start + 1)
            if end == -1:
                calls.append(ToolCall("", [], text[start:], f"{self.OPEN} is never closed"))
                break
            if reopen != -1 and reopen < end:
                calls.append(ToolCall("", [], text[start:reopen], f"{self.OPEN} inside a call"))
                pos = reopen
                continue
            pos = end + 1
            calls.append(self._read(text[start:pos]))
        return calls, any(call.error is not None for call in calls)

    def render_call(self, name: str, arguments: dict[str, Any] | list[Any]) -> str:
        values = arguments.values() if isinstance(arguments, dict) else arguments
        return f"{self.OPEN}{name}{self.SEP}{','.join(str(v) for v in values)}{self.CLOSE}"

    def instructions(self, schemas: Sequence[dict[str, Any]]) -> str:
        lines = []
        for schema in schemas:
            fn = schema["function"]
            args = ",".join(fn["parameters"]["properties"])
            lines.append(f"{fn['name']}({args}): {fn['description']}")
        return (
            "Tools: " + " ".join(lines) + " Call one as [name:argument]; its result follows as "
            "=result."
        )


def get_format(name: str) -> ToolCallFormat:
    """The format registered as `name` (ValueError listing the valid names otherwise)."""
    return TOOL_CALL_FORMATS.get(name)()
