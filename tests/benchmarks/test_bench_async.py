"""bench_async's steady state: warm-up steps and the pipeline's draining steps left out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scripts import load

A = load("bench_async")


def test_steady_state_drops_the_warmup_and_the_last_staleness_steps(tmp_path):
    rows = [{"step": i, "perf/time_per_step": t, "timing_s/gen": 1.0}
            for i, t in enumerate([9.0, 5.0, 4.0, 4.2, 4.4, 1.5], start=1)]  # fmt: skip
    text = "\n".join(json.dumps(r) for r in [*rows, {"val/score": 0.5}]) + "\n"
    (tmp_path / "experiment_log.jsonl").write_text(text)
    # warm-up 2 drops 9.0 and 5.0; staleness 1 drops the last step (1.5, nothing generated beside it)
    times, means = A.step_times(tmp_path, warmup=2, staleness=1)
    assert times == [4.0, 4.2, 4.4] and means == {"timing_s/gen": 1.0}
    assert A.step_times(tmp_path, warmup=2)[0] == [4.0, 4.2, 4.4, 1.5]  # synchronous: every step
