"""A cost model of the speculative guided rollout against draft-only, and the floor it implies.

Notation (docs/design.md, "What a guided rollout costs"): B sequences, L new tokens each, k
proposals per round, b = 1 with bonus tokens (the draft drafts one lookahead token past the
proposals while they are scored), α the probability a proposal is accepted (taken as the same
at every position), t_d(B) one draft decode step over the B sequences, t_v(B, m) one guidance
call that computes m new positions per sequence (a round scores k + 1: the round's first token,
which the guidance has not seen, and the k proposals; its rows are the k proposals' and the one
past them), t_l the draft's lookups per rejection (rows at guidance tokens the draft's top-K did
not list), P the prefills.

Tokens emitted per round per sequence (accepted proposals, then the residual or the bonus token):
    E[N] = Σ_{i=0..k} α^i = (1 - α^(k+1)) / (1 - α)        with bonus tokens
    E[N] = Σ_{i=1..k} α^i + (1 - α^k)                      without (no token after a full run)
Seconds of one round, each engine doing its own work:
    D = (k + b)·t_d(B) + (1 - α^k)·t_l          (the draft's steps and lookups)
    V = t_v(B, k + 1)                            (the guidance's verification)
    sequential: D + V   (one engine at a time, each may use every core)
    overlapped in G groups of n = B/G sequences (each engine on its own cores; a group's
    round waits for its own verification, other groups' rounds go on beside it):
        max(D, G·t_v(n, k + 1), C_n)   with the chain C_n = k·t_d(n) + max(b·t_d(n), t_v(n, k + 1))
                                                + (1 - α^k)·t_l
    (the draft's steps merge every proposing group's, so D is its least work; the guidance
    answers each group's call on its own; a group's next proposals need its verification, which
    needs its k-th proposal, while its lookahead step runs beside the call.)
Guided rollout: P + (L / E[N]) · round, P = P_d + P_v sequential and max(P_d, P_v) overlapped
(the guidance reads the prompts while the draft does); draft-only: P_d + (L - 1)·t_d(B).
A batch, though, runs until its slowest sequence ends, and its last rounds hold fewer sequences
(`slowest`): with p_r the probability that one sequence still generates at round r (its tokens
after each round by their distribution: budget min(k, left), a bonus token only with room past
k), the batch runs round r with probability s_r = 1 - (1 - p_r)^B, holding n_r = B·p_r / s_r
sequences on average then, and costs P + Σ_r s_r · round(n_r), each engine's step and
calls taken linear in the sequences between the sizes timed (`Parts.at`).
The floor is the best of the schedules at the best k and G for the measured α, with engine time
only (no Python, no scheduling between calls, no step waiting for another): a lower bound,
since t_d(n) ≤ the cost of any step that holds the group and D counts every step as one over all
B sequences. Counting the slowest sequence keeps it one: acceptances taken independent spread
the sequences' rounds less than correlated ones do, and a round's cost, a maximum of costs
linear in its sequences, is at least its cost at their expected number (Jensen).

Everything here is plain arithmetic on measured seconds, so it is unit tested
(tests/benchmarks/test_guided_cost.py); bench_guided_rollout.py times the parts in the same run.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass, field

import numpy as np


def tokens_per_round(alpha: float, k: int, bonus: bool = True) -> float:
    """E[N], the tokens one round emits per sequence, for acceptance `alpha` and `k` proposals."""
    if not 0.0 <= alpha <= 1.0 or k < 1:
        raise ValueError(f"tokens_per_round: alpha={alpha} must be in [0, 1] and k={k} >= 1")
    accepted = sum(alpha**i for i in range(1, k + 1))
    return accepted + (1.0 if bonus else 1.0 - alpha**k)


def effective_alpha(tokens: float, k: int, bonus: bool = True) -> float:
    """The α at which E[N] equals the measured tokens per round (bisection; E[N] grows with α).
    Acceptances are not independent (a round whose first proposal passes tends to pass the
    next), so the rate accepted / proposed underestimates the tokens a round gives; this α
    reproduces them at the measured k and carries them to other k."""
    low, high = 0.0, 1.0
    if tokens >= tokens_per_round(1.0, k, bonus):
        return 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if tokens_per_round(mid, k, bonus) < tokens else (low, mid)
    return (low + high) / 2


def measured_tokens_per_round(emitted: int, sequence_rounds: int) -> float:
    """Tokens per sequence-round as run: emitted tokens over the rounds summed over the sequences
    in them (the rollout's `sequence_rounds`; a round cut short by the length limit counts too)."""
    return emitted / sequence_rounds if sequence_rounds > 0 else float("nan")


@dataclass
class Engine:
    """One engine's measured seconds at one thread count: `step` a decode step (draft) or a
    call over m new positions as a function (guidance: `verify[m]`), `prefill` its first call."""

    prefill: float
    step: float = 0.0
    verify: dict[int, float] = field(default_factory=dict)

    def verify_s(self, m: int) -> float:
        """t_v(B, m): measured at the m in `verify`, linear between them and past the ends."""
        ms = sorted(self.verify)
        if m in self.verify or len(ms) == 1:
            return self.verify.get(m, self.verify[ms[0]])
        if m < ms[0]:
            lo, hi = ms[0], ms[1]
        elif m > ms[-1]:
            lo, hi = ms[-2], ms[-1]
        else:
            return float(np.interp(m, ms, [self.verify[x] for x in ms]))
        slope = (self.verify[hi] - self.verify[lo]) / (hi - lo)
        return max(0.0, self.verify[lo] + slope * (m - lo))


@functools.lru_cache(maxsize=256)  # the floor asks for each k under every schedule
def round_survival(alpha: float, k: int, bonus: bool, length: int) -> np.ndarray:
    """(R,) p_r, r = 1..R: the probability that one sequence still generates at round r, each
    proposal accepted independently with probability `alpha`; a round proposes min(k, left)
    tokens and drafts a bonus token only with room past k (`SpeculativeBatch.next_round`). From
    the distribution of the tokens it has after each round; R is the last round with p_r > 1e-12."""
    if not 0.0 <= alpha <= 1.0 or k < 1 or length < 1:
        raise ValueError(
            f"round_survival: alpha={alpha} in [0, 1], k={k} >= 1, length={length} >= 1"
        )
    tokens = np.zeros(length + 1)  # tokens[t]: probability of t tokens so far (length: ended)
    tokens[0] = 1.0
    survival = []
    while tokens[:length].sum() > 1e-12:
        survival.append(tokens[:length].sum())
        after = np.zeros(length + 1)
        after[length] = tokens[length]
        for t in np.flatnonzero(tokens[:length]):
            left = length - t
            budget = min(k, left)
            for j in range(budget):  # j accepted, then the residual token: j + 1
                after[t + j + 1] += tokens[t] * alpha**j * (1.0 - alpha)
            after[t + budget + int(bonus and left > k)] += tokens[t] * alpha**budget
        tokens = after
    survival = np.array(survival)
    survival.flags.writeable = False  # cached: shared by every caller
    return survival


def active_per_round(
    alpha: float, k: int, bonus: bool, length: int, batch: int
) -> list[tuple[float, float]]:
    """Per round r of `batch` independent sequences (`round_survival`'s p_r): (s_r, n_r), the
    probability that the batch still runs it, 1 - (1 - p_r)^B, and the sequences it then holds
    on average, B·p_r / s_r."""
    p = round_survival(alpha, k, bonus, length)
    some = 1.0 - (1.0 - p) ** batch
    return [(float(s), float(batch * q / s)) for s, q in zip(some, p) if s > 0.0]


def _line(sizes: list[float], values: list[float], n: float) -> float:
    """A cost at n sequences, linear between the `sizes` timed and past them along the nearest
    segment, never below 0; one size: proportional to n (below an affine cost a + b·n, a >= 0)."""
    if len(sizes) == 1:
        return values[0] * n / sizes[0]
    i = int(np.clip(np.searchsorted(sizes, n) - 1, 0, len(sizes) - 2))
    slope = (values[i + 1] - values[i]) / (sizes[i + 1] - sizes[i])
    return max(0.0, values[i] + slope * (n - sizes[i]))


@dataclass
class Parts:
    """The measured parts of one setting: the draft and the guidance engines with the cores
    split between them (`split`) and with every core (`full`), seconds of lookups per rejection,
    the response length L, and per number of groups G > 1 the two engines with the cores split
    over one group's B/G sequences (`groups`: G -> (draft, guidance))."""

    draft_split: Engine
    draft_full: Engine
    guidance_split: Engine
    guidance_full: Engine
    lookup_per_rejection: float
    length: int
    groups: dict[int, tuple[Engine, Engine]] = field(default_factory=dict)
    batch: int = 0
    """B, the sequences the whole-batch engines were timed over (0: not known; `at` and
    `slowest` need it)."""

    def group(self, g: int) -> tuple[Engine, Engine]:
        """(draft, guidance) over one of `g` groups, cores split (G = 1: the whole batch)."""
        if g == 1:
            return self.draft_split, self.guidance_split
        if g not in self.groups:
            raise ValueError(f"groups={g}: timed for {sorted({1, *self.groups})}")
        return self.groups[g]

    def at(self, n: float) -> Parts:
        """The parts of a round holding n of the B sequences: each engine's step and calls at n
        (a group's at n/G), linear in the sequences between the sizes timed (`_line`: B with the
        cores split, B/G in `groups`); the engines with every core scaled as the split ones."""
        if self.batch < 1:
            raise ValueError("Parts.at needs the batch size the engines were timed over (batch)")
        timed = sorted([(self.batch, self.draft_split, self.guidance_split)]
                       + [(self.batch / g, d, v) for g, (d, v) in self.groups.items()])  # fmt: skip
        sizes = [size for size, *_ in timed]
        ms = sorted(set.intersection(*(set(v.verify) for *_, v in timed)))

        def draft(x: float) -> Engine:
            return Engine(self.draft_split.prefill, _line(sizes, [d.step for _, d, _ in timed], x))

        def guidance(x: float) -> Engine:
            return Engine(self.guidance_split.prefill,
                          verify={m: _line(sizes, [v.verify[m] for *_, v in timed], x) for m in ms})  # fmt: skip

        d, v = draft(n), guidance(n)
        d_full = Engine(
            self.draft_full.prefill, self.draft_full.step * _ratio(d.step, self.draft_split.step)
        )
        v_full = Engine(self.guidance_full.prefill, verify={m: self.guidance_full.verify_s(m) * _ratio(
            v.verify[m], self.guidance_split.verify_s(m)) for m in ms})  # fmt: skip
        groups = {g: (draft(n / g), guidance(n / g)) for g in self.groups}
        return Parts(
            d, d_full, v, v_full, self.lookup_per_rejection, self.length, groups, self.batch
        )


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 1.0


SCHEDULES = ("sequential", "overlapped")


def round_seconds(
    parts: Parts, alpha: float, k: int, bonus: bool, schedule: str, groups: int = 1
) -> float:
    """Seconds of one round of every sequence: D + V ("sequential", every core to the engine
    working) or max(D, G·t_v(n, k + 1), C_n) ("overlapped" in `groups` groups, the cores split)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: valid values are {', '.join(SCHEDULES)}")
    b, lookups = int(bonus), (1.0 - alpha**k) * parts.lookup_per_rejection
    if schedule == "sequential":
        draft, guidance = parts.draft_full, parts.guidance_full
        return (k + b) * draft.step + lookups + guidance.verify_s(k + 1)
    d = _draft_work(parts, alpha, k, bonus)
    draft_n, guidance_n = parts.group(groups)
    verify_n = guidance_n.verify_s(k + 1)
    chain = k * draft_n.step + max(b * draft_n.step, verify_n) + lookups
    return max(d, groups * verify_n, chain)


def _draft_work(parts: Parts, alpha: float, k: int, bonus: bool) -> float:
    """D with the cores split: (k + b)·t_d(B) + (1 - α^k)·t_l."""
    return (k + int(bonus)) * parts.draft_split.step + (1.0 - alpha**k) * parts.lookup_per_rejection


def _rollout(
    parts: Parts, alpha: float, k: int, bonus: bool, schedule: str, per_round: float
) -> float:
    """P + (L / E[N]) · `per_round`, the prefills P as `schedule` runs them: one engine after the
    other (sequential), or both at once on their own cores (overlapped: max(P_d, P_v))."""
    if schedule == "sequential":
        prefills = parts.draft_full.prefill + parts.guidance_full.prefill
    else:  # each engine reads the prompts on its own cores, at once (`GuidanceScorer.warm`)
        prefills = max(parts.draft_split.prefill, parts.guidance_split.prefill)
    return prefills + parts.length / tokens_per_round(alpha, k, bonus) * per_round


def guided_seconds(
    parts: Parts,
    alpha: float,
    k: int,
    bonus: bool,
    schedule: str,
    groups: int = 1,
    slowest: bool = False,
) -> float:
    """Predicted seconds of the guided rollout: P + (L / E[N]) · round, or with `slowest`
    P + Σ_r s_r · round(n_r), the rounds until the batch's slowest sequence ends
    (`active_per_round`, `Parts.at`)."""
    if not slowest:
        per_round = round_seconds(parts, alpha, k, bonus, schedule, groups)
        return _rollout(parts, alpha, k, bonus, schedule, per_round)
    rounds = active_per_round(alpha, k, bonus, parts.length, parts.batch)
    work = sum(s * round_seconds(parts.at(n), alpha, k, bonus, schedule, groups) for s, n in rounds)
    return _rollout(parts, alpha, k, bonus, schedule, 0.0) + work


def draft_only_seconds(draft_full: Engine, length: int) -> float:
    """Predicted seconds of the draft-only rollout: P_d + (L - 1)·t_d(B)."""
    return draft_full.prefill + (length - 1) * draft_full.step


def floor(
    parts: Parts, alpha: float, bonus: bool, ks: range = range(1, 13), slowest: bool = False
) -> tuple[float, int, str, int]:
    """(seconds, k, schedule, G) of the cheapest schedule at the best k and number of groups G
    (those timed in `parts`) for acceptance `alpha`; `slowest` as `guided_seconds`'."""
    shapes = [("sequential", 1)] + [("overlapped", g) for g in sorted({1, *parts.groups})]
    return min(
        (guided_seconds(parts, alpha, k, bonus, s, g, slowest), k, s, g)
        for k in ks
        for s, g in shapes
    )


def perfect_overlap_floor(
    parts: Parts, alpha: float, bonus: bool, ks: range = range(1, 13)
) -> tuple[float, int, str]:
    """(seconds, k, schedule) of the model's earlier, looser floor: the overlapped round as
    max(D, V) over the whole batch, as if the engines overlapped with no group waiting for its
    own verification and no cost per call (kept to compare, in the same run)."""

    def seconds(k: int, schedule: str) -> float:
        if schedule == "sequential":
            return guided_seconds(parts, alpha, k, bonus, schedule)
        per_round = max(_draft_work(parts, alpha, k, bonus), parts.guidance_split.verify_s(k + 1))
        return _rollout(parts, alpha, k, bonus, schedule, per_round)

    return min((seconds(k, s), k, s) for k in ks for s in SCHEDULES)


def median_engine(timings: list[Engine]) -> Engine:
    """One `Engine` of the medians, field by field (and m by m), of `timings` of the same engine
    taken at different moments of a run."""
    ms = sorted(set.intersection(*(set(t.verify) for t in timings)))
    return Engine(
        prefill=statistics.median(t.prefill for t in timings),
        step=statistics.median(t.step for t in timings),
        verify={m: statistics.median(t.verify[m] for t in timings) for m in ms},
    )


# ---------------------------------------------------------------- timing the parts (the engines)
def time_draft(engine, prompts: list[list[int]], length: int, logprobs: int, threads: int,
               repeats: int = 3) -> Engine:  # fmt: skip
    """A rollout's draft engine (`engine.engines.draft`, `vllm.LLM`) at `threads` threads, with
    the rollout's own sampling settings and `logprobs` listed per token, through the path the
    rollout's draft tokens take: the engine's sessions where the rollout has them (speculative
    guidance: `SessionEngine.run`, which reads each step's listed log-probs as arrays), else
    `LLM.generate` (draft-only, which builds vLLM's per-token log-prob lists). P_d the seconds of
    a one-token generation of every prompt, t_d = (T(L) - T(1)) / (L - 1)."""
    import torch
    from vllm import SamplingParams

    ctx = engine.call_context({"ignore_eos": True})
    requests = [{"prompt_token_ids": list(p)} for p in prompts]
    sessions, runs = engine.draft_sessions, iter(range(10**9))

    def generate(n: int) -> float:
        if sessions is None:
            params = SamplingParams(**ctx.sampling_kwargs(n, logprobs, 0))
            start = time.perf_counter()
            engine.engines.draft.generate(requests, params, use_tqdm=False)
            return time.perf_counter() - start
        run = next(runs)
        chunks = [(f"cost-{run}-{i}", list(p), n, None) for i, p in enumerate(prompts)]
        start = time.perf_counter()
        sessions.run(chunks, lambda _sid, m: ctx.draft_params(m, logprobs, 0))
        seconds = time.perf_counter() - start
        # not timed: the rollout frees its sessions once, at the end
        sessions.close([sid for sid, *_ in chunks])
        return seconds

    torch._C.set_num_threads(threads)
    generate(1)  # warm
    one = statistics.median(generate(1) for _ in range(repeats))
    whole = statistics.median(generate(length) for _ in range(repeats))
    return Engine(prefill=one, step=max(0.0, whole - one) / max(length - 1, 1))


def time_guidance(engine, prompts: list[list[int]], length: int, ms: list[int], threads: int,
                  vocab: int) -> Engine:  # fmt: skip
    """The guidance engine of a rollout (`engine.engines.guidance`) at `threads` threads, over the
    channel the rollout uses: per m in `ms`, sessions of the prompts run scoring calls of m new
    positions each (the rounds of a run whose proposals are all accepted: m - 1 random tokens
    appended, the session recomputing from the last token it had) until `length` tokens are in;
    t_v(B, m) is the median call. P_v is the first call of m = min(ms) (it prefills the prompts)."""
    channel, ctx = engine.engines.guidance, engine.call_context({"ignore_eos": True})
    processing, rng = ctx.guidance_processing(), np.random.default_rng(0)
    channel.call("threads", threads)
    verify, prefill = {}, None
    try:
        for m in sorted(ms):
            sids = [f"cost-{m}-{i}" for i in range(len(prompts))]
            prefixes, calls = [list(p) for p in prompts], []
            while len(prefixes[0]) - len(prompts[0]) < length:
                new = rng.integers(4, vocab, size=(len(prompts), m - 1)).tolist()
                chunks = [(sid, p + t, 1, len(p) - 1) for sid, p, t in zip(sids, prefixes, new)]
                rows = [(len(p) - 1, m - 1) for p in prefixes]
                start = time.perf_counter()
                channel.call("score", chunks, rows, engine.num_logprobs, processing)
                calls.append(time.perf_counter() - start)
                prefixes = [p + t for p, t in zip(prefixes, new)]
            channel.call("close", sids)
            prefill = calls[0] if prefill is None else prefill
            verify[m] = statistics.median(calls[1:] or calls)
    finally:  # back to the guidance's share of the cores, as the rollout runs it
        from verl.workers.rollout.engine_lifecycle import split_cpu_threads

        channel.call("threads", int(split_cpu_threads()["OMP_NUM_THREADS"]))
    return Engine(prefill=prefill, verify=verify)
