"""Speculative guidance on the two engines: the draft engine's sessions as the algorithm's
`DraftStepper` (`_DraftRounds`), the guidance engine as its `AsyncScorer` (`GuidanceScorer`),
and the waves of sequences whose sessions fit both KV caches (`speculative_waves`), each run by
`speculative.overlapped_generate`. Each function takes the call's `context.RolloutContext`.

Row t of vLLM's prompt log-probs scores token t+1, so the proposals of a prefix of length L are
the guidance's rows L-1 .. L+n-2: a scoring chunk recomputes from position L-1 on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import numpy as np
import torch

from verl.utils.vision import ImagePrompt
from verl.workers.rollout.context import RolloutContext
from verl.workers.rollout.guidance_server import GuidanceChannel
from verl.workers.rollout.packing import Counters
from verl.workers.rollout.speculative import (
    GuidedSequence,
    ListedRows,
    Refill,
    RoundStats,
    SpeculativeBatch,
    overlapped_generate,
)
from verl.workers.rollout.vllm_sessions import SessionEngine


def speculative_waves(
    ctx: RolloutContext,
    prompts: list[list[int]],
    lam: float,
    seeds: np.ndarray,
    guided: np.ndarray,
    gate: Callable[[np.ndarray], np.ndarray] | None,
    prefix: np.ndarray | None = None,
    images: list[ImagePrompt | None] | None = None,
) -> tuple[list[GuidedSequence], RoundStats]:
    """Speculative guidance in waves of sequences whose sessions fit both KV caches at once
    (a session keeps its KV blocks from its first round to its last), each wave's sessions freed
    after it. Sequences not `guided` (B,) sample the draft alone (λ_t = 0); `gate` maps draft
    entropies to λ_t / λ; `prefix` (B,) the teacher prefix j of each sequence (λ_t = 1 on its
    first j tokens; None: none); `seeds` (B, 2) as `sequence_seeds`; `images` (B,) each
    prompt's images as `run_rounds` takes them."""
    size = wave_size(ctx, [len(p) for p in prompts], ctx.max_tokens)
    seqs, stats = [], RoundStats()
    for start in range(0, len(prompts), size):
        wave = ctx.waves.next()  # session ids are unique per wave
        part = slice(start, start + size)
        with sessions_freed(ctx):
            batches = run_rounds(
                ctx,
                wave,
                prompts[part],
                lam,
                seeds[part],
                guided[part],
                gate,
                prefix=None if prefix is None else prefix[part],
                images=None if images is None else images[part],
            )
        for batch in batches:
            seqs.extend(batch.seqs)
            stats.add(batch.stats)
    return seqs, stats


def wave_size(ctx: RolloutContext, prompt_lengths: list[int], new_tokens: int) -> int:
    """How many sessions of a prompt and `new_tokens` more (and one lookahead token) both
    engines' KV caches hold at once."""
    longest = max(prompt_lengths) + new_tokens + 1
    return min(ctx.draft_sessions.capacity(longest), ctx.engines.guidance.call("capacity", longest))


@contextmanager
def sessions_freed(ctx: RolloutContext) -> Iterator[None]:
    """Every session opened inside the block is freed on both engines at its end (after an
    error too, best effort: `run_rounds` has drained the guidance's answers in flight)."""
    try:
        yield
    except BaseException:
        ctx.draft_sessions.close()
        with suppress(RuntimeError):
            ctx.engines.guidance.call("close")
        raise
    ctx.draft_sessions.close()
    ctx.engines.guidance.call("close")


def run_rounds(
    ctx: RolloutContext,
    wave: int,
    prompts: list[list[int]],
    lam: float,
    seeds: np.ndarray,
    guided: np.ndarray,
    gate: Callable[[np.ndarray], np.ndarray] | None,
    limits: list[int] | None = None,
    stop: Callable[[int, list[int]], int | None] | None = None,
    ids: list[int] | None = None,
    prefix: np.ndarray | None = None,
    refill: Refill | None = None,
    images: list[ImagePrompt | None] | None = None,
) -> list[SpeculativeBatch]:
    """Speculative rounds until every sequence of `prompts` ended, in `pipeline_groups` batches
    run overlapped; the sessions stay open (`sessions_freed` frees them). `ids` (B,) name each
    sequence's sessions on both engines within the `wave` (default 0..B-1): a sequence continued
    under the same id (the next turn of an episode, its prompt the old one plus the tokens since)
    reuses its sessions' KV cache and computes only the new tokens. `limits` (B,) each
    sequence's most new tokens (None: the call's `max_tokens`); `stop(b, tokens)` as
    `SpeculativeBatch`'s, b the sequence's row here; `seeds` (B, 2) as `sequence_seeds` (the
    draft's sampling seed applies to a session's first chunk); `prefix` (B,) teacher prefix
    lengths as `SpeculativeBatch`'s (None: none); `refill` resumes ended sequences while the
    rounds run (`overlapped_generate`: an episode's next turn under the same id). `images` (B,)
    the `ImagePrompt` of each prompt with images (None: text): `prompts` then hold the model's
    expanded tokens, and each new session opens with the images on both engines."""
    guidance = ctx.config.offpolicy_guidance
    ids = list(range(len(prompts))) if ids is None else list(ids)
    expect_images(ctx, wave, ids, images)
    limits = [ctx.max_tokens] * len(prompts) if limits is None else list(limits)
    eos = None if ctx.ignore_eos else ctx.eos_token_id
    scale = guided.astype(np.float64)
    gens = [torch.Generator().manual_seed(int(s)) for s in seeds[:, 1]]
    groups = np.array_split(np.arange(len(prompts)), min(guidance.pipeline_groups, len(prompts)))
    batches = [SpeculativeBatch([prompts[i] for i in g], lam, guidance.num_speculative_tokens, [limits[i] for i in g],
                                eos, [gens[i] for i in g], ids=[ids[i] for i in g], bonus=guidance.bonus_token,
                                lam_scale=scale[g].tolist(), gate=gate, prefix=None if prefix is None else prefix[g],
                                target=guidance.topk_target,
                                stop=None if stop is None else (lambda r, tokens, g=g: stop(int(g[r]), tokens)))
               for g in groups]  # fmt: skip
    seed_of = dict(zip(ids, seeds[:, 0].tolist(), strict=True))

    def new_params(i: int, max_tokens: int):  # a new draft session's (its sequence's seed)
        return ctx.draft_params(max_tokens, ctx.num_logprobs, int(seed_of[i]))

    draft = _DraftRounds(ctx.draft_sessions, f"d{wave}-", new_params)
    scorer = GuidanceScorer(
        ctx.engines.guidance, f"g{wave}-", ctx.num_logprobs, ctx.guidance_processing(), ctx.counters
    )
    stagger = -(-guidance.num_speculative_tokens // len(batches))  # spread over one round
    try:
        for batch in batches:  # the guidance reads the prompts while the draft proposes
            scorer.warm(batch.ids, batch.prompts)
        overlapped_generate(batches, draft, scorer, stagger, refill)
    except BaseException:
        scorer.drain()
        raise
    ctx.counters.lookups += draft.lookups
    return batches


def expect_images(
    ctx: RolloutContext, wave: int, ids: list[int], images: list[ImagePrompt | None] | None
) -> None:
    """Tell both engines which of the wave's sessions (by sequence id) open with images."""
    with_images = [(i, im) for i, im in zip(ids, images or [None] * len(ids), strict=True) if im]
    if with_images:
        ctx.draft_sessions.expect({f"d{wave}-{i}": im for i, im in with_images})
        ctx.engines.guidance.call("expect", {f"g{wave}-{i}": im for i, im in with_images})


class GuidanceScorer:
    """The guidance engine as `speculative.AsyncScorer` for one wave: scoring requests over its
    channel, answered in order, with sessions named `prefix` + sequence id, log-probs of
    `num_logprobs` ids processed in the engine with `processing` (temperature, top_k, top_p),
    and the work counted in `counters`."""

    def __init__(
        self,
        channel: GuidanceChannel,
        prefix: str,
        num_logprobs: int,
        processing: dict,
        counters: Counters,
    ) -> None:
        self.channel, self.prefix, self.num_logprobs = channel, prefix, num_logprobs
        self.processing, self.counters = processing, counters
        self.in_flight = 0  # rounds submitted and not yet collected
        self.warming = 0  # `warm` requests not yet answered (answered before any round)

    def warm(self, ids: list[int], prefixes: list[list[int]]) -> None:
        """Have the guidance compute its sessions' KV cache up to each prefix's last token now
        (no wait, no rows kept): the first round's scoring then computes only that token and the
        proposals, and the prefill runs while the draft proposes. The KV cache holds the same
        values whichever call computes it, so the rows do not change. A one-token prefix has
        nothing before its last token (and a session must keep one token), so it is left out."""
        kept = [(i, prefix) for i, prefix in zip(ids, prefixes, strict=True) if len(prefix) > 1]
        if kept:
            self._send(
                [i for i, _ in kept], [p for _, p in kept], [[]] * len(kept), [0] * len(kept)
            )
            self.warming += 1

    def _send(self, ids: list[int], prefixes: list[list[int]], tails: list[list[int]],
              counts: list[int]) -> list[tuple]:  # fmt: skip
        """Send one scoring call: each session recomputes from its prefix's last token
        (`recompute_from`) through `tails`, and answers rows L-1 .. L+count-2. Returns the chunks."""
        chunks = [(f"{self.prefix}{i}", prefix + tail, 1, len(prefix) - 1)
                  for i, prefix, tail in zip(ids, prefixes, tails, strict=True)]  # fmt: skip
        rows = [(len(prefix) - 1, n) for prefix, n in zip(prefixes, counts, strict=True)]
        self.channel.submit("score", chunks, rows, self.num_logprobs, self.processing)
        return chunks

    def _warmed(self, wait: bool) -> None:
        """Read the answers of `warm` requests (the oldest ones on the channel): those already
        in, or with `wait` all of them."""
        while self.warming and (wait or self.channel.ready()):
            self.warming -= 1
            self.counters.computed += self.channel.result()[2]

    def submit(
        self, ids: list[int], prefixes: list[list[int]], proposals: torch.Tensor, num: torch.Tensor
    ) -> None:
        """Ask the guidance process for its log-prob tables at the proposal positions (no wait):
        the proposals of a prefix of length L are rows L-1 .. L+n-2, and the session recomputes
        from position L-1 on (`recompute_from`)."""
        counts = num.tolist()  # lists: slicing a tensor row by row costs more than the rest
        tails = [row[:n] for row, n in zip(proposals.tolist(), counts, strict=True)]
        chunks = self._send(ids, prefixes, tails, counts)
        self.counters.submitted += sum(len(tokens) for _, tokens, *_ in chunks)
        self.in_flight += 1

    def ready(self) -> bool:
        self._warmed(wait=False)
        return not self.warming and self.channel.ready()

    def collect(self) -> tuple[ListedRows, ListedRows]:
        """The guidance's listed log-probs of the oldest round submitted, one row per proposal,
        and one row per sequence one position past its last proposal (for a bonus token), both
        processed like the draft's."""
        self._warmed(wait=True)
        self.in_flight -= 1
        (ids, values), (next_ids, next_values), computed = self.channel.result()
        self.counters.computed += computed
        tables = ListedRows(ids, values)
        self.counters.tail_mass.append(tables.tail_mass())  # after processing: 1 - Q_S
        return tables, ListedRows(next_ids, next_values)

    def drain(self) -> None:
        """After an error: collect the answers still in flight, so the engine stays usable and
        its sessions can be freed (best effort: the error being raised is the one that matters)."""
        with suppress(RuntimeError):
            while self.in_flight or self.warming:
                if self.warming:
                    self.warming -= 1
                else:
                    self.in_flight -= 1
                self.channel.result()


@dataclass
class _Round:
    budget: list[int]
    outs: list  # the sessions' chunk outputs, filled in place as the engine steps
    returned: bool = False  # its proposals were handed out (its lookahead may still run)


class _DraftRounds:
    """The draft engine's sessions as `speculative.DraftStepper`: rounds of several batches
    share engine steps; a round is returned once all its sequences finished proposing, and its
    lookahead tokens (a chunk's one token past the budget) are drafted in the steps after."""

    def __init__(self, sessions: SessionEngine, prefix: str, new_params: Callable) -> None:
        self.sessions, self.prefix, self.new_params = sessions, prefix, new_params
        self.rounds: dict[int, _Round] = {}
        self.lookups = 0  # draft rows looked up (`probe`)

    def start(
        self,
        key: int,
        ids: list[int],
        prefixes: list[list[int]],
        budget: list[int],
        lookahead: list[bool],
    ) -> None:
        sids = [f"{self.prefix}{i}" for i in ids]
        index = dict(zip(sids, ids, strict=True))
        chunks = [(sid, prefix, b + extra, None)
                  for sid, prefix, b, extra in zip(sids, prefixes, budget, lookahead, strict=True)]  # fmt: skip
        outs = self.sessions.add(chunks, lambda sid, m: self.new_params(index[sid], m))
        self.rounds[key] = _Round(list(budget), outs)

    @property
    def busy(self) -> bool:
        """A chunk is running, or a round finished proposing and was not returned yet (it may have
        finished in the engine steps of a `probe`, when no chunk is left to step)."""
        return self.sessions.busy or any(
            not r.returned and self._proposed(r) for r in self.rounds.values()
        )

    @staticmethod
    def _proposed(r: _Round) -> bool:
        return all(
            o.finished or len(o.token_ids) >= b for o, b in zip(r.outs, r.budget, strict=True)
        )

    def step(self) -> list[tuple[int, torch.Tensor, torch.Tensor, ListedRows]]:
        if self.sessions.busy:
            self.sessions.step()
        done = []
        for key, r in self.rounds.items():
            if not r.returned and self._proposed(r):
                r.returned = True
                done.append((key, *draft_tables(r.outs, r.budget)))
        return done

    def drafting(self, key: int) -> bool:
        return not all(o.finished for o in self.rounds[key].outs)

    def probe(self, ids: list[int], prefixes: list[list[int]], tokens: np.ndarray) -> np.ndarray:
        """The draft's processed log p of `tokens` (R, M) after each prefix, from its engine."""
        sids = [f"{self.prefix}{i}" for i in ids]
        self.lookups += len(sids)
        return self.sessions.lookup(list(zip(sids, prefixes, tokens, strict=True)))

    def lookahead(self, key: int) -> tuple[np.ndarray, ListedRows] | None:
        r = self.rounds.pop(key)
        has = np.array([len(o.token_ids) > b for o, b in zip(r.outs, r.budget, strict=True)])
        if not has.any():
            return None
        extra = [o.row(b) for o, b, h in zip(r.outs, r.budget, has, strict=True) if h]
        return has, ListedRows(np.stack([i for i, _ in extra]), np.stack([v for _, v in extra]))


def draft_tables(outs: list, budget: list[int]) -> tuple[torch.Tensor, torch.Tensor, ListedRows]:
    """Proposals (B, k) with -1 padding, their number (B,) and the draft's listed log-probs, one
    row per proposal (sampled token, then the top-K, processed), from the sessions' chunks (the
    first budget[b] tokens of each: a chunk may run on to draft a lookahead token)."""
    have = np.array([len(o.token_ids) for o in outs])  # sampled tokens: one listed row each
    ids = np.concatenate([block for o in outs for block in o.logprob_ids])
    values = np.concatenate([block for o in outs for block in o.logprobs])
    start = np.cumsum(have) - have  # each chunk's first row
    num = np.minimum(have, budget)
    seq = np.repeat(np.arange(len(outs)), num)
    at = np.arange(len(seq)) - np.repeat(np.cumsum(num) - num, num)  # position within the chunk
    rows = ListedRows(ids[start[seq] + at], values[start[seq] + at])
    proposals = np.full((len(outs), max(budget)), -1, dtype=np.int64)
    proposals[seq, at] = rows.ids[:, 0]
    return torch.from_numpy(proposals), torch.from_numpy(num), rows
