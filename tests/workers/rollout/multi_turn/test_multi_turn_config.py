"""MultiTurnConfig (verl/workers/rollout/multi_turn/config.py) and the shared function loader
(verl/utils/user_functions.py): one-line errors naming the key, names from the registries."""

from __future__ import annotations

import pytest

from verl.utils.config_checks import ConfigError
from verl.utils.user_functions import is_file_spec, load_function
from verl.workers.reward.function import REWARD_FUNCTIONS, load_reward_function
from verl.workers.rollout.multi_turn import TOOLS, MultiTurnConfig
from verl.workers.rollout.multi_turn.tools import calculator

PREFIX = "worker.rollout.multi_turn"


def error_of(config: MultiTurnConfig) -> str:
    with pytest.raises(ConfigError) as info:
        config.validate(PREFIX)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults_are_off_and_valid():
    config = MultiTurnConfig()
    assert config.enable is False and config.tools == [] and config.tool_call_format == "hermes"
    config.validate(PREFIX)
    MultiTurnConfig(enable=True, tools=["lookup", "calculator"]).validate(PREFIX)


@pytest.mark.parametrize(
    ("fields", "message"),
    [({"max_turns": 0}, "worker.rollout.multi_turn.max_turns=0 is not valid; expected a value in [1, inf]"),
     ({"max_tool_response_length": 0}, "worker.rollout.multi_turn.max_tool_response_length=0 is not valid"),
     ({"tool_timeout_s": 0.0}, "worker.rollout.multi_turn.tool_timeout_s=0.0 is not valid; expected a value in (0.0, inf]"),
     ({"max_parallel_tools": 0}, "worker.rollout.multi_turn.max_parallel_tools=0 is not valid"),
     ({"tool_call_format": "xml"}, "worker.rollout.multi_turn.tool_call_format='xml' is not valid; valid: embedded, hermes")],
)  # fmt: skip
def test_bad_numbers_and_formats_name_the_key(fields, message):
    assert error_of(MultiTurnConfig(**fields)).startswith(message)


def test_tools_must_be_registered_names_or_file_specs():
    message = error_of(MultiTurnConfig(tools=["lookup", "search"]))
    assert message == (
        "worker.rollout.multi_turn.tools=['lookup', 'search'] is not valid; unknown tool 'search'; "
        "valid: calculator, lookup or path/to/file.py:function_name"
    )
    MultiTurnConfig(tools=["my/tools.py:search"]).validate(PREFIX)  # the loader checks the file
    assert "a tool is listed twice" in error_of(MultiTurnConfig(tools=["lookup", "lookup"]))
    assert error_of(MultiTurnConfig(enable=True)).startswith(
        "worker.rollout.multi_turn.tools=[] is not valid; multi-turn rollouts need at least one "
        "tool (worker.rollout.multi_turn.enable=true)"
    )


def test_file_specs_are_told_from_names():
    assert is_file_spec("a/b.py:fn") and is_file_spec("c:/x/b.py:fn")
    assert (
        not is_file_spec("lookup") and not is_file_spec("a/b.txt:fn") and not is_file_spec("b.py")
    )


def test_load_function_reads_the_registry_or_a_file(tmp_path):
    assert load_function("calculator", TOOLS, "k") is calculator
    (tmp_path / "t.py").write_text("def double(x: int) -> int:\n    return 2 * x\n")
    assert load_function(f"{tmp_path / 't.py'}:double", TOOLS, "k")(4) == 8
    with pytest.raises(FileNotFoundError, match=r"^k: file 'nope\.py' not found$"):
        load_function("nope.py:fn", TOOLS, "k")
    with pytest.raises(AttributeError, match=r"^k: .* defines no function 'half'$"):
        load_function(f"{tmp_path / 't.py'}:half", TOOLS, "k")
    with pytest.raises(ValueError, match=r"^unknown tool 'abacus'; valid: calculator, lookup$"):
        load_function("abacus", TOOLS, "k")


def test_load_function_says_what_load_reward_function_says(tmp_path):
    """`load_reward_function` can delegate to it without changing a message."""
    key = "worker.reward.reward_function"
    (tmp_path / "r.py").write_text("x = 1\n")
    for spec in ("nope.py:fn", f"{tmp_path / 'r.py'}:fn", "no_such_builtin"):
        with pytest.raises(Exception) as ours:
            load_function(spec, REWARD_FUNCTIONS, key)
        with pytest.raises(Exception) as theirs:
            load_reward_function(spec)
        assert (type(ours.value), str(ours.value)) == (type(theirs.value), str(theirs.value))
    assert load_function("arithmetic", REWARD_FUNCTIONS, key) is load_reward_function("arithmetic")
