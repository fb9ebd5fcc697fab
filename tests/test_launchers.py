"""Every bash launcher in examples/ builds a valid final config (`--dry-run`: models, data and
reward are checked, nothing is loaded, Ray does not start), with the capability its name promises
and the environment's overrides; the launchers check their GPU variables before python starts."""

from __future__ import annotations

import json
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
    "cpu_toolchain.sh": [("data.train_files", "embedded://toolchain@train"), ("worker.rollout.multi_turn.enable", True),
                         ("worker.rollout.multi_turn.max_turns", 4), ("worker.rollout.offpolicy_guidance.enable", True),
                         ("worker.reward.reward_function", "toolchain")],
    "cpu_vision.sh": [("data.train_files", "embedded://count@train"), ("data.image_key", "images"),
                      ("worker.actor.model.model_path", ".cache/embedded/count/draft"),
                      ("worker.rollout.offpolicy_guidance.mode", "speculative"), ("worker.reward.reward_function", "count")],
    "qwen2_5_1_5b_tools_guided.sh": [("worker.rollout.multi_turn.enable", True),
                                     ("worker.rollout.multi_turn.tool_call_format", "hermes"),
                                     ("worker.rollout.offpolicy_guidance.mode", "speculative")],
    "qwen2_5_1_5b_math_guided.sh": [("worker.rollout.offpolicy_guidance.enable", True),
                                    ("worker.rollout.offpolicy_guidance.mode", "speculative")],
    "qwen2_5_1_5b_math_guided_async.sh": [("async_training.staleness", 1), ("worker.rollout.free_cache_engine", False),
                                          ("worker.rollout.offpolicy_guidance.mode", "speculative"),
                                          ("algorithm.tis_level", "token")],
    "qwen2_5_1_5b_math_guided_mix.sh": [("worker.rollout.offpolicy_guidance.mode", "mix")],
    "qwen2_5_vl_3b_geo3k_mix.sh": [("worker.rollout.offpolicy_guidance.mode", "mix"), ("data.image_key", "images"),
                                   ("data.max_pixels", 4194304), ("data.train_files", "hiyouga/geometry3k@train")],
    "qwen2_5_1_5b_math_grpo.sh": [("worker.rollout.offpolicy_guidance.enable", False), ("algorithm.adv_estimator", "grpo")],
    "qwen2_5_1_5b_math_otb.sh": [("algorithm.adv_estimator", "optimal_token_baseline")],
    "qwen2_5_1_5b_math_opsm.sh": [("algorithm.opsm_delta", 0.1), ("worker.rollout.offpolicy_guidance.enable", True)],
    "qwen2_5_1_5b_math_cppo.sh": [("worker.actor.policy_loss.loss_type", "cppo")],
    "qwen2_5_1_5b_math_guided_multinode.sh": [("trainer.nnodes", 2), ("worker.rollout.offpolicy_guidance.enable", True)],
    "qwen2_5_7b_math_lora_guided.sh": [("worker.actor.model.lora.rank", 32), ("worker.actor.model.lora.alpha", 64),
                                       ("worker.actor.model.lora.target_modules", "all-linear"),
                                       ("worker.rollout.offpolicy_guidance.mode", "speculative")],
    "qwen2_5_1_5b_math_guide_failing.sh": [("worker.rollout.offpolicy_guidance.guide_when", "group_fails"),
                                           ("worker.rollout.offpolicy_guidance.guided_samples", 4),
                                           ("worker.rollout.n", 8), ("worker.rollout.offpolicy_guidance.lam", 0.5)],
    "qwen2_5_1_5b_math_mentor.sh": [("worker.rollout.offpolicy_guidance.lam_gate", "entropy"),
                                    ("worker.rollout.offpolicy_guidance.guided_samples", 4), ("worker.rollout.n", 12),
                                    ("algorithm.guided_advantage", "mentor"), ("algorithm.tis_level", "none")],
}  # fmt: skip


def dry_run(launcher: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(launcher), "--dry-run", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, **env})  # fmt: skip


def test_every_recipe_has_a_launcher():
    assert {p.name for p in LAUNCHERS} == set(EXPECTED)


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda p: p.name)
def test_launcher_dry_run_validates_its_config(launcher):
    gpu = not launcher.name.startswith("cpu_")
    # a hub id not cached here passes the dry run as one the run downloads (not with HF_HUB_OFFLINE)
    env = {"MODEL_PATH": "Org/draft", "N_GPUS": "4", "HF_HUB_OFFLINE": "0"} if gpu else {}
    proc = dry_run(launcher, "trainer.max_steps=3", **env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1].startswith("# dry run: config valid; checked ")
    config = OmegaConf.create(proc.stdout)
    for key, value in EXPECTED[launcher.name]:
        assert OmegaConf.select(config, key) == value, (launcher.name, key)
    assert config.trainer.max_steps == 3  # extra arguments reach the trainer
    if gpu:  # the environment's overrides reach it too
        assert (
            config.worker.actor.model.model_path == "Org/draft"
            and config.trainer.n_gpus_per_node == 4
        )


def test_mentor_launcher_exact_switches_on_the_importance_weights():
    """EXACT=1 picks configs/mentor_exact.yaml: the same selective guidance, with token TIS."""
    proc = dry_run(ROOT / "examples" / "qwen2_5_1_5b_math_mentor.sh", EXACT="1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = OmegaConf.create(proc.stdout)
    assert config.algorithm.tis_level == "token" and config.algorithm.guided_advantage == "mentor"
    assert config.worker.rollout.offpolicy_guidance.lam_gate == "entropy"
    assert config.trainer.experiment_name == "qwen2_5_1_5b_math_mentor_exact"


def test_guide_failing_launcher_prefix_adds_the_teacher_prefix():
    """PREFIX=1 merges configs/teacher_prefix.yaml after guide_failing.yaml: the guidance writes a
    prefix of half the response, shortened to 0, and λ is 0 after it."""
    proc = dry_run(ROOT / "examples" / "qwen2_5_1_5b_math_guide_failing.sh", PREFIX="1",
                   MODEL_PATH="Org/draft", N_GPUS="4", HF_HUB_OFFLINE="0")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    g = OmegaConf.create(proc.stdout).worker.rollout.offpolicy_guidance
    assert (g.guide_when, g.prefix_fraction, g.prefix_fraction_end, g.lam) == (
        "group_fails",
        0.5,
        0.0,
        0.0,
    )
    assert (
        OmegaConf.create(proc.stdout).trainer.experiment_name == "qwen2_5_1_5b_math_teacher_prefix"
    )


def test_a_bad_override_fails_in_one_line():
    proc = dry_run(
        ROOT / "examples" / "qwen2_5_1_5b_math_guided.sh", "worker.actor.policy_loss.loss_type=nope"
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines() == [proc.stderr.strip()]
        and "worker.actor.policy_loss.loss_type" in proc.stderr
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


def test_draft_gpus_take_their_share_of_the_node():
    """The async launcher with DRAFT_GPUS=2 and GUIDANCE_GPUS=2 on an 8-GPU node: 4 GPUs for the
    FSDP ranks, 2 for draft engines of their own (one replica each), 2 for the guidance."""
    launcher = ROOT / "examples" / "qwen2_5_1_5b_math_guided_async.sh"
    proc = dry_run(launcher, N_GPUS="8", GUIDANCE_GPUS="2", DRAFT_GPUS="2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = OmegaConf.create(proc.stdout)
    assert config.trainer.n_gpus_per_node == 4
    assert config.worker.rollout.n_gpus_per_node == 2 and config.worker.rollout.num_replicas == 2
    assert config.worker.rollout.offpolicy_guidance.n_gpus_per_node == 2


def test_readme_gpu_quickstart_takes_hub_ids(tmp_path, monkeypatch):
    """README's "On a GPU box" command, hub ids as given, with tiny same-tokenizer models under
    those ids in a local Hugging Face cache (HF_HUB_OFFLINE=1): `--dry-run` passes and keeps the
    ids, and the model checks `prepare` runs before Ray (`check_models`) resolve both to their
    snapshots. Without the cache the same command stops in one line naming the key."""
    from verl.tasks.tiny_lm import TinyLMSpec, save_tiny_lm
    from verl.trainer.config import load_config, to_dict
    from verl.trainer.main import check_models
    from verl.utils.model_path import add_to_hub_cache

    readme = (ROOT / "README.md").read_text()
    env = {"MODEL_PATH": "Qwen/Qwen2.5-1.5B-Instruct", "GUIDANCE_PATH": "Qwen/Qwen2.5-7B-Instruct",
           "TRAIN_FILES": "hiyouga/math12k@train", "VAL_FILES": "hiyouga/math12k@test", "N_GPUS": "8"}  # fmt: skip
    command = " ".join(f"{k}={v}" for k, v in env.items())
    assert command in " ".join(readme.replace("\\\n", " ").split())  # still the README's command
    hub = tmp_path / "hub"
    (tmp_path / "math12k").mkdir()  # the dry run checks that the data resolves (rows are not read)
    (tmp_path / "math12k" / "train.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    add_to_hub_cache(
        str(tmp_path / "math12k"), "hiyouga/math12k", cache_dir=str(hub), repo_type="dataset"
    )
    for name, spec in (("MODEL_PATH", TinyLMSpec(hidden_size=64, num_hidden_layers=1)),
                       ("GUIDANCE_PATH", TinyLMSpec(num_hidden_layers=1, seed=2))):  # fmt: skip
        add_to_hub_cache(save_tiny_lm(str(tmp_path / name), spec), env[name], cache_dir=str(hub))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    launcher = ROOT / "examples" / "qwen2_5_1_5b_math_guided.sh"
    proc = dry_run(launcher, **env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = OmegaConf.create(proc.stdout)
    assert printed.worker.actor.model.model_path == env["MODEL_PATH"]
    (tmp_path / "final.yaml").write_text(proc.stdout)
    config = load_config([f"config={tmp_path / 'final.yaml'}"])
    reloaded = json.loads(json.dumps(to_dict(config)))  # tuples as the YAML's lists
    assert reloaded == OmegaConf.to_container(printed)  # the command's config, exactly
    check_models(config)
    for key, name in (("worker.actor.model.model_path", "MODEL_PATH"),
                      ("worker.rollout.offpolicy_guidance.model_path", "GUIDANCE_PATH")):  # fmt: skip
        resolved = OmegaConf.select(OmegaConf.structured(config), key)
        assert resolved.startswith(str(hub / ("models--" + env[name].replace("/", "--"))))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    proc = subprocess.run(["bash", str(launcher), "trainer.max_steps=1"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHON": sys.executable, **env})  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith(
        "error: worker.actor.model.model_path: 'Qwen/Qwen2.5-1.5B-Instruct' is not a local folder"
    )


GUIDANCE_GPU_LAUNCHERS = ["qwen2_5_1_5b_math_guided.sh", "qwen2_5_1_5b_math_guided_multinode.sh",
                          "qwen2_5_1_5b_math_guided_async.sh",
                          "qwen2_5_1_5b_math_mentor.sh"]  # fmt: skip


@pytest.mark.parametrize("name", GUIDANCE_GPU_LAUNCHERS)
@pytest.mark.parametrize(
    ("env", "start"),
    [({"N_GPUS": "8", "GUIDANCE_GPUS": "8"}, "error: GUIDANCE_GPUS=8 is not valid with N_GPUS=8; expected 0 "),
     ({"GUIDANCE_GPUS": "two"}, "error: GUIDANCE_GPUS=two is not valid with N_GPUS=8"),
     ({"GUIDANCE_GPUS": "4", "DRAFT_GPUS": "4"},
      "error: DRAFT_GPUS=4 is not valid with N_GPUS=8 and GUIDANCE_GPUS=4; expected 0 "),
     ({"N_GPUS": "abc"}, "error: N_GPUS=abc is not valid; expected a whole number >= 1"),
     ({"NNODES": "0"}, "error: NNODES=0 is not valid; expected a whole number >= 1")],
)  # fmt: skip
def test_a_bad_gpu_variable_fails_in_bash_naming_it(name, env, start):
    """scripts/launcher_gpus.sh: checked before python starts (nothing on stdout), exit 2."""
    proc = dry_run(ROOT / "examples" / name, **env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith(start), proc.stderr


def test_an_uneven_split_names_the_launcher_variables():
    """GUIDANCE_GPUS=2 with the default batch: 1024 responses over 6 ranks; the one line names the
    data key and the launcher variables that made trainer.n_gpus_per_node 6."""
    proc = dry_run(ROOT / "examples" / "qwen2_5_1_5b_math_guided.sh", GUIDANCE_GPUS="2")
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert err.splitlines() == [err]
    assert err.startswith("error: data.rollout_batch_size=128 is not valid; ")
    assert (
        "launcher: trainer.n_gpus_per_node = N_GPUS - GUIDANCE_GPUS - DRAFT_GPUS = 8 - 2 - 0" in err
    )


def test_a_dry_run_never_imports_tensordict():
    """The command line's module and what a dry run reads (config, data, reward) leave tensordict
    (and with it torch._dynamo, about 2 s of every launcher's dry run) to the workers."""
    code = "import sys, verl.trainer.main; print(sorted(m for m in ('tensordict', 'verl.protocol') if m in sys.modules))"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]


@pytest.mark.parametrize(
    ("name", "env", "start"),
    [("qwen2_5_1_5b_math_mentor.sh", {"EXACT": "yes"}, "error: EXACT=yes is not valid; expected 0 (default: MENTOR"),
     ("qwen2_5_1_5b_math_guide_failing.sh", {"PREFIX": "2"}, "error: PREFIX=2 is not valid; expected 0 (default: no"),
     ("qwen2_5_vl_3b_geo3k_mix.sh", {"DRAFT_ONLY": "yes"}, "error: DRAFT_ONLY=yes is not valid; expected 0 (default: 1 of 8")],
)  # fmt: skip
def test_an_on_off_variable_takes_0_or_1_only(name, env, start):
    """scripts/launcher_flags.sh: EXACT=yes would otherwise run the other recipe."""
    proc = dry_run(ROOT / "examples" / name, **env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith(start) and "or 1 (" in proc.stderr, proc.stderr
