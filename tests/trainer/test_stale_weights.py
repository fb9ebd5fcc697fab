"""The stale-weight detector (issue 27): a step whose `mismatch/kl_v2` (the gap between the draft
engine's sampling log-probs and the actor's log-probs of the same tokens) exceeds
`algorithm.max_mismatch_kl` fails in one line naming the step and the value. (A real run whose
weight sync skips a tensor: `test_a_sync_that_skips_a_tensor_fails_the_next_step` in
tests/trainer/test_e2e_training.py, which shares that module's Ray session.)"""

from __future__ import annotations

import math

import pytest
import torch

from verl.trainer.core_algos.kl import compute_mismatch_metrics
from verl.trainer.ray_trainer import StaleRolloutWeights, check_mismatch_kl
from verl.utils import metric_names as M


def test_check_fires_above_the_bound_only_and_names_step_and_value():
    check_mismatch_kl({M.MISMATCH_KL_V2: 0.049}, 0.05, step=3)  # below: nothing
    check_mismatch_kl({M.MISMATCH_KL_V2: 0.05}, 0.05, step=3)  # at the bound: nothing
    check_mismatch_kl({M.MISMATCH_KL_V2: 9.0}, None, step=3)  # null: the check is off
    check_mismatch_kl({M.MISMATCH_KL_V2: math.nan}, 0.05, step=3)  # no evidence either way
    check_mismatch_kl({}, 0.05, step=3)  # no draft tokens, no metric
    with pytest.raises(StaleRolloutWeights) as error:
        check_mismatch_kl({M.MISMATCH_KL_V2: 0.2013}, 0.05, step=7)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(
        "step 7: mismatch/kl_v2 = 0.2013 exceeds algorithm.max_mismatch_kl = 0.05: "
    )
    assert "null to turn the check off" in message


def test_hand_made_batch_through_the_mismatch_metrics():
    # 2 responses x 4 positions; the last position of response 1 is padding. Sampling log-probs
    # (μ) are the actor's (π_old) plus a gap d; one token is forced (μ > -0.01) and left out.
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.5, -0.005, -2.5, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    gap = torch.tensor([[0.4, -0.4, 0.4, -0.4], [0.4, 0.0, -0.4, 9.0]])  # 9.0: padding, unread
    metrics = compute_mismatch_metrics(old + gap, old, mask)
    # 6 unforced tokens, each d² = 0.16: kl_v2 = ½ · 0.16 = 0.08 > 0.05
    assert metrics[M.MISMATCH_KL_V2] == pytest.approx(0.08)
    with pytest.raises(StaleRolloutWeights, match=r"^step 2: mismatch/kl_v2 = 0\.08 exceeds"):
        check_mismatch_kl(metrics, 0.05, step=2)
    # the same batch with |d| = 0.3: ½ · 0.09 = 0.045, under the default bound
    small = compute_mismatch_metrics(old + 0.75 * gap, old, mask)
    assert small[M.MISMATCH_KL_V2] == pytest.approx(0.045)
    check_mismatch_kl(small, 0.05, step=2)


def test_default_bound_and_its_validation():
    from verl.trainer.config import load_config
    from verl.utils.config_checks import ConfigError

    assert load_config().algorithm.max_mismatch_kl == 0.05
    assert load_config(["algorithm.max_mismatch_kl=null"]).algorithm.max_mismatch_kl is None
    with pytest.raises(ConfigError, match=r"algorithm\.max_mismatch_kl=0\.0 is not valid"):
        load_config(["algorithm.max_mismatch_kl=0"])


def test_the_command_line_reports_it_in_one_line(monkeypatch, capsys):
    from verl.trainer import main as cli

    def run(prepared):
        check_mismatch_kl({M.MISMATCH_KL_V2: 0.3}, 0.05, step=2)

    monkeypatch.setattr(cli, "prepare", lambda config: None)
    monkeypatch.setattr(cli, "run", run)
    assert cli.main([]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: step 2: mismatch/kl_v2 = 0.3 exceeds algorithm.max_mismatch_kl")
