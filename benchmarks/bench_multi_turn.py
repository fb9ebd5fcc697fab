"""Multi-turn rollout cost on the embedded tool task (`toolchain`), as ratios measured in one run.

The task's tiny pair (the supervised student, ~15 % of whole episodes right, and the guidance,
~95 %; built once under .cache/embedded/toolchain by `python -m verl.tasks.embedded --task
toolchain`) samples `--prompts` training prompts x `--n` episodes with the `lookup` tool (the
embedded format, at most 4 turns, 51 response tokens, tool tokens included), the recipe of
examples/toolchain_guided.yaml. Four rollouts, timed in alternating turns (medians of --repeats):

1. multi-turn, draft only: a turn is one request per active episode whose prompt is the whole
   episode so far; vLLM's prefix cache serves the part an earlier turn computed;
2. single-turn, draft only, the same prompts, every response exactly L policy tokens
   (`ignore_eos`), L = the mean policy tokens of an episode of (1) in a warm-up call;
3. multi-turn with speculative guidance (λ = 0.5, the defaults' K and target): every turn guided,
   each episode keeping its sessions on both engines across turns;
4. single-turn with the same guidance and the same L.

Reported: seconds per policy token of (1) over (2) (what the turn loop costs beyond its
tokens), the guided / draft-only ratio in multi-turn and in single-turn (per policy token, since
guided episodes end elsewhere), and, from the engines' own counts: per turn of (1) the tokens of
the request's prompt and those vLLM computed (prompt minus `num_cached_tokens`), and in (3) and
(4) the guidance tokens computed per emitted policy token. Guided, the guidance engine runs in its
own process and this one keeps the draft with its share of the cores, as in
bench_guided_rollout.py; draft-only is timed with torch's default threads.

Usage:
    python benchmarks/bench_multi_turn.py                  # 32 prompts x 4 episodes, 7 repeats
    python benchmarks/bench_multi_turn.py --prompts 16 --repeats 3
    python benchmarks/bench_multi_turn.py --kv-block-size 32  # prefix-cache hits on short turns
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402
from bench_guided_rollout import DEFAULT_THREADS, bootstrap_ratio  # noqa: E402

from verl.protocol import DataProto  # noqa: E402
from verl.tasks import embedded_tools as T  # noqa: E402
from verl.tasks.embedded import build_embedded  # noqa: E402
from verl.workers.rollout.config import RolloutConfig  # noqa: E402
from verl.workers.rollout.engine_lifecycle import split_cpu_threads  # noqa: E402
from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout  # noqa: E402

LAM = 0.5
VARIANTS = ("multi_draft", "single_draft", "multi_guided", "single_guided")


def rollout_config(
    n: int, response_length: int, multi_turn: bool, guidance: str | None, block: int | None = None
) -> RolloutConfig:
    """The toolchain recipe's rollout (examples/toolchain_guided.yaml) on the tiny engines."""
    cfg = RolloutConfig(n=n, temperature=1.0, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.03,
                        prompt_length=T.TOOLCHAIN_PROMPT_LENGTH, response_length=response_length, seed=0)  # fmt: skip
    cfg.kv_block_size = block
    mt = cfg.multi_turn
    mt.enable, mt.tools, mt.tool_call_format = (
        multi_turn,
        list(T.TOOLCHAIN_TOOLS),
        T.TOOLCHAIN_FORMAT,
    )
    mt.max_turns, mt.max_tool_response_length, mt.chat_template = T.TOOLCHAIN_MAX_TURNS, 8, False
    g = cfg.offpolicy_guidance
    g.enable, g.model_path, g.dtype, g.gpu_memory_utilization, g.lam = (
        bool(guidance),
        guidance,
        "float32",
        0.03,
        LAM,
    )
    return cfg


def prompt_batch(tok, count: int, single_turn: bool) -> DataProto:
    """The first `count` training prompts (`k07>3=`), left-padded; single-turn ignores EOS."""
    texts = [row["prompt"] for row in T.toolchain_split("train")[:count]]
    ids = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, ids))
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    return DataProto.from_dict({"input_ids": input_ids, "attention_mask": mask},
                               meta_info={"ignore_eos": single_turn, "lam": LAM})  # fmt: skip


class PrefillCounter:
    """Per draft-engine `generate` call (a turn of the multi-turn loop): every request's prompt
    tokens and those the engine computed (prompt minus vLLM's `num_cached_tokens`). A wrapper on
    the engine object; the engine itself is unchanged."""

    def __init__(self, engine) -> None:
        self.calls: list[list[tuple[int, int]]] = []
        self._generate = engine.generate
        engine.generate = self

    def __call__(self, requests, *args, **kwargs):
        outputs = self._generate(requests, *args, **kwargs)
        self.calls.append([(len(o.prompt_token_ids), len(o.prompt_token_ids) - (o.num_cached_tokens or 0))
                           for o in outputs])  # fmt: skip
        return outputs


def timed(engine: VLLMRollout, batch: DataProto) -> tuple[float, DataProto]:
    if engine.engines.guidance is None:
        torch._C.set_num_threads(DEFAULT_THREADS)
    else:
        split_cpu_threads()
    start = time.perf_counter()
    out = engine.generate_sequences(batch)
    return time.perf_counter() - start, out


def policy_tokens(out: DataProto) -> int:
    return int(out.batch["response_mask"].sum())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=32, help="training prompts per call")
    parser.add_argument("--n", type=int, default=4, help="episodes per prompt")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--kv-block-size", type=int, default=None,
                        help="rollout.kv_block_size (default: the engine's; vLLM's CPU build uses 128)")  # fmt: skip
    args = parser.parse_args()
    from transformers import AutoTokenizer

    models = build_embedded(task="toolchain")
    draft, guide = str(models["draft"]), str(models["guidance"])
    tok = AutoTokenizer.from_pretrained(draft)
    multi_batch, single_batch = (
        prompt_batch(tok, args.prompts, False),
        prompt_batch(tok, args.prompts, True),
    )
    budget = T.TOOLCHAIN_RESPONSE_LENGTH
    engines = {"multi_draft": VLLMRollout(draft, rollout_config(args.n, budget, True, None, args.kv_block_size), tok.eos_token_id, tok.pad_token_id)}  # fmt: skip
    counter = PrefillCounter(engines["multi_draft"].engines.draft)
    _, warm = timed(engines["multi_draft"], multi_batch)
    length = round(policy_tokens(warm) / len(warm))
    print(f"multi-turn draft-only warm-up: {policy_tokens(warm) / len(warm):.1f} policy tokens per episode; "
          f"single-turn responses of L = {length}")  # fmt: skip
    engines["single_draft"] = VLLMRollout(draft, rollout_config(args.n, length, False, None, args.kv_block_size), tok.eos_token_id, tok.pad_token_id)  # fmt: skip
    engines["multi_guided"] = VLLMRollout(draft, rollout_config(args.n, budget, True, guide, args.kv_block_size), tok.eos_token_id, tok.pad_token_id)  # fmt: skip
    engines["single_guided"] = VLLMRollout(draft, rollout_config(args.n, length, False, guide, args.kv_block_size), tok.eos_token_id, tok.pad_token_id)  # fmt: skip
    batches = {name: multi_batch if name.startswith("multi") else single_batch for name in VARIANTS}
    for name in VARIANTS[1:]:  # warm-up
        timed(engines[name], batches[name])
    seconds, tokens, per_emitted = defaultdict(list), defaultdict(list), defaultdict(list)
    turns, episodes = defaultdict(lambda: [0, 0, 0]), []
    try:
        for repeat in range(args.repeats):
            counter.calls.clear()
            for name in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
                s, out = timed(engines[name], batches[name])
                seconds[name].append(s)
                tokens[name].append(policy_tokens(out))
                if "guidance_tokens_per_emitted" in out.meta_info:
                    per_emitted[name].append(out.meta_info["guidance_tokens_per_emitted"])
                if name == "multi_draft":
                    episodes.append(out.batch["multiturn_num_turns"].float().mean().item())
            for turn, call in enumerate(counter.calls, start=1):
                turns[turn][0] += len(call)
                turns[turn][1] += sum(p for p, _ in call)
                turns[turn][2] += sum(c for _, c in call)
    finally:
        for engine in engines.values():
            engine.shutdown()
    report(args, seconds, tokens, per_emitted, turns, episodes, length)


def report(args, seconds, tokens, per_emitted, turns, episodes, length) -> None:
    """Print the per-variant figures and the ratios."""
    per_token = {n: [s / t for s, t in zip(seconds[n], tokens[n], strict=True)] for n in VARIANTS}
    print(f"\n=== {args.prompts} prompts x {args.n} episodes, {args.repeats} repeats (medians) ===")
    for name in VARIANTS:
        extra = f", {statistics.median(per_emitted[name]):.2f} guidance tokens computed per emitted" if per_emitted[name] else ""  # fmt: skip
        print(f"{name:14s} {statistics.median(seconds[name]):7.2f} s  {statistics.median(tokens[name]):6.0f} policy tokens  "
              f"{1e3 * statistics.median(per_token[name]):6.2f} ms/policy token{extra}")  # fmt: skip
    print(f"multi-turn draft-only: {statistics.median(episodes):.2f} turns per episode")
    print(
        "per turn of multi-turn draft-only (all repeats): requests, prompt tokens / computed tokens per request"
    )
    for turn, (count, prompt, computed) in sorted(turns.items()):
        print(f"  turn {turn}: {count // args.repeats:4d} requests per call, {prompt / count:5.1f} prompt tokens, {computed / count:5.1f} computed")  # fmt: skip
    print("\n=== ratios (seconds per policy token; 95 % paired-bootstrap interval) ===")
    for label, a, b in (("multi-turn / single-turn, draft only", "multi_draft", "single_draft"),
                        ("guided / draft-only, multi-turn", "multi_guided", "multi_draft"),
                        ("guided / draft-only, single-turn", "single_guided", "single_draft"),
                        ("multi-turn / single-turn, guided", "multi_guided", "single_guided")):  # fmt: skip
        ratio = statistics.median(per_token[a]) / statistics.median(per_token[b])
        low, high, _ = bootstrap_ratio(per_token[a], per_token[b])
        print(f"{label}: {ratio:.2f}x ({low:.2f}x-{high:.2f}x)")
    print(f"(single-turn responses: L = {length} policy tokens each)")


if __name__ == "__main__":
    main()
