"""Name -> function registries (verl's `register_adv_est` / `register_policy_loss` pattern).

Valid names shown in errors and config validation always come from a registry, never from a
hand-copied list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """A named table of functions with aliases and clear errors for unknown names."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._table: dict[str, F] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, *aliases: str) -> Callable[[F], F]:
        """Decorator: register `fn` under `name` (and optional alias names)."""

        def decorator(fn: F) -> F:
            for key in (name, *aliases):
                if key in self._table or key in self._aliases:
                    raise ValueError(f"{self.kind} '{key}' is already registered")
            self._table[name] = fn
            for alias in aliases:
                self._aliases[alias] = name
            return fn

        return decorator

    def canonical(self, name: str) -> str:
        """The registered name that `name` (possibly an alias) refers to."""
        key = self._aliases.get(name, name)
        if key not in self._table:
            raise ValueError(f"unknown {self.kind} '{name}'; valid: {', '.join(self.names())}")
        return key

    def get(self, name: str) -> F:
        """The function registered under `name`; ValueError listing the valid names otherwise."""
        return self._table[self.canonical(name)]

    def names(self, with_aliases: bool = True) -> list[str]:
        """Sorted valid names (aliases included unless `with_aliases=False`)."""
        keys = list(self._table)
        if with_aliases:
            keys += list(self._aliases)
        return sorted(keys)

    def aliases(self, name: str) -> list[str]:
        """The sorted alias names of the registered `name`."""
        return sorted(alias for alias, target in self._aliases.items() if target == name)

    def __contains__(self, name: object) -> bool:
        return name in self._table or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._table))

    def __len__(self) -> int:
        return len(self._table)
