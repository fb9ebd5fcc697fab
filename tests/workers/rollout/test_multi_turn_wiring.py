"""Multi-turn wiring without an engine: the nested config, its refusals, the tool check of
`main.check_inputs`, the mode registry and the multiturn/* metrics of a packed batch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from verl.trainer.config import ConfigError
from verl.workers.rollout.config import OffPolicyGuidanceConfig, RolloutConfig
from verl.workers.rollout.modes import GENERATION_MODES
from verl.workers.rollout.multi_turn import Trajectory, pack
from verl.workers.rollout.multi_turn_mode import multi_turn_dataproto, multi_turn_metrics


def test_multi_turn_is_nested_and_validated():
    cfg = RolloutConfig()
    cfg.multi_turn.enable = True
    with pytest.raises(ValueError, match=r"worker\.rollout\.multi_turn\.tools"):
        cfg.validate("worker.rollout")
    cfg.multi_turn.tools = ["lookup"]
    cfg.validate("worker.rollout")
    cfg.offpolicy_guidance.enable, cfg.offpolicy_guidance.model_path = True, "x"
    cfg.validate("worker.rollout")  # guided token by token (speculative mode)
    cfg.offpolicy_guidance.mode = "mix"
    with pytest.raises(
        ValueError, match=r"offpolicy_guidance\.mode.*'mix'.*expected speculative"
    ) as error:
        cfg.validate("worker.rollout")
    assert "\n" not in str(error.value)
    cfg.offpolicy_guidance.mode, cfg.offpolicy_guidance.keep_topk = "speculative", True
    with pytest.raises(
        ValueError, match=r"offpolicy_guidance\.keep_topk.*single-turn only"
    ) as error:
        cfg.validate("worker.rollout")
    assert "\n" not in str(error.value)


def test_check_inputs_refuses_a_bad_tool_in_one_line(tmp_path):
    from verl.trainer.config import load_config
    from verl.trainer.main import resolve_tools

    config = load_config()
    config.worker.rollout.multi_turn.enable = True
    config.worker.rollout.multi_turn.tools = [f"{tmp_path / 'missing.py'}:fn"]
    with pytest.raises(ConfigError, match=r"worker\.rollout\.multi_turn\.tools") as error:
        resolve_tools(config)
    assert "\n" not in str(error.value)
    config.worker.rollout.multi_turn.tools = ["lookup"]
    assert resolve_tools(config) == ["lookup"]


def test_mode_registered_and_metrics_of_a_packed_batch():
    assert "multi_turn" in GENERATION_MODES
    a, b = Trajectory([1, 2]), Trajectory([3])
    a.add_turn([5, 6], rollout_log_probs=[-0.5, -0.25])
    a.add_tool([7, 8, 9], ["ok", "error"])
    a.add_turn([10], rollout_log_probs=[-1.0])
    b.add_turn([11, 12, 13], rollout_log_probs=[-0.1, -0.2, -0.3])
    packed = pack([a, b], 8, 0)
    packed["retokenized"] = torch.tensor([1, 0])  # (the rollout counts these: `_packed`)
    out = multi_turn_dataproto(
        OffPolicyGuidanceConfig(), 4, 0, [[1, 2], [3]], packed, 0.0, None
    ).batch
    assert "behavior_log_probs" not in out  # guidance off
    assert out["response_mask"][0].tolist() == [1, 1, 0, 0, 0, 1, 0, 0]
    assert out["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]
    assert out["rollout_log_probs"][0, :6].tolist() == [-0.5, -0.25, 0, 0, 0, -1.0]
    assert out["position_ids"][0, 2:10].tolist() == list(range(8))
    metrics = multi_turn_metrics(out)
    assert metrics["multiturn/turns_mean"] == 1.5
    assert metrics["multiturn/tool_calls_mean"] == 1.0
    assert metrics["multiturn/tool_error_frac"] == 0.5
    assert metrics["multiturn/truncated_frac"] == 0.0
    assert metrics["multiturn/tool_token_frac"] == pytest.approx(3 / 9)
    assert metrics["multiturn/retokenized_token_frac"] == pytest.approx(1 / 9)  # 1 of 9 kept
    assert multi_turn_metrics({"response_mask": torch.ones(1, 2)}) == {}


def test_guided_episodes_pack_behavior_log_probs_at_policy_tokens_only():
    """Guided turns' slots packed around a tool delta, by hand. λ = 0.5, full lists (q̃ = q):
    μ = log(0.5·p + 0.5·q): token 5: 0.5·0.5 + 0.5·0.1 = 0.30; token 6 (the guidance's):
    0.5·0.25 + 0.5·0.5 = 0.375; token 10: 0.5·0.8 + 0.5·0.4 = 0.60. Tool tokens 7, 8 and
    padding carry 0 (NaN entropy), no provenance, and λ_t 0."""
    ln = math.log
    a = Trajectory([1, 2])
    a.add_turn([5, 6], rollout_log_probs=[ln(0.5), ln(0.25)], guidance_log_probs=[ln(0.1), ln(0.5)],
               target_log_probs=[ln(0.1), ln(0.5)], guidance_lam=[0.5, 0.5], guidance_strength=[0.5, 0.5],
               draft_entropy=[1.0, 2.0], offpolicy=[0.0, 1.0])  # fmt: skip
    a.add_tool([7, 8], ["ok"])
    a.add_turn([10], rollout_log_probs=[ln(0.8)], guidance_log_probs=[ln(0.4)], target_log_probs=[ln(0.4)],
               guidance_lam=[0.5], guidance_strength=[0.5], draft_entropy=[0.3], offpolicy=[0.0])  # fmt: skip
    guidance = OffPolicyGuidanceConfig(enable=True, model_path="x")
    packed = pack([a], 7, 0)
    packed["retokenized"] = torch.tensor([0])
    out = multi_turn_dataproto(guidance, 2, 0, [[1, 2]], packed, 0.5, np.array([True])).batch
    expected = torch.tensor([[ln(0.30), ln(0.375), 0, 0, ln(0.60), 0, 0]])
    torch.testing.assert_close(
        out["behavior_log_probs"].double(), expected.double(), atol=1e-6, rtol=0
    )
    assert out["offpolicy_mask"].tolist() == [[False, True, False, False, False, False, False]]
    assert out["guidance_log_probs"][0, 2:4].tolist() == [0, 0]
    assert out["guidance_lam"].tolist() == [[0.5, 0.5, 0, 0, 0.5, 0, 0]]
    assert out["guidance_strength"].tolist() == [[0.5, 0.5, 0, 0, 0.5, 0, 0]]
    entropy = out["draft_entropy"][0]
    assert (
        entropy[[0, 1, 4]].tolist() == pytest.approx([1.0, 2.0, 0.3])
        and entropy[[2, 3, 5, 6]].isnan().all()
    )
    assert out["guided_responses"].tolist() == [True]


def test_response_length_counts_tool_tokens():
    from verl.protocol import DataProto
    from verl.trainer.metrics import compute_data_metrics, response_lengths

    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0]])
    tool = torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    batch = DataProto.from_dict({"response_mask": mask, "tool_mask": tool,
                                 "token_level_scores": torch.zeros(2, 5)})  # fmt: skip
    metrics = compute_data_metrics(batch, {})
    assert metrics["response_length/max"] == 4 and metrics["response_length/min"] == 2
    # the same count validation logs (val/response_length) and decodes its samples up to
    assert response_lengths(batch).tolist() == [4.0, 2.0]


def test_reward_sees_the_trajectory_and_scores_the_last_policy_token():
    from types import SimpleNamespace

    import numpy as np

    from verl.protocol import DataProto
    from verl.workers.reward.function import FunctionRewardManager

    manager = FunctionRewardManager.__new__(FunctionRewardManager)
    manager.tokenizer = SimpleNamespace(batch_decode=lambda rows, **_: [str(r) for r in rows])
    manager.config = SimpleNamespace(skip_special_tokens=True, reward_function_kwargs={},
                                     reward_type="sequential", reward_function="t")  # fmt: skip
    manager.fn = lambda item: {"overall": float(item["response_length"])}
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0, 0.0]])
    tool = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0, 0.0]])
    data = DataProto.from_dict({"responses": torch.arange(6)[None], "response_mask": mask,
                                "tool_mask": tool}, {"ground_truth": np.array(["x"], dtype=object)})  # fmt: skip
    scores, _ = manager.compute(data)
    assert scores[0].tolist() == [0, 0, 0, 5.0, 0, 0]  # 5 tokens seen, score at the last policy one


def test_tool_deltas_follow_the_prompts_chat_template_setting():
    """Plain prompts (data.apply_chat_template=false, the embedded tasks) get plain deltas
    (`=text\\n`), chat prompts chat-template tool turns: the rollout's runtime reads
    multi_turn.chat_template, which the post-init pass copies from data.apply_chat_template."""
    from verl.trainer.config import load_config

    assert (
        load_config(["data.apply_chat_template=false"]).worker.rollout.multi_turn.chat_template
        is False
    )
    assert load_config([]).worker.rollout.multi_turn.chat_template is True
