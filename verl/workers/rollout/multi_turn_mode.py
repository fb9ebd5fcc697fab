"""The multi-turn generation modes: tool-using episodes, the draft alone or guided.

Token-in/token-out. Each turn of each active episode is one request whose prompt is the
episode's whole token sequence so far (prompt ids, every earlier turn's ids as sampled, every
tool delta's ids); with prefix caching (`enable_prefix_caching`, on by default) vLLM reuses the
KV cache of that prefix, so a turn computes only its new tokens. Nothing is re-rendered or
re-tokenized: a turn's ids and their log-probs are kept exactly as sampled, the tool deltas are
token ids from `multi_turn.deltas`. The modes, by the single-turn mode the call would use
(`MULTI_TURN_MODES`):
- "multi_turn" (draft_only): each turn sampled by the draft engine with the format's stop strings;
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

The loop (`run_episodes`): generate a turn for every active episode, at most the response budget
left; read the turns and run the calls of all episodes at once (`MultiTurnRuntime.step`);
append each continuing episode's delta; stop at EOS, a turn without a call, `max_turns` or the
budget. `pack` lays them out; tool tokens carry no policy slot (0) and response_mask 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from verl.protocol import DataProto
from verl.trainer.core_algos.guidance import LOG_PROB_FLOOR
from verl.workers.rollout.config import OffPolicyGuidanceConfig
from verl.workers.rollout.context import RolloutContext
from verl.workers.rollout.modes import (
    GENERATION_MODES,
    Generated,
    Job,
    guided_rows,
    teacher_prefill,
)
from verl.workers.rollout.multi_turn import MultiTurnRuntime, Trajectory, pack, retokenized_tokens
from verl.workers.rollout.packing import guidance_part
from verl.workers.rollout.speculative import GuidedSequence, RoundStats
from verl.workers.rollout.speculative_mode import run_rounds, sessions_freed, wave_size
from verl.workers.rollout.vllm_sessions import sampled_log_probs

MULTI_TURN_COUNTS = ("num_turns", "num_tool_calls", "num_tool_errors", "num_tool_truncated",
                     "retokenized")  # fmt: skip
"""Per-episode counts of the packed episodes (`pack`'s, and `_packed`'s `retokenized`), carried in
the batch as `multiturn_<name>` ((B,) long)."""
MULTI_TURN_MODES = {"draft_only": "multi_turn", "speculative": "multi_turn_speculative",
                    "teacher_only_prefill": "multi_turn_prefill"}  # fmt: skip
"""The multi-turn mode run in place of each single-turn mode (mix: refused by the config)."""
GUIDED_SLOTS = ("guidance_log_probs", "target_log_probs", "guidance_lam", "guidance_strength",
                "draft_entropy", "offpolicy")  # fmt: skip
"""Per policy token slots of a guided turn, beside `rollout_log_probs` (the draft's log p)."""


@dataclass
class Turn:
    """One policy turn of one episode as a turn function returns it."""

    ids: list[int]
    text: str
    reason: str
    """Why it ended (`runtime.FINISH_REASONS`)."""
    slots: dict[str, list[float]]
    seq: GuidedSequence | None = None
    """The speculative generation behind it (guided turns)."""


TurnFn = Callable[[list[int], list[list[int]], list[int], int], list[Turn]]
"""(episode indices, their contexts, their token budgets, the turn number from 1) -> turns."""


def finish_reason(completion) -> str:
    """The runtime's finish reason of a vLLM completion: `tool_call` when it stopped at a stop
    string, `length` at the token limit, else `eos`."""
    if completion.finish_reason == "length":
        return "length"
    return "tool_call" if isinstance(completion.stop_reason, str) else "eos"


def draft_turns(ctx: RolloutContext, runtime: MultiTurnRuntime, seeds: np.ndarray) -> TurnFn:
    """Turns by the draft engine alone (turn k of episode i sampled with seed seeds[i] + k - 1),
    with the sampled log-probs as `rollout_log_probs`."""

    def turns(active, contexts, budgets, turn):
        # the rollout's parameters, with the format's stop strings kept in the output
        # (detokenized, so vLLM can match them) and at most the budget left
        stops = {"stop": runtime.stop_strings, "include_stop_str_in_output": True}
        params = [
            ctx.draft_params(budget, 1, int(seeds[i]) + turn - 1, detokenize=True, **stops)
            for i, budget in zip(active, budgets, strict=True)
        ]
        requests = [{"prompt_token_ids": context} for context in contexts]
        outputs = ctx.engines.draft.generate(requests, params, use_tqdm=False)
        out = []
        for completion in (o.outputs[0] for o in outputs):
            ids, log_probs = sampled_log_probs(completion)
            out.append(Turn(ids, completion.text, finish_reason(completion),
                            {"rollout_log_probs": log_probs}))  # fmt: skip
        return out

    return turns


@dataclass
class GuidedTurns:
    """Turns by speculative guidance (`run_rounds`), ended at the format's stop strings (none for
    hermes: at EOS). Episode
    i (a row of `prompts`) is guided when `guided[i]` (else λ_t = 0), its acceptance draws seeded
    `seeds[i, 1]` + k - 1 at turn k, and keeps its sessions on both engines from turn to turn
    (named by i: a turn computes only the tool delta and its own tokens). Keeps every turn's
    sequence and the rounds' counters. The episodes' sessions are those of wave `wave`."""

    ctx: RolloutContext
    wave: int
    runtime: MultiTurnRuntime
    lam: float
    seeds: np.ndarray
    guided: np.ndarray
    gate: Callable[[np.ndarray], np.ndarray] | None
    stats: RoundStats = field(default_factory=RoundStats)
    seqs: list[GuidedSequence] = field(default_factory=list)

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
        )
        order = {i: row for row, i in enumerate(active)}
        seqs: list[GuidedSequence] = [None] * len(active)  # type: ignore[list-item]
        for batch in batches:
            self.stats.add(batch.stats)
            for i, seq in zip(batch.ids, batch.seqs, strict=True):
                seqs[order[i]] = seq
        self.seqs.extend(seqs)
        return [Turn(s.tokens, runtime.turn_text(s.tokens), self._reason(s), self._slots(s), s)
                for s in seqs]  # fmt: skip

    def _reason(self, seq: GuidedSequence) -> str:
        if seq.stopped:
            return "tool_call"
        eos = self.ctx.eos_token_id
        ended = not self.ctx.ignore_eos and seq.tokens and seq.tokens[-1] == eos
        return "eos" if ended else "length"

    def _slots(self, seq: GuidedSequence) -> dict[str, list[float]]:
        n = len(seq.tokens)
        return {
            "rollout_log_probs": seq.draft_log_probs,
            "guidance_log_probs": seq.guidance_log_probs,
            "target_log_probs": seq.target_log_probs or seq.guidance_log_probs,
            "guidance_lam": seq.lam or [self.lam] * n,
            "guidance_strength": seq.strength or [self.lam] * n,
            "draft_entropy": seq.draft_entropy or [float("nan")] * n,
            "offpolicy": [float(o) for o in seq.offpolicy],
        }


def run_episodes(
    limit: int, runtime: MultiTurnRuntime, prompts: list[list[int]], turns: TurnFn
) -> tuple[list[Trajectory], list[bool]]:
    """The episodes of `prompts`, each turn from `turns` and at most `limit` response tokens, and
    whether each ended at `max_turns` with calls left unanswered or at the response budget."""
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
            outcome.append_to(episodes[i])
            if outcome.unanswered:
                cut[i] = True  # max_turns reached with calls left
            elif outcome.continues and len(episodes[i].response_ids) >= limit:
                cut[i] = True  # the delta used up (or overran) the budget
            elif outcome.continues:
                still.append(i)
            elif made_i.reason == "length":
                cut[i] = True
        active = still
    return episodes, cut


def _packed(ctx: RolloutContext, episodes: list[Trajectory], cut: list[bool]) -> dict:
    """`pack`, with the turn loop's cuts in `truncated` and each episode's `retokenized` count
    (`retokenized_tokens` of its kept response: a diagnostic)."""
    width = ctx.config.response_length
    packed = pack(episodes, width, ctx.pad_token_id)
    packed["truncated"] = packed["truncated"] | torch.tensor(cut, dtype=torch.bool)
    tokenizer = ctx.multi_turn.tokenizer
    packed["retokenized"] = torch.tensor([retokenized_tokens(tokenizer, e, width) for e in episodes],
                                         dtype=torch.long)  # fmt: skip
    return packed


@GENERATION_MODES.register("multi_turn")
def multi_turn(ctx: RolloutContext, job: Job) -> Generated:
    """Multi-turn episodes by the draft engine (`draft_turns`), packed in `packed`."""
    runtime = ctx.multi_turn
    turns = draft_turns(ctx, runtime, job.seeds[:, 0])
    episodes, cut = run_episodes(ctx.max_tokens, runtime, job.prompts, turns)
    return Generated([], packed=_packed(ctx, episodes, cut))


@GENERATION_MODES.register("multi_turn_speculative")
def multi_turn_speculative(ctx: RolloutContext, job: Job) -> Generated:
    """Multi-turn episodes whose every turn is speculative guidance toward q_λ (`GuidedTurns`):
    the first `guided_samples` episodes of each prompt guided, with the gate `lam_gate`. In
    waves of episodes whose sessions (prompt and whole response budget) fit both KV caches,
    each wave's sessions freed once all its episodes ended."""
    runtime = ctx.multi_turn
    guided, gate = guided_rows(ctx.config.offpolicy_guidance, job)
    size = wave_size(ctx, [len(p) for p in job.prompts], ctx.max_tokens)
    episodes, cut, seqs, stats = [], [], [], RoundStats()
    for start in range(0, len(job.prompts), size):
        wave = ctx.waves.next()  # session ids are unique per wave
        part = slice(start, start + size)
        turns = GuidedTurns(ctx, wave, runtime, job.lam, job.seeds[part], guided[part], gate)
        with sessions_freed(ctx):
            done, cut_part = run_episodes(ctx.max_tokens, runtime, job.prompts[part], turns)
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
    runtime = ctx.multi_turn
    episodes, cut = run_episodes(ctx.max_tokens, runtime, job.prompts,
                                 draft_turns(ctx, runtime, job.seeds[:, 0]))  # fmt: skip
    packed = _packed(ctx, episodes, cut)
    width = ctx.config.response_length
    seqs = [GuidedSequence(e.response_ids[:width]) for e in episodes]
    with ctx.cores_to("guidance"):
        teacher_prefill(ctx, job.prompts, seqs)
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
