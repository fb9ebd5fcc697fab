"""Shipped YAML files parse and validate; configs/defaults.yaml matches the dataclasses."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl.trainer.config import defaults_yaml, load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_yaml_loads_and_validates(path):
    config = load_config([f"config={path}"])
    assert config.worker.rollout.response_length == config.data.max_response_length


def test_guided_example_turns_guidance_and_weights_on():
    config = load_config([f"config={ROOT / 'examples' / 'grpo_guided.yaml'}"])
    assert config.worker.rollout.offpolicy_guidance.enable
    assert config.algorithm.tis_level == "token" and config.uses_importance_weights


def test_defaults_yaml_is_up_to_date():
    committed = (ROOT / "configs" / "defaults.yaml").read_text()
    assert committed == defaults_yaml(), (
        "regenerate: python -m verl.trainer.config > configs/defaults.yaml"
    )
