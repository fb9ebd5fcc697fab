"""LoRA against full fine-tuning in the trainer's `FSDPWorker` (one in-process rank: its module
unwrapped on CPU, FSDP2 with mixed precision on a GPU): what each trains and holds, what one
weight sync moves, and the time of a log-prob pass, an update and a sync, as ratios LoRA / full
measured in one run (alternated repeats, medians).

Models: the embedded draft (`.cache/embedded/draft`, built by `make demo`) and the real SmolLM2
draft (`.cache/real/draft`, `python -m verl.tasks.real_model`). LoRA: rank 32, alpha 64, every
Linear but the LM head (configs/lora.yaml); the batch: 64 responses of up to 32 tokens after
prompts of up to 16 (synthetic tokens; the cost does not depend on their values).

    python benchmarks/bench_lora.py [--model embedded|real ...] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from verl.protocol import DataProto  # noqa: E402
from verl.tasks.synthetic import synthetic_rl_batch  # noqa: E402
from verl.utils.fsdp_utils import free_port  # noqa: E402
from verl.workers.config import WorkerConfig  # noqa: E402
from verl.workers.fsdp_workers import FSDPWorker  # noqa: E402

MODELS = {
    "embedded": ROOT / ".cache" / "embedded" / "draft",
    "real": ROOT / ".cache" / "real" / "draft",
}
BATCH, PROMPT, RESPONSE = 64, 16, 32


def make_worker(path: Path, rank: int, port: int) -> FSDPWorker:
    cfg = WorkerConfig()
    actor = cfg.actor
    actor.model.model_path = str(path)
    actor.model.enable_gradient_checkpointing = False
    actor.model.lora.rank, actor.model.lora.alpha = rank, 2 * rank
    actor.global_batch_size, actor.micro_batch_size_per_device_for_update = BATCH, 16
    actor.micro_batch_size_per_device_for_experience = 32
    actor.optim.lr, actor.optim.training_steps = 1e-5, 100
    worker = FSDPWorker(cfg, "actor", 0, 1)
    worker.init_distributed("127.0.0.1", port)
    worker.init_model()
    return worker


def step_data(worker: FSDPWorker, vocab: int) -> DataProto:
    data = synthetic_rl_batch(BATCH, PROMPT, RESPONSE, vocab_size=vocab, seed=0, group_size=8)
    old = worker.compute_log_prob(data).batch["old_log_probs"]
    adv = torch.randn(BATCH, 1, generator=torch.Generator().manual_seed(0))
    return DataProto.from_dict({**dict(data.batch.items()), "old_log_probs": old,
                                "advantages": adv.expand(-1, RESPONSE) * data.batch["response_mask"]})  # fmt: skip


def state_bytes(worker: FSDPWorker) -> dict[str, int]:
    """Bytes of the trained parameters, their gradients' size and AdamW's state (after a step)."""
    params = [p for p in worker.module.parameters() if p.requires_grad]
    trained = sum(p.numel() * p.element_size() for p in params)
    adam = sum(t.numel() * t.element_size() for s in worker.optimizer.state.values()
               for t in s.values() if torch.is_tensor(t) and t.dim() > 0)  # fmt: skip
    total = sum(p.numel() * p.element_size() for p in worker.module.parameters())
    return {"weights": total, "trained": trained, "grads": trained, "adam": adam}


def sync_once(worker: FSDPWorker, plan: list[list[str]]) -> int:
    """Every bucket of a weight sync made once; returns the bytes they hold."""
    moved = 0
    for bucket in plan:
        for array, _ in worker.weight_bucket(bucket).values():
            moved += array.nbytes
    return moved


def bench(name: str, path: Path, repeats: int) -> dict:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    port = free_port()
    workers = {"full": make_worker(path, 0, port), "lora": make_worker(path, 32, port)}
    data = {k: step_data(w, vocab) for k, w in workers.items()}
    plans = {k: w.weight_bucket_plan(64) for k, w in workers.items()}
    calls = {
        "compute_log_prob": lambda k: workers[k].compute_log_prob(data[k]),
        "update_actor": lambda k: workers[k].update_actor(data[k]),
        "weight_sync": lambda k: sync_once(workers[k], plans[k]),
    }
    times = {(c, k): [] for c in calls for k in workers}
    for call in calls.values():  # warm-up
        for k in workers:
            call(k)
    for _ in range(repeats):
        for c, call in calls.items():
            for k in workers:
                start = time.perf_counter()
                call(k)
                times[(c, k)].append(time.perf_counter() - start)
    report = {"model": name, "repeats": repeats}
    for k, w in workers.items():
        report[k] = {**state_bytes(w), "sync_bytes": sync_once(w, plans[k]),
                     **{c: statistics.median(times[(c, k)]) for c in calls}}  # fmt: skip
    for c in (*calls, "trained", "adam", "sync_bytes"):
        report[f"{c}_ratio"] = report["lora"][c] / report["full"][c]
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    for k in workers:
        r = report[k]
        print(f"[{name}] {k:4s}: weights {mib(r['weights'])}, trained {mib(r['trained'])}, AdamW state "
              f"{mib(r['adam'])}, sync {mib(r['sync_bytes'])}; log-prob {r['compute_log_prob']:.3f} s, "
              f"update {r['update_actor']:.3f} s, sync {r['weight_sync']:.3f} s")  # fmt: skip
    print(f"[{name}] LoRA / full: trained {report['trained_ratio']:.4f}x, AdamW {report['adam_ratio']:.4f}x, "
          f"sync bytes {report['sync_bytes_ratio']:.2f}x; log-prob {report['compute_log_prob_ratio']:.2f}x, "
          f"update {report['update_actor_ratio']:.2f}x, sync {report['weight_sync_ratio']:.2f}x")  # fmt: skip
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=tuple(MODELS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "lora_bench.json"
    )
    args = parser.parse_args(argv)
    names = args.model or list(MODELS)
    missing = [n for n in names if not (MODELS[n] / "config.json").is_file()]
    if missing:
        print(f"bench_lora: {MODELS[missing[0]]} is not built; `make demo` builds the embedded "
              "draft, `python -m verl.tasks.real_model` the real one", file=sys.stderr)  # fmt: skip
        return 2
    torch.manual_seed(0)
    reports = [bench(n, MODELS[n], args.repeats) for n in names]
    args.out.write_text(json.dumps(reports, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
