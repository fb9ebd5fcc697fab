"""Benchmark two core-algorithm costs, reported as ratios measured within one run.

1. Time of the OTB advantage estimator vs GRPO on the same batch (median of alternated repeats).
2. Peak extra memory of the chunked Σπ² (`compute_sum_pi_squared`) vs a naive
   `softmax(logits).pow(2).sum(-1)`, each variant in its own fresh subprocess so peaks don't mix.
   CPU: peak RSS (ru_maxrss) above a baseline taken after the logits are materialized.
   CUDA: torch.cuda.max_memory_allocated above memory_allocated after the logits exist.

Absolute timings are noisy on shared machines; compare only the ratios from one run.

Usage:
    python benchmarks/bench_core_algos.py
    python benchmarks/bench_core_algos.py --responses 1024 --length 512 --repeats 3
    python benchmarks/bench_core_algos.py --shape 4x1024x32768 --chunk-size 512
    python benchmarks/bench_core_algos.py --skip-memory
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from verl.trainer.core_algos.advantage import get_adv_estimator_fn  # noqa: E402
from verl.trainer.core_algos.sum_pi_squared import compute_sum_pi_squared  # noqa: E402

MIB = 1024 * 1024
CHILD_TAG = "BENCH_CHILD_RESULT "


# --------------------------------------------------------------------------------------------
# 1. OTB vs GRPO time
# --------------------------------------------------------------------------------------------


def make_advantage_batch(
    responses: int, length: int, n: int, seed: int = 0
) -> dict[str, torch.Tensor | np.ndarray]:
    """A right-padded outcome-reward batch shared by both estimators (all (B, T) except index)."""
    if responses % n:
        raise ValueError(f"--responses ({responses}) must be a multiple of --n ({n})")
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (responses,), generator=gen)
    cols = torch.arange(length)
    response_mask = (cols.unsqueeze(0) < lengths.unsqueeze(1)).float()
    outcome = torch.randint(0, 2, (responses,), generator=gen).float()
    token_level_rewards = torch.zeros(responses, length)
    token_level_rewards[torch.arange(responses), lengths - 1] = outcome
    # old_log_probs in (-5, 0]: -5 * U[0, 1)
    old_log_probs = -5.0 * torch.rand(responses, length, generator=gen)
    # sum_pi_squared in (0, 1]: 1 - U[0, 1)
    sum_pi_squared = 1.0 - torch.rand(responses, length, generator=gen)
    index = np.array([f"uid-{i // n}" for i in range(responses)], dtype=object)
    return {
        "token_level_rewards": token_level_rewards,
        "response_mask": response_mask,
        "index": index,
        "old_log_probs": old_log_probs * response_mask,
        "sum_pi_squared": sum_pi_squared * response_mask,
    }


def bench_advantage(responses: int, length: int, n: int, repeats: int) -> dict[str, float]:
    batch = make_advantage_batch(responses, length, n)
    fns = {
        "otb": get_adv_estimator_fn("optimal_token_baseline"),
        "grpo": get_adv_estimator_fn("grpo"),
    }
    for fn in fns.values():  # warm-up (lazy init, allocator)
        fn(**batch)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(repeats):
        # alternate the order so both share the machine's noise (and neither is always first)
        order = list(fns) if rep % 2 == 0 else list(reversed(fns))
        for name in order:
            t0 = time.perf_counter()
            adv, _ = fns[name](**batch)
            times[name].append(time.perf_counter() - t0)
            assert adv.shape == (responses, length)
    otb_ms = statistics.median(times["otb"]) * 1e3
    grpo_ms = statistics.median(times["grpo"]) * 1e3
    print(f"[adv] batch {responses}x{length} (n={n}, {responses // n} prompts), {repeats} repeats")
    for name in fns:
        ts = ", ".join(f"{t * 1e3:.1f}" for t in times[name])
        print(f"[adv]   {name:5s} median {statistics.median(times[name]) * 1e3:9.2f} ms  ({ts})")
    print(f"[adv]   ratio otb/grpo: {otb_ms / grpo_ms:.2f}x")
    return {"otb_ms": otb_ms, "grpo_ms": grpo_ms, "ratio": otb_ms / grpo_ms}


# --------------------------------------------------------------------------------------------
# 2. Σπ² peak memory, one fresh subprocess per variant
# --------------------------------------------------------------------------------------------


def naive_sum_pi_squared(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits, dim=-1).pow(2).sum(dim=-1)


def _status_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status (VmHWM, VmRSS) in bytes; None where /proc is missing."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _maxrss_bytes() -> int:
    """Peak RSS of this process: VmHWM (resettable, see reset_peak_rss), else ru_maxrss."""
    peak = _status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    """Resident set size now (VmRSS); falls back to the peak where /proc is missing."""
    now = _status_bytes("VmRSS")
    return now if now is not None else _maxrss_bytes()


def reset_peak_rss() -> bool:
    """Reset the peak-RSS mark to the current RSS (Linux >= 4.0); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def child_main(variant: str, shape: tuple[int, ...], chunk_size: int, device: str) -> None:
    """Runs in a fresh process: allocate logits, take a baseline, run `variant` once, report."""
    torch.manual_seed(0)
    variants = {
        "naive": naive_sum_pi_squared,
        "chunked": lambda x: compute_sum_pi_squared(x, chunk_size=chunk_size),
    }
    run, other = variants[variant], variants["chunked" if variant == "naive" else "naive"]
    cuda = device == "cuda"

    # Warm both code paths on a tiny tensor so lazy init (kernels, thread pools) is not counted.
    tiny = torch.randn(2, 3, shape[-1], device=device)
    run(tiny)
    other(tiny)
    del tiny

    logits = torch.empty(shape, dtype=torch.float32, device=device)
    logits.normal_()  # fills in place: no second full-size tensor ever exists
    float(logits.view(-1)[::4096].sum())  # touch (and sync) so the pages are resident
    if cuda:
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        baseline = _maxrss_bytes()

    t0 = time.perf_counter()
    result = run(logits)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0

    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _maxrss_bytes()

    # After the peak is recorded: check against the other variant (its memory is not measured).
    reference = other(logits)
    max_abs_diff = float((result - reference).abs().max())
    report = {
        "variant": variant,
        "device": device,
        "logits_mib": logits.numel() * logits.element_size() / MIB,
        "baseline_mib": baseline / MIB,
        "peak_mib": peak / MIB,
        "extra_mib": (peak - baseline) / MIB,
        "seconds": seconds,
        "max_abs_diff": max_abs_diff,
        "result_mean": float(result.double().mean()),
    }
    print(CHILD_TAG + json.dumps(report), flush=True)


def run_child(variant: str, shape: tuple[int, ...], chunk_size: int, device: str) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--_child",
        variant,
        "--shape",
        "x".join(map(str, shape)),
        "--chunk-size",
        str(chunk_size),
        "--device",
        device,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        raise RuntimeError(
            f"{variant} child failed (rc={proc.returncode}); a negative rc / -9 usually means "
            f"out of memory, try a smaller --shape.\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    for line in proc.stdout.splitlines():
        if line.startswith(CHILD_TAG):
            return json.loads(line[len(CHILD_TAG) :])
    raise RuntimeError(f"{variant} child printed no result:\n{proc.stdout}\n{proc.stderr}")


def bench_memory(shape: tuple[int, ...], chunk_size: int, device: str) -> dict[str, float]:
    how = "cuda.max_memory_allocated" if device == "cuda" else "peak RSS (ru_maxrss)"
    print(
        f"[mem] logits {'x'.join(map(str, shape))} fp32 on {device}, chunk_size={chunk_size}, {how}"
    )
    reports = {v: run_child(v, shape, chunk_size, device) for v in ("naive", "chunked")}
    for v, r in reports.items():
        print(
            f"[mem]   {v:7s} extra {r['extra_mib']:9.1f} MiB  (baseline {r['baseline_mib']:.0f}, "
            f"peak {r['peak_mib']:.0f} MiB)  time {r['seconds'] * 1e3:8.1f} ms  "
            f"max|Δ| vs other {r['max_abs_diff']:.3e}"
        )
    naive, chunked = reports["naive"], reports["chunked"]
    if min(naive["extra_mib"], chunked["extra_mib"]) < 1.0:
        # ru_maxrss moves in pages and only past the earlier high-water mark: tiny shapes read ~0
        print("[mem]   warning: an extra below 1 MiB is not measurable here; use a larger --shape")
        ratio = float("nan")
    else:
        ratio = naive["extra_mib"] / chunked["extra_mib"]
    print(
        f"[mem]   ratio naive/chunked extra memory: {fmt_ratio(ratio)}; "
        f"time naive/chunked: {naive['seconds'] / chunked['seconds']:.2f}x"
    )
    return {
        "naive_mib": naive["extra_mib"],
        "chunked_mib": chunked["extra_mib"],
        "ratio": ratio,
        "naive_s": naive["seconds"],
        "chunked_s": chunked["seconds"],
        "max_abs_diff": max(naive["max_abs_diff"], chunked["max_abs_diff"]),
        "logits_mib": naive["logits_mib"],
    }


# --------------------------------------------------------------------------------------------


def fmt_ratio(ratio: float) -> str:
    return "n/a" if ratio != ratio else f"{ratio:.1f}x"  # NaN when not measurable


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.lower().replace(",", "x").split("x"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad shape {text!r}; use e.g. 8x2048x32768") from exc
    if len(shape) < 2 or min(shape) <= 0:
        raise argparse.ArgumentTypeError(f"bad shape {text!r}; need >= 2 positive dims")
    return shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--responses", type=int, default=4096, help="batch size B (prompts x n)")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt (group size)")
    parser.add_argument("--length", type=int, default=1024, help="response length T")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per estimator")
    parser.add_argument(
        "--shape",
        type=parse_shape,
        default=(8, 2048, 32768),
        help="logits shape, e.g. 8x2048x32768",
    )
    parser.add_argument("--chunk-size", type=int, default=1024, help="compute_sum_pi_squared rows")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--skip-advantage", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--_child", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda requested but CUDA is not available")

    if args._child:
        child_main(args._child, args.shape, args.chunk_size, device)
        return

    start = time.perf_counter()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, memory device {device}")
    adv = (
        None
        if args.skip_advantage
        else bench_advantage(args.responses, args.length, args.n, args.repeats)
    )
    mem = None if args.skip_memory else bench_memory(args.shape, args.chunk_size, device)
    total = time.perf_counter() - start

    print("\n=== summary (ratios from one run; absolute times are machine-dependent) ===")
    if adv is not None:
        print(
            f"OTB/GRPO time ratio: {adv['ratio']:.2f}x (otb {adv['otb_ms']:.1f} ms, "
            f"grpo {adv['grpo_ms']:.1f} ms, {args.responses}x{args.length})"
        )
    if mem is not None:
        shape = "x".join(map(str, args.shape))
        print(
            f"Σπ² peak extra memory naive/chunked: {fmt_ratio(mem['ratio'])} (naive "
            f"{mem['naive_mib']:.0f} MiB, chunked {mem['chunked_mib']:.0f} MiB, logits {shape} "
            f"fp32, {device})"
        )
        print(
            f"Σπ² time naive/chunked: {mem['naive_s'] / mem['chunked_s']:.2f}x (naive "
            f"{mem['naive_s'] * 1e3:.0f} ms, chunked {mem['chunked_s'] * 1e3:.0f} ms); "
            f"max abs diff {mem['max_abs_diff']:.1e}"
        )
    print(f"total runtime: {total:.1f} s")


if __name__ == "__main__":
    main()
