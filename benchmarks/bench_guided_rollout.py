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

With --real the pair is the real one (`verl.tasks.real_model.build_pair()`: SmolLM2-135M-Instruct
as the guidance, the same model without 4 middle layers as the draft, a 49,152-token vocabulary,
float32), the prompts are chat-template questions (`REAL_QUESTIONS`), and the defaults shrink to
16 prompts x 32 new tokens, k = 1, 5 repeats. --logprobs takes a list (`full` = the vocabulary
size): every K gets its own engine pair, timed in the same turns against one draft-only engine.
Draft-only samples as a user would without guidance (1 log-prob per token, the rollout's own
setting), whatever K is; guided, the draft reports K log-probs per position too (the rollout
does). With several K values or --real, a top-K section adds, per K: draft lookups per emitted
token (`draft_lookups`: rejected positions whose top-K set the draft's own top-K did not cover),
the seconds and draft-engine steps inside those lookups (`time_draft_lookups`), `target_tv`,
`topk_tail_mass`, and peak memory (this process's peak RSS during one call above its RSS before
it, from /proc/self/clear_refs; each guidance process's peak RSS over the calls).

After the timed repeats, every guided setting gets the cost model's section (`guided_cost.py`,
docs/design.md "What a guided rollout costs"): its parts timed on the same engines after every
repeat, under the same load, and read as medians (over the whole batch and over one of 2, 4 and
8 groups), the prediction for the sequential schedule and
for the run's groups beside the measured ratio, the floor (the best k, schedule and number of
groups, engine time only) and measured / floor; then where the time went in the draft's process
(`guided_profile.py`: engine steps, rewinds, lookups, requests, waits, verification, the rest).

Usage:
    python benchmarks/bench_guided_rollout.py
    python benchmarks/bench_guided_rollout.py --prompts 32 --response 32 --repeats 2
    python benchmarks/bench_guided_rollout.py --k 4 --bonus on,off   # with and without bonus tokens
    python benchmarks/bench_guided_rollout.py --k 4 --teacher on     # + teacher-only, both ways
    python benchmarks/bench_guided_rollout.py --real --logprobs 20,256,full   # cost vs top-K
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

from benchmarks import guided_cost, guided_profile
from verl.protocol import DataProto
from verl.tasks.real_model import CHAT_PROMPTS
from verl.tasks.tiny_lm import TinyLMSpec, save_tiny_lm
from verl.trainer.core_algos.guidance import TOPK_TARGETS
from verl.workers.rollout.config import OffPolicyGuidanceConfig, RolloutConfig
from verl.workers.rollout.engine_lifecycle import split_cpu_threads
from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout

DEFAULT_THREADS = torch.get_num_threads()  # before any engine changes it
EAGER_TAGS = {"on": "", "off": " compiled", "guidance": " compiled-guidance"}  # --eager values
RUN_PEAK_KB = [0]  # this process's peak RSS over every timed call (warm-ups included), kB
LOOKUP_S = [0.0]  # seconds inside the draft engine's lookups (`time_draft_lookups`), this call
DRAFT_STEPS = {"all": 0, "lookup": 0, "in_lookup": 0, "lookup_steps": 0}  # draft engine, this call
TINY_DEFAULTS = {"prompts": 64, "response": 64, "k": "1,2", "repeats": 15}
REAL_DEFAULTS = {"prompts": 16, "response": 32, "k": "1", "repeats": 5}
REAL_MEMORY_SHARE = 0.01
"""--real: each engine's KV cache, as a share of system memory (16 x 80 tokens need ~60 MB)."""
REAL_QUESTIONS = (
    *CHAT_PROMPTS,
    "Give me a tip for sleeping better.",
    "What does a cat eat?",
    "Describe a sunny morning.",
    "Why is the sky blue?",
    "List two animals that live in the ocean.",
    "What is the opposite of hot?",
    "How many days are in a week?",
    "Write a short greeting for a friend.",
    "What is water made of?",
    "Suggest a name for a small dog.",
)
"""User turns of the --real prompts (chat template, generation prompt), cycled past 16."""


def parse_logprobs(text: str, vocab: int) -> list[int]:
    """`--logprobs` values: comma-separated integers or `full` (the vocabulary size), in order;
    a value above the vocabulary is the vocabulary (as the rollout caps it), duplicates are kept
    once."""
    values: list[int] = []
    for part in text.split(","):
        part = part.strip().lower()
        value = vocab if part == "full" else min(int(part), vocab)
        if value < 1:
            raise ValueError(f"--logprobs {part}: expected a positive integer or full")
        if value not in values:
            values.append(value)
    return values


def logprobs_tag(k: int, vocab: int) -> str:
    """How a top-K value is named in the output: `K=20`, or `K=V` (49152) at the vocabulary."""
    return f"K=V ({vocab})" if k == vocab else f"K={k}"


def peak_rss_reset(pid: int | str = "self") -> bool:
    """Reset a process's peak RSS (VmHWM) to its current RSS; False where Linux refuses."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def rss_kb(pid: int | str = "self") -> dict[str, int]:
    """{"VmRSS": kB, "VmHWM": kB} of a process ({} where /proc cannot tell)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {line.split(":")[0]: int(line.split()[1]) for line in lines
            if line.startswith(("VmRSS:", "VmHWM:"))}  # fmt: skip


def rollout(
    draft: str,
    guidance: str | None,
    args: argparse.Namespace,
    k: int,
    tok,
    eager: str = "on",
    logprobs: int = OffPolicyGuidanceConfig.logprobs,
    prompt_length: int | None = None,
) -> VLLMRollout:
    share = REAL_MEMORY_SHARE if args.real else 0.03
    width = args.prompt_len + 2 if prompt_length is None else prompt_length
    cfg = RolloutConfig(n=1, dtype=args.dtype, enforce_eager=eager != "off", gpu_memory_utilization=share, seed=0,
                        prompt_length=width, response_length=args.response)  # fmt: skip
    g = cfg.offpolicy_guidance
    g.enable, g.model_path, g.dtype, g.gpu_memory_utilization = (
        bool(guidance),
        guidance,
        args.dtype,
        share,
    )
    g.logprobs, g.num_speculative_tokens, g.lam = logprobs, k, 0.5
    g.enforce_eager = eager == "on"  # "guidance": an eager draft beside a compiled guidance
    return VLLMRollout(draft, cfg, tok.eos_token_id, tok.pad_token_id)


def prompts(tok, count: int, length: int, lam: float = 0.5) -> DataProto:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, len(tok), (count, length), generator=gen)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                               meta_info={"ignore_eos": True, "lam": lam})  # fmt: skip


def chat_prompts(tok, count: int, lam: float = 0.5) -> DataProto:
    """`count` chat-template prompts (REAL_QUESTIONS, cycled), left-padded to one width."""
    from verl.tasks.real_model import chat_prompt_ids

    ids = [chat_prompt_ids(tok, REAL_QUESTIONS[i % len(REAL_QUESTIONS)]) for i in range(count)]
    width = max(map(len, ids))
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    return DataProto.from_dict({"input_ids": input_ids, "attention_mask": mask},
                               meta_info={"ignore_eos": True, "lam": lam})  # fmt: skip


def time_draft_lookups() -> None:
    """Count the seconds spent in `SessionEngine.lookup` (the draft engine's rows at guidance
    tokens its own top-K did not list) into LOOKUP_S, and the draft engine's steps (all of them,
    and those taken inside a lookup) into DRAFT_STEPS: wrappers, the methods themselves
    unchanged. A step inside a lookup also advances the other groups' chunks, so the seconds
    are an upper bound of what the lookups cost. Only the draft engine runs in this process."""
    from verl.workers.rollout.vllm_sessions import SessionEngine

    lookup, step = SessionEngine.lookup, SessionEngine.step
    if getattr(lookup, "timed_by_bench", False):
        return

    def timed_lookup(self, requests):
        start = time.perf_counter()
        DRAFT_STEPS["in_lookup"] += 1
        DRAFT_STEPS["lookup"] += bool(requests)
        try:
            return lookup(self, requests)
        finally:
            DRAFT_STEPS["in_lookup"] -= 1
            LOOKUP_S[0] += time.perf_counter() - start

    def counted_step(self):
        DRAFT_STEPS["all"] += 1
        DRAFT_STEPS["lookup_steps"] += DRAFT_STEPS["in_lookup"] > 0
        return step(self)

    timed_lookup.timed_by_bench = True
    SessionEngine.lookup, SessionEngine.step = timed_lookup, counted_step


def timed(
    engine: VLLMRollout,
    batch: DataProto,
    groups: int = 1,
    bonus: bool = True,
    scoring: str = "overlap",
    target: str = OffPolicyGuidanceConfig.topk_target,
) -> tuple[float, DataProto]:
    if engine.engines.guidance is None:  # the threads each setting has in a process of its own
        torch._C.set_num_threads(DEFAULT_THREADS)
    else:
        split_cpu_threads()
        engine.config.offpolicy_guidance.pipeline_groups = groups
        engine.config.offpolicy_guidance.bonus_token = bonus
        engine.config.offpolicy_guidance.teacher_scoring = scoring
        engine.config.offpolicy_guidance.topk_target = target
    before = rss_kb()
    reset = peak_rss_reset()
    LOOKUP_S[0] = 0.0
    guided_profile.reset()
    DRAFT_STEPS.update(all=0, lookup=0, in_lookup=0, lookup_steps=0)
    start = time.perf_counter()
    out = engine.generate_sequences(batch)
    seconds = time.perf_counter() - start
    out.meta_info["draft_lookup_s"] = LOOKUP_S[0]
    out.meta_info["profile"] = guided_profile.snapshot()
    out.meta_info["draft_steps"] = dict(DRAFT_STEPS)
    if reset and before:  # this process's peak during the call, above its RSS before it
        peak = rss_kb()["VmHWM"]
        out.meta_info["parent_peak_rss_growth_kb"] = peak - before["VmRSS"]
        RUN_PEAK_KB[0] = max(RUN_PEAK_KB[0], peak)  # clear_refs reset VmHWM: keep the run's
    return seconds, out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--real", action="store_true",
                        help="the real pair (SmolLM2-135M-Instruct and its 26-layer draft), chat prompts")  # fmt: skip
    parser.add_argument("--prompts", type=int, default=None, help="64 (--real: 16)")
    parser.add_argument(
        "--prompt-len", type=int, default=16, help="tiny pair only (--real: chat prompts)"
    )
    parser.add_argument("--response", type=int, default=None, help="new tokens: 64 (--real: 32)")
    parser.add_argument(
        "--k",
        default=None,
        help="num_speculative_tokens values, comma-separated: 1,2 (--real: 1, the default k)",
    )
    parser.add_argument("--logprobs", default=str(OffPolicyGuidanceConfig.logprobs),
                        help="top-K log-probs per position: comma-separated, `full` = the vocabulary size "
                             "(default: the config's)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=None, help="15 (--real: 5)")
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
        "--target",
        default=OffPolicyGuidanceConfig.topk_target,
        help="offpolicy_guidance.topk_target values, comma-separated: renormalize, draft_tail "
        "(default: the config's)",
    )
    parser.add_argument(
        "--eager",
        default="on",
        help="enforce_eager: on (both engines), off (both compiled: torch.compile, cached after "
        "the first build), guidance (an eager draft, a compiled guidance), or a comma-separated "
        "list; each setting is compared with draft-only on its own draft engine",
    )
    args = parser.parse_args()
    for key, value in (REAL_DEFAULTS if args.real else TINY_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    bad = [e for e in args.eager.split(",") if e not in EAGER_TAGS]
    if bad:
        parser.error(f"--eager {bad[0]!r}: valid values are {', '.join(EAGER_TAGS)}")
    bad = [t for t in args.target.split(",") if t not in TOPK_TARGETS]
    if bad:
        parser.error(f"--target {bad[0]!r}: valid values are {', '.join(TOPK_TARGETS.names())}")
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
    from transformers import AutoConfig, AutoTokenizer

    if args.real:
        from verl.tasks.real_model import build_pair

        pair = build_pair()
        draft, guide = str(pair.draft), str(pair.guidance)
    else:
        draft = save_tiny_lm(
            f"{root}/draft",
            TinyLMSpec(hidden_size=128, num_hidden_layers=2, vocab_size=100, seed=1),
        )
        guide = save_tiny_lm(
            f"{root}/guidance",
            TinyLMSpec(hidden_size=256, num_hidden_layers=2, vocab_size=100, seed=2),
        )
    tok = AutoTokenizer.from_pretrained(draft)
    vocab = AutoConfig.from_pretrained(draft).vocab_size
    try:
        top_ks = parse_logprobs(args.logprobs, vocab)
    except ValueError as error:
        sys.exit(str(error))
    if args.real:
        batch, teacher_batch = (
            chat_prompts(tok, args.prompts),
            chat_prompts(tok, args.prompts, lam=0.0),
        )
        width = batch.batch["input_ids"].shape[1]
    else:
        batch = prompts(tok, args.prompts, args.prompt_len)
        teacher_batch = prompts(tok, args.prompts, args.prompt_len, lam=0.0)
        width = None
    ks, groups = [int(k) for k in args.k.split(",")], [int(g) for g in args.groups.split(",")]
    bonus = [b == "on" for b in args.bonus.split(",")]
    targets = args.target.split(",")
    time_draft_lookups()  # the lookups' seconds: the cost model's t_l
    guided_profile.install()  # where the rest goes
    runs, baselines = (
        {},
        {},
    )  # name -> (engine, groups, bonus, scoring); guided name -> its draft-only
    top_k_of: dict[str, int] = {}  # guided or teacher name -> its top-K
    for eager in args.eager.split(","):
        tag = EAGER_TAGS[eager]
        base = "draft-only" + ("" if eager == "guidance" else tag)  # the same draft engine
        if base not in runs:  # plain sampling (1 log-prob per token), whatever K is
            runs[base] = (
                rollout(draft, None, args, 1, tok, eager, prompt_length=width),
                1,
                False,
                "",
                "renormalize",
            )
        for top_k, k in ((top_k, k) for top_k in top_ks for k in ks):
            # one engine pair per (K, k); groups and bonus are read at every call
            engine = rollout(draft, guide, args, k, tok, eager, top_k, width)
            ktag = f" {logprobs_tag(top_k, vocab)}" if len(top_ks) > 1 else ""
            for g, b, t in ((g, b, t) for g in groups for b in bonus for t in targets):
                ttag = f" {t}" if len(targets) > 1 else ""
                name = f"guided k={k} g={g}" + ("" if b else " no-bonus") + tag + ktag + ttag
                runs[name], baselines[name], top_k_of[name] = (engine, g, b, "", t), base, top_k
            if args.teacher == "on":  # λ = 0: the guidance only scores, both ways
                for scoring in ("overlap", "prefill"):
                    name = f"teacher {scoring} k={k}" + tag + ktag
                    runs[name], baselines[name] = (
                        (engine, groups[0], bonus[0], scoring, targets[0]),
                        base,
                    )
                    top_k_of[name] = top_k
    times: dict[str, list[float]] = {name: [] for name in runs}
    meta = {}
    peaks: dict[str, list[int]] = {name: [] for name in runs}  # this process's peak growth, kB
    lookup_s: dict[str, list[float]] = {name: [] for name in runs}
    profiles: dict[str, list[dict]] = {name: [] for name in runs}
    startup_rss = rss_kb().get("VmRSS", 0)  # every engine built, nothing generated yet
    for engine, *_ in runs.values():  # each guidance process's peak counts from here
        proc = getattr(engine.engines.guidance, "_proc", None)
        if proc is not None:
            peak_rss_reset(proc.pid)

    def call(engine, g, b, scoring, target):
        return timed(
            engine, teacher_batch if scoring else batch, g, b, scoring or "overlap", target
        )

    for _ in range(2):  # warm-up: torch.compile'd helpers specialise on the first shapes they see
        for setting in runs.values():
            call(*setting)
    parts = CostParts(runs, baselines, batch, args.response, vocab)
    for _ in range(args.repeats):
        for name, setting in runs.items():
            seconds, out = call(*setting)
            times[name].append(seconds)
            meta[name] = out.meta_info
            lookup_s[name].append(out.meta_info["draft_lookup_s"])
            profiles[name].append(out.meta_info["profile"])
            if "parent_peak_rss_growth_kb" in out.meta_info:
                peaks[name].append(out.meta_info["parent_peak_rss_growth_kb"])
            assert int(out.batch["response_mask"].sum()) == args.prompts * args.response
        parts.time()  # the cost model's parts, under the same load as this repeat
    if args.real:
        pair_name = (f"real pair (SmolLM2-135M-Instruct and its draft, {Path(draft).parent}; vocabulary {vocab}), "
                     f"{args.prompts} chat prompts of up to {width} tokens")  # fmt: skip
    else:
        pair_name = f"{args.prompts} prompts x {args.prompt_len} tokens"
    print(f"torch {torch.__version__}, {pair_name}, {args.response} new tokens, "
          f"top-{args.logprobs} log-probs, {args.dtype}, λ=0.5, {os.cpu_count()} cores; g = pipeline_groups")  # fmt: skip
    for name, t in times.items():
        m = meta[name]
        extra = ""
        if "guidance_tokens_per_emitted" in m:
            extra = (f"  guidance tokens/emitted {m['guidance_tokens_per_emitted']:.2f}  accept {m['accept_rate']:.2f}  "
                     f"rounds {m['rounds']}  bonus tokens {m['bonus_tokens']}")  # fmt: skip
        print(
            f"{name:{max(22, *map(len, times))}s} median {statistics.median(t):7.2f} s  ({', '.join(f'{x:.2f}' for x in t)}){extra}"
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
    cost_model_section(runs, baselines, times, meta, lookup_s, parts, args)
    guided = [n for n in baselines if n.startswith("guided")]
    print("\n=== where the guided rollout's time goes (this process, the repeat of median wall time; "
          "seconds, share of the wall time, calls) ===")  # fmt: skip
    middle = {
        n: sorted(range(len(times[n])), key=times[n].__getitem__)[len(times[n]) // 2]
        for n in guided
    }
    print(guided_profile.table({n: profiles[n][i] for n, i in middle.items()},
                               {n: times[n][i] for n, i in middle.items()}))  # fmt: skip
    if args.real or len(top_ks) > 1:
        top_k_section(runs, baselines, times, meta, peaks, lookup_s, top_k_of, vocab, startup_rss)
    for name in [n for n in times if n.startswith("teacher overlap")]:
        other = name.replace("overlap", "prefill")
        ratio = statistics.median(times[name]) / statistics.median(times[other])
        ci_low, ci_high, share = bootstrap_ratio(times[name], times[other], goal=1.0)
        print(f"{name} / {other}: wall time {ratio:.2f}x (95 % bootstrap interval {ci_low:.2f}-{ci_high:.2f}; "
              f"overlap faster in {share:.0%} of resamples)")  # fmt: skip


CALL_SIZES = (2, 3, 5, 9)
"""The m (new positions per sequence) of the guidance calls `time_parts` times, besides k + 1."""


def prompt_ids(batch: DataProto) -> list[list[int]]:
    """Each row's prompt tokens, padding left out."""
    return [row[mask.bool()].tolist() for row, mask in
            zip(batch.batch["input_ids"], batch.batch["attention_mask"])]  # fmt: skip


class CostParts:
    """The cost model's parts of every guided setting, timed after each repeat (`time`) and read
    as medians over the repeats (`of`): the draft and the guidance engines with the cores split
    and with every core over the batch, and with the cores split over one of 2, 4 and 8 groups
    (`time_parts`). Timed once per pair of engines alike (K, eager or compiled), since they do not
    depend on k: the settings of different k read the same parts."""

    def __init__(self, runs, baselines, batch: DataProto, length: int, vocab: int) -> None:
        self.ids = prompt_ids(batch)
        self.length, self.vocab = length, vocab
        self.engines = {}  # key -> one engine pair of that kind
        ks = set()
        for name in (n for n in baselines if n.startswith("guided")):
            engine = runs[name][0]
            self.engines.setdefault(self.key(engine), engine)
            ks.add(engine.config.offpolicy_guidance.num_speculative_tokens)
        self.ms = sorted(set(CALL_SIZES) | {k + 1 for k in ks})
        self.timings: dict[tuple, list[tuple]] = {key: [] for key in self.engines}

    @staticmethod
    def key(engine) -> tuple:
        guidance = engine.config.offpolicy_guidance
        return engine.num_logprobs, engine.config.enforce_eager, guidance.enforce_eager

    def time(self) -> None:
        split = int(split_cpu_threads()["OMP_NUM_THREADS"])
        for key, engine in self.engines.items():
            self.timings[key].append(
                time_parts(engine, self.ids, self.length, self.ms, split, self.vocab)
            )

    def of(self, engine) -> tuple[list[guided_cost.Engine], dict]:
        """([draft split, draft full, guidance split, guidance full], {G: (draft, guidance)})."""
        timings = self.timings[self.key(engine)]
        whole = [guided_cost.median_engine([t[i] for t in timings]) for i in range(4)]
        groups = {g: tuple(guided_cost.median_engine([t[4][g][i] for t in timings]) for i in range(2))
                  for g in timings[0][4]}  # fmt: skip
        return whole, groups


def cost_model_section(runs, baselines, times, meta, lookup_s, parts: CostParts, args) -> None:
    """Per guided setting: the measured ratio beside the cost model's prediction (sequential and
    the run's groups) and the floor (`guided_cost`), from its parts timed on the same engines
    after every repeat (`CostParts`), and the earlier model's floor; the lookups' seconds per
    rejection from the timed runs."""
    print("\n=== cost model (guided / draft-only; benchmarks/guided_cost.py, docs/design.md) ===")
    split = int(split_cpu_threads()["OMP_NUM_THREADS"])
    draft_only: dict[str, guided_cost.Engine] = {}
    for name in (n for n in baselines if n.startswith("guided")):
        base = baselines[name]
        engine, g, bonus, _, _ = runs[name]
        k = engine.config.offpolicy_guidance.num_speculative_tokens
        if base not in draft_only:
            draft_only[base] = guided_cost.time_draft(
                runs[base][0], parts.ids, args.response, 1, DEFAULT_THREADS
            )
        engines, groups = parts.of(engine)
        m = meta[name]
        rejections = max(1, m["emitted_tokens"] - m["accepted_tokens"] - m["bonus_tokens"])
        model = guided_cost.Parts(*engines, statistics.median(lookup_s[name]) / rejections,
                                  args.response, groups, len(parts.ids))  # fmt: skip
        per_round = guided_cost.measured_tokens_per_round(m["emitted_tokens"], m["sequence_rounds"])
        alpha = guided_cost.effective_alpha(per_round, k, bonus)  # the measured tokens per round
        measured = statistics.median(times[base])
        ratio = statistics.median(times[name]) / measured
        seq, ovl = (guided_cost.guided_seconds(model, alpha, k, bonus, s, count, slowest=True) / measured
                    for s, count in (("sequential", 1), ("overlapped", g)))  # fmt: skip
        best, best_k, schedule, best_g = guided_cost.floor(model, alpha, bonus, slowest=True)
        mean, mean_k, mean_schedule, mean_g = guided_cost.floor(model, alpha, bonus)
        loose, loose_k, loose_schedule = guided_cost.perfect_overlap_floor(model, alpha, bonus)
        check = guided_cost.draft_only_seconds(draft_only[base], args.response)
        print(f"{name}: measured {ratio:.2f}x; model {seq:.2f}x sequential, {ovl:.2f}x overlapped in {g} groups; "
              f"floor {best / measured:.2f}x (k={best_k}, {schedule}, G={best_g}; rounds until the slowest of "
              f"{len(parts.ids)} sequences ends); measured / floor {ratio * measured / best:.2f}x (the mean rounds "
              f"L / E[N]: floor {mean / measured:.2f}x, k={mean_k}, {mean_schedule}, G={mean_g}, measured / it "
              f"{ratio * measured / mean:.2f}x; the earlier model's perfect overlap: floor "
              f"{loose / measured:.2f}x, k={loose_k}, {loose_schedule}; measured / it {ratio * measured / loose:.2f}x); "
              f"{per_round:.2f} tokens per sequence-round, effective alpha {alpha:.3f} (accepted / proposed "
              f"{m['accept_rate']:.3f}, which would give {guided_cost.tokens_per_round(m['accept_rate'], k, bonus):.2f}); "
              f"draft-only {measured:.2f} s measured, {check:.2f} s model")  # fmt: skip
        d_split, d_full, g_split, g_full = engines
        print(f"  parts (medians of {len(parts.timings[parts.key(engine)])} timings; split {split} / full {DEFAULT_THREADS} "
              f"threads): draft step {d_split.step * 1e3:.2f} / {d_full.step * 1e3:.2f} ms (draft-only "
              f"{draft_only[base].step * 1e3:.2f} ms), prefill {d_split.prefill:.3f} / {d_full.prefill:.3f} s; guidance prefill "
              f"{g_split.prefill:.3f} / {g_full.prefill:.3f} s, call of m positions "
              + ", ".join(f"m={x}: {g_split.verify[x] * 1e3:.1f} / {g_full.verify[x] * 1e3:.1f} ms" for x in sorted(g_split.verify))
              + f"; lookups {model.lookup_per_rejection * 1e3:.2f} ms per rejection")  # fmt: skip
        for count, (d_n, g_n) in sorted(groups.items()):
            print(f"  one of {count} groups ({len(parts.ids) // count} sequences, split): draft step {d_n.step * 1e3:.2f} ms; "
                  f"guidance call of m = k + 1 = {k + 1}: {g_n.verify_s(k + 1) * 1e3:.1f} ms")  # fmt: skip


def time_parts(
    engine, ids: list[list[int]], length: int, ms: list[int], split: int, vocab: int
) -> tuple:
    """The cost model's parts on a rollout's engines: the draft and the guidance with `split`
    threads and with every core over all `ids`, then {G: (draft, guidance)} with `split`
    threads over the first B/G of them, for G = 2, 4, 8 dividing B."""
    whole = [
        guided_cost.time_draft(engine, ids, length, engine.num_logprobs, t)
        for t in (split, DEFAULT_THREADS)
    ]
    whole += [
        guided_cost.time_guidance(engine, ids, length, ms, t, vocab)
        for t in (split, DEFAULT_THREADS)
    ]
    groups = {}
    for count in (g for g in (2, 4, 8) if len(ids) % g == 0):
        part = ids[: len(ids) // count]
        groups[count] = (guided_cost.time_draft(engine, part, length, engine.num_logprobs, split),
                         guided_cost.time_guidance(engine, part, length, ms, split, vocab))  # fmt: skip
    split_cpu_threads()
    return (*whole, groups)


def top_k_section(
    runs, baselines, times, meta, peaks, lookup_s, top_k_of, vocab: int, startup_rss: int
) -> None:
    """Per guided setting: its top-K, the wall-time ratio, guidance tokens, acceptance, draft
    lookups per emitted token, target_tv, tail mass and peak memory (see the module docstring)."""
    print("\n=== cost vs top-K (guided / draft-only; draft-only samples with 1 log-prob) ===")
    mb = 1024.0
    for name, base in baselines.items():
        if not name.startswith("guided"):
            continue
        m = meta[name]
        emitted = max(m["emitted_tokens"], 1)
        steps = m.get("draft_steps", {})
        ratio = statistics.median(times[name]) / statistics.median(times[base])
        proc = getattr(runs[name][0].engines.guidance, "_proc", None)
        guidance_peak = rss_kb(proc.pid).get("VmHWM") if proc is not None else None
        parent = f"{statistics.median(peaks[name]) / mb:.0f} MiB" if peaks[name] else "n/a"
        print(f"{name}: {logprobs_tag(top_k_of[name], vocab)}  ratio {ratio:.2f}x "
              f"(guided {statistics.median(times[name]):.2f} s / draft-only {statistics.median(times[base]):.2f} s)  "
              f"guidance tokens/emitted {m.get('guidance_tokens_per_emitted', float('nan')):.2f}  "
              f"accept {m.get('accept_rate', float('nan')):.3f}  "
              f"draft lookups/emitted {m['draft_lookups'] / emitted:.3f} ({m['draft_lookups']}, "
              f"{statistics.median(lookup_s[name]):.2f} s a call, median; {steps.get('lookup', 0)} lookup calls, "
              f"{steps.get('lookup_steps', 0)} of {steps.get('all', 0)} draft-engine steps inside them)  "
              f"target_tv {m.get('target_tv', float('nan')):.4g}  "
              f"topk_tail_mass {m.get('topk_tail_mass', float('nan')):.4f}  "
              f"peak RSS: this process +{parent} per call (median), guidance process "
              f"{guidance_peak / mb if guidance_peak else float('nan'):.0f} MiB")  # fmt: skip
    for base in sorted({b for n, b in baselines.items() if n.startswith("guided")}):
        if peaks[base]:
            print(f"{base}: peak RSS this process +{statistics.median(peaks[base]) / mb:.0f} MiB per call (median); "
                  f"this process (all draft engines): {startup_rss / mb:.0f} MiB once the engines were built, "
                  f"peak {RUN_PEAK_KB[0] / mb:.0f} MiB over the calls")  # fmt: skip


if __name__ == "__main__":
    main()
