"""`make demo ARGS="key=value ..."` hands the overrides to the demo; a bare `key=value` (a make
variable, which make would silently keep to itself) is refused in one line pointing at ARGS."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def make_n(*args: str) -> subprocess.CompletedProcess:
    """`make -n ARGS`: the commands make would run, none run. Run as a user would from a shell:
    under `make test` the parent make's MAKELEVEL/MAKEFLAGS would make this one a sub-make that
    prints "Entering directory" lines and inherits the parent's flags."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    return subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=env)  # fmt: skip


def test_make_demo_passes_args_to_the_demo():
    proc = make_n("demo", "ARGS=trainer.max_steps=5 worker.rollout.n=4")
    assert proc.returncode == 0, proc.stderr
    assert "-m verl.trainer.demo trainer.max_steps=5 worker.rollout.n=4" in proc.stdout


def test_make_demo_without_args_runs_the_demo_as_is():
    proc = make_n("demo")
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("-m verl.trainer.demo")


def test_a_bare_override_after_make_demo_is_refused_in_one_line():
    proc = make_n("demo", "trainer.max_steps=5")
    assert proc.returncode == 2 and proc.stdout == ""
    err = proc.stderr.strip()
    assert err.splitlines() == [err]
    assert (
        "make demo trainer.max_steps=5:" in err
        and 'valid: make demo ARGS="trainer.max_steps=5"' in err
    )


def test_readme_shows_the_args_form():
    assert 'make demo ARGS="trainer.max_steps=5"' in (ROOT / "README.md").read_text()
