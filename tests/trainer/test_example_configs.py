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


OVERLAYS = sorted(p for p in (ROOT / "configs").glob("*.yaml") if p.name != "defaults.yaml")
GUIDE = ["worker.rollout.offpolicy_guidance.model_path=/models/guide"]
ALONE_NEEDS = {"distill.yaml": ["worker.rollout.offpolicy_guidance.enable=true", *GUIDE],
               # 4 guided + at least 2 unguided responses per prompt (the default n is 5)
               "mentor.yaml": [*GUIDE, "worker.rollout.n=6"], "mentor_exact.yaml": [*GUIDE, "worker.rollout.n=6"]}  # fmt: skip


def _leaves(node, prefix=""):
    """(dotted key, value) of every leaf of a YAML mapping."""
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _leaves(value, path + ".")
        else:
            yield path, value


def test_the_overlays_cover_every_capability():
    names = {p.stem for p in OVERLAYS}
    assert {"guidance_speculative", "guidance_mix", "otb", "opsm", "tis", "mis", "geo_mask",
            "dppo_tv", "cppo", "luffy", "distill", "mentor", "mentor_exact"} <= names  # fmt: skip


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
@pytest.mark.parametrize(
    "base", [None, ROOT / "examples" / "grpo_guided.yaml"], ids=["alone", "on-base"]
)
def test_overlay_loads_validates_and_sets_its_keys(overlay, base):
    """`config=<base> config=configs/<x>.yaml` (or the overlay alone on the defaults) validates,
    and every key the overlay sets has its value in the final config."""
    from omegaconf import OmegaConf

    from verl.trainer.config import to_dict

    args = ([f"config={base}"] if base else []) + [f"config={overlay}"]
    extra = [] if base else ALONE_NEEDS.get(overlay.name, GUIDE)
    config = to_dict(load_config(args + extra))
    for key, value in _leaves(OmegaConf.to_container(OmegaConf.load(overlay))):
        node = config
        for part in key.split("."):
            node = node[part]
        assert node == value, f"{overlay.name}: {key} = {node!r}, the overlay says {value!r}"


def test_overlays_compose_in_order_and_the_cli_wins():
    otb, cppo = ROOT / "configs" / "otb.yaml", ROOT / "configs" / "cppo.yaml"
    config = load_config([f"config={ROOT / 'examples' / 'grpo_guided.yaml'}", f"config={otb}", f"config={cppo}",
                          "worker.actor.policy_loss.tv_delta=0.3"])  # fmt: skip
    assert config.algorithm.adv_estimator == "optimal_token_baseline"
    assert (
        config.worker.actor.policy_loss.loss_type == "cppo"
        and config.worker.actor.policy_loss.tv_delta == 0.3
    )
    assert config.worker.rollout.offpolicy_guidance.enable  # the base's keys stay
