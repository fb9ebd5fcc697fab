"""The rollout stage with `offpolicy_guidance.guide_when`: guide only the prompts the draft fails.

    first stage: every prompt's n responses from the draft alone (scored by the guidance as a
                 guided batch is, so both stages carry the same tensors)
    reward:      each first-stage response scored; a prompt is guided when `GUIDE_WHEN` says so
                 (group_fails: all n below `fail_below`)
    second stage: m guided responses per guided prompt, their own seeds (stage 1 of
                 `sequence_seeds`), in place of the prompt's first m first-stage responses

The batch keeps its size (prompts x n), so FSDP's micro-batches and the GRPO groups are those of
a one-stage step. docs/design.md#guide-only-where-the-student-fails gives why μ stays exact.
"""

from __future__ import annotations

import torch

from verl.protocol import DataProto
from verl.trainer.core_algos.guide_when import GUIDE_WHEN, replaced_rows, selection_metrics
from verl.utils import metric_names as M
from verl.workers.rollout.config import OffPolicyGuidanceConfig
from verl.workers.rollout.modes import guided_per_prompt
from verl.workers.rollout.worker import merge_rollout_meta


def needs_two_stages(guidance: OffPolicyGuidanceConfig, lam: float, prefix: float) -> bool:
    """Whether this step's rollout runs in two stages: guidance on, a selective `guide_when`,
    and something to guide with (λ > 0 or a teacher prefix; mix mode always has its samples)."""
    if not guidance.enable or guidance.guide_when == "always":  # GUIDE_WHEN's one-stage rule
        return False
    return guidance.mode == "mix" or lam > 0.0 or prefix > 0.0


def generate_two_stage(
    rollout, reward, batch: DataProto, guidance: OffPolicyGuidanceConfig, n: int, metrics: dict
) -> DataProto:
    """The step's rollout in two stages on `rollout` (a `RolloutGroup`), `reward` scoring the
    first (a `FunctionRewardManager`); adds the selection's metrics to `metrics`."""
    first = DataProto(batch=batch.batch, non_tensor_batch=batch.non_tensor_batch,
                      meta_info={**batch.meta_info, "guided_per_prompt": 0})  # fmt: skip
    out = rollout.generate_sequences(first)
    token_scores, _ = reward.compute(out)
    scores = token_scores.sum(-1)
    guided = GUIDE_WHEN.get(guidance.guide_when)(scores, n, guidance.fail_below)
    metrics.update(selection_metrics(scores, n, guided))
    lam = batch.meta_info.get("lam", 0.0)
    if guided.any():
        m = guided_per_prompt(guidance, {}, n)
        second_in = batch.index_select(guided.numpy())
        second_in.meta_info = {**batch.meta_info, "n": m, "guided_per_prompt": m, "stage": 1}
        second = rollout.generate_sequences(second_in)
        out.replace_rows(replaced_rows(guided, n, m), second)
        out.meta_info = merge_rollout_meta([out.meta_info, second.meta_info])
    out.meta_info["lam"] = lam
    return out


def group_success(scores: torch.Tensor, n: int, fail_below: float) -> dict[str, float]:
    """critic/score/group_any_success: the share of prompts whose group holds a response at or
    above `fail_below`. scores (P·n,)."""
    share = (scores.view(-1, n) >= fail_below).any(-1).float().mean().item()
    return {M.CRITIC_SCORE_GROUP_ANY_SUCCESS: share}
