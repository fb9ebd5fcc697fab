"""Multi-turn, tool-using rollouts: the pure foundation (no engine, no Ray).

Design: token-in/token-out. An episode's tokens are the prompt's ids, each policy turn's ids
exactly as sampled, and after each turn that called tools the *delta* of the tool messages
(`deltas.py`: rendered on a fixed dummy history, never on the real one). History is never
re-rendered, so every policy token keeps the exact context, log-prob and μ it was sampled with;
`trajectory.retokenized_tokens` only measures how far a text round trip would drift.

Modules: `config` (MultiTurnConfig), `tools` (TOOLS, describe_tool, run_tool_calls), `parsing`
(TOOL_CALL_FORMATS: hermes, embedded; stop strings), `deltas` (tool_delta_ids), `trajectory`
(Trajectory, pack), `runtime` (MultiTurnRuntime: the engine-free half of the loop).

The turn loop on the engines (`../multi_turn_mode.py`)
-----------------------------------------------------
For a batch of episodes, each with one session per engine (draft, and guidance when enabled),
each episode advancing on its own (its next turn starts once its own calls returned):

1. Generate a turn for each active episode with the format's stop strings
   (`runtime.stop_strings`, kept in the output: the embedded format's `]`; none for hermes, whose
   turn ends at EOS, `<|im_end|>`, holding any number of calls) and EOS, at most
   `response_length - used` tokens. Guided speculative rounds run unchanged inside a turn; the
   rollout checks the decoded *emitted* tokens for a stop string after each round and cuts the
   turn at the token completing it (`MultiTurnRuntime.turn_end`). The tokens dropped after it
   were never part of the episode: the cut is a stopping time (a function of the prefix), so the
   kept tokens' μ is unchanged.
   (Mix mode is refused with multi-turn.)
2. Record the turn: `trajectory.add_turn(ids, rollout_log_probs=..., behavior_log_probs=...,
   offpolicy_mask=..., ...)`, one value per sampled token; μ stays exact per policy token.
3. `runtime.read(text, finish_reason, turns_done)` as the turn ends: parse it (its own text
   only); the calls of an episode that continues (ended at a stop string, or at EOS for hermes,
   made a call, turns left) run in threads while the engines go on (`runtime.run_calls`;
   `tool_timeout_s`; at most `max_parallel_tools` threads over the run, hung calls included,
   shared by all episodes: `tools.ToolSlots`; never raising: errors, timeouts, unknown tools and
   malformed calls become error texts the policy reads, with a status for the metrics); once
   they return the episode gets its delta, one result per call in call order
   (`runtime.answer`, `outcome.append_to(trajectory)`). `runtime.step` does the same for a
   batch of turns at once (the turn-by-turn reference loop).
4. Append the delta as *prompt* tokens to the episode's sessions on both engines (resume the
   session with prompt + response so far + delta): nothing is sampled there, no log-probs or μ
   are needed for them, and the guidance's next rounds see exactly the tokens the draft sees
   (same tokenizer, same ids). Per-position λ_t and the entropy gate stay functions of the
   prefix, tool tokens included, so the mixture stays exact.
5. An episode stops when it does not continue, or when its delta would not fit
   `response_length` (it ends truncated); the batch ends with its last episode. Then `pack(trajectories, response_length, pad_id)` gives the (B, T) tensors.

What response_mask 0 means (tool tokens and padding)
----------------------------------------------------
A tool token is context, never a prediction of the policy: it has response_mask 0, tool_mask 1
and response_attention_mask 1. It enters no loss (policy, entropy, KL, distillation), no
advantage or baseline (GRPO/RLOO broadcast, OTB with compact positions), no importance weight,
TIS/MIS/geometric/OPSM mask, no guidance metric and no mismatch metric. It is attended to: the
actor's forward uses the attention mask over prompt + all response tokens, and asks the LM head
only for the rows predicting response_mask-1 tokens (holes are fine).
Code that reads `response_mask.sum(-1)` as the response *length* must read
`response_attention_mask` instead once multi-turn is on: `FunctionRewardManager._inputs` (decode)
and `compute` (score position: the last token with response_mask 1, the final turn's EOS, or the
score would land on a masked token and be lost), `RayPPOTrainer._val_samples` and
`val/response_length`, `trainer/metrics.compute_data_metrics` (`response_length/*`, clip ratio).

Where it is wired: `RolloutConfig.multi_turn` (validated; mix and keep_topk refused with
guidance), `main.resolve_tools` in `check_inputs`, `main.tool_instructions` (the system message
of chat prompts), the multi-turn generation modes of `../multi_turn_mode.py` (draft-only,
speculative with each episode's sessions kept across turns, λ = 0 prefill scoring), and the
multiturn/* metrics (per tool status included). What it does not do yet is listed in
README_guidance.md's known limits.
"""

from verl.workers.rollout.multi_turn.config import MultiTurnConfig
from verl.workers.rollout.multi_turn.deltas import (
    ToolDelta,
    retokenization_mismatch,
    tool_delta_ids,
)
from verl.workers.rollout.multi_turn.parsing import TOOL_CALL_FORMATS, ToolCall, get_format
from verl.workers.rollout.multi_turn.runtime import MultiTurnRuntime, TurnOutcome
from verl.workers.rollout.multi_turn.tools import (
    TOOLS,
    Tool,
    ToolResult,
    ToolSlots,
    describe_tool,
    load_tools,
    run_tool_calls,
)
from verl.workers.rollout.multi_turn.trajectory import (
    Segment,
    Trajectory,
    pack,
    retokenized_counts,
    retokenized_tokens,
)

__all__ = [
    "TOOLS",
    "TOOL_CALL_FORMATS",
    "MultiTurnConfig",
    "MultiTurnRuntime",
    "Segment",
    "Tool",
    "ToolCall",
    "ToolDelta",
    "ToolResult",
    "ToolSlots",
    "Trajectory",
    "TurnOutcome",
    "describe_tool",
    "get_format",
    "load_tools",
    "pack",
    "retokenization_mismatch",
    "retokenized_counts",
    "retokenized_tokens",
    "run_tool_calls",
    "tool_delta_ids",
]
