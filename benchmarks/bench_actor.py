"""Actor benchmark: cost of Σπ² in `compute_log_prob`, as ratios measured in one run.

1. Tokens/s of compute_log_prob without and with Σπ² (alternated repeats, medians).
   Goal: Σπ² adds at most 5 %.
2. Peak extra memory of one compute_log_prob pass without Σπ², with Σπ², and with Σπ²
   checkpointing (LM head in chunks), each in a fresh subprocess (peak RSS above a baseline taken
   after the model and batch exist; torch.cuda.max_memory_allocated on GPU).

The model is a randomly initialised Qwen2 (default hidden 512, 4 layers, vocab 32768) so the
vocabulary-to-width ratio resembles real models; on this 2-core CPU absolute times are noisy.

Usage:
    python benchmarks/bench_actor.py
    python benchmarks/bench_actor.py --hidden 256 --layers 2 --vocab 16384 --batch 8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_core_algos import (
    CHILD_TAG,
    MIB,
    _maxrss_bytes,
    current_rss_bytes,
    reset_peak_rss,
)

from verl.utils.synthetic import synthetic_rl_batch
from verl.utils.tiny_lm import TinyLMSpec, build_tiny_qwen2
from verl.workers.actor.config import ActorConfig
from verl.workers.actor.dp_actor import DataParallelPPOActor

VARIANTS = {
    "plain": {"calculate_sum_pi_squared": False},
    "sum_pi_squared": {"calculate_sum_pi_squared": True},
    "sum_pi_squared_checkpointing": {
        "calculate_sum_pi_squared": True,
        "sum_pi_squared_checkpointing": True,
    },
}


def setup(args: argparse.Namespace, device: str):
    spec = TinyLMSpec(hidden_size=args.hidden, num_hidden_layers=args.layers, vocab_size=args.vocab,
                      max_position_embeddings=args.prompt + args.response + 8)  # fmt: skip
    model = build_tiny_qwen2(spec).to(device).eval()
    data = synthetic_rl_batch(args.batch, args.prompt, args.response, vocab_size=args.vocab, seed=0,
                              min_prompt=args.prompt // 2, min_response=args.response // 2)  # fmt: skip
    data.meta_info["temperature"] = 1.0
    return model, data.to(device)


def make_actor(model, args: argparse.Namespace, variant: str) -> DataParallelPPOActor:
    cfg = ActorConfig(micro_batch_size_per_device_for_experience=args.micro, **VARIANTS[variant])
    return DataParallelPPOActor(cfg, model)


def bench_throughput(args: argparse.Namespace, device: str) -> dict[str, float]:
    model, data = setup(args, device)
    tokens = float(data.batch["response_mask"].sum())
    actors = {v: make_actor(model, args, v) for v in ("plain", "sum_pi_squared")}
    times: dict[str, list[float]] = {v: [] for v in actors}
    for actor in actors.values():  # warm-up
        actor.compute_log_prob(data)
    for _ in range(args.repeats):
        for variant, actor in actors.items():
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            actor.compute_log_prob(data)
            if device == "cuda":
                torch.cuda.synchronize()
            times[variant].append(time.perf_counter() - start)
    medians = {v: statistics.median(t) for v, t in times.items()}
    for v, t in times.items():
        print(
            f"[tput] {v:15s} median {medians[v] * 1e3:9.1f} ms  {tokens / medians[v]:9.0f} tok/s  ({', '.join(f'{x * 1e3:.0f}' for x in t)})"
        )
    overhead = medians["sum_pi_squared"] / medians["plain"] - 1
    print(f"[tput] Σπ² overhead: {overhead * 100:+.1f} % (goal: at most +5 %)")
    return {
        "tokens": tokens,
        "plain_s": medians["plain"],
        "spi2_s": medians["sum_pi_squared"],
        "overhead": overhead,
    }


def child_main(args: argparse.Namespace, variant: str, device: str) -> None:
    """Fresh process: build, warm up on a tiny batch, take the baseline, run one pass, report."""
    model, data = setup(args, device)
    actor = make_actor(model, args, variant)
    actor.compute_log_prob(data[:1])  # lazy initialisation outside the measured window
    if device == "cuda":
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_peak_rss()  # building the model peaked above what one pass needs
        baseline = current_rss_bytes()
    out = actor.compute_log_prob(data)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else _maxrss_bytes()
    report = {
        "variant": variant,
        "extra_mib": (peak - baseline) / MIB,
        "baseline_mib": baseline / MIB,
        "peak_mib": peak / MIB,
        "mean_lp": float(out.batch["old_log_probs"].mean()),
    }
    print(CHILD_TAG + json.dumps(report), flush=True)


def run_child(argv: list[str], variant: str) -> dict:
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv, "--_child", variant],
                          capture_output=True, text=True)  # fmt: skip
    for line in proc.stdout.splitlines():
        if line.startswith(CHILD_TAG):
            return json.loads(line[len(CHILD_TAG) :])
    raise RuntimeError(
        f"{variant} child failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )


def bench_memory(argv: list[str]) -> dict[str, float]:
    reports = {v: run_child(argv, v) for v in VARIANTS}
    for v, r in reports.items():
        print(
            f"[mem]  {v:29s} extra {r['extra_mib']:8.1f} MiB  (baseline {r['baseline_mib']:.0f}, peak {r['peak_mib']:.0f} MiB)"
        )
    plain = max(reports["plain"]["extra_mib"], 1e-9)
    return {v: r["extra_mib"] / plain for v, r in reports.items()} | {
        f"{v}_mib": r["extra_mib"] for v, r in reports.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=192)
    parser.add_argument(
        "--micro", type=int, default=8, help="micro_batch_size_per_device_for_experience"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = (
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    if args._child:
        child_main(args, args._child, device)
        return
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {device}; model hidden {args.hidden} x {args.layers} layers, "
          f"vocab {args.vocab}; batch {args.batch} x (prompt {args.prompt} + response {args.response})")  # fmt: skip
    tput = bench_throughput(args, device)
    print("\n=== summary (ratios from one run) ===")
    print(f"Σπ² compute_log_prob time with/without: {1 + tput['overhead']:.3f}x ({tput['overhead'] * 100:+.1f} %; "
          f"{tput['tokens'] / tput['plain_s']:.0f} vs {tput['tokens'] / tput['spi2_s']:.0f} tok/s; goal <= +5 %)")  # fmt: skip
    if not args.skip_memory:
        argv = [a for a in sys.argv[1:] if a != "--skip-memory"]
        mem = bench_memory(argv)
        print(f"Σπ² peak extra memory with/without: {mem['sum_pi_squared']:.2f}x "
              f"({mem['sum_pi_squared_mib']:.0f} vs {mem['plain_mib']:.0f} MiB); with Σπ² checkpointing: "
              f"{mem['sum_pi_squared_checkpointing']:.2f}x ({mem['sum_pi_squared_checkpointing_mib']:.0f} MiB)")  # fmt: skip


if __name__ == "__main__":
    main()
