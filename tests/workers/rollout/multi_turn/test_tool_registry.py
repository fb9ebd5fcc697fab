"""Tools (verl/workers/rollout/multi_turn/tools.py): descriptions from signatures and docstrings,
the built-in lookup and calculator, and `run_tool_calls`, which never raises, never lets a slow
tool hold the others, and bounds the threads hung calls keep (timeouts tested with Events, no
wall-clock assertion)."""

from __future__ import annotations

import threading

import pytest

from verl.workers.rollout.multi_turn.parsing import ToolCall
from verl.workers.rollout.multi_turn.tools import (
    LOOKUP_TABLE,
    Tool,
    ToolSlots,
    calculator,
    describe_tool,
    load_tools,
    lookup,
    run_tool_calls,
)


def search(query: str, limit: int = 3, tags: list[str] | None = None, exact: bool = False) -> str:
    """Search the notes for a query.

    Returns the best matches, one a line.

    Args:
        query: the words to look for; a longer
            description continues here.
        limit (int): how many matches at most.
        tags: only notes with these tags.
        exact: match whole words only.

    Returns:
        The matches.
    """
    return f"{query}:{limit}:{tags}:{exact}"


def test_describe_tool_builds_the_json_schema_from_signature_and_docstring():
    assert describe_tool(search).schema() == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes for a query. Returns the best matches, one a line.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "the words to look for; a longer description continues here."},
                    "limit": {"type": "integer", "description": "how many matches at most.", "default": 3},
                    "tags": {"type": "array", "items": {"type": "string"}, "description": "only notes with these tags.", "default": None},
                    "exact": {"type": "boolean", "description": "match whole words only.", "default": False},
                },
                "required": ["query"],
            },
        },
    }  # fmt: skip


def test_describe_tool_refuses_what_it_cannot_describe():
    def bare(x: int) -> int:
        return x

    def star(*xs: int) -> int:
        """Sum."""
        return sum(xs)

    def untyped(x) -> int:
        """Echo."""
        return x

    def complex_arg(x: complex) -> str:
        """Echo."""
        return str(x)

    with pytest.raises(TypeError, match="tool 'bare' has no docstring"):
        describe_tool(bare)
    with pytest.raises(TypeError, match=r"tool 'star': \*args / \*\*kwargs are not allowed \(xs\)"):
        describe_tool(star)
    with pytest.raises(TypeError, match="parameter 'x' has type None; supported: str, int"):
        describe_tool(untyped)
    with pytest.raises(TypeError, match="parameter 'x' has type <class 'complex'>"):
        describe_tool(complex_arg)


def test_lookup_table_by_hand():
    # (37·n + 11) mod 100: k00 -> 11, k07 -> 259+11 = 270 -> 70, k99 -> 3663+11 = 3674 -> 74
    assert (lookup("k00"), lookup("k07"), lookup(" k99 ")) == ("11", "70", "74")
    assert sorted(map(int, LOOKUP_TABLE.values())) == list(range(100))  # a bijection
    with pytest.raises(ValueError, match=r"no key 'zz'; keys are k00\.\.k99"):
        lookup("zz")


@pytest.mark.parametrize(
    ("expression", "value"),
    [("2+3*4", "14"), ("(12+79)//7", "13"), ("-7//2", "-4"), ("10-2-3", "5"), (" +5 ", "5"),
     ("9" * 30, "9" * 30)],
)  # fmt: skip
def test_calculator_evaluates_integer_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [("2**3", "only integers"), ("1/2", "only integers"), ("1.5+1", "only integers"),
     ("True+1", "only integers"), ("__import__('os')", "only integers"), ("x", "only integers"),
     ("", "cannot read ''"), ("1+", "cannot read"), ("9" * 31, "exceeds"),
     ("1" * 201, "longer than 200"), ("1//0", "by zero")],
)  # fmt: skip
def test_calculator_refuses_everything_else(expression, error):
    with pytest.raises((ValueError, ZeroDivisionError), match=error):
        calculator(expression)


def test_load_tools_by_name_and_from_a_file(tmp_path):
    (tmp_path / "t.py").write_text(
        'def double(x: int) -> int:\n    """Twice x.\n\n    Args:\n        x: a number.\n    """\n'
        "    return 2 * x\n"
    )
    tools = load_tools(["lookup", f"{tmp_path / 't.py'}:double"])
    assert list(tools) == ["lookup", "double"] and tools["double"].fn(4) == 8
    assert tools["double"].parameters["properties"]["x"] == {
        "type": "integer",
        "description": "a number.",
    }
    (tmp_path / "u.py").write_text(
        'def lookup(key: str) -> str:\n    """Shadow."""\n    return key\n'
    )
    with pytest.raises(ValueError, match="two tools are named 'lookup'"):
        load_tools(["lookup", f"{tmp_path / 'u.py'}:lookup"])


def tool(fn) -> Tool:
    return describe_tool(fn)


def test_every_failure_becomes_a_result_with_a_status():
    def boom(x: int) -> str:
        """Fail."""
        raise RuntimeError(f"bad {x}")

    def listing(n: int) -> list:
        """A list."""
        return list(range(n))

    tools = {
        "lookup": tool(lookup),
        "boom": tool(boom),
        "listing": tool(listing),
        "calc": tool(calculator),
    }
    calls = [
        ToolCall("lookup", {"key": "k07"}),
        ToolCall("boom", {"x": 3}),
        ToolCall("search", {"query": "a"}),
        ToolCall("", {}, "<tool_call>{</tool_call>", "invalid JSON"),
        ToolCall("lookup", {}),
        ToolCall("lookup", {"key": 7}),
        ToolCall("lookup", {"key": "k01", "extra": 1}),
        ToolCall("listing", ["3"]),  # positional text (the embedded format) converts to int
        ToolCall("listing", ["three"]),
        ToolCall("calc", ["1//0"]),
    ]
    results = run_tool_calls(calls, tools, timeout_s=30.0, slots=4)
    assert [(r.name, r.status, r.text) for r in results] == [
        ("lookup", "ok", "70"),
        ("boom", "error", "error: RuntimeError: bad 3"),
        ("search", "unknown_tool", "error: unknown tool 'search'; tools: boom, calc, listing, lookup"),
        ("", "malformed", "error: malformed tool call: invalid JSON"),
        ("lookup", "malformed", "error: malformed tool call: missing a required argument: 'key'"),
        ("lookup", "malformed", "error: malformed tool call: argument 'key'=7 is not of type string"),
        ("lookup", "malformed", "error: malformed tool call: got an unexpected keyword argument 'extra'"),
        ("listing", "ok", "[0, 1, 2]"),
        ("listing", "malformed", "error: malformed tool call: argument 'n'='three' is not of type integer"),
        ("calc", "error", "error: ZeroDivisionError: integer division or modulo by zero"),
    ]  # fmt: skip
    assert run_tool_calls([], tools, 1.0, 2) == []


def waiting_tool(release: threading.Event, started: threading.Event | None = None) -> Tool:
    def slow(key: str) -> str:
        """Wait until released."""
        if started is not None:
            started.set()
        release.wait()
        return "late"

    return tool(slow)


def test_a_hung_tool_times_out_and_the_others_finish():
    release = threading.Event()  # set only after run_tool_calls returned: `slow` cannot finish
    tools = {"slow": waiting_tool(release), "lookup": tool(lookup)}
    calls = [ToolCall("slow", {"key": "a"}), ToolCall("lookup", {"key": "k00"})]
    try:
        results = run_tool_calls(calls, tools, timeout_s=1.0, slots=2)
    finally:
        release.set()
    assert [(r.status, r.text) for r in results] == [
        ("timeout", "error: tool 'slow' timed out after 1 s"), ("ok", "11")]  # fmt: skip


def test_a_timed_out_tool_keeps_its_place_until_it_returns():
    """One slot, the hung call first: it times out but its thread still runs and holds the slot,
    so the second call is not run (`unavailable`) rather than waiting behind it."""
    release, started = threading.Event(), threading.Event()
    tools = {"slow": waiting_tool(release, started), "lookup": tool(lookup)}
    calls = [ToolCall("slow", {"key": "a"}), ToolCall("lookup", {"key": "k07"})]
    try:
        results = run_tool_calls(calls, tools, timeout_s=0.5, slots=1)
    finally:
        release.set()
    assert started.is_set() and [r.status for r in results] == ["timeout", "unavailable"]


def test_calls_run_concurrently():
    """Two calls that each wait for the other finish only when they run at the same time."""
    barrier = threading.Barrier(2, timeout=60)

    def meet(name: str) -> str:
        """Wait for the other call."""
        barrier.wait()
        return name

    calls = [ToolCall("meet", {"name": "a"}), ToolCall("meet", {"name": "b"})]
    results = run_tool_calls(calls, {"meet": tool(meet)}, timeout_s=60.0, slots=2)
    assert [(r.status, r.text) for r in results] == [("ok", "a"), ("ok", "b")]


def tool_threads(name: str) -> int:
    return sum(t.name == f"tool-{name}" and t.is_alive() for t in threading.enumerate())


def hanging_tools() -> tuple[threading.Event, dict]:
    """A `hang` tool that returns only once the event is set, beside `lookup`."""
    release = threading.Event()

    def hang(key: str) -> str:
        """Never return until released."""
        release.wait()
        return "late"

    return release, {"hang": tool(hang), "lookup": tool(lookup)}


def test_hung_calls_hold_at_most_the_slots_and_free_them_when_they_return():
    """Slots of size 2 shared over batches: two calls that never return (until released) time
    out and keep their threads; the next batches' calls get `unavailable` at once, no thread is
    started for them (2 hung threads after 5 batches, not 5); once the hung calls return, their
    slots are free and a call runs again."""
    release, tools = hanging_tools()
    slots = ToolSlots(2)
    try:
        first = run_tool_calls([ToolCall("hang", {"key": "a"}), ToolCall("hang", {"key": "b"})],
                               tools, timeout_s=0.2, slots=slots)  # fmt: skip
        assert [r.status for r in first] == ["timeout", "timeout"]
        assert slots.hung == 2 and tool_threads("hang") == 2
        for _ in range(4):
            calls = [ToolCall("hang", {"key": "c"}), ToolCall("lookup", {"key": "k07"})]
            later = run_tool_calls(calls, tools, timeout_s=0.2, slots=slots)
            assert [(r.status, r.text) for r in later] == [
                ("unavailable", "error: tool 'hang' not run: all 2 tool slots are held by calls "
                                "that timed out and have not returned"),
                ("unavailable", "error: tool 'lookup' not run: all 2 tool slots are held by calls "
                                "that timed out and have not returned")]  # fmt: skip
        assert slots.hung == 2 and tool_threads("hang") == 2
    finally:
        release.set()
    for thread in [t for t in threading.enumerate() if t.name == "tool-hang"]:
        thread.join(timeout=30)
    assert slots.hung == 0 and tool_threads("hang") == 0
    again = run_tool_calls([ToolCall("lookup", {"key": "k07"})], tools, timeout_s=5.0, slots=slots)
    assert [(r.status, r.text) for r in again] == [("ok", "70")]


def test_one_hung_call_leaves_the_other_slot_to_the_batch():
    """Slots of size 2, one held by a hung call: the next batch's three calls run one at a time
    in the free slot, all ok."""
    release, tools = hanging_tools()
    slots = ToolSlots(2)
    try:
        (first,) = run_tool_calls(
            [ToolCall("hang", {"key": "a"})], tools, timeout_s=0.2, slots=slots
        )
        assert first.status == "timeout" and slots.hung == 1
        keys = ["k00", "k01", "k07"]
        results = run_tool_calls([ToolCall("lookup", {"key": k}) for k in keys], tools,
                                 timeout_s=5.0, slots=slots)  # fmt: skip
        # (37·n + 11) mod 100: 11, 48, 70
        assert [(r.status, r.text) for r in results] == [("ok", "11"), ("ok", "48"), ("ok", "70")]
    finally:
        release.set()


class CountedSlots(ToolSlots):
    """`ToolSlots` that sets `second_wait` when a second caller asks to wait for a slot."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.waits, self.second_wait = 0, threading.Event()

    def acquire(self, wait: bool = False) -> int | None:
        if wait:
            self.waits += 1
            if self.waits == 2:
                self.second_wait.set()
        return super().acquire(wait)


def test_a_batch_waits_for_a_slot_another_batch_s_running_call_holds():
    """Two batches sharing one slot, run at once (as two episodes' calls are): batch b, started
    while batch a's call holds the slot and still runs, waits for it and runs, ok, instead of
    being reported `unavailable` (that is for slots held by hung calls only)."""
    release, started = threading.Event(), threading.Event()
    tools = {"slow": waiting_tool(release, started), "lookup": tool(lookup)}
    slots = CountedSlots(1)
    results: dict[str, list] = {}

    def batch(name: str, call: ToolCall) -> None:
        results[name] = run_tool_calls([call], tools, timeout_s=60.0, slots=slots)

    a = threading.Thread(target=batch, args=("a", ToolCall("slow", {"key": "a"})))
    a.start()
    assert started.wait(timeout=60)  # a's call holds the slot
    b = threading.Thread(target=batch, args=("b", ToolCall("lookup", {"key": "k07"})))
    b.start()
    try:
        assert slots.second_wait.wait(timeout=60)  # b asks for the slot a holds
    finally:
        release.set()
    a.join(timeout=60)
    b.join(timeout=60)
    assert [r.status for r in results["a"]] == ["ok"]
    assert [(r.status, r.text) for r in results["b"]] == [("ok", "70")]


def test_inline_tools_run_in_the_caller_s_thread_and_the_others_on_their_own(tmp_path):
    """`INLINE_TOOLS` (lookup, calculator) are loaded inline and a file's tool never is; an inline
    tool's call runs in the calling thread (no hand-off, no deadline: here a 0 s timeout that any
    threaded call would miss), the others in threads of their own, and the results keep the
    calls' order, an inline tool's error included."""
    (tmp_path / "t.py").write_text(
        'def where(x: int) -> str:\n    """Which thread.\n\n    Args:\n        x: a number.\n    """\n'
        "    import threading, time\n    time.sleep(0.2)\n    return threading.current_thread().name\n"
    )
    tools = load_tools(["lookup", "calculator", f"{tmp_path / 't.py'}:where"])
    assert [t.inline for t in tools.values()] == [True, True, False]
    here = threading.current_thread().name

    def probe() -> str:
        """Which thread."""
        return threading.current_thread().name

    tools["probe"] = Tool("probe", probe, "Which thread.", {"type": "object", "properties": {},
                                                            "required": []}, inline=True)  # fmt: skip
    calls = [ToolCall("where", {"x": 1}), ToolCall("probe", {}), ToolCall("lookup", {"key": "k07"}),
             ToolCall("calculator", {"expression": "2**3"})]  # fmt: skip
    results = run_tool_calls(calls, tools, timeout_s=5.0, slots=2)
    assert results[0].status == "ok" and results[0].text != here  # a thread of its own
    assert results[1].text == here and results[2].text == LOOKUP_TABLE["k07"]
    assert results[3].status == "error" and "only integers" in results[3].text
    inline_only = run_tool_calls(calls[1:], tools, timeout_s=0.0, slots=1)
    assert [r.status for r in inline_only] == ["ok", "ok", "error"]  # no deadline applies
