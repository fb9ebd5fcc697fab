"""Which generation mode a `generate_sequences` call runs (`modes.pick_mode`), by hand: the table
below is the rollout's choice, the same one its engine tests exercise mode by mode."""

from __future__ import annotations

import pytest

from verl.workers.rollout.config import OffPolicyGuidanceConfig
from verl.workers.rollout.modes import GENERATION_MODES, pick_mode
from verl.workers.rollout.multi_turn_mode import MULTI_TURN_MODES  # registers the multi-turn modes


def guidance(**fields) -> OffPolicyGuidanceConfig:
    config = OffPolicyGuidanceConfig(enable=True, lam=0.5)
    for key, value in fields.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize(
    ("fields", "meta", "expected"),
    [
        ({"enable": False}, {"lam": 0.7}, ("draft_only", 0.0)),  # no guidance: λ is 0
        ({}, {"guidance": False, "lam": 0.7}, ("draft_only", 0.0)),  # e.g. validation
        ({}, {"lam": 0.7}, ("speculative", 0.7)),  # the trainer's λ of the step
        ({}, {}, ("speculative", 0.5)),  # no λ sent: the configured one
        ({"mode": "mix"}, {"lam": 0.0}, ("mix", 0.0)),
        ({}, {"lam": 0.0}, ("teacher_only_prefill", 0.0)),  # λ = 0 scored by prefill
        ({"guided_samples": 0}, {"lam": 0.7}, ("teacher_only_prefill", 0.7)),  # none guided
        ({"guided_samples": 2}, {"lam": 0.7}, ("speculative", 0.7)),
        ({"teacher_scoring": "overlap"}, {"lam": 0.0}, ("speculative", 0.0)),  # scored in rounds
    ],
)
def test_pick_mode(fields, meta, expected):
    assert pick_mode(guidance(**fields), meta, n=4) == expected


def test_every_mode_pick_mode_names_is_registered():
    assert GENERATION_MODES.names() == [
        "draft_only",
        "mix",
        "multi_turn",
        "multi_turn_prefill",
        "multi_turn_speculative",
        "speculative",
        "teacher_only_prefill",
    ]
    # every single-turn mode but mix has a multi-turn form (mix is refused with multi-turn)
    assert set(MULTI_TURN_MODES) == set(GENERATION_MODES.names()) - {"mix"} - set(
        MULTI_TURN_MODES.values()
    )
    assert set(MULTI_TURN_MODES.values()) <= set(GENERATION_MODES.names())
    with pytest.raises(ValueError, match="unknown generation mode 'x'; valid: draft_only, mix"):
        GENERATION_MODES.get("x")
