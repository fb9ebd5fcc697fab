"""Rollout layouts through Ray: draft replicas x guidance services, as throughput ratios measured
in one run (2-core CPU: times are noisy, and replicas share the two cores).

Each layout is a `RolloutGroup` (the trainer's rollout): 1 draft replica with 1 guidance service,
2 + 2, and 2 drafts sharing 1 guidance service; plus draft-only (guidance off for the call) on 1
and 2 replicas. The same prompts and lengths (`ignore_eos`, λ = 0.5) go through each; reported:
emitted tokens per second (median of --repeats, after one warm-up call) and the ratio to the 1 + 1
layout. On 2 cores no layout can be faster than one replica: the point of more replicas is more
GPUs, and this measures what the split itself costs.

Usage:
    python benchmarks/bench_rollout_layouts.py
    python benchmarks/bench_rollout_layouts.py --prompts 16 --response 32 --repeats 2
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray
import torch

from verl.protocol import DataProto
from verl.tasks.tiny_lm import TinyLMSpec, save_tiny_lm
from verl.workers.rollout.config import RolloutConfig
from verl.workers.rollout.worker import RolloutGroup

LAYOUTS = ((1, 1), (2, 2), (2, 1))
"""(draft replicas, guidance services) of the guided layouts."""


def config(guidance: str, args: argparse.Namespace, services: int) -> RolloutConfig:
    cfg = RolloutConfig(n=4, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.03, seed=0,
                        prompt_length=args.prompt_len + 2, response_length=args.response)  # fmt: skip
    g = dataclasses.replace(cfg.offpolicy_guidance, enable=True, model_path=guidance, dtype="float32",
                            gpu_memory_utilization=0.03, lam=0.5, num_replicas=services)  # fmt: skip
    return dataclasses.replace(cfg, offpolicy_guidance=g)


def batch(vocab: int, args: argparse.Namespace, guided: bool) -> DataProto:
    ids = torch.randint(
        4, vocab, (args.prompts, args.prompt_len), generator=torch.Generator().manual_seed(0)
    )
    meta = {"ignore_eos": True, "lam": 0.5, "n": 4, "guidance": guided, "global_step": 0}
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, meta_info=meta
    )


def tokens_per_s(group: RolloutGroup, data: DataProto, repeats: int) -> float:
    group.generate_sequences(data)  # warm-up
    times, emitted = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        out = group.generate_sequences(data)
        times.append(time.perf_counter() - start)
        emitted = int(out.batch["response_mask"].sum())
    return emitted / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    root = tempfile.mkdtemp()
    spec = dict(vocab_size=100, num_hidden_layers=2)
    draft = save_tiny_lm(f"{root}/draft", TinyLMSpec(hidden_size=128, seed=1, **spec))
    guide = save_tiny_lm(f"{root}/guidance", TinyLMSpec(hidden_size=256, seed=2, **spec))
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for drafts, services in (*LAYOUTS, (1, 0), (2, 0)):
            group = RolloutGroup(drafts, draft, config(guide, args, max(services, 1)))
            try:
                rate = tokens_per_s(group, batch(100, args, services > 0), args.repeats)
            finally:
                group.shutdown()
            rows.append((drafts, services, rate))
            print(f"{drafts} draft + {services} guidance: {rate:.0f} tokens/s", flush=True)
    finally:
        ray.shutdown()
    base = {
        guided: next(r for d, s, r in rows if d == 1 and (s > 0) == guided)
        for guided in (True, False)
    }
    print("\n| draft replicas | guidance services | emitted tokens/s | vs 1 replica |")
    print("| --- | --- | --- | --- |")
    for drafts, services, rate in rows:
        print(f"| {drafts} | {services or 'off'} | {rate:.0f} | {rate / base[services > 0]:.2f}x |")


if __name__ == "__main__":
    main()
