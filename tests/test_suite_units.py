"""The scheduling lists of tests/conftest.py name files that exist (a renamed file would silently
lose its place: a heavy one could then run beside another heavy one)."""

from __future__ import annotations

from pathlib import Path

from conftest import FIRST, HEAVY, work_unit

ROOT = Path(__file__).resolve().parents[1]


def test_every_listed_unit_is_a_test_file():
    for path in HEAVY + tuple(u for u in FIRST if u != "heavy"):
        assert (ROOT / path).is_file(), path
    assert "heavy" in FIRST and len(set(FIRST)) == len(FIRST)


def test_heavy_files_make_one_unit():
    assert {work_unit(f"{path}::test_x") for path in HEAVY} == {"heavy"}
    assert work_unit("tests/test_protocol.py::test_x") == "tests/test_protocol.py"
