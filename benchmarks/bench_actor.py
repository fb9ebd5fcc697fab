"""Actor benchmark: cost of Σπ² in `compute_log_prob`, and the worker path against plain HF, as
ratios measured in one run.

1. Tokens/s of compute_log_prob without and with Σπ² (alternated repeats, medians).
   Goal: Σπ² adds at most 5 %.
2. Peak extra memory of one compute_log_prob pass without Σπ², with Σπ², and with Σπ²
   checkpointing (LM head in chunks), each in a fresh subprocess (peak RSS above a baseline taken
   after the model and batch exist; torch.cuda.max_memory_allocated on GPU).
3. `--worker arithmetic|runsum` (CPU): the trainer's path, `FSDPWorker` (1 rank on gloo, the
   module unwrapped) driven through `RayWorkerGroup` as `RayPPOTrainer` drives it, with the
   actor settings of examples/grpo_guided.yaml, against a plain HF forward/backward of the same
   model, tokens and micro-batching in this process (padded micro-batches, the PPO clipped
   token-mean loss, AdamW), for compute_log_prob and for update_actor, alternated; the worker's
   time is split into stages (Ray + DataProto transfer, forward, backward, optimizer, the rest)
   by timers the worker installs around its own calls. Shapes: `arithmetic` is the demo's
   (hidden 256 x 4 layers, 512 x (8 + 4) tokens, mini-batches of 256), `runsum` the evidence's
   (hidden 128 x 2 layers, 256 x (21 + 21) tokens, mini-batches of 128); randomly initialised
   weights.

The model is a randomly initialised Qwen2 (default hidden 512, 4 layers, vocab 32768) so the
vocabulary-to-width ratio resembles real models; on this 2-core CPU absolute times are noisy.

Usage:
    python benchmarks/bench_actor.py
    python benchmarks/bench_actor.py --hidden 256 --layers 2 --vocab 16384 --batch 8 --repeats 3
    python benchmarks/bench_actor.py --worker arithmetic --worker runsum --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
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

from verl.tasks.synthetic import synthetic_rl_batch
from verl.tasks.tiny_lm import TinyLMSpec, build_tiny_qwen2
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


# ---------------------------------------------------------------- worker path vs plain HF
ROOT = Path(__file__).resolve().parents[1]
WORKER_SHAPES = {  # the embedded tasks' models and one step's batch (see verl/tasks/embedded.py)
    "arithmetic": {"hidden": 256, "layers": 4, "batch": 512, "prompt": (4, 8), "response": (1, 4),
                   "global_batch_size": 256},
    "runsum": {"hidden": 128, "layers": 2, "batch": 256, "prompt": (21, 21), "response": (21, 21),
               "global_batch_size": 128},
}  # fmt: skip
STAGES = ("forward", "backward", "optimizer")


def paired_ratio_ci(a: list[float], b: list[float], draws: int = 2000) -> tuple[float, float]:
    """95 % paired-bootstrap interval of median(a) / median(b) (pairs resampled together)."""
    rng, pairs, ratios = random.Random(0), list(zip(a, b, strict=True)), []
    for _ in range(draws):
        sample = [rng.choice(pairs) for _ in pairs]
        ratios.append(
            statistics.median(x for x, _ in sample) / statistics.median(y for _, y in sample)
        )
    ratios.sort()
    return ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]


def worker_batch(shape: dict, seed: int = 0):
    """One step's batch (uids, old log-probs and advantages as the trainer sends them)."""
    (p_min, p_max), (r_min, r_max) = shape["prompt"], shape["response"]
    data = synthetic_rl_batch(shape["batch"], p_max, r_max, vocab_size=100, seed=seed, group_size=8,
                              min_prompt=p_min, min_response=r_min)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    mask = data.batch["response_mask"]
    data.batch["old_log_probs"] = -torch.rand(mask.shape, generator=gen) * mask
    data.batch["advantages"] = torch.randn(len(data), 1, generator=gen).expand_as(mask) * mask
    data.meta_info["temperature"] = 1.0
    return data


def worker_config(model_path: str, shape: dict):
    """examples/grpo_guided.yaml's worker settings on `model_path` (mini-batch per `shape`)."""
    from verl.trainer.config import load_config

    cfg = load_config([f"config={ROOT / 'examples' / 'grpo_guided.yaml'}",
                       f"worker.actor.model.model_path={model_path}",
                       f"worker.actor.global_batch_size={shape['global_batch_size']}",
                       "worker.rollout.offpolicy_guidance.enable=false"]).worker  # fmt: skip
    cfg.actor.optim.training_steps = 1000
    return cfg


def make_probe_worker():
    """FSDPWorker plus `timed`: run a method, returning its result, its wall time and the time of
    its stages (timers around the actor's forward, backward and optimizer calls)."""
    from verl.workers.fsdp_workers import FSDPWorker

    class ProbeWorker(FSDPWorker):
        def timed(self, data, stage_method: str):
            stages = dict.fromkeys(STAGES, 0.0)
            actor, backward = self.actor, torch.Tensor.backward

            def timer(stage: str, fn):
                def run(*args, **kwargs):
                    start = time.perf_counter()
                    try:
                        return fn(*args, **kwargs)
                    finally:
                        stages[stage] += time.perf_counter() - start

                return run

            actor._response_logits = timer("forward", actor._response_logits)
            actor._clip_and_step = timer("optimizer", actor._clip_and_step)
            torch.Tensor.backward = timer("backward", backward)
            start = time.perf_counter()
            try:
                out = getattr(self, stage_method)(data)
            finally:
                torch.Tensor.backward = backward
                del actor._response_logits, actor._clip_and_step
            return out, time.perf_counter() - start, stages

    return ProbeWorker


def plain_hf(model, data, cfg):
    """compute_log_prob and update written plainly on `model`: padded micro-batches of the
    worker's sizes, logits of the last T+1 positions, the PPO clipped token-mean loss, AdamW
    (torch defaults), gradient clipping."""
    actor, loss_cfg = cfg.actor, cfg.actor.policy_loss
    optimizer = torch.optim.AdamW(model.parameters(), lr=actor.optim.lr, betas=tuple(actor.optim.betas),
                                  weight_decay=actor.optim.weight_decay)  # fmt: skip
    resp_len = data.batch["responses"].shape[1]

    def log_probs(batch):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], use_cache=False,
                       logits_to_keep=resp_len + 1).logits[:, :-1]  # fmt: skip
        return (
            torch.log_softmax(logits.float(), -1)
            .gather(-1, batch["responses"].unsqueeze(-1))
            .squeeze(-1)
        )

    def compute_log_prob():
        model.eval()
        with torch.no_grad():
            return torch.cat(
                [
                    log_probs(m.batch)
                    for m in data.split(actor.micro_batch_size_per_device_for_experience)
                ]
            )

    def update():
        model.train()
        for mini in data.split(actor.global_batch_size):
            optimizer.zero_grad(set_to_none=True)
            tokens = mini.batch["response_mask"].sum()
            for micro in mini.split(actor.micro_batch_size_per_device_for_update):
                b = micro.batch
                ratio = torch.exp(log_probs(b) - b["old_log_probs"])
                clipped = ratio.clamp(1 - loss_cfg.clip_ratio_low, 1 + loss_cfg.clip_ratio_high)
                surrogate = torch.min(ratio * b["advantages"], clipped * b["advantages"])
                (-(surrogate * b["response_mask"]).sum() / tokens).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), actor.max_grad_norm)
            optimizer.step()

    return compute_log_prob, update


@contextmanager
def ray_session():
    import ray

    ray.init(
        address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False
    )
    try:
        yield
    finally:
        ray.shutdown()


def bench_worker(task: str, repeats: int) -> dict[str, dict]:
    """Alternated repeats of worker compute_log_prob, plain HF log-probs, worker update, plain HF
    update; medians, ratios worker / plain HF with a paired-bootstrap interval, the stages."""
    from transformers import AutoModelForCausalLM

    from verl.protocol import DataProto
    from verl.tasks.tiny_lm import save_tiny_lm
    from verl.workers.worker_group import RayWorkerGroup

    shape = WORKER_SHAPES[task]
    spec = TinyLMSpec(
        hidden_size=shape["hidden"], num_hidden_layers=shape["layers"], vocab_size=128, seed=12
    )
    data = worker_batch(shape)
    tokens = int(data.batch["attention_mask"].sum())
    with tempfile.TemporaryDirectory() as tmp, ray_session():
        path = save_tiny_lm(tmp, spec)
        cfg = worker_config(path, shape)
        group = RayWorkerGroup(make_probe_worker(), 1, cfg, "actor")
        group.execute_all("init_model")
        torch.set_num_threads(os.cpu_count() or 1)  # the worker's: cpu_count // world_size
        hf_lp, hf_update = plain_hf(
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), data, cfg
        )

        def worker(method: str):
            def run():
                results = group.execute_dp("timed", data, stage_method=method)
                if method == "compute_log_prob":
                    DataProto.concat([r[0] for r in results]).unpad(group._last_pad)
                return results[0][1], results[0][2]

            return run

        calls = {"compute_log_prob": (worker("compute_log_prob"), hf_lp),
                 "update_actor": (worker("update_actor"), hf_update)}  # fmt: skip
        times = {
            m: {"worker": [], "inside": [], "hf": [], **{s: [] for s in STAGES}} for m in calls
        }
        for run_worker, run_hf in calls.values():  # warm-up
            run_worker()
            run_hf()
        for _ in range(repeats):
            for method, (run_worker, run_hf) in calls.items():
                for side in ("worker", "hf"):
                    start = time.perf_counter()
                    inside = run_worker() if side == "worker" else run_hf()
                    times[method][side].append(time.perf_counter() - start)
                    if side == "worker":
                        times[method]["inside"].append(inside[0])
                        for stage in STAGES:
                            times[method][stage].append(inside[1][stage])
        group.shutdown()
    print(f"[worker {task}] hidden {shape['hidden']} x {shape['layers']} layers, {shape['batch']} responses, "
          f"{tokens} valid tokens; micro-batches {cfg.actor.micro_batch_size_per_device_for_experience} "
          f"(log-prob) / {cfg.actor.micro_batch_size_per_device_for_update} (update), gradient checkpointing "
          f"{cfg.actor.model.enable_gradient_checkpointing}, padding-free {cfg.actor.padding_free}")  # fmt: skip
    report = {}
    for method, t in times.items():
        med = {k: statistics.median(v) for k, v in t.items() if v}
        low, high = paired_ratio_ci(t["worker"], t["hf"])
        pairs = sorted(a / b for a, b in zip(t["worker"], t["hf"], strict=True))
        ray_s = statistics.median(a - b for a, b in zip(t["worker"], t["inside"], strict=True))
        rest = statistics.median(
            i - sum(t[s][k] for s in STAGES) for k, i in enumerate(t["inside"])
        )
        stages = {
            "Ray + DataProto transfer": ray_s,
            **{s: med[s] for s in STAGES},
            "rest in the worker": rest,
        }
        report[method] = {"worker_s": med["worker"], "hf_s": med["hf"], "ratio": med["worker"] / med["hf"],
                          "ci": (low, high), "pairs": (pairs[0], pairs[-1]), "stages": stages}  # fmt: skip
        print(f"[worker {task}] {method:16s} worker {med['worker']:7.3f} s  plain HF {med['hf']:7.3f} s  "
              f"worker/HF {med['worker'] / med['hf']:.2f}x (95 % CI {low:.2f}-{high:.2f}; pairs "
              f"{pairs[0]:.2f}-{pairs[-1]:.2f}; {repeats} repeats)")  # fmt: skip
        for stage, seconds in stages.items():
            if stage in ("backward", "optimizer") and method == "compute_log_prob":
                continue
            print(
                f"[worker {task}]     {stage:26s} {seconds:7.3f} s  {seconds / med['worker']:6.1%}"
            )
    return report


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
    parser.add_argument("--worker", action="append", choices=list(WORKER_SHAPES), default=[],
                        help="(CPU) only the worker path vs plain HF on this embedded task's shape; repeatable")  # fmt: skip
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = (
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    if args._child:
        child_main(args, args._child, device)
        return
    if args.worker:
        reports = {task: bench_worker(task, args.repeats) for task in args.worker}
        print("\n=== summary (ratios from one run) ===")
        for task, report in reports.items():
            for method, r in report.items():
                print(
                    f"{task} {method}: worker/plain HF {r['ratio']:.2f}x (95 % CI {r['ci'][0]:.2f}-{r['ci'][1]:.2f})"
                )
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
