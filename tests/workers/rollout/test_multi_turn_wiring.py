"""Multi-turn wiring without an engine: the nested config, its refusals, the tool check of
`main.check_inputs`, the mode registry and the multiturn/* metrics of a packed batch."""

from __future__ import annotations

import pytest
import torch

from verl.trainer.config import ConfigError
from verl.workers.rollout.config import RolloutConfig
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
    with pytest.raises(ValueError, match=r"multi_turn\.enable.*draft-only") as error:
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
    out = multi_turn_dataproto(4, 0, [[1, 2], [3]], packed).batch
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
    assert multi_turn_metrics({"response_mask": torch.ones(1, 2)}) == {}


def test_response_length_counts_tool_tokens():
    from verl.protocol import DataProto
    from verl.trainer.metrics import compute_data_metrics

    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0]])
    tool = torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    batch = DataProto.from_dict({"response_mask": mask, "tool_mask": tool,
                                 "token_level_scores": torch.zeros(2, 5)})  # fmt: skip
    metrics = compute_data_metrics(batch, {})
    assert metrics["response_length/max"] == 4 and metrics["response_length/min"] == 2


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
