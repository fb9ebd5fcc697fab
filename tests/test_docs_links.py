"""The README is a front door (first screen within 60 lines) and no doc links to nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "README_guidance.md", "benchmarks/README.md", "docs/design.md"]


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    lines = path.read_text().splitlines()
    fenced, out = False, set()
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


def test_slug_by_hand():
    assert slug(" Guidance: `worker.rollout.offpolicy_guidance.*`") == (
        "guidance-workerrolloutoffpolicy_guidance"
    )
    assert slug("Compared with EasyR1, verl and TRL") == "compared-with-easyr1-verl-and-trl"


def test_first_screen_fits_60_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("## Where to look next")
    after = [i for i, line in enumerate(lines) if line.startswith("## ") and i > start]
    end = after[0] if after else len(lines)
    assert end <= 60, f"the newcomer's screen runs to line {end}; keep it within 60"
    first = "\n".join(lines[:end])
    for must in ("make demo", "make test", "examples/", "README_guidance.md"):
        assert must in first, must


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    path = ROOT / doc
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{doc}: {broken}"


def test_the_manuals_contents_line_lists_every_section():
    """README_guidance.md's "Contents:" paragraph links every `## ` section, in order."""
    path = ROOT / "README_guidance.md"
    text = path.read_text()
    start = text.index("Contents: ")
    contents = text[start : text.index("\n\n", start)]
    linked = re.findall(r"\]\(#([^)]+)\)", contents)
    fenced, sections = False, []
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            sections.append(slug(line[3:]))
    assert linked == sections
