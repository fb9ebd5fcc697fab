"""User functions named in a config: a built-in by its registered name, or `path/to/file.py:fn`.

One loader for every config key that names a function (EasyR1's reward functions, the
multi-turn rollout's tools): `load_function(spec, registry, key)`. A spec is a file spec when
the part before its last `:` ends with `.py`; anything else is looked up in the registry. Every
user file is imported through `import_user_file`, which turns a file that does not import into
one line with its file:line.
"""

from __future__ import annotations

import importlib.util
import os
import traceback
from collections.abc import Callable
from types import ModuleType

from verl.utils.registry import Registry

FILE_SPEC_HINT = "path/to/file.py:function_name"
"""How a file spec is written, for error messages listing what is valid."""


class UserFileError(ValueError):
    """A user's Python file that does not import; the message is one line with file:line."""


def _where(error: BaseException, path: str) -> str:
    """`path:line` of the deepest frame of `error`'s traceback inside the file `path` (`path`
    alone when none is: the error came from a module it imports, before any line of its own)."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if os.path.abspath(f.filename) == os.path.abspath(path)]  # fmt: skip
    return f"{path}:{frames[-1].lineno}" if frames else path


def import_user_file(path: str, key: str, module_name: str) -> ModuleType:
    """The Python file `path` (named by config key `key`) imported as a fresh module
    `module_name`. The one door for every user file a config names (reward functions, tools):
    FileNotFoundError for a missing file, and UserFileError for one that does not import (a
    syntax error, a failed import, any exception at its top level), each one line starting with
    `key: ` and giving `file:line` and the error's first line, never a traceback."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{key}: file {path!r} not found")
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as error:  # IndentationError too
        where = f"{error.filename or path}:{error.lineno}" if error.lineno else path
        raise UserFileError(f"{key}: {where}: {type(error).__name__}: {error.msg}") from None
    except Exception as error:  # ImportError, NameError, ... raised while the file runs
        text = (str(error).strip().splitlines() or [""])[0]
        raise UserFileError(
            f"{key}: {_where(error, path)}: importing it raised {type(error).__name__}: {text}"
        ) from None
    return module


def is_file_spec(spec: str) -> bool:
    """True when `spec` names a function in a file (`path/to/file.py:fn`), not a built-in."""
    return ":" in spec and spec.rsplit(":", 1)[0].endswith(".py")


def load_function(spec: str, registry: Registry, key: str) -> Callable:
    """The function `spec` names: `registry`'s entry, or `fn` defined in `path/to/file.py`
    (the file is imported as a fresh module on every call).

    Errors: ValueError (unknown built-in, listing the registry's names), FileNotFoundError (no
    such file), UserFileError (the file does not import: `import_user_file`) and AttributeError
    (the file defines no such function), the last three starting with `key: `.
    """
    if not is_file_spec(spec):
        return registry.get(spec)
    path, name = spec.rsplit(":", 1)
    kind = registry.kind.replace(" ", "_")
    module = import_user_file(path, key, f"user_{kind}_{abs(hash(path))}")
    if not callable(getattr(module, name, None)):
        raise AttributeError(f"{key}: {path!r} defines no function {name!r}")
    return getattr(module, name)
