"""The engine-free half of the turn loop: between two generation calls, read every finished
turn's calls, run those of the whole batch concurrently, and give each episode its delta.

    runtime = MultiTurnRuntime(config, tokenizer, use_chat_template)
    sampling stop strings: runtime.stop_strings (kept in the output; none for hermes)
    loop:  generate a turn for every active episode
           outcomes = runtime.step(texts, finish_reasons, turns_done)
           for each: trajectory.add_turn(ids, ...); outcome.append_to(trajectory)
                     if outcome.continues: append outcome.delta.ids to the episode's sessions

Which turns are answered: one that made at least one call, with turns left, and that ended at a
stop string (embedded: at the call's `]`) or, for a format that `answers_at_eos` (hermes), at EOS
(all its calls run, results in call order). A turn's calls are read from its own text only.
The tool threads of the whole run are bounded by one `ToolSlots` of `max_parallel_tools`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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

    def step(
        self, texts: Sequence[str], finish_reasons: Sequence[str], turns_done: Sequence[int]
    ) -> list[TurnOutcome]:
        """One outcome per episode whose turn just ended: `texts` its decoded text,
        `finish_reasons` (FINISH_REASONS) why it ended, `turns_done` its policy turns so far,
        this one included. An episode continues when its turn ended at a stop string (or at EOS
        where the format `answers_at_eos`), made at least one call and `turns_done <
        max_turns`; its delta holds one result per call, in call order. The calls of every
        continuing episode run together (`run_tool_calls` on `tool_slots`)."""
        for reason in finish_reasons:
            if reason not in FINISH_REASONS:
                raise ValueError(
                    f"finish reason {reason!r} is not valid; valid: {', '.join(FINISH_REASONS)}"
                )
        parsed = [self.format.parse(text) for text in texts]
        ends = ("tool_call", "eos") if self.format.answers_at_eos else ("tool_call",)
        reasons = finish_reasons
        answerable = [reason in ends and bool(calls)
                      for (calls, _), reason in zip(parsed, reasons, strict=True)]  # fmt: skip
        answered = [a and done < self.max_turns
                    for a, done in zip(answerable, turns_done, strict=True)]  # fmt: skip
        batch = [
            call for (calls, _), go in zip(parsed, answered, strict=True) if go for call in calls
        ]
        results = iter(run_tool_calls(batch, self.tools, self.tool_timeout_s, self.tool_slots))
        outcomes = []
        for (calls, malformed), reason, can, go in zip(parsed, reasons, answerable, answered,
                                                       strict=True):  # fmt: skip
            if not go:
                outcomes.append(TurnOutcome(False, calls, malformed, unanswered=can))
                continue
            mine = [next(results) for _ in calls]
            delta = tool_delta_ids(self.tokenizer, [r.text for r in mine],
                                   self.max_tool_response_length, self.use_chat_template,
                                   after_eos=reason == "eos")  # fmt: skip
            outcomes.append(TurnOutcome(True, calls, malformed, mine, delta))
        return outcomes
