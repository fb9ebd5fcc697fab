"""PNG panels of a run's metrics: `python -m verl.tools.plot_metrics <run_dir>`.

Reads `<run_dir>/experiment_log.jsonl` (the file logger) and writes `<run_dir>/plots/*.png`:
reward, response length, guidance/*, mismatch/*, distill/* and importance-weight statistics, one figure per
group with one panel per metric, in the order a user reads them (`FIRST`, then by name). A metric
shows in one group only (the importance weights have their own), and one that stayed exactly 0
over the run gets no panel: the figure names those in one line at its foot.
Also called at the end of every training run.
"""

from __future__ import annotations

import argparse
import json
import math
import os

GROUPS = {
    "reward": ("critic/score/mean", "val/reward_score"),
    "response_length": (
        "response_length/mean",
        "response_length/clip_ratio",
        "val/response_length",
    ),
    "guidance": ("guidance/",),
    "mismatch": ("mismatch/",),
    "distill": ("distill/", "actor/distill_loss"),
    "importance_weights": (
        "guidance/is_weight_mean",
        "guidance/is_weight_std",
        "guidance/is_weight_min",
        "guidance/is_weight_max",
        "guidance/is_clip_frac",
    ),
}


FIRST = (
    "guidance/lambda", "guidance/lambda_mean", "guidance/target_lambda_mean",
    "guidance/offpolicy_token_ratio", "guidance/offpolicy_seq_ratio", "guidance/accept_rate",
    "guidance/behavior_kl", "guidance/guided_grad_share", "guidance/guided_score_gap",
    "guidance/guided_seq_score", "guidance/unguided_seq_score", "guidance/topk_tail_mass",
    "guidance/target_tv", "mismatch/kl_v1", "mismatch/kl_v2",
)  # fmt: skip
"""Panels first in their figure, in this order: what the guidance did, then what it cost."""


def read_log(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """metric name -> [(step, value)] from experiment_log.jsonl (null / non-finite values skipped)."""
    series: dict[str, list[tuple[int, float]]] = {}
    with open(os.path.join(run_dir, "experiment_log.jsonl")) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            step = row.pop("step")
            for key, value in row.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    series.setdefault(key, []).append((step, float(value)))
    return series


def _members(group: tuple[str, ...], names: list[str]) -> list[str]:
    return [n for n in names if any(n == p or (p.endswith("/") and n.startswith(p)) for p in group)]


def panels(series: dict[str, list[tuple[int, float]]]) -> dict[str, tuple[list[str], list[str]]]:
    """group -> (metrics drawn, in reading order; metrics that stayed 0, named at the foot) for
    every group with data. A metric named exactly by a group belongs to that group only."""
    exact = {p for patterns in GROUPS.values() for p in patterns if not p.endswith("/")}
    rank = {name: i for i, name in enumerate(FIRST)}
    layout = {}
    for group, patterns in GROUPS.items():
        names = [n for n in _members(patterns, sorted(series)) if n in patterns or n not in exact]
        if not names:
            continue
        names.sort(key=lambda n: (rank.get(n, len(rank)), n))
        zero = [n for n in names if all(v == 0.0 for _, v in series[n])]
        layout[group] = ([n for n in names if n not in zero], zero)
    return layout


def plot_run(run_dir: str) -> list[str]:
    """Write one PNG per metric group that has data; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = read_log(run_dir)
    out_dir = os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for group, (names, zero) in panels(series).items():
        cols = min(3, max(1, len(names)))
        rows = max(1, math.ceil(len(names) / cols))
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
        for ax, name in zip(axes.flat, names, strict=False):
            steps, values = zip(*series[name], strict=True)
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3)
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(names) :]:
            ax.axis("off")
        if zero:
            fig.text(0.01, 0.005, "0 at every step: " + ", ".join(zero), fontsize=7, wrap=True)
        fig.tight_layout(rect=(0, 0.04 if zero else 0, 1, 1))
        path = os.path.join(out_dir, f"{group}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="folder holding experiment_log.jsonl")
    args = parser.parse_args()
    for path in plot_run(args.run_dir):
        print(path)


if __name__ == "__main__":
    main()
