"""Every bash launcher in examples/ builds a valid final config (`--dry-run`: no models, data or
Ray are touched), with the capability its name promises and the environment's overrides."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
LAUNCHERS = sorted((ROOT / "examples").glob("*.sh"))
EXPECTED = {  # launcher -> (dotted key, value) pairs its final config must hold
    "cpu_demo.sh": [("data.train_files", "embedded://arithmetic@train"), ("worker.rollout.offpolicy_guidance.enable", True)],
    "qwen2_5_1_5b_math_guided.sh": [("worker.rollout.offpolicy_guidance.enable", True),
                                    ("worker.rollout.offpolicy_guidance.mode", "speculative")],
    "qwen2_5_1_5b_math_guided_mix.sh": [("worker.rollout.offpolicy_guidance.mode", "mix")],
    "qwen2_5_1_5b_math_grpo.sh": [("worker.rollout.offpolicy_guidance.enable", False), ("algorithm.adv_estimator", "grpo")],
    "qwen2_5_1_5b_math_otb.sh": [("algorithm.adv_estimator", "optimal_token_baseline")],
    "qwen2_5_1_5b_math_opsm.sh": [("algorithm.opsm_delta", 0.1), ("worker.rollout.offpolicy_guidance.enable", True)],
    "qwen2_5_1_5b_math_cppo.sh": [("worker.actor.loss_type", "cppo")],
    "qwen2_5_1_5b_math_guided_multinode.sh": [("trainer.nnodes", 2), ("worker.rollout.offpolicy_guidance.enable", True)],
}  # fmt: skip


def dry_run(launcher: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(launcher), "--dry-run", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, **env})  # fmt: skip


def test_every_recipe_has_a_launcher():
    assert {p.name for p in LAUNCHERS} == set(EXPECTED)


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda p: p.name)
def test_launcher_dry_run_validates_its_config(launcher):
    gpu = launcher.name != "cpu_demo.sh"
    env = {"MODEL_PATH": "/models/draft", "N_GPUS": "4"} if gpu else {}
    proc = dry_run(launcher, "trainer.max_steps=3", **env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = OmegaConf.create(proc.stdout)
    for key, value in EXPECTED[launcher.name]:
        assert OmegaConf.select(config, key) == value, (launcher.name, key)
    assert config.trainer.max_steps == 3  # extra arguments reach the trainer
    if gpu:  # the environment's overrides reach it too
        assert (
            config.worker.actor.model.model_path == "/models/draft"
            and config.trainer.n_gpus_per_node == 4
        )


def test_a_bad_override_fails_in_one_line():
    proc = dry_run(ROOT / "examples" / "qwen2_5_1_5b_math_guided.sh", "worker.actor.loss_type=nope")
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines() == [proc.stderr.strip()]
        and "worker.actor.loss_type" in proc.stderr
    )


def test_guidance_gpus_take_their_share_of_the_node():
    """GUIDANCE_GPUS=2 on an 8-GPU node: 6 GPUs for the FSDP ranks and draft engines, 2 for the
    guidance engines (768 responses a step split over the 6 ranks)."""
    launcher = ROOT / "examples" / "qwen2_5_1_5b_math_guided.sh"
    proc = dry_run(launcher, "data.rollout_batch_size=96", N_GPUS="8", GUIDANCE_GPUS="2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = OmegaConf.create(proc.stdout)
    assert config.trainer.n_gpus_per_node == 6
    assert config.worker.rollout.offpolicy_guidance.n_gpus_per_node == 2
