"""The guidance engine's `vllm.LLM` arguments, read from the rollout config (no engine built)."""

from __future__ import annotations

import pytest

from verl.workers.rollout.config import RolloutConfig
from verl.workers.rollout.engine_config import guidance_engine_args


def _config(rollout_eager: bool, guidance_eager: bool | None, mode: str = "speculative"):
    cfg = RolloutConfig(enforce_eager=rollout_eager)
    g = cfg.offpolicy_guidance
    g.enable, g.model_path, g.mode, g.enforce_eager = True, "/models/guide", mode, guidance_eager
    g.dtype, g.tensor_parallel_size = "float32", 2
    return cfg


@pytest.mark.parametrize(
    ("rollout_eager", "guidance_eager", "expected"),
    [(True, None, True), (False, None, False), (True, False, False), (False, True, True)],
)
def test_guidance_enforce_eager_follows_the_rollout_unless_set(
    rollout_eager, guidance_eager, expected
):
    args = guidance_engine_args(_config(rollout_eager, guidance_eager), 20, {"seed": 3})
    assert args["enforce_eager"] is expected


def test_guidance_engine_args_carry_its_own_model_and_the_shared_ones():
    args = guidance_engine_args(_config(True, None), 20, {"seed": 3, "max_model_len": 83})
    own = (args["model"], args["dtype"], args["tensor_parallel_size"])
    assert own == ("/models/guide", "float32", 2)
    assert (args["max_logprobs"], args["seed"], args["max_model_len"]) == (20, 3, 83)
    # both modes report processed log-probs (scoring rows are processed in the engine by the
    # session patch; mix-mode samples report what they drew from)
    assert args["logprobs_mode"] == "processed_logprobs"
    mix = guidance_engine_args(_config(True, None, mode="mix"), 20, {})
    assert mix["logprobs_mode"] == "processed_logprobs"


def test_guidance_enforce_eager_is_a_yaml_key():
    from verl.trainer.config import load_config
    from verl.utils.config_checks import ConfigError

    cfg = load_config(
        [
            "worker.rollout.enforce_eager=true",
            "worker.rollout.offpolicy_guidance.enforce_eager=false",
            "worker.rollout.offpolicy_guidance.model_path=/models/guide",
        ]
    )
    assert guidance_engine_args(cfg.worker.rollout, 20, {})["enforce_eager"] is False
    assert load_config().worker.rollout.offpolicy_guidance.enforce_eager is None
    with pytest.raises(ConfigError, match=r"offpolicy_guidance\.enforce_eager: Value 'maybe'"):
        load_config(["worker.rollout.offpolicy_guidance.enforce_eager=maybe"])
