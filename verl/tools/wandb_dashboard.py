"""Saved wandb workspace (a "view") of the guided-RL metrics: one section per dashboard section of
`verl.utils.metric_reference`, one line plot per logged metric, in reference order.

Usage:
    python -m verl.tools.wandb_dashboard --entity ENTITY --project PROJECT [--name NAME]
    python -m verl.tools.wandb_dashboard --entity ENTITY --project PROJECT --dry-run

`--dry-run` prints the sections and their panel keys without touching the network; otherwise the
view is uploaded (needs `wandb login`) and its URL printed. Sections and keys come only from
`metric_reference`, so the dashboard follows the logged names. `<component>` families
(e.g. `critic/score/<component>`) are not plain keys and get no panel here: their members depend
on the reward function (the project's default workspace still shows them).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws

from verl.utils import metric_reference as R

OPEN_SECTIONS = ("Guidance", "Off-policy correction")
"""Sections shown expanded when the view opens; the others start collapsed."""


def panel_keys(section: str) -> list[str]:
    """The plain metric keys of one section, in reference order (`<component>` families left out)."""
    return [doc.name for doc in R.in_section(section) if "<component>" not in doc.name]


def build_workspace(entity: str, project: str, name: str = "guided RL") -> ws.Workspace:
    """The workspace object, one section per `metric_reference.SECTIONS` entry (no network)."""
    sections = [
        ws.Section(
            name=section,
            panels=[wr.LinePlot(title=key, x="Step", y=[key]) for key in panel_keys(section)],
            is_open=section in OPEN_SECTIONS,
        )
        for section in R.SECTIONS
    ]
    return ws.Workspace(entity=entity, project=project, name=name, sections=sections)


def describe(workspace: ws.Workspace) -> str:
    """Plain-text listing of the workspace's sections and their panel keys."""
    lines = [f"{workspace.entity}/{workspace.project}: view '{workspace.name}'"]
    for section in workspace.sections:
        state = "open" if section.is_open else "closed"
        lines.append(f"{section.name} ({len(section.panels)} panels, {state})")
        lines.extend(f"  {key}" for panel in section.panels for key in panel.y)
    return "\n".join(lines)


def _one_line(exc: BaseException) -> str:
    """`Type: message` of an exception, whitespace collapsed to a single line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m verl.tools.wandb_dashboard",
        description="Create a saved wandb workspace of the guided-RL metrics.",
    )
    parser.add_argument("--entity", required=True, help="wandb entity (user or team)")
    parser.add_argument("--project", required=True, help="wandb project the runs log to")
    parser.add_argument("--name", default="guided RL", help="name of the saved view")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the sections and keys; no network"
    )
    args = parser.parse_args(argv)

    try:
        workspace = build_workspace(args.entity, args.project, args.name)
    except ValueError as exc:  # pydantic's validation (e.g. an emoji in --name)
        parser.error(_one_line(exc))
    if args.dry_run:
        print(describe(workspace))
        return 0
    try:
        workspace.save()
        url = workspace.url
    except Exception as exc:  # wandb raises many types (auth, HTTP, GraphQL): one line for all
        print(
            f"error: could not save the workspace to wandb ({_one_line(exc)}): "
            "run `wandb login` first and check the network",
            file=sys.stderr,
        )
        return 1
    print(url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
