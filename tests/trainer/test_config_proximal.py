"""`algorithm.proximal`: where π_old comes from, and the settings under which the rollout's
log-probs cannot stand for it (refused in one line before anything starts)."""

from __future__ import annotations

import pytest

from verl.trainer.config import load_config
from verl.utils.config_checks import ConfigError

GUIDANCE = "worker.rollout.offpolicy_guidance"


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (
            [f"{GUIDANCE}.enable=true", f"{GUIDANCE}.model_path=/m", f"{GUIDANCE}.mode=mix"],
            "mode='mix'",
        ),
        (["worker.rollout.top_p=0.9"], "top_p=0.9"),
        (["worker.rollout.top_k=20"], "top_k=20"),
        (["worker.actor.calculate_sum_pi_squared=true"], "calculate_sum_pi_squared=true"),
    ],
)
def test_proximal_from_the_rollout_is_refused_where_the_engine_cannot_give_pi_old(args, names):
    """The engine's log-probs stand for π_old only where they are the draft's own, at full
    vocabulary, and nothing else needs the actor's forward (Σπ²)."""
    with pytest.raises(ConfigError) as error:
        load_config(["algorithm.proximal=rollout", *args])
    message = str(error.value)
    assert message.startswith("algorithm.proximal='rollout' is not valid") and names in message
    assert "\n" not in message and "valid: recompute" in message


def test_proximal_defaults_to_recompute_and_takes_rollout_with_speculative_guidance():
    assert load_config().algorithm.proximal == "recompute"
    guided = [f"{GUIDANCE}.enable=true", f"{GUIDANCE}.model_path=/m", "algorithm.proximal=rollout"]
    assert load_config(guided).algorithm.proximal == "rollout"
    with pytest.raises(
        ConfigError, match=r"^algorithm\.proximal='nope' is not valid; valid: recompute, rollout"
    ):
        load_config(["algorithm.proximal=nope"])
