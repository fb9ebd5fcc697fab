"""One door to vLLM (docs/design.md#the-vllm-door-and-the-patch): only `vllm_engine.py` and
`vllm_sessions.py` import the session patch or reach vLLM's private internals; every other module
under verl/ uses vLLM's public API (`vllm.LLM`, `SamplingParams`, `generate`, `sleep`,
`wake_up`, `vllm.inputs.TokensPrompt`) and the door's functions. Parsed with `ast`, no engine.

A module outside the door fails, naming file and line, when it
- imports the patch (`verl_patches`, `patches`, `vllm_session_rewind`) or a private vLLM package
  (`vllm.v1`, `vllm.engine`, `vllm.worker`, `vllm.executor`, `vllm.model_executor`), by `import`,
  `from ... import` (also `from vllm import v1`) or `importlib.import_module` / `__import__`;
- reads an attribute that leads into the engine's internals (`INTERNALS`: `.llm_engine`,
  `.engine_core`, `.model_executor`, `.driver_worker`, `.model_runner`, `.scheduler`, the
  patch's `live_runner`, and `LLM.collective_rpc` / `apply_model`, which hand out workers and
  the model), as `x.name` or `getattr(x, "name")`.
Strings that merely mention a module (a logger's name) and attributes with other names
(`lr_scheduler`, the door's `vllm_engine.is_sleeping`) pass. An LR scheduler is therefore
called `lr_scheduler`, as everywhere in verl/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOOR = ("verl/workers/rollout/vllm_engine.py", "verl/workers/rollout/vllm_sessions.py")
PRIVATE_MODULES = ("verl_patches", "patches", "vllm_session_rewind", "vllm.v1", "vllm.engine",
                   "vllm.worker", "vllm.executor", "vllm.model_executor")  # fmt: skip
INTERNALS = {
    "llm_engine": "the LLMEngine behind vllm.LLM",
    "engine_core": "the engine core",
    "model_executor": "the executor",
    "driver_worker": "the worker",
    "model_runner": "the model runner",
    "scheduler": "the scheduler",
    "live_runner": "the session patch's model runner",
    "collective_rpc": "a call on the engine's workers",
    "apply_model": "a call on the engine's model",
}
IMPORTERS = ("import_module", "__import__")


def _private(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in PRIVATE_MODULES)


def _imported(node: ast.AST) -> list[str]:
    """The modules `node` imports (for `from m import a, b`: m, and m.a, m.b, since `a` may be a
    submodule), or the constant argument of an import function."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        name = (
            node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        )
        if name in IMPORTERS and isinstance(node.args[0].value, str):
            return [node.args[0].value]
    return []


def _attribute(node: ast.AST) -> str | None:
    """The attribute name `node` reads: `x.name`, or `getattr(x, "name"[, default])`."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if (
        isinstance(node, ast.Call)
        and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
    ):
        return node.args[1].value
    return None


def violations(source: str, name: str) -> list[str]:
    """Every way into vLLM's internals in `source`, as 'name:line: what'."""
    found = []
    for node in ast.walk(ast.parse(source, filename=name)):
        for module in _imported(node):
            if _private(module):
                found.append(f"{name}:{node.lineno}: imports {module}")
                break
        attr = _attribute(node)
        if attr in INTERNALS:
            found.append(f"{name}:{node.lineno}: reads .{attr} ({INTERNALS[attr]})")
    return sorted(set(found), key=lambda line: int(line.split(":")[1]))


def package_modules() -> list[Path]:
    return sorted((ROOT / "verl").rglob("*.py"))


def test_only_the_door_reaches_into_vllm():
    outside = [p for p in package_modules() if p.relative_to(ROOT).as_posix() not in DOOR]
    assert len(outside) > 50  # the whole package was found
    bad = [v for p in outside for v in violations(p.read_text(), p.relative_to(ROOT).as_posix())]
    assert not bad, (
        "vLLM's internals or the session patch reached outside vllm_engine.py / vllm_sessions.py; "
        "add a function to one of them and call it instead:\n" + "\n".join(bad)
    )


@pytest.mark.parametrize("path", DOOR)
def test_the_door_is_where_the_internals_are_touched(path):
    """The allowed modules exist and do reach in (an exemption with nothing behind it is stale)."""
    file = ROOT / path
    assert file.is_file(), f"{path} is named as vLLM's door but does not exist"
    assert violations(file.read_text(), path), f"{path} no longer touches vLLM's internals"


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ("from verl_patches import vllm_session_rewind", "imports verl_patches"),
        ("import verl_patches.vllm_session_rewind as rewind", "imports verl_patches.vllm_session_rewind"),
        ("from verl_patches.vllm_session_rewind import PROCESS_KEY", "imports verl_patches.vllm_session_rewind"),
        ("from patches import vllm_session_rewind", "imports patches"),
        ("from vllm.v1.request import RequestStatus", "imports vllm.v1.request"),
        ("import vllm.engine.llm_engine", "imports vllm.engine.llm_engine"),
        ("from vllm import model_executor", "imports vllm.model_executor"),
        ("from vllm.worker import worker_base", "imports vllm.worker"),
        ("importlib.import_module('vllm.v1.worker.gpu_model_runner')", "imports vllm.v1.worker.gpu_model_runner"),
        ("llm.llm_engine.is_sleeping()", "reads .llm_engine"),
        ("client = engine.engine_core", "reads .engine_core"),
        ("core.model_executor.driver_worker", "reads .model_executor"),
        ("core.model_executor.driver_worker", "reads .driver_worker"),
        ("runner = worker.model_runner", "reads .model_runner"),
        ("core.scheduler.schedule()", "reads .scheduler"),
        ("getattr(core, 'scheduler', None)", "reads .scheduler"),
        ("rewind.live_runner(llm).reload_weights(weights_iterator=w)", "reads .live_runner"),
        ("llm.collective_rpc('reload_weights')", "reads .collective_rpc"),
    ],
)  # fmt: skip
def test_the_rule_names_each_way_in_with_its_line(line, what):
    source = f"x = 1\n\n\ndef f(llm, core, engine, worker, weights, w):\n    {line}\n"
    found = violations(source, "snippet.py")
    assert f"snippet.py:5: {what}" in "\n".join(found), found


def test_public_vllm_use_and_the_doors_functions_pass():
    source = """
import vllm
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from verl.workers.rollout import vllm_engine
from verl.workers.rollout.vllm_engine import build_llm, is_sleeping, reload_weights, vocab_size
from verl.workers.rollout.vllm_sessions import SessionEngine, scoring_params

LOGGER = "vllm.model_executor.model_loader.reload.layerwise"  # a logger's name, not an import


def f(llm, weights, optimizer):
    llm.generate([TokensPrompt(prompt_token_ids=[1])], SamplingParams(max_tokens=1))
    llm.sleep(level=1)
    llm.wake_up(tags=["weights"])
    llm.reset_prefix_cache()
    reload_weights(llm, weights)
    vllm_engine.is_sleeping(llm)
    self.lr_scheduler.step()
    return vllm.__version__, vocab_size(llm), getattr(optimizer, "param_groups")
"""
    assert violations(source, "snippet.py") == []
