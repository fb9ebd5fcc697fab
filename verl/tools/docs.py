"""Regenerates the reference tables of README_guidance.md from the code they describe.

Knob tables come from the config dataclasses (field, default, the field's one-line docstring),
algorithm tables from the registries (name, the docstring's formula line, its paper links) and
the metric reference from `verl.utils.metric_reference`. Each table sits between
`<!-- generated:NAME -->` and `<!-- /generated:NAME -->`; the prose around them is hand-written.

    python -m verl.tools.docs           # rewrite README_guidance.md in place
    python -m verl.tools.docs --check   # exit 1 when the committed file is stale (the tests do this)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import re
import sys
import textwrap
from pathlib import Path

from verl.trainer import core_algos as C
from verl.trainer.config import AlgorithmConfig, AsyncTrainingConfig
from verl.trainer.core_algos.advantage import GUIDED_ADVANTAGES
from verl.trainer.core_algos.guidance import LAM_GATES
from verl.trainer.core_algos.policy_loss import PolicyLossConfig
from verl.utils.metric_reference import SECTIONS, in_section
from verl.workers.actor.config import ActorConfig, LoraConfig
from verl.workers.rollout.config import OffPolicyGuidanceConfig
from verl.workers.rollout.multi_turn.config import MultiTurnConfig

GUIDE = Path(__file__).resolve().parents[2] / "README_guidance.md"

LOSS_FIELDS = tuple(
    f.name for f in dataclasses.fields(PolicyLossConfig) if f.name not in PolicyLossConfig.DERIVED
)
"""The keys of worker.actor.policy_loss a user sets (the others copy algorithm.*)."""

REGISTRIES = (
    ("algorithm.adv_estimator", C.ADV_ESTIMATORS),
    ("worker.actor.policy_loss.loss_type", C.POLICY_LOSSES),
    ("worker.actor.policy_loss.loss_agg_mode", C.LOSS_AGG_MODES),
    ("algorithm.tis_level, algorithm.mis_level", C.RATIO_LEVELS),
    ("worker.rollout.offpolicy_guidance.mode", C.GUIDANCE_MODES),
    ("worker.rollout.offpolicy_guidance.behavior", C.BEHAVIORS),
    ("worker.rollout.offpolicy_guidance.lam_schedule", C.LAM_SCHEDULES),
    ("worker.rollout.offpolicy_guidance.lam_gate", LAM_GATES),
    ("algorithm.guided_advantage", GUIDED_ADVANTAGES),
    ("algorithm.distill.mode", C.DISTILL_MODES),
    ("algorithm.kl_penalty, algorithm.distill.estimator", C.KL_ESTIMATORS),
)


def field_docs(cls: type) -> dict[str, str]:
    """The one-line docstring under each field of a dataclass, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body, docs = tree.body[0].body, {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "(required)"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`" if value else "`''`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def knob_rows(cls: type, prefix: str, only: tuple[str, ...] | None = None) -> list[str]:
    """Markdown rows `| key | default | effect |` of a config dataclass, nested blocks expanded."""
    docs, rows = field_docs(cls), []
    for field in dataclasses.fields(cls):
        if only is not None and field.name not in only:
            continue
        key = f"{prefix}.{field.name}"
        kind = field.default_factory if field.default_factory is not dataclasses.MISSING else None
        if kind is not None and dataclasses.is_dataclass(kind):
            rows += knob_rows(kind, key)
            continue
        rows.append(f"| `{key}` | {_default(field)} | {_cell(docs.get(field.name, ''))} |")
    return rows


def knob_table(cls: type, prefix: str, only: tuple[str, ...] | None = None) -> str:
    """A Markdown table of a config block's keys."""
    head = ["| key | default | effect |", "| --- | --- | --- |"]
    return "\n".join(head + knob_rows(cls, prefix, only))


def _paper_links(doc: str) -> str:
    links = [u.rstrip(".,);") for u in re.findall(r"https?://[^\s)]+", doc)]
    return ", ".join(f"<{u}>" for u in dict.fromkeys(links)) or "—"


def algorithm_table() -> str:
    """Every registered algorithm name with its formula line and paper, grouped by the key."""
    lines = ["| key | name | formula | paper |", "| --- | --- | --- | --- |"]
    for key, registry in REGISTRIES:
        for name in registry:
            doc = inspect.getdoc(registry.get(name)) or ""
            first = doc.split("\n\n")[0].replace("\n", " ")
            formula = first.split(" Paper:")[0].split(" Ref:")[0].strip()
            aliases = "".join(f" (alias `{a}`)" for a in registry.aliases(name))
            lines.append(
                f"| `{key}` | `{name}`{aliases} | {_cell(formula)} | {_paper_links(doc)} |"
            )
    return "\n".join(lines)


def metric_reference() -> str:
    """The metric reference: one table per dashboard section."""
    parts = []
    for section in SECTIONS:
        rows = [
            f"| `{d.name}` | {_cell(d.meaning)} | {_cell(d.healthy)} |" for d in in_section(section)
        ]
        parts.append(
            "\n".join(
                [
                    f"#### {section}",
                    "",
                    "| metric | meaning | healthy |",
                    "| --- | --- | --- |",
                    *rows,
                ]
            )
        )
    return "\n\n".join(parts)


BLOCKS = {
    "knobs-guidance": lambda: knob_table(
        OffPolicyGuidanceConfig, "worker.rollout.offpolicy_guidance"
    ),
    "knobs-algorithm": lambda: knob_table(AlgorithmConfig, "algorithm"),
    "knobs-actor-loss": lambda: "\n".join(
        [
            knob_table(PolicyLossConfig, "worker.actor.policy_loss", LOSS_FIELDS),
            *knob_rows(ActorConfig, "worker.actor", ("calculate_sum_pi_squared",)),
        ]
    ),
    "algorithms": algorithm_table,
    "knobs-multi-turn": lambda: knob_table(MultiTurnConfig, "worker.rollout.multi_turn"),
    "knobs-lora": lambda: knob_table(LoraConfig, "worker.actor.model.lora"),
    "knobs-async": lambda: knob_table(AsyncTrainingConfig, "async_training"),
    "metrics": metric_reference,
}
"""Generated block name -> its Markdown."""


def render(text: str) -> str:
    """`text` with every generated block replaced by its current content."""
    for name, make in BLOCKS.items():
        begin, end = f"<!-- generated:{name} -->", f"<!-- /generated:{name} -->"
        if begin not in text or end not in text:
            raise ValueError(f"README_guidance.md: missing the markers {begin} ... {end}")
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{make()}\n{end}{tail}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    parser.add_argument("--path", type=Path, default=GUIDE)
    args = parser.parse_args(argv)
    text = args.path.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print(f"{args.path} is stale: run python -m verl.tools.docs", file=sys.stderr)
            return 1
        return 0
    args.path.write_text(new)
    print(f"wrote {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
