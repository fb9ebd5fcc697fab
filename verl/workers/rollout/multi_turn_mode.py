"""The `multi_turn` generation mode: tool-using episodes sampled by the draft engine alone.

Token-in/token-out. Each turn of each active episode is one draft request whose prompt is the
episode's whole token sequence so far (`TokensPrompt`: prompt ids, every earlier turn's ids as
sampled, every tool delta's ids); with prefix caching (`enable_prefix_caching`, on by default)
vLLM reuses the KV cache of that prefix, so a turn computes only its new tokens. Nothing is
re-rendered or re-tokenized: a turn's ids and their sampled log-probs are kept exactly as the
engine reports them, the tool deltas are token ids from `multi_turn.deltas`. Guidance across
turns is not implemented (the config refuses guidance with multi-turn).

The loop (`run_episodes`): generate a turn for every active episode with the call format's stop
strings (kept in the output) and EOS, at most the response budget left; read the turns and run
the calls of all episodes at once (`MultiTurnRuntime.step`); append each continuing episode's
delta; stop at EOS, a turn without a call, `max_turns` or the budget. `pack` lays them out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from verl.protocol import DataProto
from verl.workers.rollout.modes import GENERATION_MODES, Generated, Job
from verl.workers.rollout.multi_turn import MultiTurnRuntime, Trajectory, pack
from verl.workers.rollout.vllm_sessions import sampled_log_probs

if TYPE_CHECKING:
    from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout

MULTI_TURN_COUNTS = ("num_turns", "num_tool_calls", "num_tool_errors", "num_tool_truncated")
"""Per-episode counts `pack` returns, carried in the batch as `multiturn_<name>` ((B,) long)."""


def finish_reason(completion) -> str:
    """The runtime's finish reason of a vLLM completion: `tool_call` when it stopped at a stop
    string, `length` at the token limit, else `eos`."""
    if completion.finish_reason == "length":
        return "length"
    return "tool_call" if isinstance(completion.stop_reason, str) else "eos"


def _turn_params(rollout: VLLMRollout, runtime: MultiTurnRuntime, budget: int, seed: int):
    """A turn's sampling parameters: the rollout's, with the format's stop strings kept in the
    output (detokenized, so vLLM can match them) and at most `budget` tokens."""
    from vllm import SamplingParams

    kwargs = rollout._sampling_kwargs(budget, 1, seed, detokenize=True,
                                      stop=runtime.stop_strings, include_stop_str_in_output=True)  # fmt: skip
    return SamplingParams(**kwargs)


def run_episodes(
    rollout: VLLMRollout, runtime: MultiTurnRuntime, prompts: list[list[int]], seeds: np.ndarray
) -> tuple[list[Trajectory], list[bool]]:
    """The episodes of `prompts` (one seed each, turn k sampled with seed + k) and whether each
    ended at `max_turns` with calls left unanswered or at the response budget."""
    limit = rollout._max_tokens
    episodes = [Trajectory(list(p)) for p in prompts]
    cut = [False] * len(prompts)
    active = list(range(len(prompts)))
    turn = 0
    while active:
        turn += 1
        used = {i: len(episodes[i].response_ids) for i in active}
        params = [_turn_params(rollout, runtime, limit - used[i], int(seeds[i]) + turn - 1)
                  for i in active]  # fmt: skip
        requests = [{"prompt_token_ids": episodes[i].context_ids()} for i in active]
        outputs = rollout.engines.draft.generate(requests, params, use_tqdm=False)
        completions = [out.outputs[0] for out in outputs]
        reasons = [finish_reason(c) for c in completions]
        outcomes = runtime.step([c.text for c in completions], reasons, [turn] * len(active))
        still = []
        for i, completion, reason, outcome in zip(
            active, completions, reasons, outcomes, strict=True
        ):
            ids, log_probs = sampled_log_probs(completion)
            episodes[i].add_turn(ids, rollout_log_probs=log_probs)
            outcome.append_to(episodes[i])
            if reason == "tool_call" and outcome.calls and not outcome.continues:
                cut[i] = True  # max_turns reached with calls left
            elif outcome.continues and len(episodes[i].response_ids) >= limit:
                cut[i] = True  # the delta used up (or overran) the budget
            elif outcome.continues:
                still.append(i)
            elif reason == "length":
                cut[i] = True
        active = still
    return episodes, cut


@GENERATION_MODES.register("multi_turn")
def multi_turn(rollout: VLLMRollout, job: Job) -> Generated:
    """Multi-turn episodes by the draft engine (`run_episodes`), packed (`pack`) in `packed`."""
    runtime = rollout.multi_turn_runtime()
    episodes, cut = run_episodes(rollout, runtime, job.prompts, job.seeds[:, 0])
    packed = pack(episodes, rollout.config.response_length, rollout.pad_token_id)
    packed["truncated"] = packed["truncated"] | torch.tensor(cut, dtype=torch.bool)
    return Generated([], packed=packed)


def multi_turn_dataproto(
    prompt_length: int, pad_token_id: int, prompts: list[list[int]], packed: dict
) -> DataProto:
    """The packed episodes in EasyR1's layout: `prompts` left-padded, `responses`,
    `input_ids`, `attention_mask` (tool tokens 1), `position_ids`, `response_mask` (tool tokens
    0), `rollout_log_probs` (at policy positions), `tool_mask`, `turn_index`, and per episode
    `multiturn_truncated` (bool) and `multiturn_<count>` (MULTI_TURN_COUNTS)."""
    b = len(prompts)
    prompt_t = torch.full((b, prompt_length), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(b, prompt_length, dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt_t[i, prompt_length - len(p) :] = torch.tensor(p, dtype=torch.long)
        prompt_mask[i, prompt_length - len(p) :] = 1
    resp_mask = packed["response_mask"].float()
    attention = torch.cat([prompt_mask, packed["response_attention_mask"]], dim=1)
    tensors = {
        "prompts": prompt_t,
        "responses": packed["responses"],
        "input_ids": torch.cat([prompt_t, packed["responses"]], dim=1),
        "attention_mask": attention,
        "position_ids": (attention.cumsum(-1) - 1).clamp(min=0) * attention,
        "response_mask": resp_mask,
        "rollout_log_probs": packed["rollout_log_probs"] * resp_mask,
        "tool_mask": packed["tool_mask"].float(),
        "turn_index": packed["turn_index"],
        "multiturn_truncated": packed["truncated"],
        **{f"multiturn_{name}": packed[name] for name in MULTI_TURN_COUNTS},
    }
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
    }
