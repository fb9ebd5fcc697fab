"""The file logger and the plot tool."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from verl.tools.plot_metrics import panels, plot_run, read_log
from verl.utils.tracking import Tracking


def test_file_logger_writes_one_json_line_per_call_and_nulls_non_finite(tmp_path):
    tracker = Tracking(["file"], "p", "e", str(tmp_path), {}, total_steps=2)
    tracker.log({"critic/score/mean": 0.5, "guidance/is_weight_mean": math.nan}, step=1)
    tracker.log({"val/reward_score": 0.25}, step=1)
    tracker.finish()
    rows = [json.loads(line) for line in open(tmp_path / "experiment_log.jsonl")]
    assert rows == [{"step": 1, "critic/score/mean": 0.5, "guidance/is_weight_mean": None},
                    {"step": 1, "val/reward_score": 0.25}]  # fmt: skip


def test_unknown_logger_is_refused(tmp_path):
    with pytest.raises(ValueError, match="valid: console, file, wandb, tensorboard"):
        Tracking(["mlflow"], "p", "e", str(tmp_path), {}, total_steps=1)


def test_tensorboard_and_offline_wandb_write_their_files(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = Tracking(["tensorboard", "wandb"], "p", "e", str(tmp_path), {"a": 1}, total_steps=1)
    tracker.log({"critic/score/mean": 0.5}, step=1)
    tracker.finish()
    assert os.listdir(tmp_path / "tensorboard")
    assert any(name.startswith("offline-run") for name in os.listdir(tmp_path / "wandb"))


def test_plots_cover_reward_guidance_mismatch_distill_and_weights(tmp_path):
    with open(tmp_path / "experiment_log.jsonl", "w") as f:
        for step in range(1, 4):
            f.write(json.dumps({"step": step, "critic/score/mean": step / 4, "response_length/mean": 3.0,
                                "guidance/offpolicy_token_ratio": 0.1, "guidance/is_weight_mean": 1.0,
                                "mismatch/kl_v1": 0.0, "actor/pg_loss": None, "distill/reverse_kl": 0.5}) + "\n")  # fmt: skip
    assert read_log(str(tmp_path))["critic/score/mean"] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    written = plot_run(str(tmp_path))
    names = sorted(os.path.basename(p) for p in written)
    assert names == [
        "distill.png",
        "guidance.png",
        "importance_weights.png",
        "mismatch.png",
        "response_length.png",
        "reward.png",
    ]
    assert all(os.path.getsize(p) > 1000 for p in written)
    cli = subprocess.run([sys.executable, "-m", "verl.tools.plot_metrics", str(tmp_path)], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert cli.returncode == 0 and "reward.png" in cli.stdout


def test_panels_read_first_what_guidance_did_and_name_the_metrics_that_stayed_zero():
    series = {name: [(1, 0.0), (2, value)] for name, value in {
        "guidance/is_clip_frac": 0.0, "guidance/missing_logprob_ratio": 0.0,
        "guidance/draft_lookup_ratio": 0.0, "guidance/accept_rate": 0.6,
        "guidance/behavior_kl": 0.02, "guidance/lambda": 0.5, "guidance/is_weight_mean": 1.1,
        "guidance/zeta_unlisted": 0.3, "critic/score/mean": 0.4}.items()}  # fmt: skip
    layout = panels(series)
    drawn, zero = layout["guidance"]
    # FIRST's order, then the rest by name; is_weight_mean is drawn with the importance weights
    assert drawn == ["guidance/lambda", "guidance/accept_rate", "guidance/behavior_kl",
                     "guidance/zeta_unlisted"]  # fmt: skip
    assert zero == ["guidance/draft_lookup_ratio", "guidance/missing_logprob_ratio"]
    assert layout["importance_weights"] == (["guidance/is_weight_mean"], ["guidance/is_clip_frac"])
    assert layout["reward"] == (["critic/score/mean"], [])


SAMPLES = [{"prompt": "7+8=", "response": "15", "ground_truth": "15", "score": 1.0},
           {"prompt": "a long\nprompt " * 20, "response": "3", "ground_truth": "4", "score": 0.0}]  # fmt: skip


def test_validation_samples_go_to_their_own_file_and_a_short_console_line_each(tmp_path, capsys):
    tracker = Tracking(["console", "file"], "p", "e", str(tmp_path), {}, total_steps=4)
    tracker.log_generations(SAMPLES, step=0)
    tracker.log_generations([], step=1)  # nothing to log: nothing written
    tracker.log_generations(SAMPLES, step=2)
    tracker.finish()
    rows = [json.loads(line) for line in open(tmp_path / "val_generations.jsonl")]
    assert rows == [{"step": step, **sample} for step in (0, 2) for sample in SAMPLES]
    assert not (tmp_path / "experiment_log.jsonl").read_text()  # the metrics file stays flat
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("val step")]
    assert lines[0] == "val step 0 | score 1 | 7+8= -> 15 (truth 15)"
    assert len(lines) == 4 and all(len(line) < 200 and "\n" not in line for line in lines)
    assert lines[1].startswith("val step 0 | score 0 | a long⏎prompt a long⏎prompt")


def test_offline_wandb_gets_a_table_of_every_validation_so_far(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = Tracking(["wandb"], "p", "e", str(tmp_path), {}, total_steps=2)
    tracker.log_generations(SAMPLES, step=0)
    tracker.log_generations(SAMPLES[:1], step=2)
    tracker.finish()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    tables = [json.loads(path.read_text()) for path in (run / "files/media/table/val").iterdir()]
    assert all(
        name.startswith("generations_") for name in os.listdir(run / "files/media/table/val")
    )
    last = max(tables, key=lambda table: len(table["data"]))
    assert last["columns"] == ["step", "prompt", "response", "ground_truth", "score"]
    assert last["data"] == [[0, *SAMPLES[0].values()], [0, *SAMPLES[1].values()],
                            [2, *SAMPLES[0].values()]]  # fmt: skip
