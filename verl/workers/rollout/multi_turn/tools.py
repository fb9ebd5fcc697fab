"""Tools of multi-turn rollouts: plain Python functions, described from their signature and
docstring (TRL style), and run concurrently by `run_tool_calls`, which never raises: each call in
a thread with a timeout, the threads bounded over the run by `ToolSlots` (a timed-out call cannot
be stopped; it keeps its slot until it returns).

A tool is a function with typed parameters (str, int, float, bool, list, dict, or `X | None`)
and a Google-style docstring: a description, then an `Args:` section with one `name: text` line
per parameter. `describe_tool` turns it into a JSON-schema description for the system prompt:

    {"type": "function", "function": {"name": ..., "description": ...,
     "parameters": {"type": "object", "properties": {...}, "required": [...]}}}

Built-ins (`TOOLS`): `lookup` (the embedded task's key-value table) and `calculator` (+ - * //
on integers, evaluated without `eval`). Others load from `path/to/file.py:fn`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import logging
import queue
import re
import threading
import time
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from verl.utils.registry import Registry
from verl.utils.user_functions import is_file_spec, load_function
from verl.workers.rollout.multi_turn.parsing import ToolCall

logger = logging.getLogger(__name__)
TOOLS = Registry("tool")
TOOL_STATUSES = ("ok", "error", "timeout", "unavailable", "unknown_tool", "malformed")
"""Outcome of one call: ran and returned; raised; ran past its timeout; not run, every tool slot
being held by a hung call (`ToolSlots`); named no loaded tool; could not be read or did not fit
the tool's parameters."""
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
              dict: "object"}  # fmt: skip
"""Python annotation -> JSON-schema type of a tool parameter."""
LOOKUP_TABLE = {f"k{n:02d}": str((37 * n + 11) % 100) for n in range(100)}
"""The `lookup` tool's table: key k00..k99 -> (37·n + 11) mod 100 (a bijection onto 0..99)."""
DOC_SECTIONS = ("Args:", "Arguments:", "Returns:", "Raises:", "Examples:", "Note:")
"""Docstring section headers; the description is the text before the first."""
ARG_LINE = re.compile(r"^(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
"""One parameter's first line in an `Args:` section: `name: text` or `name (type): text`."""
CALCULATOR_MAX_CHARS = 200
"""Longest expression `calculator` accepts."""
CALCULATOR_MAX_ABS = 10**30
"""Largest magnitude of any intermediate value of `calculator` (refused beyond it)."""


@TOOLS.register("lookup")
def lookup(key: str) -> str:
    """Look a key up in the task's table and return its value.

    Args:
        key: the key, k00 to k99.
    """
    if key.strip() not in LOOKUP_TABLE:
        raise ValueError(f"no key {key!r}; keys are k00..k99")
    return LOOKUP_TABLE[key.strip()]


_CALC_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
             ast.Mult: lambda a, b: a * b, ast.FloorDiv: lambda a, b: a // b}  # fmt: skip


def _calc(node: ast.AST) -> int:
    """Value of an integer expression tree of + - * // (floor division, as Python's) and unary
    minus or plus; ValueError on anything else."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = -_calc(node.operand) if isinstance(node.op, ast.USub) else _calc(node.operand)
    elif isinstance(node, ast.BinOp) and type(node.op) in _CALC_OPS:
        value = _CALC_OPS[type(node.op)](_calc(node.left), _calc(node.right))
    else:
        raise ValueError("only integers, parentheses and + - * // are allowed")
    if abs(value) > CALCULATOR_MAX_ABS:
        raise ValueError(f"a value exceeds {CALCULATOR_MAX_ABS:.0e} in magnitude")
    return value


@TOOLS.register("calculator")
def calculator(expression: str) -> str:
    """Evaluate an integer expression with + - * // and parentheses.

    Args:
        expression: the expression, e.g. (12+79)//7.
    """
    if len(expression) > CALCULATOR_MAX_CHARS:
        raise ValueError(f"expression longer than {CALCULATOR_MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {expression!r}") from None
    return str(_calc(tree.body))


INLINE_TOOLS = frozenset({"lookup", "calculator"})
"""Built-ins that are pure and bounded (a table read; integer arithmetic capped in length and
magnitude, no powers): they return in microseconds, so their calls run in the caller's thread,
without a thread hand-off or a deadline (`Tool.inline`)."""


@dataclass(frozen=True)
class Tool:
    """A loaded tool: its function and the description the policy is shown."""

    name: str
    """The name calls use."""
    fn: Callable[..., Any]
    """The function (called with the call's arguments)."""
    description: str
    """The docstring's text before its `Args:` section."""
    parameters: dict[str, Any]
    """JSON schema of the arguments: {"type": "object", "properties": ..., "required": ...}."""
    inline: bool = False
    """Run in the caller's thread, with no deadline (`INLINE_TOOLS`); a tool from a file always
    gets a thread of its own and `tool_timeout_s`."""

    def schema(self) -> dict[str, Any]:
        """The OpenAI / Hermes function description (`tools=` of `apply_chat_template`)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}  # fmt: skip


def _json_type(annotation: Any) -> dict[str, Any] | None:
    """JSON-schema type of a parameter annotation; None when it is not supported."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return _json_type(rest[0]) if len(rest) == 1 else None
    base = origin or annotation
    if base not in JSON_TYPES:
        return None
    schema: dict[str, Any] = {"type": JSON_TYPES[base]}
    if base is list and args and _json_type(args[0]):
        schema["items"] = _json_type(args[0])
    return schema


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(description, parameter -> text) of a Google-style docstring: the text before its first
    section, and the `Args:` lines `name: text` or `name (type): text`, each continued by the
    deeper-indented lines after it."""
    description, args = [], {}
    section, indent, current = None, None, None
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped in DOC_SECTIONS:
            section = stripped
            continue
        if section is None:
            description.append(stripped)
            continue
        if section not in ("Args:", "Arguments:") or not stripped:
            continue
        depth, match = len(line) - len(line.lstrip()), ARG_LINE.match(stripped)
        if match and (indent is None or depth <= indent):
            indent, current = depth, match[1]
            args[current] = match[2]
        elif current is not None:
            args[current] += " " + stripped
    return " ".join(" ".join(description).split()), args


def describe_tool(fn: Callable[..., Any], name: str | None = None) -> Tool:
    """A `Tool` of `fn`, named `name` (default: the function's name). TypeError when `fn` lacks
    a docstring, takes *args / **kwargs, or has a parameter without a supported type hint."""
    name = name or fn.__name__
    doc = inspect.getdoc(fn)
    if not doc:
        raise TypeError(f"tool {name!r} has no docstring (its description for the policy)")
    description, arg_text = _docstring_parts(doc)
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {name!r}: *args / **kwargs are not allowed ({param.name})")
        schema = _json_type(hints.get(param.name))
        if schema is None:
            raise TypeError(
                f"tool {name!r}: parameter {param.name!r} has type {hints.get(param.name)!r}; "
                f"supported: {', '.join(t.__name__ for t in JSON_TYPES)} or X | None"
            )
        if param.name in arg_text:
            schema["description"] = arg_text[param.name]
        if param.default is param.empty:
            required.append(param.name)
        else:
            schema["default"] = param.default
        properties[param.name] = schema
    parameters = {"type": "object", "properties": properties, "required": required}
    return Tool(name=name, fn=fn, description=description, parameters=parameters)


def load_tools(
    specs: Sequence[str], key: str = "worker.rollout.multi_turn.tools"
) -> dict[str, Tool]:
    """Name -> Tool for each spec (a `TOOLS` name, or `path/to/file.py:fn` named by its function);
    ValueError when two specs give the same name."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        fn = load_function(spec, TOOLS, key)
        builtin = None if is_file_spec(spec) else TOOLS.canonical(spec)
        tool = describe_tool(fn, builtin)
        if builtin in INLINE_TOOLS:
            tool = dataclasses.replace(tool, inline=True)
        if tool.name in tools:
            raise ValueError(f"{key}: two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools


@dataclass(frozen=True)
class ToolResult:
    """What one call gave: the text the policy sees next and how the call went."""

    name: str
    """The tool the call named ('' when the call could not be read)."""
    text: str
    """The tool's return value as text, or an error text starting with `error:`."""
    status: str
    """One of TOOL_STATUSES."""


def _fits(value: Any, annotation: Any) -> tuple[bool, Any]:
    """(fits, value) for an argument and its annotation; a string converts to a declared int or
    float (the embedded format's arguments are text), an int passes as a float."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return True, None
        annotation = next(a for a in args if a is not type(None))
    base = typing.get_origin(annotation) or annotation
    if base in (int, float) and isinstance(value, str):
        try:
            return True, base(value.strip())
        except ValueError:
            return False, value
    if base is float and type(value) is int:
        return True, float(value)
    ok = isinstance(value, base) and not (base in (int, float) and isinstance(value, bool))
    return ok, value


@functools.lru_cache(maxsize=256)
def _signature(fn: Callable[..., Any]) -> tuple[inspect.Signature, dict[str, Any]]:
    """A tool function's signature and type hints, read once per function (every call binds)."""
    return inspect.signature(fn), typing.get_type_hints(fn)


def _bind(tool: Tool, arguments: dict[str, Any] | list[Any]) -> dict[str, Any]:
    """Keyword arguments for `tool.fn`; TypeError saying why the arguments do not fit."""
    signature, hints = _signature(tool.fn)
    if isinstance(arguments, dict):
        bound = signature.bind(**arguments)
    else:
        bound = signature.bind(*arguments)
    kwargs = {}
    for name, value in bound.arguments.items():
        ok, kwargs[name] = _fits(value, hints[name])
        if not ok:
            wanted = tool.parameters["properties"][name]["type"]
            raise TypeError(f"argument {name!r}={value!r} is not of type {wanted}")
    return kwargs


def _as_text(value: Any) -> str:
    """A tool's return value as the text the policy sees (JSON for anything but a string)."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _prepare(call: ToolCall, tools: dict[str, Tool]) -> ToolResult | dict[str, Any]:
    """The keyword arguments of a call that can run, or the result of one that cannot."""
    if call.error is not None:
        return ToolResult(call.name, f"error: malformed tool call: {call.error}", "malformed")
    if call.name not in tools:
        valid = ", ".join(sorted(tools)) or "none"
        return ToolResult(call.name, f"error: unknown tool {call.name!r}; tools: {valid}",
                          "unknown_tool")  # fmt: skip
    try:
        return _bind(tools[call.name], call.arguments)
    except Exception as error:  # TypeError from binding; anything else odd is malformed too
        return ToolResult(call.name, f"error: malformed tool call: {error}", "malformed")


class ToolSlots:
    """The threads tool calls may hold at once, `size` at most, over a whole run.

    A call holds a slot from its start until its function returns. A call past its timeout gets
    its `timeout` result at once, but Python cannot stop a thread: the call is *hung* and keeps
    its slot until the function returns, if ever. So hung calls hold at most `size` threads for
    the run, and while every slot is held by a hung call, further calls are not started (status
    `unavailable`) instead of queueing behind them. Several threads may share one (`run_tool_calls`
    of several episodes at once): a call waits for a slot that another batch's running call holds.
    """

    def __init__(self, size: int):
        self.size = max(1, size)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a slot freed or a call hung
        self._held: set[int] = set()
        self._hung: set[int] = set()
        self._next = 0

    def acquire(self, wait: bool = False) -> int | None:
        """A slot's ticket, or None when all `size` are held; with `wait`, None only when every
        slot is held by a hung call, else it waits until one is freed."""
        with self._changed:
            while len(self._held) >= self.size:
                if not wait or len(self._hung) >= self.size:
                    return None
                self._changed.wait()
            self._next += 1
            self._held.add(self._next)
            return self._next

    def release(self, ticket: int) -> None:
        """The call holding `ticket` returned (on time or not): its slot is free."""
        with self._changed:
            self._held.discard(ticket)
            self._hung.discard(ticket)
            self._changed.notify_all()

    def abandon(self, ticket: int) -> None:
        """The call holding `ticket` timed out: hung until it returns."""
        with self._changed:
            if ticket in self._held:
                self._hung.add(ticket)
                self._changed.notify_all()

    @property
    def hung(self) -> int:
        """Calls past their timeout whose function has not returned (each holds a thread)."""
        with self._lock:
            return len(self._hung)


def _call(name: str, fn: Callable[..., Any], kwargs: dict) -> ToolResult:
    """One call's result: its text, or the error it raised (a result the policy sees)."""
    try:
        return ToolResult(name, _as_text(fn(**kwargs)), "ok")
    except Exception as error:
        return ToolResult(name, f"error: {type(error).__name__}: {error}", "error")


def _start(index: int, name: str, fn: Callable[..., Any], kwargs: dict, done: queue.Queue,
           slots: ToolSlots, ticket: int) -> None:  # fmt: skip
    """Run one call in a daemon thread that reports (index, result) to `done` and frees its slot
    when the function returns."""

    def work() -> None:
        try:
            result = _call(name, fn, kwargs)
        finally:
            slots.release(ticket)
        done.put((index, result))

    threading.Thread(target=work, name=f"tool-{name}", daemon=True).start()


def run_tool_calls(calls: Sequence[ToolCall], tools: dict[str, Tool], timeout_s: float,
                   slots: ToolSlots | int) -> list[ToolResult]:  # fmt: skip
    """One result per call, in order; never raises.

    An inline tool's call (`Tool.inline`) runs here, first, with no deadline. Each other call
    runs in its own thread, holding one of `slots` (an int: fresh slots of that size,
    for this batch alone), with its own deadline (`timeout_s` from its start). A call past its
    deadline gets status `timeout` at once and is hung: its thread keeps its slot until the
    function returns (`ToolSlots`), so a hung tool delays the batch by at most its timeout and
    hung calls hold at most `slots.size` threads. Calls wait for a free slot while a call of this
    batch runs, or one of another batch sharing `slots`; when every slot is held by a hung call,
    the calls left get status `unavailable` without running. Malformed calls, unknown names and
    arguments that do not fit never run.
    """
    slots = slots if isinstance(slots, ToolSlots) else ToolSlots(slots)
    results: list[ToolResult | None] = [None] * len(calls)
    pending = []
    for i, call in enumerate(calls):
        prepared = _prepare(call, tools)
        if isinstance(prepared, ToolResult):
            results[i] = prepared
        elif tools[call.name].inline:  # here and now (`INLINE_TOOLS`)
            results[i] = _call(call.name, tools[call.name].fn, prepared)
        else:
            pending.append((i, prepared))
    if not pending:
        return results  # type: ignore[return-value]
    done: queue.Queue = queue.Queue()
    running: dict[int, tuple[float, int]] = {}  # index -> (deadline, ticket)
    while pending or running:
        while pending and (ticket := slots.acquire(wait=not running)) is not None:
            i, kwargs = pending.pop(0)
            running[i] = (time.monotonic() + timeout_s, ticket)
            _start(i, calls[i].name, tools[calls[i].name].fn, kwargs, done, slots, ticket)
        if not running:  # calls left and every slot held by a hung call
            for i, _ in pending:
                name = calls[i].name
                text = (f"error: tool {name!r} not run: all {slots.size} tool slots are held by "
                        "calls that timed out and have not returned")  # fmt: skip
                results[i] = ToolResult(name, text, "unavailable")
            break
        try:
            wait = min(deadline for deadline, _ in running.values()) - time.monotonic()
            i, result = done.get(timeout=max(0.0, wait))
            if i in running:  # a call that already timed out reports too late: ignored
                results[i] = result
                del running[i]
        except queue.Empty:
            now = time.monotonic()
            for i in [i for i, (deadline, _) in running.items() if deadline <= now]:
                name = calls[i].name
                text = f"error: tool {name!r} timed out after {timeout_s:g} s"
                results[i] = ToolResult(name, text, "timeout")
                slots.abandon(running.pop(i)[1])
                logger.warning("tool %r timed out after %g s; its thread still runs (%d of %d "
                               "tool slots held by hung calls)", name, timeout_s, slots.hung,
                               slots.size)  # fmt: skip
    return results
