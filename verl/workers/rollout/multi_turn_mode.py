"""The multi-turn generation modes: tool-using episodes, the draft alone or guided.

Token-in/token-out. An episode's context is its whole token sequence so far (prompt ids, every
earlier turn's ids as sampled, every tool delta's ids). Each episode keeps a session on the draft
engine from turn to turn (`vllm_sessions.SessionEngine`, `episode_sessions`), so a turn computes
only its last token and the tool delta; a format whose stop strings need text runs a request per
turn (the whole context each time). Nothing is re-rendered or re-tokenized: a turn's ids and
their log-probs are kept exactly as sampled, the tool deltas are token ids from
`multi_turn.deltas`. The modes, by the single-turn mode the call would use (`MULTI_TURN_MODES`):
- "multi_turn" (draft_only): each turn sampled by the draft engine, ended at the format's stop
  strings: a one-character one (embedded's `]`) by the ids whose text holds it, so the engine
  detokenizes nothing (`MultiTurnRuntime.stop_token_ids`; +20 % a step when it did);
- "multi_turn_speculative" (speculative): each turn a speculative generation toward q_λ on both
  engines (`run_rounds`; an episode keeps its sessions from turn to turn, so a turn computes
  only the tool delta before it and its own tokens), ended where the
  draft engine would have stopped it (`MultiTurnRuntime.turn_end`: the fewest tokens whose text
  holds a stop string; a stopping time, so every kept token is still an exact sample of q_λ
  given its prefix, tool tokens included in the prefix); per policy token the same provenance,
  log p, log q, log q̃ and λ_t as a single-turn response, so μ is exact token by token;
- "multi_turn_prefill" (teacher_only_prefill, λ = 0): draft-only episodes, then the guidance
  scores every episode's response in one prefill (log q at each policy token, given the tool
  tokens before it).

Episodes advance on their own: when an episode's turn ends, its calls run on a thread pool
(`ToolRuns`) while the engines keep working on the others, and its next turn starts as soon as
they returned. Draft-only (`episode_stream.EpisodeStream`): the next turn is its session's next
chunk on the draft engine, which is stepped one step at a time, so it always runs every episode
that has a turn to generate. Guided (`GuidedEpisodes`): the episode resumes in its speculative
batch under the same session ids (`SpeculativeBatch.resume`) and joins the batch's next round.
An episode's draws come from its own seeds alone (a draft session seeded once; a request per
turn, or the guided acceptance draws, seeded by turn), so its tokens do not depend on when its
turns ran. An episode stops at EOS, a turn without a
call, `max_turns` or the budget (`follow`). The turn-by-turn loop (`run_episodes`: every active
episode's turn in one engine call, then all their calls) is kept as the reference
(`TURN_BARRIER_KEY`). `pack` lays the episodes out; tool tokens carry no policy slot (0) and
response_mask 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from verl.protocol import DataProto
from verl.trainer.core_algos.guidance import LOG_PROB_FLOOR
from verl.utils.vision import engine_request
from verl.workers.rollout.config import OffPolicyGuidanceConfig
from verl.workers.rollout.context import RolloutContext
from verl.workers.rollout.episode_stream import (
    EpisodeStream,
    Outcomes,
    ToolRuns,
    Turn,
    draft_turn,
    follow,
    session_capacity,
    session_turn,
    turn_params,
)
from verl.workers.rollout.modes import (
    GENERATION_MODES,
    Generated,
    Job,
    guided_rows,
    teacher_prefill,
)
from verl.workers.rollout.multi_turn import (
    MultiTurnRuntime,
    ToolCall,
    ToolResult,
    Trajectory,
    pack,
    retokenized_counts,
)
from verl.workers.rollout.packing import guidance_part
from verl.workers.rollout.speculative import GuidedSequence, RoundStats, SpeculativeBatch
from verl.workers.rollout.speculative_mode import run_rounds, sessions_freed, wave_size
from verl.workers.rollout.vllm_sessions import SessionEngine

MULTI_TURN_COUNTS = ("num_turns", "num_tool_calls", "num_tool_errors", "num_tool_truncated",
                     "retokenized")  # fmt: skip
"""Per-episode counts of the packed episodes (`pack`'s, and `_packed`'s `retokenized`), carried in
the batch as `multiturn_<name>` ((B,) long)."""
MULTI_TURN_MODES = {"draft_only": "multi_turn", "speculative": "multi_turn_speculative",
                    "teacher_only_prefill": "multi_turn_prefill"}  # fmt: skip
"""The multi-turn mode run in place of each single-turn mode (mix: refused by the config)."""
TURN_BARRIER_KEY = "multi_turn_barrier"
"""A call's meta_info key: true runs the episodes turn by turn (`run_episodes` over `draft_turns`
or `GuidedTurns`: one engine call or one `run_rounds` per turn) instead of on their own
(`EpisodeStream`, `GuidedEpisodes`); the same seeds per turn, kept as the reference the tests and
the benchmark compare against."""
GUIDED_SLOTS = ("guidance_log_probs", "target_log_probs", "guidance_lam", "guidance_strength",
                "draft_entropy", "offpolicy")  # fmt: skip
"""Per policy token slots of a guided turn, beside `rollout_log_probs` (the draft's log p)."""


TurnFn = Callable[[list[int], list[list[int]], list[int], int], list[Turn]]
"""(episode indices, their contexts, their token budgets, the turn number from 1) -> turns."""


def draft_turns(
    ctx: RolloutContext, runtime: MultiTurnRuntime, seeds: np.ndarray, images: list | None = None,
    sessions: SessionEngine | None = None,
) -> TurnFn:  # fmt: skip
    """Turns by the draft engine alone, one `generate` call over the active episodes per turn
    (turn k of episode i seeded seeds[i] + k - 1, `turn_params`); `images` as `Job.images`. With
    `sessions`, one chunk per active episode per turn instead, each episode in a session of its
    own from turn to turn, seeded seeds[i] (as `EpisodeStream` with sessions)."""
    name = f"b{ctx.waves.next()}" if sessions is not None else ""

    def turns(active, contexts, budgets, turn):
        if sessions is not None:
            chunks = [(f"{name}-{i}", context, budget, None)
                      for i, context, budget in zip(active, contexts, budgets, strict=True)]  # fmt: skip
            seed = {sid: int(seeds[i]) for (sid, *_), i in zip(chunks, active, strict=True)}
            if images:  # the sessions not open yet open with their prompts' images
                sessions.expect({sid: images[i] for (sid, *_), i in zip(chunks, active, strict=True)
                                 if images[i] is not None})  # fmt: skip
            outs = sessions.run(
                chunks, lambda sid, limit: turn_params(ctx, runtime, seed[sid], limit)
            )
            return [session_turn(outs[sid], ctx, runtime, budget) for sid, _, budget, _ in chunks]
        params = [turn_params(ctx, runtime, int(seeds[i]) + turn - 1, budget)
                  for i, budget in zip(active, budgets, strict=True)]  # fmt: skip
        requests = [engine_request(context, images[i] if images else None)
                    for i, context in zip(active, contexts, strict=True)]  # fmt: skip
        outputs = ctx.engines.draft.generate(requests, params, use_tqdm=False)
        return [draft_turn(o.outputs[0], runtime) for o in outputs]

    turns.session_ids = [f"{name}-{i}" for i in range(len(seeds))] if sessions is not None else []
    return turns


def guided_turn(
    ctx: RolloutContext, runtime: MultiTurnRuntime, seq: GuidedSequence, lam: float
) -> Turn:
    """A speculative turn's sequence as a `Turn`: its text as the engine would report it, why it
    ended (at a stop string, at EOS, else at the token limit) and its per-token slots
    (`GUIDED_SLOTS` and the draft's log p; λ where a turn sampled no target recorded none)."""
    eos_ended = not ctx.ignore_eos and bool(seq.tokens) and seq.tokens[-1] == ctx.eos_token_id
    reason = "tool_call" if seq.stopped else "eos" if eos_ended else "length"
    n = len(seq.tokens)
    slots = {
        "rollout_log_probs": seq.draft_log_probs,
        "guidance_log_probs": seq.guidance_log_probs,
        "target_log_probs": seq.target_log_probs or seq.guidance_log_probs,
        "guidance_lam": seq.lam or [lam] * n,
        "guidance_strength": seq.strength or [lam] * n,
        "draft_entropy": seq.draft_entropy or [float("nan")] * n,
        "offpolicy": [float(o) for o in seq.offpolicy],
    }
    return Turn(seq.tokens, runtime.turn_text(seq.tokens), reason, slots, seq)


@dataclass
class GuidedTurns:
    """Turns by speculative guidance (`run_rounds`) for `run_episodes`, one `run_rounds` over the
    active episodes per turn, ended at the format's stop strings (none for hermes: at EOS).
    Episode i (a row of `prompts`) is guided when `guided[i]` (else λ_t = 0), its acceptance
    draws seeded `seeds[i, 1]` + k - 1 at turn k, and keeps its sessions on both engines from turn
    to turn (named by i: a turn computes only the tool delta and its own tokens). Keeps every
    turn's sequence and the rounds' counters. The episodes' sessions are those of wave `wave`."""

    ctx: RolloutContext
    wave: int
    runtime: MultiTurnRuntime
    lam: float
    seeds: np.ndarray
    guided: np.ndarray
    gate: Callable[[np.ndarray], np.ndarray] | None
    stats: RoundStats = field(default_factory=RoundStats)
    seqs: list[GuidedSequence] = field(default_factory=list)
    images: list | None = None
    """Each episode's prompt images (`Job.images`' part), or None."""

    def __call__(self, active, contexts, budgets, turn):
        runtime, seeds = self.runtime, self.seeds[active].copy()
        seeds[:, 1] += turn - 1
        batches = run_rounds(
            self.ctx,
            self.wave,
            contexts,
            self.lam,
            seeds,
            self.guided[active],
            self.gate,
            budgets,
            lambda _, tokens: runtime.turn_end(tokens),
            ids=active,
            images=[self.images[i] for i in active] if self.images else None,
        )
        order = {i: row for row, i in enumerate(active)}
        seqs: list[GuidedSequence] = [None] * len(active)  # type: ignore[list-item]
        for batch in batches:
            self.stats.add(batch.stats)
            for i, seq in zip(batch.ids, batch.seqs, strict=True):
                seqs[order[i]] = seq
        self.seqs.extend(seqs)
        return [guided_turn(self.ctx, runtime, seq, self.lam) for seq in seqs]


def run_episodes(
    limit: int, runtime: MultiTurnRuntime, prompts: list[list[int]], turns: TurnFn
) -> tuple[list[Trajectory], list[bool]]:
    """The episodes of `prompts` turn by turn (every active episode's turn from one `turns` call,
    then the calls of all of them), each at most `limit` response tokens, and whether each ended
    cut (`follow`)."""
    episodes = [Trajectory(list(p)) for p in prompts]
    cut = [False] * len(prompts)
    active = list(range(len(prompts)))
    turn = 0
    while active:
        turn += 1
        budgets = [limit - len(episodes[i].response_ids) for i in active]
        made = turns(active, [episodes[i].context_ids() for i in active], budgets, turn)
        outcomes = runtime.step([t.text for t in made], [t.reason for t in made], [turn] * len(active))  # fmt: skip
        still = []
        for i, made_i, outcome in zip(active, made, outcomes, strict=True):
            episodes[i].add_turn(made_i.ids, **made_i.slots)
            goes_on, cut[i] = follow(episodes[i], outcome, made_i.reason, limit)
            if goes_on:
                still.append(i)
        active = still
    return episodes, cut


@dataclass
class GuidedEpisodes(Outcomes):
    """Guided episodes of one wave that advance on their own: one `run_rounds` over the wave, whose
    batches hand each ended turn here (`speculative.Refill`). A turn's calls run on a thread pool
    while the rounds go on (`ToolRuns`); once they return, the delta is appended and the episode
    resumes in its batch under the same id (`SpeculativeBatch.resume`: its sessions on both
    engines compute only the delta and the new turn), joining the batch's next round. Episode i is
    guided when `guided[i]` (else λ_t = 0), its draft session seeded `seeds[i, 0]`, its acceptance
    draws at turn k seeded `seeds[i, 1]` + k - 1, as `GuidedTurns`'s. `call_tools`, `submitted`
    and `finished` as `EpisodeStream`'s. Keeps every turn's sequence (`seqs`) and the rounds'
    counters (`stats`)."""

    ctx: RolloutContext
    wave: int
    runtime: MultiTurnRuntime
    lam: float
    seeds: np.ndarray
    guided: np.ndarray
    gate: Callable[[np.ndarray], np.ndarray] | None
    limit: int
    call_tools: Callable[[int, list[ToolCall]], list[ToolResult]] | None = None
    stats: RoundStats = field(default_factory=RoundStats)
    seqs: list[GuidedSequence] = field(default_factory=list)
    submitted: list[tuple[int, int]] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    images: list | None = None
    """Each episode's prompt images (`Job.images`' part), or None."""

    def run(self, prompts: list[list[int]]) -> tuple[list[Trajectory], list[bool]]:
        """The episodes of `prompts` (the wave's), and whether each ended cut (`follow`)."""
        n = len(prompts)
        self.episodes = [Trajectory(list(p)) for p in prompts]
        self.cut, self._turns = [False] * n, [1] * n
        self.submitted += [(i, 1) for i in range(n)]
        self._at: dict[int, tuple[int, SpeculativeBatch, int]] = {}  # episode -> key, batch, row
        with ToolRuns(self.runtime, self.call_tools) as self._tools:
            batches = run_rounds(self.ctx, self.wave, prompts, self.lam, self.seeds, self.guided, self.gate,
                                 [self.limit] * n, lambda _, tokens: self.runtime.turn_end(tokens),
                                 refill=self, images=self.images)  # fmt: skip
        for batch in batches:
            self.stats.add(batch.stats)
        return self.episodes, self.cut

    def ended(self, key: int, batch: SpeculativeBatch, rows: list[int]) -> None:
        """Record the turns that ended in batch `key`'s last round; start their calls, or end
        their episodes."""
        for row in rows:
            i, seq = batch.ids[row], batch.seqs[row]
            self._at[i] = (key, batch, row)
            self.seqs.append(seq)
            self._record(i, guided_turn(self.ctx, self.runtime, seq, self.lam))

    @property
    def waiting(self) -> bool:
        """Some turn's calls have not returned."""
        return self._tools.waiting

    def resumed(self, wait: bool) -> list[int]:
        """The batches in which episodes resumed (their calls returned and they go on), after
        waiting for some calls to return if asked."""
        keys = set()
        for i, read, results in self._tools.returned(wait_for_one=wait):
            if self._follow(i, read, results):
                key, batch, row = self._at[i]
                self._turns[i] += 1
                draws = torch.Generator().manual_seed(int(self.seeds[i, 1]) + self._turns[i] - 1)
                budget = self.limit - len(self.episodes[i].response_ids)
                batch.resume(row, self.episodes[i].context_ids(), budget, draws)
                self.submitted.append((i, self._turns[i]))
                keys.add(key)
        return sorted(keys)


def _packed(ctx: RolloutContext, episodes: list[Trajectory], cut: list[bool]) -> dict:
    """`pack`, with the turn loop's cuts in `truncated` and each episode's `retokenized` count
    (`retokenized_counts` of its kept response: a diagnostic)."""
    width = ctx.config.response_length
    packed = pack(episodes, width, ctx.pad_token_id)
    packed["truncated"] = packed["truncated"] | torch.tensor(cut, dtype=torch.bool)
    tokenizer = ctx.multi_turn.tokenizer
    packed["retokenized"] = torch.tensor(
        retokenized_counts(tokenizer, episodes, width), dtype=torch.long
    )
    return packed


@GENERATION_MODES.register("multi_turn")
def multi_turn(ctx: RolloutContext, job: Job) -> Generated:
    """Multi-turn episodes by the draft engine (`draft_episodes`), packed in `packed`."""
    episodes, cut = draft_episodes(ctx, job)
    return Generated([], packed=_packed(ctx, episodes, cut))


def draft_episodes(ctx: RolloutContext, job: Job) -> tuple[list[Trajectory], list[bool]]:
    """Draft-only episodes of `job`: on their own (`EpisodeStream`), or turn by turn when the
    call's meta_info sets `TURN_BARRIER_KEY`; with the episodes' cuts. Each episode keeps a draft
    session from turn to turn (`episode_sessions`) when it can, else a turn is a new request."""
    runtime, seeds = ctx.multi_turn, job.seeds[:, 0]
    sessions = episode_sessions(ctx, job)
    if job.meta.get(TURN_BARRIER_KEY, False):
        n = len(job.prompts)
        if sessions is not None and session_capacity(sessions, job.prompts, ctx.max_tokens) < n:
            sessions = None  # turn by turn, every episode's session would be held at once
        turns = draft_turns(ctx, runtime, seeds, job.images, sessions)
        try:
            return run_episodes(ctx.max_tokens, runtime, job.prompts, turns)
        finally:
            if sessions is not None:
                sessions.close(turns.session_ids)
    return EpisodeStream(ctx, runtime, job.prompts, seeds, ctx.max_tokens, images=job.images,
                         sessions=sessions).run()  # fmt: skip


def episode_sessions(ctx: RolloutContext, job: Job) -> SessionEngine | None:
    """The draft's sessions when draft-only episodes can keep one from turn to turn: the engine
    has them (multi-turn builds it so) and turns end at stop ids (`runtime.stop_token_ids`: the
    engine core's stop check, which sessions run, matches no stop string). Else None (a request
    per turn)."""
    if ctx.draft_sessions is None or ctx.multi_turn.stop_token_ids is None:
        return None
    return ctx.draft_sessions


@GENERATION_MODES.register("multi_turn_speculative")
def multi_turn_speculative(ctx: RolloutContext, job: Job) -> Generated:
    """Multi-turn episodes whose every turn is speculative guidance toward q_λ: the first
    `guided_samples` episodes of each prompt guided, with the gate `lam_gate`. In waves of
    episodes whose sessions (prompt and whole response budget) fit both KV caches, each wave's
    sessions freed once all its episodes ended; in a wave the episodes advance on their own
    (`GuidedEpisodes`), or turn by turn (`GuidedTurns`) when the call's meta_info sets
    `TURN_BARRIER_KEY`."""
    runtime = ctx.multi_turn
    guided, gate = guided_rows(ctx.config.offpolicy_guidance, job)
    size = wave_size(ctx, [len(p) for p in job.prompts], ctx.max_tokens)
    episodes, cut, seqs, stats = [], [], [], RoundStats()
    for start in range(0, len(job.prompts), size):
        wave = ctx.waves.next()  # session ids are unique per wave
        part = slice(start, start + size)
        args = (ctx, wave, runtime, job.lam, job.seeds[part], guided[part], gate)
        images = None if job.images is None else job.images[part]
        with sessions_freed(ctx):
            if job.meta.get(TURN_BARRIER_KEY, False):
                turns = GuidedTurns(*args, images=images)
                done, cut_part = run_episodes(ctx.max_tokens, runtime, job.prompts[part], turns)
            else:
                turns = GuidedEpisodes(*args, ctx.max_tokens, images=images)
                done, cut_part = turns.run(job.prompts[part])
        episodes += done
        cut += cut_part
        seqs += turns.seqs
        stats.add(turns.stats)
    return Generated(seqs, stats, guided, packed=_packed(ctx, episodes, cut))


@GENERATION_MODES.register("multi_turn_prefill")
def multi_turn_prefill(ctx: RolloutContext, job: Job) -> Generated:
    """λ = 0 by prefill: draft-only episodes, then each episode's kept response scored by the
    guidance in one prefill (`teacher_prefill`); log q at every response token, read at the
    policy tokens. Every token is the draft's: off-policy 0, log q̃ = log q, λ_t = λ."""
    episodes, cut = draft_episodes(ctx, job)
    packed = _packed(ctx, episodes, cut)
    width = ctx.config.response_length
    seqs = [GuidedSequence(e.response_ids[:width]) for e in episodes]
    with ctx.cores_to("guidance"):
        teacher_prefill(ctx, job.prompts, seqs, job.images)
    guide = torch.zeros_like(packed["rollout_log_probs"], dtype=torch.float64)
    for i, seq in enumerate(seqs):
        guide[i, : len(seq.tokens)] = torch.tensor(seq.guidance_log_probs, dtype=torch.float64)
    policy = packed["response_mask"].bool()
    packed.update(guidance_log_probs=guide * policy, target_log_probs=guide * policy,
                  guidance_lam=torch.full_like(guide, job.lam) * policy,
                  guidance_strength=torch.full_like(guide, job.lam) * policy,
                  draft_entropy=torch.full_like(guide, float("nan")),
                  offpolicy=torch.zeros_like(guide))  # fmt: skip
    return Generated([], guided=np.zeros(len(job.prompts), dtype=bool), packed=packed)


def multi_turn_dataproto(
    guidance: OffPolicyGuidanceConfig,
    prompt_length: int,
    pad_token_id: int,
    prompts: list[list[int]],
    packed: dict,
    lam: float,
    guided: np.ndarray | None,
) -> DataProto:
    """The packed episodes in EasyR1's layout: `prompts` left-padded, `responses`,
    `input_ids`, `attention_mask` (tool tokens 1), `position_ids`, `response_mask` (tool tokens
    0), `rollout_log_probs` (the draft's log p at policy positions), `tool_mask`, `turn_index`,
    per episode `multiturn_truncated` (bool) and `multiturn_<count>` (MULTI_TURN_COUNTS); with
    guidance (`GUIDED_SLOTS` packed), `packing.guidance_part`'s tensors as for one turn (μ, the
    masks, λ_t, the draft's entropy, `guided_responses`), read at policy tokens only."""
    b = len(prompts)
    prompt_t = torch.full((b, prompt_length), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(b, prompt_length, dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt_t[i, prompt_length - len(p) :] = torch.tensor(p, dtype=torch.long)
        prompt_mask[i, prompt_length - len(p) :] = 1
    resp_mask = packed["response_mask"].float()
    attention = torch.cat([prompt_mask, packed["response_attention_mask"]], dim=1)
    draft_lp = packed["rollout_log_probs"].float().clamp(min=LOG_PROB_FLOOR)
    tensors = {
        "prompts": prompt_t,
        "responses": packed["responses"],
        "input_ids": torch.cat([prompt_t, packed["responses"]], dim=1),
        "attention_mask": attention,
        "position_ids": (attention.cumsum(-1) - 1).clamp(min=0) * attention,
        "response_mask": resp_mask,
        "rollout_log_probs": draft_lp * resp_mask,
        "tool_mask": packed["tool_mask"].float(),
        "turn_index": packed["turn_index"],
        "multiturn_truncated": packed["truncated"],
        **{f"multiturn_{name}": packed[name] for name in MULTI_TURN_COUNTS},
    }
    if guidance.enable and all(name in packed for name in GUIDED_SLOTS):
        policy = resp_mask.bool()
        entropy = packed["draft_entropy"].float().masked_fill(~policy, float("nan"))
        guide = packed["guidance_log_probs"].float()
        target = packed["target_log_probs"].float()
        guided = np.zeros(b, dtype=bool) if guided is None else guided
        tensors.update(guidance_part(guidance, draft_lp, guide, target, packed["offpolicy"].bool(),
                                     resp_mask, packed["guidance_lam"], entropy, lam, guided,
                                     packed["guidance_strength"]))  # fmt: skip
    return DataProto.from_dict(tensors)


def multi_turn_metrics(batch: dict) -> dict[str, float]:
    """multiturn/* of a batch that `multi_turn_dataproto` laid out (empty for any other)."""
    from verl.utils import metric_names as M

    if "multiturn_num_turns" not in batch:
        return {}
    calls = batch["multiturn_num_tool_calls"].float()
    tool_tokens = batch["tool_mask"].sum()
    kept = tool_tokens + batch["response_mask"].sum()
    return {
        M.MULTITURN_TURNS_MEAN: batch["multiturn_num_turns"].float().mean().item(),
        M.MULTITURN_TOOL_CALLS_MEAN: calls.mean().item(),
        M.MULTITURN_TOOL_ERROR_FRAC: (
            batch["multiturn_num_tool_errors"].sum() / calls.sum().clamp(min=1)
        ).item(),
        M.MULTITURN_TRUNCATED_FRAC: batch["multiturn_truncated"].float().mean().item(),
        M.MULTITURN_TOOL_TOKEN_FRAC: (tool_tokens / kept.clamp(min=1)).item(),
        M.MULTITURN_RETOKENIZED_FRAC: (
            batch["multiturn_retokenized"].sum() / kept.clamp(min=1)
        ).item(),
    }
