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


def check_choice(key: str, value: Any, valid: Iterable[str]) -> None:
    """`value` must be one of `valid` (pass a registry's names, never a hand-copied list)."""
    valid = list(valid)
    if value not in valid:
        fail(key, value, f"valid: {', '.join(valid)}")


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
