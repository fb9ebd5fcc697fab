"""Worker output to files: a run whose console should show only the trainer's own lines (`make
demo`) sets `VERL_WORKER_LOG_DIR`, and every Ray worker then writes its stdout and stderr (the
engines' warnings, vLLM's and torch's messages, child processes) to a file of its own there."""

from __future__ import annotations

import os
import sys

WORKER_LOG_ENV = "VERL_WORKER_LOG_DIR"
"""Environment variable naming the folder of the worker logs (unset: output goes to the driver)."""


def redirect_worker_output(role: str) -> str | None:
    """In a Ray worker: when `VERL_WORKER_LOG_DIR` is set, point this process's file descriptors
    1 and 2 (so C-level output and child processes too) and sys.stdout/stderr at
    `<dir>/<role>-<pid>.log`, appending; returns that path (None: not set, nothing changed)."""
    folder = os.environ.get(WORKER_LOG_ENV)
    if not folder:
        return None
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{role}-{os.getpid()}.log")
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    return path
