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


@pytest.mark.parametrize(
    ("var", "valid"),
    [("max_steps=5", 'valid: make demo ARGS="trainer.max_steps=5", or a Makefile variable (VENV '),
     ("dtype=float32", 'valid: make demo ARGS="worker.rollout.dtype=float32" or make demo '
                       'ARGS="worker.rollout.offpolicy_guidance.dtype=float32", or'),
     ("nokey=1", 'valid: make demo ARGS="<section>.nokey=1" with the key\'s full name')],
)  # fmt: skip
def test_a_key_without_its_section_after_make_demo_is_refused_with_its_full_name(var, valid):
    """A command-line variable the Makefile does not read (a key without a dot) would be dropped;
    its full dotted name comes from configs/defaults.yaml."""
    proc = make_n("demo", var)
    assert proc.returncode == 2 and proc.stdout == ""
    err = proc.stderr.strip()
    assert err.splitlines() == [err]
    assert (
        f"make demo {var}: not a variable of this Makefile, so make would drop it; {valid}" in err
    )
