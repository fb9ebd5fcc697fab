"""One-line configuration errors that name the key, the bad value and what would be valid."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any


class ConfigError(ValueError):
    """A bad configuration value, reported before any expensive work starts."""


def fail(key: str, value: Any, expected: str) -> None:
    """Raise ConfigError: `key=value` is not valid, `expected` says what is."""
    raise ConfigError(f"{key}={value!r} is not valid; {expected}")


DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "fp32": "float32",
                 "f32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16",
                 "torch.float32": "float32"}  # fmt: skip
"""Common spellings of a dtype that torch and vLLM do not take as a string -> the name they take
(`check_choice(..., aliases=DTYPE_ALIASES)` names it in the error)."""


def check_choice(
    key: str, value: Any, valid: Iterable[str], aliases: Mapping[str, str] | None = None
) -> None:
    """`value` must be one of `valid` (pass a registry's names, never a hand-copied list); a value
    of `aliases` is refused too, the error naming the valid spelling it stands for."""
    valid = list(valid)
    if value not in valid:
        meant = (aliases or {}).get(str(value).lower())
        hint = f" ({value!r} is written {meant!r})" if meant in valid else ""
        fail(key, value, f"valid: {', '.join(valid)}{hint}")


def check_range(
    key: str,
    value: float,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> None:
    """low ≤ value ≤ high (low < value when `low_open`); either bound may be None."""
    if value is None:
        fail(key, value, "expected a number")
    if (low is not None and (value <= low if low_open else value < low)) or (
        high is not None and value > high
    ):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        fail(key, value, f"expected a value in {'(' if low_open else '['}{lo}, {hi}]")


def check_fields(key: str, value: Mapping[str, Any], valid: Iterable[str], why: str = "") -> None:
    """Every field (key) of the dict `value` must be one of `valid`; an unknown one is named with
    its closest valid names. `why` says where `valid` comes from."""
    valid = list(valid)
    for name in value:
        if name not in valid:
            close = difflib.get_close_matches(str(name), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            fail(key, dict(value), f"unknown field {name!r}{hint}; valid: {', '.join(valid)}{why}")
