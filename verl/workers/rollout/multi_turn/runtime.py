"""The engine-free half of the turn loop: read each finished turn's calls, run them, and give
its episode the delta.

    runtime = MultiTurnRuntime(config, tokenizer, use_chat_template)
    sampling stop strings: runtime.stop_strings (kept in the output; none for hermes)
    one episode whose turn ended (the draft-only loop, episodes on their own):
           turn = runtime.read(text, finish_reason, turns_done)
           results = runtime.run_calls(turn.calls) if turn.answered else []  (any thread)
           outcome = runtime.answer(turn, results)
    a batch of turns ended together (the guided loop): outcomes = runtime.step(texts, ...)
    then:  trajectory.add_turn(ids, ...); outcome.append_to(trajectory)
           if outcome.continues: append outcome.delta.ids to the episode's context

Which turns are answered: one that made at least one call, with turns left, and that ended at a
stop string (embedded: at the call's `]`) or, for a format that `answers_at_eos` (hermes), at EOS
(all its calls run, results in call order). A turn's calls are read from its own text only.
The tool threads of the whole run are bounded by one `ToolSlots` of `max_parallel_tools`,
shared by every turn's calls, whichever thread runs them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from verl.workers.rollout.multi_turn.config import MultiTurnConfig
from verl.workers.rollout.multi_turn.deltas import ToolDelta, tool_delta_ids
from verl.workers.rollout.multi_turn.parsing import ToolCall, get_format
from verl.workers.rollout.multi_turn.tools import ToolResult, ToolSlots, load_tools, run_tool_calls
from verl.workers.rollout.multi_turn.trajectory import Trajectory

FINISH_REASONS = ("tool_call", "eos", "length")
"""Why a turn ended: at a format's stop string (vLLM: finish_reason 'stop' with the string as
stop_reason), at EOS (finish_reason 'stop', stop_reason None or the eos id) or at the length
limit. A turn ended at a stop string is answered, one ended at EOS when the format
`answers_at_eos`; its last token is then the EOS (vLLM keeps it in a completion's ids, the
speculative rounds in the sequence's tokens)."""


@dataclass(frozen=True)
class TurnOutcome:
    """What follows one policy turn."""

    continues: bool
    """The episode goes on: `delta` is appended and the policy generates another turn."""
    calls: list[ToolCall] = field(default_factory=list)
    """The calls read from the turn (also when they are not run)."""
    malformed: bool = False
    """Some call of the turn could not be read."""
    results: list[ToolResult] = field(default_factory=list)
    """One per call when the turn is answered, else empty."""
    delta: ToolDelta | None = None
    """The tokens appended when the episode continues."""
    unanswered: bool = False
    """The turn would be answered but was the `max_turns`-th: its calls are not run."""

    def append_to(self, trajectory: Trajectory) -> None:
        """Add the delta and the calls' outcomes to `trajectory` (nothing when it ends): each
        call's status, and as truncated the results (status ok) cut to
        `max_tool_response_length` (a cut error text is not counted)."""
        if self.delta is not None:
            cut = [t and r.status == "ok"
                   for r, t in zip(self.results, self.delta.truncated, strict=True)]  # fmt: skip
            trajectory.add_tool(self.delta.ids, [r.status for r in self.results], cut)


@dataclass(frozen=True)
class TurnCalls:
    """A finished policy turn as read (`MultiTurnRuntime.read`), before its calls run."""

    calls: list[ToolCall]
    """The calls read from the turn's own text."""
    malformed: bool
    """Some call of the turn could not be read."""
    reason: str
    """Why the turn ended (FINISH_REASONS)."""
    answerable: bool
    """It ended where the format answers and made a call."""
    answered: bool
    """Its calls run (answerable, and turns left)."""


class MultiTurnRuntime:
    """The tools, the call format and the delta rule of one rollout (`MultiTurnConfig`)."""

    def __init__(self, config: MultiTurnConfig, tokenizer, use_chat_template: bool | None = None):
        """`use_chat_template`: deltas through the tokenizer's chat template (the prompts were
        rendered with it: `data.apply_chat_template`), else plain (None: when it has one)."""
        self.tokenizer, self.use_chat_template = tokenizer, use_chat_template
        self.format = get_format(config.tool_call_format)
        self.tools = load_tools(config.tools)
        self.max_turns = config.max_turns
        self.max_tool_response_length = config.max_tool_response_length
        self.tool_timeout_s = config.tool_timeout_s
        self.tool_slots = ToolSlots(config.max_parallel_tools)
        """The run's tool threads: hung calls (timed out, not returned) keep theirs."""
        self._deltas = functools.lru_cache(maxsize=4096)(self._delta)

    @property
    def hung_tool_calls(self) -> int:
        """Tool calls of this runtime that timed out and have not returned (each holds a
        thread and one of the `max_parallel_tools` slots)."""
        return self.tool_slots.hung

    @property
    def stop_strings(self) -> list[str]:
        """Where the engine stops a turn (with `include_stop_str_in_output`): the format's stop
        strings (empty for hermes, whose turns end at EOS)."""
        return list(self.format.stop_strings)

    @cached_property
    def stop_token_ids(self) -> tuple[int, ...] | None:
        """The ids whose text holds a stop string (ascending), when every stop string is one ASCII character
        (the embedded format's `]`; none for hermes), else None. An ASCII byte never spans two
        tokens, so a turn's text first holds such a stop string at the first of these ids: the
        engine can stop there by id, without detokenizing every step (`multi_turn_mode.
        turn_params`). Longer stop strings are matched by the engine in its text."""
        stops = self.stop_strings
        if any(len(stop) != 1 or not stop.isascii() for stop in stops):
            return None
        if not stops:
            return ()
        vocab = len(getattr(self.tokenizer, "tokenizer", self.tokenizer))  # a processor's own
        texts = self.tokenizer.batch_decode([[i] for i in range(vocab)], skip_special_tokens=True)
        return tuple(i for i, text in enumerate(texts) if any(stop in text for stop in stops))

    def decode(self, ids: Sequence[int]) -> str:
        """A turn's text as the engine detokenizes it (special tokens skipped)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def turn_end(self, ids: Sequence[int]) -> int | None:
        """Where a turn sampled without the engine's stop strings ends as the engine would have
        ended it: the fewest leading `ids` whose text holds a stop string (the token completing
        it kept), or None when their text holds none. (A prefix's text is a prefix of the whole
        text, so the search halves the range.)"""

        def has_stop(n: int) -> bool:
            text = self.decode(ids[:n])
            return any(stop in text for stop in self.stop_strings)

        if not has_stop(len(ids)):
            return None
        low, high = 0, len(ids)  # has_stop(low) is False, has_stop(high) is True
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (low, mid) if has_stop(mid) else (mid, high)
        return high

    def turn_text(self, ids: Sequence[int]) -> str:
        """A turn's text up to the end of its first stop string, as the engine reports a turn it
        stopped there (`include_stop_str_in_output`); the whole text when it holds none."""
        text = self.decode(ids)
        ends = [text.index(stop) + len(stop) for stop in self.stop_strings if stop in text]
        return text[: min(ends)] if ends else text

    def instructions(self) -> str:
        """System-prompt text describing the tools and how to call them."""
        return self.format.instructions([tool.schema() for tool in self.tools.values()])

    def read(self, text: str, finish_reason: str, turns_done: int) -> TurnCalls:
        """One finished turn read (its own text only): its calls, and whether they are run. A
        turn is answered when it ended at a stop string (or at EOS where the format
        `answers_at_eos`), made at least one call and `turns_done < max_turns` (`turns_done`: its
        policy turns so far, this one included)."""
        if finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"finish reason {finish_reason!r} is not valid; valid: {', '.join(FINISH_REASONS)}"
            )
        calls, malformed = self.format.parse(text)
        ends = ("tool_call", "eos") if self.format.answers_at_eos else ("tool_call",)
        answerable = finish_reason in ends and bool(calls)
        return TurnCalls(calls, malformed, finish_reason, answerable,
                         answerable and turns_done < self.max_turns)  # fmt: skip

    def runs_inline(self, calls: Sequence[ToolCall]) -> bool:
        """Whether `run_calls` would start no thread for `calls`: each is malformed, names no
        tool of the run, or names an inline one (`Tool.inline`)."""
        tools = self.tools
        return all(c.error is not None or c.name not in tools or tools[c.name].inline
                   for c in calls)  # fmt: skip

    def run_calls(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """One result per call, in call order (`run_tool_calls` on the run's `tool_slots`; safe to
        call from several threads at once)."""
        return run_tool_calls(calls, self.tools, self.tool_timeout_s, self.tool_slots)

    def answer(self, turn: TurnCalls, results: Sequence[ToolResult] = ()) -> TurnOutcome:
        """What follows a read turn: for an answered one, its `results` (one per call, in call
        order) as the delta; else the episode ends (`unanswered` when the calls would have run
        but the turn was the `max_turns`-th)."""
        if not turn.answered:
            return TurnOutcome(False, turn.calls, turn.malformed, unanswered=turn.answerable)
        results = list(results)
        delta = self._deltas(tuple(r.text for r in results), turn.reason == "eos")
        return TurnOutcome(True, turn.calls, turn.malformed, results, delta)

    def _delta(self, texts: tuple[str, ...], after_eos: bool) -> ToolDelta:
        """`tool_delta_ids` of `texts` with this run's settings (`answer` keeps the last 4,096:
        a tool's results repeat, and the same texts always give the same delta)."""
        return tool_delta_ids(self.tokenizer, list(texts), self.max_tool_response_length,
                              self.use_chat_template, after_eos=after_eos)  # fmt: skip

    def step(
        self, texts: Sequence[str], finish_reasons: Sequence[str], turns_done: Sequence[int]
    ) -> list[TurnOutcome]:
        """One outcome per episode whose turn just ended (`read`, then `answer`): `texts` its
        decoded text, `finish_reasons` (FINISH_REASONS) why it ended, `turns_done` its policy
        turns so far, this one included. The calls of every answered turn run together
        (`run_calls`); each delta holds one result per call, in call order."""
        read = [self.read(*turn) for turn in zip(texts, finish_reasons, turns_done, strict=True)]
        results = iter(self.run_calls([call for turn in read if turn.answered
                                       for call in turn.calls]))  # fmt: skip
        return [self.answer(turn, [next(results) for _ in turn.calls] if turn.answered else [])
                for turn in read]  # fmt: skip
