"""Multi-turn rollout cost on the embedded tool task (`toolchain`), as ratios measured in one run.

The task's tiny pair (the supervised student, ~15 % of whole episodes right, and the guidance,
~95 %; built once under .cache/embedded/toolchain by `python -m verl.tasks.embedded --task
toolchain`) samples `--prompts` training prompts x `--n` episodes with the `lookup` tool (the
embedded format, at most 4 turns, 51 response tokens, tool tokens included), the recipe of
examples/toolchain_guided.yaml. Seven rollouts, timed in alternating turns (medians of --repeats):

1. multi-turn, draft only, episodes on their own (`EpisodeStream`): each episode keeps a draft
   session from turn to turn, whose next chunk (the tool delta, then the turn) joins the engine as
   soon as the episode's tool calls returned, while the engine keeps stepping the others; a turn
   computes only what came since the last one;
2. the same episodes turn by turn (meta_info `multi_turn_barrier`): one engine call per turn over
   every active episode, then all their calls (the same tokens for the same seeds);
3. single-turn, draft only, the same prompts, every response exactly L policy tokens
   (`ignore_eos`), L = the mean policy tokens of an episode of (1) in a warm-up call;
4. multi-turn with speculative guidance (λ = 0.5, the defaults' K and target): every turn guided,
   each episode keeping its sessions on both engines across turns;
5. single-turn with the same guidance and the same L;
6. `--stream K` batches a call of (1)'s episodes through one pool, each batch's drained tail
   filled with the next batch's episodes, and a weight sync between batches: the turns on the
   engine interrupted, the same weights reloaded, the turns resumed (partial rollout);
7. the same pool without the syncs (the tail filled only).

Reported: the floor of the cost model (benchmarks/guided_cost.py) per policy token beside the
guided rollouts' measured seconds per policy token (`floor_section`); seconds per policy token of (1) and of (2) over (3) (what the turn loop costs beyond
its tokens), (1) over (2), whether (1) and (2) gave the same episodes, the guided / draft-only
ratio in multi-turn and in single-turn (per policy token, since guided episodes end elsewhere),
(6) and (7) over (1) and over (3), and, from the engines' own counts: the draft's engine steps and
the tokens it computed (vLLM's scheduled tokens) per call of (1), (2), (6) and (7), and in (4) and
(5) the guidance tokens computed per emitted policy token. Guided, the guidance engine runs in its own process and this one keeps
the draft with its share of the cores, as in bench_guided_rollout.py; draft-only is timed with
torch's default threads. `--draft-only` runs (1) to (3) alone (the guidance model is not needed).

Usage:
    python benchmarks/bench_multi_turn.py                  # 32 prompts x 4 episodes, 7 repeats
    python benchmarks/bench_multi_turn.py --prompts 16 --repeats 3
    python benchmarks/bench_multi_turn.py --stream 0       # without (6) and (7)
    python benchmarks/bench_multi_turn.py --draft-only --prompts 16 --repeats 3
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

import guided_cost  # noqa: E402
import torch  # noqa: E402
from bench_guided_rollout import (  # noqa: E402
    CALL_SIZES,
    DEFAULT_THREADS,
    bootstrap_ratio,
    prompt_ids,
    time_parts,
)

from verl.protocol import DataProto  # noqa: E402
from verl.tasks import embedded_tools as T  # noqa: E402
from verl.tasks.embedded import build_embedded, task_dir  # noqa: E402
from verl.workers.rollout.config import RolloutConfig  # noqa: E402
from verl.workers.rollout.engine_lifecycle import split_cpu_threads  # noqa: E402
from verl.workers.rollout.multi_turn_mode import TURN_BARRIER_KEY  # noqa: E402
from verl.workers.rollout.vllm_engine import RequestStream, vocab_size  # noqa: E402
from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout  # noqa: E402
from verl.workers.rollout.vllm_sessions import SessionEngine  # noqa: E402

LAM = 0.5
VARIANTS = ("multi_draft", "multi_barrier", "single_draft", "multi_guided", "single_guided")
"""The rollouts timed; `multi_barrier` runs on `multi_draft`'s engine."""
DRAFT_ONLY = VARIANTS[:3]
STREAMED = ("multi_stream", "multi_pool")
"""`--stream K`: K batches a call through one pool (`StreamedRollout`) on `multi_draft`'s
engine, with a weight sync between batches (partial rollout) and without (the tail filled only)."""


def rollout_config(
    n: int, response_length: int, multi_turn: bool, guidance: str | None
) -> RolloutConfig:
    """The toolchain recipe's rollout (examples/toolchain_guided.yaml) on the tiny engines."""
    cfg = RolloutConfig(n=n, temperature=1.0, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.03,
                        prompt_length=T.TOOLCHAIN_PROMPT_LENGTH, response_length=response_length, seed=0)  # fmt: skip
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


def prompt_batch(tok, count: int, single_turn: bool, barrier: bool = False) -> DataProto:
    """The first `count` training prompts (`k07>3=`), left-padded; single-turn ignores EOS;
    `barrier`: multi-turn turn by turn."""
    texts = [row["prompt"] for row in T.toolchain_split("train")[:count]]
    ids = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, ids))
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    meta = {"ignore_eos": single_turn, "lam": LAM, TURN_BARRIER_KEY: barrier}
    return DataProto.from_dict({"input_ids": input_ids, "attention_mask": mask}, meta_info=meta)


class StepCounter:
    """Engine steps of the loops that step the draft themselves (`RequestStream.step`,
    `SessionEngine.step`), counted while installed (`with`); the engines are unchanged."""

    def __init__(self) -> None:
        self.steps = 0
        self._saved = []

    def __enter__(self) -> StepCounter:
        for cls in (RequestStream, SessionEngine):
            original = cls.step

            def step(engine, _original=original):
                self.steps += 1
                return _original(engine)

            self._saved.append((cls, original))
            cls.step = step
        return self

    def __exit__(self, *exc) -> None:
        for cls, original in self._saved:
            cls.step = original


class StreamedRollout:
    """Multi-turn draft-only episodes in the steady state of a partial rollout: each call runs
    `batches` batches of the call's episodes (its prompts x n, seeded anew per call) through one
    `EpisodeStream` pool, the drained tail of each batch filled with the next batch's episodes,
    and between batches a weight sync (the turns on the engine interrupted, the same weights
    reloaded from `state`, the turns resumed under new seeds; no sync when `state` is None), each
    episode in a draft session as in `multi_draft`. Counts interrupted turns; returns the policy
    tokens' mask."""

    def __init__(self, rollout: VLLMRollout, state: dict | None, batches: int, n: int) -> None:
        self.rollout, self.state, self.batches, self.n = rollout, state, batches, n
        self.engines = rollout.engines
        self.calls = self.interrupted = 0

    def generate_sequences(self, batch: DataProto) -> DataProto:
        from verl.workers.rollout.episode_stream import EpisodeStream
        from verl.workers.rollout.multi_turn.trajectory import POLICY

        rollout = self.rollout
        rollout.wake_up()
        ctx = rollout.call_context(batch.meta_info)
        keep = batch.batch["attention_mask"].bool()
        prompts = [
            ids[k].tolist() for ids, k in zip(batch.batch["input_ids"], keep) for _ in range(self.n)
        ]
        base = 10**6 * (self.calls * self.batches + 1)
        self.calls += 1
        pool = EpisodeStream(
            ctx, ctx.multi_turn, [], [], ctx.max_tokens, sessions=ctx.draft_sessions
        )

        def sync() -> int:
            rollout.sync_weights(self.state)
            return pool.version + 1

        pool.run_batches([(prompts, range(base + 10**6 * b, base + 10**6 * b + len(prompts)))
                          for b in range(self.batches)], sync if self.state else None)  # fmt: skip
        self.interrupted += pool.interrupted
        mask = torch.tensor(
            [[sum(len(s.ids) for s in e.segments if s.kind == POLICY)] for e in pool.episodes]
        )
        return DataProto.from_dict({"response_mask": mask})


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


def model_paths(draft_only: bool) -> tuple[str, str | None]:
    """The task's draft and guidance (built once); with `draft_only` the draft alone, taken as soon
    as it is built (the build saves it before the guidance)."""
    draft = Path(task_dir("toolchain")) / "draft"
    if draft_only and (draft / "embedded.json").is_file():
        return str(draft), None
    models = build_embedded(task="toolchain")
    return str(models["draft"]), None if draft_only else str(models["guidance"])


def turn_steps(out: DataProto) -> tuple[int, int]:
    """From a multi-turn rollout's episodes: the engine steps of a turn-barrier loop (a turn's
    call takes as many steps as its longest turn has tokens: the sum over turns of the longest)
    and of any loop (at least the policy tokens of the longest episode, whose turns follow one
    another)."""
    policy = out.batch["response_mask"].bool()
    turn = out.batch["turn_index"]
    counts = torch.stack(
        [(policy & (turn == k)).sum(-1) for k in range(int(turn.max()) + 1)], dim=-1
    )
    return int(counts.max(0).values.sum()), int(counts.sum(-1).max())


def same_episodes(a: DataProto, b: DataProto) -> tuple[bool, float]:
    """Whether two rollouts hold the same tokens and masks, and their largest log-prob gap."""
    keys = ("responses", "response_mask", "tool_mask", "multiturn_num_turns")
    same = all(torch.equal(a.batch[k], b.batch[k]) for k in keys)
    gap = (a.batch["rollout_log_probs"] - b.batch["rollout_log_probs"]).abs().max().item()
    return same, gap


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=32, help="training prompts per call")
    parser.add_argument("--n", type=int, default=4, help="episodes per prompt")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--draft-only", action="store_true", help="the draft-only rollouts alone")
    parser.add_argument("--stream", type=int, default=4,
                        help="batches per call of the streamed multi-turn rollout (a pool with partial rollout; 0: not run)")  # fmt: skip
    args = parser.parse_args()
    from transformers import AutoTokenizer

    draft, guide = model_paths(args.draft_only)
    tok = AutoTokenizer.from_pretrained(draft)
    variants = (DRAFT_ONLY if args.draft_only else VARIANTS) + (STREAMED if args.stream else ())
    multi, single = prompt_batch(tok, args.prompts, False), prompt_batch(tok, args.prompts, True)
    batches = {name: single if name.startswith("single") else multi for name in VARIANTS}
    batches["multi_barrier"] = prompt_batch(tok, args.prompts, False, barrier=True)
    batches.update(dict.fromkeys(STREAMED, multi))

    def rollout(length: int, multi_turn: bool, guidance: str | None) -> VLLMRollout:
        cfg = rollout_config(args.n, length, multi_turn, guidance)
        return VLLMRollout(draft, cfg, tok.eos_token_id, tok.pad_token_id)

    engines = {"multi_draft": rollout(T.TOOLCHAIN_RESPONSE_LENGTH, True, None)}
    engines["multi_barrier"] = engines["multi_draft"]
    try:
        _, warm = timed(engines["multi_draft"], multi)
        length = round(policy_tokens(warm) / len(warm))
        print(f"multi-turn draft-only warm-up: {policy_tokens(warm) / len(warm):.1f} policy tokens per episode; "
              f"single-turn responses of L = {length}")  # fmt: skip
        engines["single_draft"] = rollout(length, False, None)
        if args.stream:
            from transformers import AutoModelForCausalLM

            state = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).state_dict()
            for name, synced in zip(STREAMED, (state, None), strict=True):
                engines[name] = StreamedRollout(engines["multi_draft"], synced, args.stream, args.n)
        if not args.draft_only:
            engines["multi_guided"] = rollout(T.TOOLCHAIN_RESPONSE_LENGTH, True, guide)
            engines["single_guided"] = rollout(length, False, guide)
        for name in variants[1:]:  # warm-up
            timed(engines[name], batches[name])
        streamed = {name: engines[name] for name in STREAMED if name in engines}
        for pool in streamed.values():
            pool.interrupted = 0
        results = run_repeats(args.repeats, variants, engines, batches)
        parts = (
            None
            if args.draft_only
            else floor_parts(engines["single_guided"], single, args.n, length)
        )
    finally:
        for engine in {id(e): e for e in engines.values() if isinstance(e, VLLMRollout)}.values():
            engine.shutdown()
    report(args, variants, *results, length)
    if parts is not None:
        seconds, tokens, _, (_, _, rounds), *_ = results
        floor_section(
            engines["single_guided"], parts, seconds, tokens, rounds, args.prompts * args.n, length
        )
    for name, pool in streamed.items():
        syncs = args.repeats * max(args.stream - 1, 1)
        print(
            f"{name}: {args.stream} batches a call, {pool.interrupted / syncs:.1f} turns interrupted a sync"
        )


def run_repeats(repeats: int, variants, engines, batches) -> tuple:
    """Time every variant `repeats` times in alternating order: seconds, policy tokens, guidance
    tokens per emitted token, and for the draft-stepping loops the engine steps and the draft
    tokens computed (prompt and decode, vLLM's scheduled tokens) per call; turns per episode,
    and whether the two multi-turn loops agreed (same tokens, largest log-prob gap)."""
    seconds, tokens, per_emitted = defaultdict(list), defaultdict(list), defaultdict(list)
    steps, computed, episodes, outputs = defaultdict(list), defaultdict(list), [], {}
    rounds = defaultdict(lambda: [0, 0])  # guided: emitted tokens, sequence-rounds (all repeats)
    for repeat in range(repeats):
        for name in variants if repeat % 2 == 0 else variants[::-1]:
            sessions = getattr(engines[name], "rollout", engines[name]).draft_sessions
            before = sessions.tokens_computed if sessions is not None else 0
            with StepCounter() as counter:
                s, out = timed(engines[name], batches[name])
            seconds[name].append(s)
            tokens[name].append(policy_tokens(out))
            if sessions is not None:
                steps[name].append(counter.steps)
                computed[name].append(sessions.tokens_computed - before)
            outputs.setdefault(name, out)
            if "guidance_tokens_per_emitted" in out.meta_info:
                per_emitted[name].append(out.meta_info["guidance_tokens_per_emitted"])
                rounds[name][0] += out.meta_info["emitted_tokens"]
                rounds[name][1] += out.meta_info["sequence_rounds"]
            if name == "multi_draft":
                episodes.append(out.batch["multiturn_num_turns"].float().mean().item())
    agree = same_episodes(outputs["multi_draft"], outputs["multi_barrier"])
    return (
        seconds,
        tokens,
        per_emitted,
        (steps, computed, rounds),
        episodes,
        (*agree, *turn_steps(outputs["multi_draft"])),
    )


def floor_parts(engine: VLLMRollout, batch: DataProto, n: int, length: int) -> tuple:
    """The cost model's parts (`bench_guided_rollout.time_parts`) on the guided single-turn
    rollout's engines, over the call's B = prompts x n sequences (responses of `length`)."""
    ids = [row for row in prompt_ids(batch) for _ in range(n)]
    k = engine.config.offpolicy_guidance.num_speculative_tokens
    split = int(split_cpu_threads()["OMP_NUM_THREADS"])
    vocab = vocab_size(engine.engines.draft)
    ms = sorted({*CALL_SIZES, k + 1})
    # timed over fewer tokens than L: a scoring call may run m - 2 tokens past what it times, and
    # the engines hold only the longest prompt plus L (t_d and t_v are per step and per call)
    return time_parts(engine, ids, max(length - max(ms), 2), ms, split, vocab)


def floor_section(
    engine, parts: tuple, seconds, tokens, rounds, sequences: int, length: int
) -> None:
    """The floor (`guided_cost.floor`: the best k, schedule and groups, engine time only, the
    slowest sequence counted) of a single-turn guided call of B x L policy tokens at each guided
    rollout's measured acceptance, per policy token, beside its measured seconds per policy
    token. A multi-turn call does that work and more (the tool tokens, episodes of unequal
    length), so the single-turn floor bounds it from below too. `rounds`: per guided rollout,
    its emitted tokens and sequence-rounds over the repeats."""
    d_split, d_full, g_split, g_full, groups = parts
    guidance = engine.config.offpolicy_guidance
    k, bonus = guidance.num_speculative_tokens, guidance.bonus_token
    model = guided_cost.Parts(d_split, d_full, g_split, g_full, 0.0, length, groups, sequences)
    print("\n=== floor (benchmarks/guided_cost.py; per policy token, engine time only) ===")
    print(f"parts over {sequences} sequences (split threads; floor of {length} tokens each): draft step {d_split.step * 1e3:.2f} ms, "
          f"guidance call of m = k + 1 = {k + 1}: {g_split.verify_s(k + 1) * 1e3:.1f} ms; draft lookups "
          "counted as free (which keeps it a lower bound)")  # fmt: skip
    for name in ("multi_guided", "single_guided"):
        per_round = guided_cost.measured_tokens_per_round(*rounds[name])
        alpha = guided_cost.effective_alpha(per_round, k, bonus)
        best, best_k, schedule, best_g = guided_cost.floor(model, alpha, bonus, slowest=True)
        floor_per_token = best / (sequences * length)
        measured = statistics.median(
            s / t for s, t in zip(seconds[name], tokens[name], strict=True)
        )
        print(f"{name}: measured {measured * 1e3:.2f} ms per policy token; floor {floor_per_token * 1e3:.2f} ms "
              f"(k={best_k}, {schedule}, G={best_g}; effective alpha {alpha:.3f}); measured / floor "
              f"{measured / floor_per_token:.2f}x")  # fmt: skip


RATIOS = (("multi-turn / single-turn, draft only", "multi_draft", "single_draft"),
          ("multi-turn / single-turn, draft only, turn barrier", "multi_barrier", "single_draft"),
          ("episodes on their own / turn barrier, draft only", "multi_draft", "multi_barrier"),
          ("guided / draft-only, multi-turn", "multi_guided", "multi_draft"),
          ("guided / draft-only, single-turn", "single_guided", "single_draft"),
          ("multi-turn / single-turn, guided", "multi_guided", "single_guided"),
          ("multi-turn streamed with syncs / single-turn, draft only", "multi_stream", "single_draft"),
          ("streamed with syncs / one batch a call, multi-turn draft only", "multi_stream", "multi_draft"),
          ("streamed without syncs / one batch a call, multi-turn draft only", "multi_pool", "multi_draft"))  # fmt: skip


def report(args, variants, seconds, tokens, per_emitted, counts, episodes, agree, length) -> None:
    """Print the per-variant figures and the ratios."""
    per_token = {n: [s / t for s, t in zip(seconds[n], tokens[n], strict=True)] for n in variants}
    print(f"\n=== {args.prompts} prompts x {args.n} episodes, {args.repeats} repeats (medians) ===")
    for name in variants:
        extra = f", {statistics.median(per_emitted[name]):.2f} guidance tokens computed per emitted" if per_emitted[name] else ""  # fmt: skip
        print(f"{name:14s} {statistics.median(seconds[name]):7.2f} s  {statistics.median(tokens[name]):6.0f} policy tokens  "
              f"{1e3 * statistics.median(per_token[name]):6.2f} ms/policy token{extra}")  # fmt: skip
    print(f"multi-turn draft-only: {statistics.median(episodes):.2f} turns per episode")
    same, gap, barrier_steps, longest = agree
    print(
        f"episodes on their own vs turn barrier: same tokens and masks: {same}, largest log-prob gap {gap:.2e}"
    )
    print(f"engine steps a call needs: turn barrier {barrier_steps} (the longest turn of each turn), any loop at least "
          f"{longest} (the longest episode's policy tokens)")  # fmt: skip
    steps, computed, _ = counts
    print(
        "draft engine steps and draft tokens computed (prompt and decode) per call, per policy token:"
    )
    for name in variants:
        if computed[name]:
            per = statistics.median(
                c / t for c, t in zip(computed[name], tokens[name], strict=True)
            )
            print(f"  {name:14s} {statistics.median(steps[name]):6.0f} steps  {statistics.median(computed[name]):7.0f} tokens "
                  f"computed, {per:.2f} per policy token")  # fmt: skip
    print("\n=== ratios (seconds per policy token; 95 % paired-bootstrap interval) ===")
    for label, a, b in RATIOS:
        if a in variants and b in variants:
            ratio = statistics.median(per_token[a]) / statistics.median(per_token[b])
            low, high, _ = bootstrap_ratio(per_token[a], per_token[b])
            print(f"{label}: {ratio:.2f}x ({low:.2f}x-{high:.2f}x)")
    print(f"(single-turn responses: L = {length} policy tokens each)")


if __name__ == "__main__":
    main()
