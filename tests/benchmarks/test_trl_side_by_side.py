"""The TRL side-by-side script's pure logic: the config mapping, step timing and the report.

Nothing here installs TRL or trains: the TRL settings come from our resolved config, and the
timings and results are hand-made.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scripts import load

T = load("trl_side_by_side")


def ours(steps: int = 3, *extra: str):
    return T.load_config([*T.ours_args(steps, 7, Path("/tmp/unused")), *extra])


def test_trl_config_maps_our_plain_grpo_recipe():
    trl = T.trl_config(ours(3), 3, 7, "/tmp/o")
    # one of our steps: 64 prompts x 8 = 512 completions, 2 optimizer updates of 256
    assert trl["per_device_train_batch_size"] * trl["steps_per_generation"] == 64 * 8
    assert trl["per_device_train_batch_size"] == 256 and trl["gradient_accumulation_steps"] == 1
    assert trl["steps_per_generation"] == 2 and trl["max_steps"] == 6  # TRL counts optimizer steps
    assert trl["num_generations"] == 8 and trl["num_iterations"] == 1
    assert trl["loss_type"] == "bnpo" and trl["beta"] == 0.0 and trl["scale_rewards"] == "group"
    assert (trl["epsilon"], trl["epsilon_high"], trl["delta"]) == (0.2, 0.28, 3.0)
    assert trl["learning_rate"] == 1e-4 and trl["lr_scheduler_type"] == "constant"
    assert trl["warmup_steps"] == 0 and trl["weight_decay"] == 0.01
    assert (trl["adam_beta1"], trl["adam_beta2"], trl["max_grad_norm"]) == (0.9, 0.999, 1.0)
    assert trl["temperature"] == 1.0 and trl["top_p"] == 1.0 and trl["top_k"] == 0
    assert trl["max_completion_length"] == 4 and trl["use_vllm"] is False
    assert trl["bf16"] is False and trl["fp16"] is False
    assert trl["seed"] == trl["data_seed"] == 7 and trl["save_strategy"] == "no"
    json.dumps(trl)  # goes to the worker as JSON


def test_trl_config_follows_our_batch_settings():
    batch = (
        "worker.actor.global_batch_size=128",
        "worker.actor.micro_batch_size_per_device_for_update=128",
    )
    trl = T.trl_config(ours(2, *batch), 2, 0, "/tmp/o")
    assert trl["steps_per_generation"] == 4 and trl["max_steps"] == 8
    assert trl["per_device_train_batch_size"] == 128


@pytest.mark.parametrize(
    "override, reason",
    [
        ("worker.rollout.offpolicy_guidance.enable=true", "guidance must be off"),
        ("worker.actor.policy_loss.loss_agg_mode=seq-mean-token-mean", "token-mean"),
        ("worker.actor.optim.lr_warmup_steps=5", "constant learning rate"),
        (
            "worker.actor.optim.lr_warmup_steps=null worker.actor.optim.lr_warmup_ratio=0.1",
            "warm-up",
        ),
        ("worker.actor.global_batch_size=384", "whole global batches"),
    ],
)
def test_trl_config_refuses_what_it_cannot_map(override, reason):
    with pytest.raises(ValueError, match=reason):
        T.trl_config(ours(2, *override.split()), 2, 0, "/tmp/o")


def test_mapping_shows_our_values():
    rows = {keys: value for keys, value, _ in T.mapping(ours())}
    assert rows["data.rollout_batch_size, worker.rollout.n"] == "64, 8"
    assert rows["worker.actor.policy_loss.clip_ratio_dual"] == "3.0"
    assert rows["algorithm.tis_level"] == "none"  # no rollout correction without guidance


def test_step_timing_by_hand():
    # begin at 10 s; optimizer steps end at 11, 12.5 (our step 1) and 14, 15.5 (our step 2)
    clock = {
        "train_begin": 10.0,
        "step_ends": [11.0, 12.5, 14.0, 15.5],
        "train_runtime_s": 6.0,
        "setup_s": 1.0,
    }
    t = T.summarize_trl(clock, steps=2, updates=2)
    assert t["step_times"] == [2.5, 3.0] and t["s_per_step"] == 2.75
    assert t["train_runtime_s_per_step"] == 3.0
    with pytest.raises(RuntimeError, match="expected 6"):
        T.summarize_trl(clock, steps=3, updates=2)
    rows = [{"step": 0, "val/reward_score": 0.25},
            {"step": 1, "perf/time_per_step": 2.0, "timing_s/gen": 1.0, "critic/score/mean": 0.2},
            {"step": 2, "perf/time_per_step": 4.0, "timing_s/gen": 2.0, "critic/score/mean": 0.3,
             "val/reward_score": 0.5}]  # fmt: skip
    o = T.summarize_ours(rows, 2)
    assert o["timing_s_mean"] == {"timing_s/gen": 1.5} and o["train_reward"] == [0.2, 0.3]
    assert o["s_per_step"] == 3.0 and (o["val_accuracy_start"], o["val_accuracy_end"]) == (
        0.25,
        0.5,
    )


def test_report_by_hand():
    cfg = ours()
    result = {
        "steps": 3, "seed": 7, "step_definition": "64 prompts x 8", "accuracy_start": 0.3,
        "ours": {"s_per_step": 2.0, "accuracy_end": 0.42, "val_accuracy_start": 0.3, "val_accuracy_end": 0.42,
                 "train_reward": [0.2, 0.25, 0.3]},
        "trl": {"s_per_step": 5.0, "accuracy_end": 0.4, "train_reward": [0.21, 0.24, 0.31],
                "train_runtime_s_per_step": 5.1},
        "ratio_s_per_step": 2.5, "trl_install_s": None, "trl_torch_threads": 2, "cpu_count": 2,
        "load_avg_1min": [0.5, 1.5], "trl_versions": {"trl": "1.16.0"}, "mapping": T.mapping(cfg),
        "differences": T.differences(cfg),
    }  # fmt: skip
    md = T.report_md(result)
    assert "| seconds per step | 2.00 | 5.00 |" in md
    assert "| greedy accuracy after 3 steps | 42.0% | 40.0% |" in md
    assert "**2.50x**" in md and "trl 1.16.0" in md and "TRL env (reused)" in md
    assert "train_runtime / N: 5.10 s" in md
    assert "| 0.20 0.25 0.30 | 0.21 0.24 0.31 |" in md
    assert md.count("- differs: ") == len(T.differences(cfg)) > 5
    assert "`worker.actor.policy_loss.clip_ratio_dual` = 3.0 | delta" in md


def test_trl_env_is_reused_when_its_stamp_lists_the_pins(tmp_path, monkeypatch):
    def no_install(*a, **k):
        raise AssertionError("must not install")

    monkeypatch.setattr(T.subprocess, "run", no_install)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    (tmp_path / "trl-pins.json").write_text(json.dumps(list(T.TRL_PINS)))
    assert T.ensure_trl_env(tmp_path) is None
    (tmp_path / "trl-pins.json").write_text(json.dumps(["trl==0.1"]))
    assert T.ensure_trl_env(tmp_path, skip_install=True) is None  # used as it is
    with pytest.raises(SystemExit, match="no python"):
        T.ensure_trl_env(tmp_path / "absent", skip_install=True)


def test_alternating_runs_pool_their_steps_and_report_the_interval():
    # ours: runs of [2, 4] and [3, 3] s -> pooled mean 3.0; TRL: [1.5, 1.5] and [1.5, 1.5] -> 1.5
    runs = [
        {"s_per_step": 3.0, "step_times": [2.0, 4.0]},
        {"s_per_step": 3.0, "step_times": [3.0, 3.0]},
    ]
    ours = T.pooled(runs)
    assert ours["s_per_step"] == 3.0 and ours["step_times"] == [2.0, 4.0, 3.0, 3.0]
    assert ours["runs_s_per_step"] == [3.0, 3.0]
    trl = T.pooled([{"s_per_step": 1.5, "step_times": [1.5, 1.5]}] * 2)
    ratio, low, high = T.bootstrap_ratio(trl["step_times"], ours["step_times"])
    # TRL / ours = 1.5 / 3.0 = 0.5; resampled ours means lie in [2, 4], so the ratio in [0.375, 0.75]
    assert ratio == 0.5 and 0.375 <= low <= 0.5 <= high <= 0.75
    text = T.alternating(
        {"ratio_ci95": [low, high], "repeats": 2, "staleness": 1, "ours": ours, "trl": trl}
    )
    assert f"95 % bootstrap CI {low:.2f}-{high:.2f}; 2 alternating runs of each side" in text
    assert "ours at staleness 1: ours 3.00, 3.00 s, TRL 1.50, 1.50 s per step" in text
