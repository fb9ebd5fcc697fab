"""Asynchronous vs synchronous training: steady-state seconds per step, as ratios from one run.

Each run is `python -m verl.trainer.main` on examples/grpo_guided.yaml (the demo's recipe: 64
prompts x 8 responses, two updates of 256), without validation, for `--steps` steps, at
`async_training.staleness` 0 (the synchronous trainer), 1 and 2; once with guidance off (plain
GRPO) and once guided (speculative, the demo's λ). The runs alternate (0, 1, 2, 0, 1, 2, ...,
`--repeats` times) so that load drift on a shared machine falls on every variant alike. Steady
state: each run's `perf/time_per_step` after its first `--warmup` steps and before its last k
(at staleness k the last k steps train batches generated earlier with nothing generated beside
them); a step's wall time runs from the moment the trainer asks for its batch to the end of its
weight sync. Each run starts in an empty folder. The ratio sync / async
of mean step times gets a bootstrap 95 % interval over the steps of every run of both variants.
Writes <out>/bench_async.json and prints a table.

Usage:
    .venv/bin/python benchmarks/bench_async.py [--steps 12] [--warmup 3] [--repeats 2] [--recipes plain,guided] [--pair random]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_stats import bootstrap_ratio  # noqa: E402

WORK = ROOT / ".cache" / "bench_async"
RECIPES = {"plain": ["worker.rollout.offpolicy_guidance.enable=false"], "guided": []}


def random_pair() -> list[str]:
    """Overrides for a randomly initialised pair of the embedded models' shape (hidden 256, 4
    layers, the char vocabulary), built once under WORK, and the coin reward of
    benchmarks/noise_reward.py (1 with probability 0.08): the demo's compute per token and
    non-zero advantages, without the embedded pair's build (minutes to an hour on a loaded
    2-core machine)."""
    from verl.tasks.embedded import MODEL
    from verl.tasks.tiny_lm import save_tiny_lm

    paths = {}
    for name, seed in (("draft", 1), ("guidance", 2)):
        path = WORK / "pair" / name
        if not (path / "config.json").exists():
            save_tiny_lm(str(path), dataclasses.replace(MODEL, seed=seed))
        paths[name] = path
    return [f"worker.actor.model.model_path={paths['draft']}",
            f"worker.rollout.offpolicy_guidance.model_path={paths['guidance']}",
            f"worker.reward.reward_function={ROOT / 'benchmarks' / 'noise_reward.py'}:coin",
            "worker.reward.reward_type=sequential"]  # fmt: skip


def run_args(recipe: str, staleness: int, steps: int, run_dir: Path, pair: list[str] = ()) -> list[str]:  # fmt: skip
    """The `verl.trainer.main` arguments of one run (`pair`: model overrides, see random_pair)."""
    return [f"config={ROOT / 'examples' / 'grpo_guided.yaml'}", *RECIPES[recipe], *pair,
            f"async_training.staleness={staleness}", "worker.rollout.free_cache_engine=false",
            f"trainer.max_steps={steps}", "trainer.val_before_train=false", "data.val_files=",
            "trainer.logger=[file]", f"trainer.save_checkpoint_path={run_dir}", "trainer.resume=none"]  # fmt: skip


def step_times(
    run_dir: Path, warmup: int, staleness: int = 0
) -> tuple[list[float], dict[str, float]]:
    """Steady-state seconds per step of a finished run, and its mean async/* and timing_s/*: its
    steps after the first `warmup`, less the last `staleness` (their batches were generated while
    earlier steps trained and nothing is generated beside them: the pipeline draining, faster
    than its steady state)."""
    rows = [
        json.loads(x)
        for x in (run_dir / "experiment_log.jsonl").read_text().splitlines()
        if x.strip()
    ]
    rows = [r for r in rows if "perf/time_per_step" in r]
    rows = rows[warmup : len(rows) - staleness]
    keys = {k for r in rows for k in r if k.startswith(("async/", "timing_s/"))}
    means = {k: statistics.fmean(r[k] for r in rows if k in r) for k in sorted(keys)}
    return [r["perf/time_per_step"] for r in rows], means


def run_once(recipe: str, staleness: int, steps: int, run_dir: Path, pair: list[str]) -> None:
    """One training run in a fresh run_dir (the trainer appends to an existing experiment log),
    its output in run_dir/run.log; on failure, the log's tail and exit."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "verl.trainer.main",
        *run_args(recipe, staleness, steps, run_dir, pair),
    ]
    with (run_dir / "run.log").open("w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc:
        sys.exit(
            f"{recipe} staleness {staleness} failed (exit {rc}):\n"
            + (run_dir / "run.log").read_text()[-3000:]
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each run left out")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--staleness", default="0,1,2")
    parser.add_argument("--recipes", default="plain,guided")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--pair",
        choices=("embedded", "random"),
        default="embedded",
        help="the demo's built pair, or random weights of its shape (random_pair)",
    )
    args = parser.parse_args()
    pair = random_pair() if args.pair == "random" else []
    levels = [int(k) for k in args.staleness.split(",")]
    result = {"pair": args.pair, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "cpu_count": os.cpu_count(),
              "load_avg_1min_start": os.getloadavg()[0], "runs": [], "ratios": {}}  # fmt: skip
    for recipe in args.recipes.split(","):
        times: dict[int, list[float]] = {k: [] for k in levels}
        for repeat in range(args.repeats):
            for k in levels:
                run_dir = WORK / f"{recipe}-s{k}-r{repeat}"
                start = time.perf_counter()
                run_once(recipe, k, args.steps, run_dir, pair)
                steps, means = step_times(run_dir, args.warmup, k)
                times[k] += steps
                result["runs"].append({"recipe": recipe, "staleness": k, "repeat": repeat, "step_times": steps,
                                       "wall_s": time.perf_counter() - start, "means": means})  # fmt: skip
                print(
                    f"{recipe} staleness {k} #{repeat}: {statistics.fmean(steps):.2f} s/step",
                    flush=True,
                )
        for k in levels[1:]:
            ratio, low, high = bootstrap_ratio(times[levels[0]], times[k])
            result["ratios"][f"{recipe}: staleness {levels[0]} / {k}"] = {
                "ratio": ratio, "ci95": [low, high], "s_per_step": [statistics.fmean(times[levels[0]]), statistics.fmean(times[k])]}  # fmt: skip
    result["load_avg_1min_end"] = os.getloadavg()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_async.json").write_text(json.dumps(result, indent=1))
    print(
        "| recipe: sync / async | s/step sync | s/step async | speed-up | 95 % CI |\n| --- | --- | --- | --- | --- |"
    )
    for name, r in result["ratios"].items():
        (a, b), (low, high) = r["s_per_step"], r["ci95"]
        print(f"| {name} | {a:.2f} | {b:.2f} | {r['ratio']:.2f}x | {low:.2f}-{high:.2f} |")
    print(f"wrote {args.out / 'bench_async.json'}")


if __name__ == "__main__":
    main()
