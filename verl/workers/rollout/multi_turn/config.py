"""Configuration of multi-turn, tool-using rollouts (nested as `worker.rollout.multi_turn`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from verl.utils.config_checks import check_choice, check_range, fail
from verl.utils.user_functions import FILE_SPEC_HINT, is_file_spec
from verl.workers.rollout.multi_turn.parsing import TOOL_CALL_FORMATS
from verl.workers.rollout.multi_turn.tools import TOOLS


@dataclass
class MultiTurnConfig:
    """Episodes of several policy turns, the policy calling tools between them."""

    enable: bool = False
    """Turn multi-turn rollouts on (off: one policy turn per prompt, no tools)."""
    max_turns: int = 4
    """Policy turns per episode at most; the last one's tool calls are not run."""
    tools: list[str] = field(default_factory=list)
    """Tools the policy may call: built-in names (TOOLS) or path/to/file.py:function_name."""
    max_tool_response_length: int = 256
    """Tokens of a tool's text kept; a longer one is cut there (a cut result, not a cut error
    text, counts as truncated)."""
    tool_timeout_s: float = 10.0
    """Seconds a tool call may run; past it the call's result is a timeout error (its thread runs on, holding one of max_parallel_tools); the built-in lookup and calculator run inline, with no deadline."""
    tool_call_format: str = "hermes"
    """How the policy writes a tool call (TOOL_CALL_FORMATS): hermes or embedded."""
    max_parallel_tools: int = 8
    """Tool threads at most, hung calls (timed out, still running) included."""
    chat_template: bool = True
    """auto: data.apply_chat_template (tool results as chat-template tool turns, else plain
    `=text\n`)."""

    def validate(self, prefix: str) -> None:
        """Fail fast, in one line naming the key, on a bad value."""
        check_range(f"{prefix}.max_turns", self.max_turns, 1)
        check_range(f"{prefix}.max_tool_response_length", self.max_tool_response_length, 1)
        check_range(f"{prefix}.tool_timeout_s", self.tool_timeout_s, 0.0, low_open=True)
        check_range(f"{prefix}.max_parallel_tools", self.max_parallel_tools, 1)
        check_choice(f"{prefix}.tool_call_format", self.tool_call_format, TOOL_CALL_FORMATS.names())
        valid = f"valid: {', '.join(TOOLS.names())} or {FILE_SPEC_HINT}"
        for spec in self.tools:
            if not isinstance(spec, str) or not (is_file_spec(spec) or spec in TOOLS):
                fail(f"{prefix}.tools", list(self.tools), f"unknown tool {spec!r}; {valid}")
        if len(set(self.tools)) != len(self.tools):
            fail(f"{prefix}.tools", list(self.tools), "a tool is listed twice")
        if self.enable and not self.tools:
            why = f"multi-turn rollouts need at least one tool ({prefix}.enable=true); {valid}"
            fail(f"{prefix}.tools", list(self.tools), why)
