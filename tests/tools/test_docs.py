"""README_guidance.md's reference tables are generated from the code, complete and current."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from verl.tools import docs
from verl.trainer.config import AlgorithmConfig, DistillConfig
from verl.utils import metric_names as M
from verl.utils.metric_reference import METRIC_DOCS, SECTIONS, in_section
from verl.workers.rollout.config import OffPolicyGuidanceConfig

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "README_guidance.md").read_text()


def test_readme_guidance_tables_are_current():
    assert docs.render(GUIDE) == GUIDE, "stale tables: run python -m verl.tools.docs"
    assert docs.main(["--check"]) == 0


def test_reference_covers_exactly_the_names_the_trainer_can_log():
    assert set(METRIC_DOCS) == set(M.ALL_FIXED) | set(M.FAMILIES)
    assert all(M.is_known(name) for name in METRIC_DOCS if "<" not in name)
    assert {doc.section for doc in METRIC_DOCS.values()} == set(SECTIONS)
    for doc in METRIC_DOCS.values():
        assert doc.meaning and doc.healthy, doc.name


@pytest.mark.parametrize("namespace", ["guidance/", "mismatch/", "variance_proxy/", "distill/"])
def test_every_metric_of_the_guidance_namespaces_appears_in_the_manual(namespace):
    names = [n for n in M.ALL_FIXED if n.startswith(namespace)]
    assert names
    reference = GUIDE.split("## Metric reference", 1)[1]
    missing = [n for n in names if f"`{n}`" not in reference]
    assert not missing, missing


def test_is_known_accepts_fixed_names_and_component_families_only():
    assert M.is_known("guidance/lambda")
    assert M.is_known("critic/score/accuracy") and M.is_known("val/score/format")
    assert not M.is_known("guidance/made_up")
    assert not M.is_known("val/score/")
    assert not M.is_known("timing_s/nonexistent_stage")


def test_every_guidance_and_algorithm_knob_has_a_documented_row():
    for cls, prefix in (
        (OffPolicyGuidanceConfig, "worker.rollout.offpolicy_guidance"),
        (AlgorithmConfig, "algorithm"),
        (DistillConfig, "algorithm.distill"),
    ):
        documented = docs.field_docs(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.default_factory):
                continue  # expanded under its own prefix
            assert documented.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
            assert re.search(rf"\| `{re.escape(prefix)}\.{f.name}` \| ", GUIDE), f.name


@dataclass
class _Inner:
    """A nested block."""

    depth: int = 3
    """How deep | it goes."""


@dataclass
class _Outer:
    """A block with every kind of default."""

    flag: bool = True
    """A switch."""
    name: str = ""
    """A name."""
    limit: float | None = None
    """A limit."""
    table: dict = field(default_factory=dict)
    """A mapping."""
    inner: _Inner = field(default_factory=_Inner)
    """The nested block."""
    undocumented: int = 1


def test_knob_rows_by_hand():
    assert docs.field_docs(_Outer) == {
        "flag": "A switch.", "name": "A name.", "limit": "A limit.", "table": "A mapping.",
        "inner": "The nested block.",
    }  # fmt: skip
    assert docs.knob_rows(_Outer, "x") == [
        "| `x.flag` | `true` | A switch. |",
        "| `x.name` | `''` | A name. |",
        "| `x.limit` | `null` | A limit. |",
        "| `x.table` | `{}` | A mapping. |",
        "| `x.inner.depth` | `3` | How deep \\| it goes. |",  # nested block expanded, pipe escaped
        "| `x.undocumented` | `1` |  |",
    ]
    assert docs.knob_rows(_Outer, "x", only=("limit",)) == ["| `x.limit` | `null` | A limit. |"]


def test_algorithm_table_lists_every_registered_name():
    table = docs.algorithm_table()
    for key, registry in docs.REGISTRIES:
        for name in registry:
            aliases = "".join(f" (alias `{a}`)" for a in registry.aliases(name))
            assert f"| `{key}` | `{name}`{aliases} |" in table
    # the aliases the errors list are in the table too (otb, tir_otb, vanilla)
    for alias in ("`otb`", "`tir_otb`", "`vanilla`"):
        assert f"(alias {alias})" in table
    # the formula is the docstring's first paragraph, the paper its links, trailing dots dropped
    assert "| `algorithm.adv_estimator` | `rloo` | RLOO: A_i = R_i" in table
    assert "<https://arxiv.org/abs/2402.14740>" in table


def test_render_replaces_blocks_and_refuses_missing_markers():
    blocks = "".join(f"<!-- generated:{n} -->\nold\n<!-- /generated:{n} -->\n" for n in docs.BLOCKS)
    out = docs.render("intro\n" + blocks + "outro\n")
    assert out.startswith("intro\n") and out.endswith("outro\n") and "\nold\n" not in out
    assert docs.render(out) == out  # idempotent
    assert "| `guidance/lambda` |" in out
    with pytest.raises(ValueError, match="generated:metrics"):
        docs.render(blocks.split("<!-- generated:metrics -->")[0])


def test_sections_group_the_reference():
    assert next(d.name for d in in_section("Guidance")) == M.GUIDANCE_LAMBDA
    with pytest.raises(ValueError, match="valid: Guidance"):
        in_section("Nope")
