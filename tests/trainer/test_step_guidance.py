"""The trainer owns each step's λ and MENTOR's weight (`ray_trainer.step_guidance`): hand values.

Steps are 1-based (the first training step is 1). The base schedule runs over
`lam_schedule_steps` (or the run); MENTOR's weight is w(n) = ½(1 + cos(π n/S)) at step n as its
own code counts (its step counter is incremented before w is computed), 0 from step S on, where
λ drops to 0 and the rollout turns unguided.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from verl.trainer.config import ConfigError, load_config
from verl.trainer.ray_trainer import step_guidance

G = "worker.rollout.offpolicy_guidance."
BASE = ["data.train_files=embedded://arithmetic@train", f"{G}enable=true", f"{G}model_path=/g"]
ROOT = Path(__file__).resolve().parents[2]
MENTOR = [f"config={ROOT / 'configs' / 'mentor.yaml'}", "worker.rollout.n=12", f"{G}model_path=/g",
          "data.train_files=embedded://arithmetic@train"]  # fmt: skip


@pytest.mark.parametrize(
    ("span", "total", "step", "expected"),
    [
        (4, 50, 1, 0.9),  # first step: lam
        (4, 50, 3, 0.5),  # 0.9 - 0.8·2/4
        (4, 50, 5, 0.1),  # the schedule's last step (1 + S): lam_end
        (4, 50, 9, 0.1),  # past it
        (None, 9, 1, 0.9),  # unset: S = 9 - 1 = 8
        (None, 9, 5, 0.5),  # 0.9 - 0.8·4/8
        (None, 9, 9, 0.1),  # the run's last step
    ],
)
def test_the_trainer_schedules_lam_with_and_without_lam_schedule_steps(span, total, step, expected):
    keys = [*BASE, f"{G}lam=0.9", f"{G}lam_end=0.1", f"{G}lam_schedule=linear"]
    if span is not None:
        keys.append(f"{G}lam_schedule_steps={span}")
    lam, weight = step_guidance(load_config(keys), step, total)
    assert lam == pytest.approx(expected, abs=1e-12) and weight is None


@pytest.mark.parametrize(
    ("step", "weight"),
    [
        (1, 0.9998286624877786),  # ½(1 + cos(π/120)): MENTOR's first step is already below 1
        (59, 0.5 * (1 + math.cos(59 * math.pi / 120))),  # 0.513088...
        (60, 0.5),  # ½(1 + cos(π/2))
        (119, 0.00017133751222137006),  # ½(1 + cos(119π/120)): the last guided step
        (120, 0.0),  # step S: decayed, MENTOR stops guiding here
        (200, 0.0),
    ],
)
def test_mentor_weight_and_lam_follow_mentors_step_count(step, weight):
    lam, w = step_guidance(load_config(MENTOR), step, 300)
    assert w == pytest.approx(weight, abs=1e-15)
    assert lam == (1.0 if weight > 0 else 0.0)  # the overlay's λ = 1, gated per position


def test_mentor_overlay_carries_mentors_choices():
    config = load_config(MENTOR)
    guidance = config.worker.rollout.offpolicy_guidance
    assert guidance.first_step_entropy_threshold == 999.0 and guidance.entropy_threshold == 1.5
    assert guidance.bonus_token is False and guidance.guided_samples == 4
    assert config.algorithm.guided_advantage_cap == 99.0


@pytest.mark.parametrize(("n", "guided"), [(5, 4), (4, 3), (2, 1)])
def test_mentor_refuses_a_group_without_two_unguided_responses(n, guided):
    keys = [*MENTOR, f"worker.rollout.n={n}", f"{G}guided_samples={guided}"]
    with pytest.raises(ConfigError) as error:
        load_config(keys)
    message = str(error.value)
    assert (
        "\n" not in message and "guided_samples" in message and f"worker.rollout.n={n}" in message
    )
    assert f"1..{n - 2}" in message


def test_mentor_accepts_two_unguided_responses():
    config = load_config([*MENTOR, "worker.rollout.n=6", f"{G}guided_samples=4"])
    assert config.worker.rollout.n - config.worker.rollout.offpolicy_guidance.guided_samples == 2
