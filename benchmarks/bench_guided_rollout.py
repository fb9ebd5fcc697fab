"""Guided rollout cost vs draft-only, as ratios measured in one run (2-core CPU: times are noisy).

The same prompts and response lengths (`ignore_eos`) are generated draft-only and with
speculative guidance (λ = 0.5) by a tiny pair: the guidance is twice the draft's width.
Reported: wall-time ratio guided / draft-only (goal <= 2.0) and guidance tokens computed per
emitted token, counted by the guidance engine's scheduler (every token it ran; goal <= 2).

Guided, the guidance engine runs in its own process and this process keeps the draft with its
share of the cores (`split_cpu_threads`: 1 of 2 here); draft-only is timed with torch's default
threads, as it runs in a process of its own. Both are timed in turns, medians of --repeats.

With --teacher on it also times the teacher-only rollout of on-policy distillation (λ = 0: the
guidance only scores the draft's tokens) both ways: `overlap` (speculative rounds, the scoring
beside the drafting) and `prefill` (draft-only generation, then one guidance prefill of every
whole sequence, what other distillation recipes do), same prompts and lengths.

Usage:
    python benchmarks/bench_guided_rollout.py
    python benchmarks/bench_guided_rollout.py --prompts 32 --response 32 --repeats 2
    python benchmarks/bench_guided_rollout.py --k 4 --bonus on,off   # with and without bonus tokens
    python benchmarks/bench_guided_rollout.py --k 4 --teacher on     # + teacher-only, both ways
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import numpy as np
import torch

from verl.protocol import DataProto
from verl.utils.tiny_lm import TinyLMSpec, save_tiny_lm
from verl.workers.rollout.config import OffPolicyGuidanceConfig, RolloutConfig
from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout, split_cpu_threads

DEFAULT_THREADS = torch.get_num_threads()  # before any engine changes it
EAGER_TAGS = {"on": "", "off": " compiled", "guidance": " compiled-guidance"}  # --eager values


def rollout(
    draft: str, guidance: str | None, args: argparse.Namespace, k: int, tok, eager: str = "on"
) -> VLLMRollout:
    cfg = RolloutConfig(n=1, dtype=args.dtype, enforce_eager=eager != "off", gpu_memory_utilization=0.03, seed=0,
                        prompt_length=args.prompt_len + 2, response_length=args.response)  # fmt: skip
    g = cfg.offpolicy_guidance
    g.enable, g.model_path, g.dtype, g.gpu_memory_utilization = (
        bool(guidance),
        guidance,
        args.dtype,
        0.03,
    )
    g.logprobs, g.num_speculative_tokens, g.lam = args.logprobs, k, 0.5
    g.enforce_eager = eager == "on"  # "guidance": an eager draft beside a compiled guidance
    return VLLMRollout(draft, cfg, tok.eos_token_id, tok.pad_token_id)


def prompts(tok, count: int, length: int, lam: float = 0.5) -> DataProto:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, len(tok), (count, length), generator=gen)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                               meta_info={"ignore_eos": True, "lam": lam})  # fmt: skip


def timed(
    engine: VLLMRollout,
    batch: DataProto,
    groups: int = 1,
    bonus: bool = True,
    scoring: str = "overlap",
) -> tuple[float, DataProto]:
    if engine.engines.guidance is None:  # the threads each setting has in a process of its own
        torch._C.set_num_threads(DEFAULT_THREADS)
    else:
        split_cpu_threads()
        engine.config.offpolicy_guidance.pipeline_groups = groups
        engine.config.offpolicy_guidance.bonus_token = bonus
        engine.config.offpolicy_guidance.teacher_scoring = scoring
    start = time.perf_counter()
    out = engine.generate_sequences(batch)
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--k", default="4,6", help="num_speculative_tokens values, comma-separated")
    parser.add_argument("--logprobs", type=int, default=20, help="top-K log-probs per position")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtype", default="float32", help="both engines' dtype (e.g. bfloat16)")
    parser.add_argument("--groups", default=str(OffPolicyGuidanceConfig.pipeline_groups),
                        help="offpolicy_guidance.pipeline_groups values, comma-separated")  # fmt: skip
    parser.add_argument(
        "--bonus", default="on", help="offpolicy_guidance.bonus_token: on, off or on,off"
    )
    parser.add_argument(
        "--teacher",
        default="off",
        help="on: also time the teacher-only rollout (λ = 0), overlap and prefill",
    )
    parser.add_argument(
        "--eager",
        default="on",
        help="enforce_eager: on (both engines), off (both compiled: torch.compile, cached after "
        "the first build), guidance (an eager draft, a compiled guidance), or a comma-separated "
        "list; each setting is compared with draft-only on its own draft engine",
    )
    args = parser.parse_args()
    bad = [e for e in args.eager.split(",") if e not in EAGER_TAGS]
    if bad:
        parser.error(f"--eager {bad[0]!r}: valid values are {', '.join(EAGER_TAGS)}")
    with tempfile.TemporaryDirectory(prefix="bench_guided_") as root:  # the tiny pair's files
        measure(args, root)


def bootstrap_ratio(
    guided: list[float], draft: list[float], goal: float = 2.0, resamples: int = 10_000
) -> tuple[float, float, float]:
    """Paired bootstrap of the ratio of medians: repeats are drawn with replacement (a draft-only
    time and the guided time of the same repeat stay together). Returns the 2.5 and 97.5
    percentiles of median(guided) / median(draft-only) over the resamples, and the share of
    resamples at or under `goal`."""
    g, d = np.asarray(guided), np.asarray(draft)
    picks = np.random.default_rng(0).integers(0, len(g), size=(resamples, len(g)))
    ratios = np.median(g[picks], axis=1) / np.median(d[picks], axis=1)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high), float((ratios <= goal).mean())


def measure(args: argparse.Namespace, root: str) -> None:
    """Time every setting in turns and print the figures and the summary."""
    from transformers import AutoTokenizer

    draft = save_tiny_lm(
        f"{root}/draft", TinyLMSpec(hidden_size=128, num_hidden_layers=2, vocab_size=100, seed=1)
    )
    guide = save_tiny_lm(
        f"{root}/guidance", TinyLMSpec(hidden_size=256, num_hidden_layers=2, vocab_size=100, seed=2)
    )
    tok = AutoTokenizer.from_pretrained(draft)
    batch = prompts(tok, args.prompts, args.prompt_len)
    teacher_batch = prompts(tok, args.prompts, args.prompt_len, lam=0.0)
    ks, groups = [int(k) for k in args.k.split(",")], [int(g) for g in args.groups.split(",")]
    bonus = [b == "on" for b in args.bonus.split(",")]
    runs, baselines = (
        {},
        {},
    )  # name -> (engine, groups, bonus, scoring); guided name -> its draft-only
    for eager in args.eager.split(","):
        tag = EAGER_TAGS[eager]
        base = "draft-only" + ("" if eager == "guidance" else tag)  # the same draft engine
        if base not in runs:
            runs[base] = (rollout(draft, None, args, 1, tok, eager), 1, False, "")
        for k in ks:  # one engine pair per k; groups and bonus are read at every call
            engine = rollout(draft, guide, args, k, tok, eager)
            for g, b in ((g, b) for g in groups for b in bonus):
                name = f"guided k={k} g={g}" + ("" if b else " no-bonus") + tag
                runs[name], baselines[name] = (engine, g, b, ""), base
            if args.teacher == "on":  # λ = 0: the guidance only scores, both ways
                for scoring in ("overlap", "prefill"):
                    name = f"teacher {scoring} k={k}" + tag
                    runs[name], baselines[name] = (engine, groups[0], bonus[0], scoring), base
    times: dict[str, list[float]] = {name: [] for name in runs}
    meta = {}

    def call(engine, g, b, scoring):
        return timed(engine, teacher_batch if scoring else batch, g, b, scoring or "overlap")

    for _ in range(2):  # warm-up: torch.compile'd helpers specialise on the first shapes they see
        for setting in runs.values():
            call(*setting)
    for _ in range(args.repeats):
        for name, setting in runs.items():
            seconds, out = call(*setting)
            times[name].append(seconds)
            meta[name] = out.meta_info
            assert int(out.batch["response_mask"].sum()) == args.prompts * args.response
    print(f"torch {torch.__version__}, {args.prompts} prompts x {args.prompt_len} tokens, {args.response} new tokens, "
          f"top-{args.logprobs} log-probs, {args.dtype}, λ=0.5, {os.cpu_count()} cores; g = pipeline_groups")  # fmt: skip
    for name, t in times.items():
        m = meta[name]
        extra = ""
        if "guidance_tokens_per_emitted" in m:
            extra = (f"  guidance tokens/emitted {m['guidance_tokens_per_emitted']:.2f}  accept {m['accept_rate']:.2f}  "
                     f"rounds {m['rounds']}  bonus tokens {m['bonus_tokens']}")  # fmt: skip
        print(
            f"{name:22s} median {statistics.median(t):7.2f} s  ({', '.join(f'{x:.2f}' for x in t)}){extra}"
        )
    print("\n=== summary (ratios from one run) ===")
    for name, base in baselines.items():
        ratio = statistics.median(times[name]) / statistics.median(times[base])
        # each repeat runs draft-only and then this setting: their ratio shows the machine's noise
        pairs = [g / d for g, d in zip(times[name], times[base], strict=True)]
        low, mid, high = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else pairs * 3
        # the fastest repeat of each: the least disturbed by the machine's other load
        best = min(times[name]) / min(times[base])
        ci_low, ci_high, share = bootstrap_ratio(times[name], times[base])
        per_emitted = meta[name]["guidance_tokens_computed"] / meta[name]["emitted_tokens"]
        print(
            f"{name}: wall time {ratio:.2f}x {base} (goal <= 2.0; 95 % bootstrap interval "
            f"{ci_low:.2f}-{ci_high:.2f}, <= 2.0 in {share:.0%} of resamples; per-repeat ratios: "
            f"median {mid:.2f}, quartiles {low:.2f}-{high:.2f}; fastest repeats {best:.2f}x); "
            f"{per_emitted:.2f} guidance tokens computed per emitted token (goal <= 2)"
        )
    for name in [n for n in times if n.startswith("teacher overlap")]:
        other = name.replace("overlap", "prefill")
        ratio = statistics.median(times[name]) / statistics.median(times[other])
        ci_low, ci_high, share = bootstrap_ratio(times[name], times[other], goal=1.0)
        print(f"{name} / {other}: wall time {ratio:.2f}x (95 % bootstrap interval {ci_low:.2f}-{ci_high:.2f}; "
              f"overlap faster in {share:.0%} of resamples)")  # fmt: skip


if __name__ == "__main__":
    main()
