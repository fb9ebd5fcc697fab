"""Every reference in code and docs points to something the repository holds.

Paths under the repository's top folders (verl/, tests/, benchmarks/, ...) and the top-level
Markdown files named in any tracked source or document must exist, and every
`docs/design.md#anchor` must name a heading of that document. Placeholders (`<run>/...`),
patterns (`*`), and files a run writes (outputs/, checkpoints/) are not references.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = ("verl", "tests", "benchmarks", "configs", "examples", "scripts", "docs", "patches")
FOLDERS = "|".join(TOP)
PATH = re.compile(
    rf"(?<![\w./<-])((?:{FOLDERS})/[\w./-]*\w|README(?:_guidance)?\.md|DESIGN\.md|STYLE\.md)(#[\w-]+)?"
)
OTHER_PROJECTS = re.compile(r"(verl's|EasyR1's|EasyR1|TRL's|MENTOR's|upstream|verl-project)\W*$")


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    keep = (".py", ".md", ".sh", ".yaml", ".toml", ".cfg")
    this = Path(__file__).resolve().relative_to(ROOT).as_posix()  # its patterns are not references
    return [
        ROOT / p for p in out.stdout.split() if (p.endswith(keep) or p == "Makefile") and p != this
    ]


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m) for m in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}


def references() -> list[tuple[str, int, str, str]]:
    found = []
    for path in tracked_text_files():
        if path == Path(__file__).resolve():  # this file names the patterns it looks for
            continue
        rel = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in PATH.finditer(line):
                target, anchor = match.group(1).rstrip("."), match.group(2) or ""
                before, after = line[: match.start()], line[match.end() :]
                pattern = "*" in target or after[:1] in ("*", "{", "<")
                if pattern or OTHER_PROJECTS.search(before):
                    continue
                found.append((rel, number, target, anchor))
    return found


def test_every_referenced_path_exists():
    missing = []
    for rel, number, target, _ in references():
        if not (ROOT / target).exists() and not (ROOT / rel).parent.joinpath(target).exists():
            missing.append(f"{rel}:{number}: {target}")
    assert not missing, "references to files the repository lacks:\n" + "\n".join(missing)


def test_design_anchors_resolve():
    design = anchors(ROOT / "docs" / "design.md")
    bad = [f"{rel}:{n}: {target}{anchor}" for rel, n, target, anchor in references()
           if target == "docs/design.md" and anchor and anchor[1:] not in design]  # fmt: skip
    assert not bad, "docs/design.md anchors that do not exist:\n" + "\n".join(bad)


@pytest.mark.parametrize("name", ["DESIGN.md", "STYLE.md"])
def test_no_citation_of_documents_outside_the_repository(name):
    cited = [f"{rel}:{n}" for rel, n, target, _ in references() if target == name]
    assert not cited, f"{name} is not in the repository: " + ", ".join(cited)
