"""Tests of the name -> function Registry."""

from __future__ import annotations

import pytest

from verl.utils.registry import Registry


@pytest.fixture
def registry() -> Registry:
    reg: Registry = Registry("widget")

    @reg.register("beta", "b", "second")
    def beta():
        return "beta"

    @reg.register("alpha")
    def alpha():
        return "alpha"

    return reg


def test_register_returns_the_function_unchanged():
    reg: Registry = Registry("thing")

    def fn(x):
        return x + 1

    assert reg.register("fn")(fn) is fn
    assert reg.get("fn") is fn
    assert reg.get("fn")(1) == 2


def test_aliases_resolve_to_the_same_function(registry):
    beta = registry.get("beta")
    assert beta() == "beta"
    assert registry.get("b") is beta
    assert registry.get("second") is beta
    assert registry.canonical("b") == "beta"
    assert registry.canonical("second") == "beta"
    assert registry.canonical("beta") == "beta"
    assert registry.get("alpha")() == "alpha"


@pytest.mark.parametrize("name", ["alpha", "beta", "b", "second"])
def test_duplicate_name_or_alias_raises(registry, name):
    with pytest.raises(ValueError, match=f"widget '{name}' is already registered"):
        registry.register(name)(lambda: None)


def test_new_alias_clashing_with_a_name_raises(registry):
    with pytest.raises(ValueError, match="'alpha' is already registered"):
        registry.register("gamma", "alpha")(lambda: None)


def test_failed_registration_leaves_registry_unchanged(registry):
    with pytest.raises(ValueError):
        registry.register("gamma", "beta")(lambda: None)
    assert "gamma" not in registry
    assert registry.names() == ["alpha", "b", "beta", "second"]


def test_unknown_name_error_lists_valid_names(registry):
    with pytest.raises(ValueError) as err:
        registry.get("nope")
    msg = str(err.value)
    assert msg == "unknown widget 'nope'; valid: alpha, b, beta, second"
    with pytest.raises(ValueError, match="unknown widget 'nope'"):
        registry.canonical("nope")


def test_names_sorted_with_and_without_aliases(registry):
    assert registry.names() == ["alpha", "b", "beta", "second"]
    assert registry.names(with_aliases=False) == ["alpha", "beta"]


def test_iteration_len_and_contains(registry):
    assert list(registry) == ["alpha", "beta"]  # canonical names only, sorted
    assert len(registry) == 2
    assert "alpha" in registry
    assert "b" in registry  # aliases count as members
    assert "second" in registry
    assert "gamma" not in registry
    assert 3 not in registry


def test_empty_registry():
    reg: Registry = Registry("empty")
    assert len(reg) == 0
    assert list(reg) == []
    assert reg.names() == []
    with pytest.raises(ValueError, match="unknown empty 'x'; valid: "):
        reg.get("x")


def test_registries_are_independent(registry):
    other: Registry = Registry("gadget")
    other.register("alpha")(lambda: "other alpha")
    assert other.get("alpha")() == "other alpha"
    assert registry.get("alpha")() == "alpha"
    assert "b" not in other
