"""No import cycle among the modules under verl/.

Every import is an edge of the module graph: at module level, inside functions and under
TYPE_CHECKING; relative imports resolved against the importing module's package; `from pkg import
name` is an edge to the module `pkg.name` when there is one, else to `pkg`. A strongly connected
component of more than one module is a cycle, and the test names its modules and their edges.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules_under(root: Path, package: str = "verl") -> dict[str, Path]:
    """Dotted name -> file of every module of `package` under `root` (a package is its
    `__init__.py`)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported(tree: ast.AST, package: str) -> Iterator[str]:
    """The dotted names the imports of a module refer to (`package`: the module's own package,
    against which relative imports resolve): `import a.b` gives a.b, `from a import b` gives a.b."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph(root: Path, package: str = "verl") -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports (itself excluded). A name resolves to its
    longest prefix that is a module: `a.b.f` (a function of a.b) to a.b."""
    modules = modules_under(root, package)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        own = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = {resolve(n) for n in imported(ast.parse(path.read_text()), own)}
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node, each sorted (Tarjan's algorithm,
    iterative: a node's low link is the smallest index reachable from its DFS subtree)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> Iterator[str]:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        return iter(sorted(graph[node]))

    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, visit(root))]
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    work.append((succ, visit(succ)))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:  # every successor done
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:  # the root of a component: pop it
                    component = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def describe(graph: dict[str, set[str]], component: list[str]) -> str:
    """A cycle's modules and its edges, one line."""
    edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a]) if b in component]
    return f"{', '.join(component)} ({'; '.join(edges)})"


def test_no_import_cycle_under_verl():
    graph = import_graph(ROOT)
    found = cycles(graph)
    assert not found, "import cycles under verl/ (break each so that imports run one way): " + (
        " | ".join(describe(graph, c) for c in found)
    )


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """The checker itself, on a small package: an import under TYPE_CHECKING, a relative one
    inside a function, `from pkg import module` and a plain `import` each close a cycle; a
    `from module import name` is an edge to the module."""
    pkg = tmp_path / "verl"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from verl.b import B\n",
        "b.py": "def f():\n    from . import a\n",
        "sub/__init__.py": "",
        "sub/c.py": "from verl.sub import d\n",
        "sub/d.py": "import verl.sub.c\nfrom ..a import name\n",
        "e.py": "from verl.sub.d import something\nimport os\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(tmp_path)
    assert graph["verl.e"] == {"verl.sub.d"}
    assert graph["verl.sub.d"] == {"verl.sub.c", "verl.a"}
    found = cycles(graph)
    assert found == [["verl.a", "verl.b"], ["verl.sub.c", "verl.sub.d"]]
    assert describe(graph, found[0]) == "verl.a, verl.b (verl.a -> verl.b; verl.b -> verl.a)"


LEAVES = {
    "verl.utils": ("verl.utils",),
    "verl.trainer.core_algos": ("verl.trainer.core_algos", "verl.utils"),
}
"""Packages that are leaves of the project: each imports only the packages listed with it."""


def test_utils_and_core_algos_are_leaves_and_nothing_below_imports_the_tasks():
    """`verl/utils/` imports nothing of the project outside itself and `core_algos` only itself
    and utils; no worker imports the built-in tasks (`verl.tasks` import the workers)."""

    def inside(name: str, packages: tuple[str, ...]) -> bool:
        return any(name == p or name.startswith(p + ".") for p in packages)

    graph, wrong = import_graph(ROOT), []
    for module, targets in sorted(graph.items()):
        for leaf, allowed in LEAVES.items():
            if inside(module, (leaf,)):
                wrong += [f"{module} -> {t}" for t in sorted(targets) if not inside(t, allowed)]
        if inside(module, ("verl.workers", "verl.utils")):
            wrong += [f"{module} -> {t}" for t in sorted(targets) if inside(t, ("verl.tasks",))]
    assert not wrong, "imports against the layers: " + "; ".join(wrong)
