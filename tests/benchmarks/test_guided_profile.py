"""The guided rollout's profile (benchmarks/guided_profile.py): each part's own seconds, on a
fake clock."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scripts import load

P = load("guided_profile")


class Clock:
    """perf_counter that moves only when told."""

    now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_nested_calls_count_their_own_seconds_and_a_whole_part_keeps_its_inner_calls(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(P, "time", clock)
    parts = {
        ("m", "Toy", "outer"): "outer",
        ("m", "Toy", "inner"): "inner",
        ("m", "Toy", "whole"): "whole",
    }
    monkeypatch.setattr(P, "PARTS", parts)
    monkeypatch.setattr(P, "WHOLE", {"whole"})

    class Toy:
        def inner(self, dt):
            clock.now += dt

        def outer(self):
            clock.now += 1.0  # own
            self.inner(2.0)  # inner's
            self.whole()  # whole's, its inner call included
            clock.now += 0.5  # own

        def whole(self):
            clock.now += 3.0
            self.inner(4.0)

    for name, part in (("outer", "outer"), ("inner", "inner"), ("whole", "whole")):
        P._wrap(Toy, name, part)
    P.reset()
    Toy().outer()
    # outer: 1 + 0.5 own (wall 10.5 less inner 2 and whole 7); inner 2 (once: the call inside
    # whole is whole's); whole 3 + 4
    assert P.snapshot() == {"outer": (1.5, 1), "inner": (2.0, 1), "whole": (7.0, 1)}
    table = P.table({"run": P.snapshot()}, {"run": 12.0})
    # the rest: 12 - (1.5 + 2 + 7) = 1.5 s, 12 % of the wall
    assert "| Python between calls (the rest) | 1.500 s (12%) |" in table
    assert "| whole | 7.000 s (58%, 1) |" in table
