"""Worker output to files (`VERL_WORKER_LOG_DIR`): what `make demo` keeps off the console."""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = """
import os, subprocess, sys
from verl.utils.worker_logs import redirect_worker_output
print("before")
path = redirect_worker_output("rollout")
print("python print", path is not None)
os.write(1, b"fd 1 write\\n")
os.write(2, b"fd 2 write\\n")
print("to stderr", file=sys.stderr)
subprocess.run(["echo", "child process"], check=True)
"""


def test_every_output_of_a_worker_goes_to_its_file(tmp_path):
    """With the variable set, Python prints, raw writes to fds 1 and 2 (vLLM's C++ and torch's
    warnings take that road) and a child process's output all land in <dir>/<role>-<pid>.log,
    and nothing after the redirect reaches the console."""
    env = {**os.environ, "VERL_WORKER_LOG_DIR": str(tmp_path / "logs")}
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout == "before\n" and out.stderr == ""
    (log,) = (tmp_path / "logs").iterdir()
    assert log.name.startswith("rollout-") and log.name.endswith(".log")
    text = log.read_text()
    for line in ("python print True", "fd 1 write", "fd 2 write", "to stderr", "child process"):
        assert line in text, line


def test_without_the_variable_nothing_changes():
    env = {k: v for k, v in os.environ.items() if k != "VERL_WORKER_LOG_DIR"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
    )
    assert "python print False" in out.stdout and "fd 1 write" in out.stdout
    assert "fd 2 write" in out.stderr
