"""Where a guided rollout's time goes, seen from the draft's process (the one that drives it).

`install()` wraps a few methods (the methods themselves unchanged) so that each call adds its
own seconds, less those of wrapped calls inside it, to one part of `SECONDS`; a part marked
whole (the draft's lookups) keeps the seconds of everything inside it. `reset()` before a call,
`table(wall)` after it: each part's seconds and share of the wall time, and "Python between
calls", the rest (round bookkeeping, building the batch, copies outside the wrapped methods).
"""

from __future__ import annotations

import time

PARTS = {  # (module, class, method) -> part; the order is the table's
    ("verl.workers.rollout.vllm_sessions", "SessionEngine", "step"): "draft engine steps",
    ("verl.workers.rollout.vllm_sessions", "SessionEngine", "add"): "draft rewinds and new chunks",
    ("verl.workers.rollout.vllm_sessions", "SessionEngine", "lookup"): "draft lookups (their steps too)",
    ("verl.workers.rollout.guidance_server", "GuidanceChannel", "submit"): "guidance requests sent",
    ("verl.workers.rollout.guidance_server", "GuidanceChannel", "result"): "waiting for the guidance",
    ("verl.workers.rollout.speculative_batch", "SpeculativeBatch", "apply"): "verification (Python)",
    ("verl.workers.rollout.speculative_batch", "SpeculativeBatch", "next_round"): "next round (Python)",
}  # fmt: skip
WHOLE = {"draft lookups (their steps too)"}
SECONDS: dict[str, float] = {}
CALLS: dict[str, int] = {}
_stack: list[list[float]] = []  # per open wrapped call: [seconds of wrapped calls inside it]


def reset() -> None:
    """Zero the counters (before a timed call)."""
    for part in PARTS.values():
        SECONDS[part], CALLS[part] = 0.0, 0


def _wrap(cls, name: str, part: str) -> None:
    method = getattr(cls, name)
    if getattr(method, "profiled_part", None):
        return

    def wrapped(*args, **kwargs):
        if _stack and _stack[-1][1]:  # inside a part that keeps everything: not counted again
            return method(*args, **kwargs)
        _stack.append([0.0, part in WHOLE])
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            inner = _stack.pop()[0]
            SECONDS[part] += elapsed - inner
            CALLS[part] += 1
            if _stack:
                _stack[-1][0] += elapsed

    wrapped.profiled_part = part
    setattr(cls, name, wrapped)


def install() -> None:
    """Wrap every method of `PARTS` (once)."""
    import importlib

    for (module, cls, name), part in PARTS.items():
        _wrap(getattr(importlib.import_module(module), cls), name, part)
    reset()


def snapshot() -> dict[str, tuple[float, int]]:
    """{part: (seconds, calls)} since the last `reset`."""
    return {part: (SECONDS[part], CALLS[part]) for part in PARTS.values()}


def table(rows: dict[str, dict[str, tuple[float, int]]], walls: dict[str, float]) -> str:
    """A markdown table: one column per setting (its `snapshot` and wall seconds), one row per
    part with seconds, share of the wall time and calls, and the rest as Python between calls."""
    names = list(rows)
    lines = ["| part | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for part in PARTS.values():
        cells = []
        for name in names:
            seconds, calls = rows[name][part]
            cells.append(f"{seconds:.3f} s ({seconds / walls[name]:.0%}, {calls})")
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    rest = [walls[n] - sum(s for s, _ in rows[n].values()) for n in names]
    lines.append("| Python between calls (the rest) | "
                 + " | ".join(f"{r:.3f} s ({r / walls[n]:.0%})" for r, n in zip(rest, names)) + " |")  # fmt: skip
    lines.append("| wall | " + " | ".join(f"{walls[n]:.3f} s" for n in names) + " |")
    return "\n".join(lines)
