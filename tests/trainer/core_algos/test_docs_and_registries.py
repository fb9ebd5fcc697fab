"""Every algorithm of the core (docs/design.md#architecture-and-the-dependency-rule) is findable by registry name with a formula, shapes and a paper link."""

from __future__ import annotations

import pytest

from verl.trainer import core_algos as C

REGISTRIES = {
    "advantage estimator": C.ADV_ESTIMATORS,
    "policy loss": C.POLICY_LOSSES,
    "loss aggregation": C.LOSS_AGG_MODES,
    "kl estimator": C.KL_ESTIMATORS,
    "guidance behavior": C.BEHAVIORS,
    "distillation mode": C.DISTILL_MODES,
}

EXPECTED_NAMES = {
    "advantage estimator": {
        "grpo",
        "rloo",
        "reinforce_plus_plus",
        "optimal_token_baseline",
        "tir_optimal_token_baseline",
        "none",
    },
    "policy loss": {"ppo", "dppo_tv", "cppo"},
    "loss aggregation": {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"},
    "kl estimator": {"k1", "k2", "k3"},
    "guidance behavior": {"exact", "provenance"},
    "distillation mode": {"reward", "loss"},
}

STANDALONE = [
    C.compute_sum_pi_squared,
    C.compute_variance_proxy_metrics,
    C.compute_importance_weights,
    C.compute_rejection_mask,
    C.compute_geometric_mask,
    C.compute_opsm_mask,
    C.cppo_keep_mask,
    C.luffy_shaping,
    C.apply_kl_penalty,
    C.compute_mismatch_metrics,
    C.distill_token_kl,
    C.compute_distill_metrics,
]


@pytest.mark.parametrize("kind", sorted(REGISTRIES))
def test_registry_holds_the_design_algorithms(kind):
    assert EXPECTED_NAMES[kind] <= set(REGISTRIES[kind].names())


def _documented(fn) -> None:
    doc = fn.__doc__ or ""
    first = doc.strip().splitlines()[0] if doc.strip() else ""
    assert "=" in first or "·" in first or ":" in first, (
        f"{fn.__name__}: first line should carry the formula"
    )
    assert "(B, T)" in doc or "(B,)" in doc, (
        f"{fn.__name__}: docstring should give the tensor shapes"
    )
    assert "http" in doc, f"{fn.__name__}: docstring should link the paper"


@pytest.mark.parametrize("kind", sorted(REGISTRIES))
def test_registered_functions_carry_formula_shapes_and_link(kind):
    registry = REGISTRIES[kind]
    for name in registry:
        _documented(registry.get(name))


@pytest.mark.parametrize("fn", STANDALONE, ids=lambda f: f.__name__)
def test_standalone_functions_carry_formula_shapes_and_link(fn):
    _documented(fn)
