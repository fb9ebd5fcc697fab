"""The wandb dashboard is built from the metric reference, shows only logged names, and fails cleanly
offline."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from verl.tools import wandb_dashboard as D
from verl.utils import metric_names as M
from verl.utils import metric_reference as R


@pytest.fixture(scope="module")
def workspace():
    return D.build_workspace("e", "p")


def _keys(workspace) -> list[str]:
    return [key for section in workspace.sections for panel in section.panels for key in panel.y]


def test_every_panel_key_is_a_logged_metric(workspace):
    keys = _keys(workspace)
    assert keys, "the dashboard has no panels"
    assert [k for k in keys if not M.is_known(k)] == []
    assert len(keys) == len(set(keys)), "a metric has two panels"
    for section in workspace.sections:
        for panel in section.panels:
            assert panel.y == [panel.title]  # one metric per panel, titled by its name


def test_every_fixed_name_has_a_panel(workspace):
    keys = set(_keys(workspace))
    guidance = [name for name in M.ALL_FIXED if name.startswith("guidance/")]
    assert guidance and set(guidance) <= keys
    assert set(M.ALL_FIXED) - keys == set()


def test_sections_follow_the_reference(workspace):
    assert [s.name for s in workspace.sections] == list(R.SECTIONS)
    opened = {s.name for s in workspace.sections if s.is_open}
    assert opened == {"Guidance", "Off-policy correction"}
    for section in workspace.sections:  # panel order is the reference order
        assert [p.y[0] for p in section.panels] == D.panel_keys(section.name)


def test_workspace_serialises_offline(workspace):
    view = workspace._to_model()  # what `.save()` uploads; builds without any network call
    spec = view.spec.model_dump_json(by_alias=True, exclude_none=True)
    assert view.entity == "e" and view.project == "p" and view.display_name == "guided RL"
    assert "guidance/lambda" in spec and "timing_s/gen" in spec


def test_dry_run_prints_sections_and_keys(capsys):
    assert D.main(["--entity", "e", "--project", "p", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "Guidance" in out and "guidance/lambda" in out and "perf/throughput" in out


def test_save_without_credentials_fails_in_one_line(tmp_path):
    # Real save path in a subprocess: no API key, HOME (and so ~/.netrc) in an empty tmp dir.
    # wandb raises "No API key configured" before any request, so nothing is contacted; the
    # timeouts only bound a regression that would try the network.
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        HOME=str(tmp_path),
        WANDB_MODE="offline",
        WANDB_CONFIG_DIR=str(tmp_path / "wandb"),
        WANDB_HTTP_TIMEOUT="2",
        WANDB__SERVICE_WAIT="2",
        NETRC=str(tmp_path / ".netrc"),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "verl.tools.wandb_dashboard", "--entity", "e", "--project", "p"],
        env=env,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: could not save the workspace"), lines
    assert "wandb login" in lines[0]
    assert proc.stdout == ""
