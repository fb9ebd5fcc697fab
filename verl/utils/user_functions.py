"""User functions named in a config: a built-in by its registered name, or `path/to/file.py:fn`.

One loader for every config key that names a function (EasyR1's reward functions, the
multi-turn rollout's tools): `load_function(spec, registry, key)`. A spec is a file spec when
the part before its last `:` ends with `.py`; anything else is looked up in the registry.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

from verl.utils.registry import Registry

FILE_SPEC_HINT = "path/to/file.py:function_name"
"""How a file spec is written, for error messages listing what is valid."""


def is_file_spec(spec: str) -> bool:
    """True when `spec` names a function in a file (`path/to/file.py:fn`), not a built-in."""
    return ":" in spec and spec.rsplit(":", 1)[0].endswith(".py")


def load_function(spec: str, registry: Registry, key: str) -> Callable:
    """The function `spec` names: `registry`'s entry, or `fn` defined in `path/to/file.py`
    (the file is imported as a fresh module on every call).

    Errors: ValueError (unknown built-in, listing the registry's names), FileNotFoundError (no
    such file) and AttributeError (the file defines no such function), the last two starting
    with `key: `.
    """
    if not is_file_spec(spec):
        return registry.get(spec)
    path, name = spec.rsplit(":", 1)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{key}: file {path!r} not found")
    kind = registry.kind.replace(" ", "_")
    module_spec = importlib.util.spec_from_file_location(f"user_{kind}_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise AttributeError(f"{key}: {path!r} defines no function {name!r}")
    return getattr(module, name)
