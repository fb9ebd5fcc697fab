"""The demo's summary names the run's mode and shows the rows that apply; the Ctrl-C line."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from verl.trainer.config import load_config
from verl.trainer.demo import run_mode, summarize
from verl.trainer.main import interrupted_message

GUIDANCE = "worker.rollout.offpolicy_guidance"
GUIDED = [f"{GUIDANCE}.enable=true", f"{GUIDANCE}.model_path=/m"]


def _log(run_dir, rows) -> None:
    (run_dir / "plots").mkdir()
    with open(run_dir / "experiment_log.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


@pytest.mark.parametrize(
    ("args", "title"),
    [
        ([f"{GUIDANCE}.enable=false"], "GRPO (guidance off)"),
        (GUIDED, "GRPO, speculative guidance"),
        ([*GUIDED, f"{GUIDANCE}.mode=mix"], "GRPO, mix guidance"),
        ([*GUIDED, f"{GUIDANCE}.lam=0", "algorithm.adv_estimator=none", "algorithm.distill.coef=1"],
         "on-policy distillation (reward mode), the draft's own rollouts (λ = 0, the guidance only scores)"),
        ([*GUIDED, "algorithm.distill.coef=0.1"], "GRPO + on-policy distillation (reward mode), speculative guidance"),
    ],
)  # fmt: skip
def test_run_mode_names_what_trained(args, title):
    assert run_mode(load_config(args)) == title


def test_summary_leaves_out_guidance_rows_without_guidance(tmp_path):
    _log(tmp_path, [{"step": 0, "val/reward_score": 0.25},
                    {"step": 1, "critic/score/mean": 0.5}, {"step": 2, "critic/score/mean": 0.75},
                    {"step": 2, "val/reward_score": 0.5}])  # fmt: skip
    text = summarize(
        str(tmp_path), load_config(["config=examples/grpo_guided.yaml", f"{GUIDANCE}.enable=false"])
    )
    assert "=== GRPO (guidance off), embedded arithmetic task ===" in text
    assert "validation accuracy (draft alone, greedy)" in text
    assert (
        "25.0% -> 50.0%" in text
        and "training reward (rollouts)" in text
        and "50.0% -> 75.0%" in text
    )
    for absent in ("guidance tokens", "importance weight", "lambda", "guided", "reverse KL"):
        assert absent not in text, absent


def test_summary_names_an_overlays_task_and_its_sampled_validation(tmp_path):
    """`make demo ARGS="config=examples/count_guided.yaml"`: the vision task, validated at T = 1."""
    _log(tmp_path, [{"step": 0, "val/reward_score": 0.15}, {"step": 1, "critic/score/mean": 0.5},
                    {"step": 1, "val/reward_score": 0.2}])  # fmt: skip
    overlay = ["config=examples/grpo_guided.yaml", "config=examples/count_guided.yaml"]
    text = summarize(str(tmp_path), load_config(overlay))
    assert "=== GRPO, speculative guidance, embedded count task ===" in text
    assert "validation accuracy (draft, T = 1, n = 4)     15.0% -> 20.0%" in text


def test_summary_of_a_guided_distillation_run_shows_its_rows(tmp_path):
    _log(tmp_path, [{"step": 0, "val/reward_score": 0.25},
                    {"step": 1, "critic/score/mean": 0.5, "guidance/lambda": 0.5, "guidance/offpolicy_token_ratio": 0.1,
                     "guidance/is_weight_mean": 1.0, "distill/reverse_kl": 0.8},
                    {"step": 2, "critic/score/mean": 0.75, "guidance/lambda": 0.25, "guidance/offpolicy_token_ratio": 0.3,
                     "guidance/is_weight_mean": 0.98, "distill/reverse_kl": 0.4},
                    {"step": 2, "val/reward_score": 0.5}])  # fmt: skip
    text = summarize(str(tmp_path), load_config([*GUIDED, "algorithm.distill.coef=0.1"]))
    assert "training reward (guided rollouts)" in text
    assert "20.0%" in text and "0.990" in text and "0.50 -> 0.25" in text  # means, λ first -> last
    assert "reverse KL to the guidance (first -> last)" in text and "0.800 -> 0.400" in text


def test_interrupted_message_names_the_step_checkpoint_and_resume(tmp_path):
    config = load_config([])
    trainer = SimpleNamespace(
        global_step=7, total_steps=40, run_dir=str(tmp_path), _checkpoints=lambda: [5, 6]
    )
    assert interrupted_message(trainer, config) == (
        f"interrupted at step 7 of 40; last complete checkpoint: {tmp_path}/global_step_6 (step 6); "
        "to resume from it, run the same command again")  # fmt: skip
    assert "add trainer.resume=auto" in interrupted_message(
        trainer, load_config(["trainer.resume=none"])
    )
    trainer._checkpoints = list
    assert "no complete checkpoint" in interrupted_message(trainer, config)
    assert (
        interrupted_message(None, config)
        == "interrupted while starting the workers; nothing was trained"
    )
