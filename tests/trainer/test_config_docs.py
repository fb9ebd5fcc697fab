"""Every config dataclass field has a one-line docstring (EasyR1's `verl/trainer/config.py`
style): the classes are found by parsing the package, and the checker itself is tested."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import verl

VERL_ROOT = Path(verl.__file__).parent
CONFIG_MODULES = {
    "trainer/config.py": None,
    "workers/config.py": None,
    "workers/actor/config.py": None,
    "workers/rollout/config.py": None,
    "workers/reward/config.py": None,
    "trainer/core_algos/policy_loss.py": {"PolicyLossConfig"},
}
EXPECTED_CLASSES = {
    "DataConfig",
    "AlgorithmConfig",
    "DistillConfig",
    "TrainerConfig",
    "AsyncTrainingConfig",
    "PPOConfig",
    "WorkerConfig",
    "ModelConfig",
    "LoraConfig",
    "OptimConfig",
    "FSDPConfig",
    "OffloadConfig",
    "ActorConfig",
    "RefConfig",
    "OffPolicyGuidanceConfig",
    "RolloutConfig",
    "RewardConfig",
    "PolicyLossConfig",
}


def _is_dataclass_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    if isinstance(target, ast.Name):
        return target.id == "dataclass"
    return isinstance(target, ast.Attribute) and target.attr == "dataclass"


def _config_classes() -> list[tuple[str, ast.ClassDef]]:
    found = []
    for rel, only in CONFIG_MODULES.items():
        tree = ast.parse((VERL_ROOT / rel).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            if not any(_is_dataclass_decorator(d) for d in node.decorator_list):
                continue
            if only is None or node.name in only:
                found.append((rel, node))
    return found


CONFIG_CLASSES = _config_classes()


def test_all_config_classes_are_found():
    assert {node.name for _, node in CONFIG_CLASSES} == EXPECTED_CLASSES


def _field_doc_problems(node: ast.ClassDef) -> list[str]:
    """Annotated class-level fields not immediately followed by a one-line string statement."""
    body = node.body
    problems = []
    for i, stmt in enumerate(body):
        if not isinstance(stmt, ast.AnnAssign):
            continue
        name = ast.unparse(stmt.target)
        nxt = body[i + 1] if i + 1 < len(body) else None
        if not (
            isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            problems.append(f"{name}: no docstring")
            continue
        doc = nxt.value.value.strip()
        if not doc:
            problems.append(f"{name}: empty docstring")
        elif "\n" in doc:
            problems.append(f"{name}: docstring spans several lines")
    return problems


def test_field_doc_checker_flags_undocumented_fields():
    source = (
        "@dataclass\n"
        "class Demo:\n"
        "    a: int = 1\n"
        '    """Documented."""\n'
        "    b: int = 2\n"
        "    c: int = 3\n"
        '    """Two\n    lines."""\n'
        "    d: int = 4\n"
    )
    node = ast.parse(source).body[0]
    assert _field_doc_problems(node) == [
        "b: no docstring",
        "c: docstring spans several lines",
        "d: no docstring",
    ]


@pytest.mark.parametrize(
    "rel, node", CONFIG_CLASSES, ids=[f"{rel}::{node.name}" for rel, node in CONFIG_CLASSES]
)
def test_every_config_field_has_a_one_line_docstring(rel, node):
    assert any(isinstance(stmt, ast.AnnAssign) for stmt in node.body), node.name
    problems = _field_doc_problems(node)
    assert not problems, f"{rel}::{node.name}: {problems}"
