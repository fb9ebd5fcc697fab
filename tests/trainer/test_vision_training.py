"""Guided GRPO with images through the command line (speculative guidance at λ = 0.5 from a second
tiny Qwen2.5-VL, for the prompts whose draft group fails: `guide_when: group_fails`, a second
rollout stage on the selected rows and their images), on a folder of pictures to count written here: two steps whose draft engine
log-probs equal the actor's (so the weight sync reached the vision tower too) and whose responses
carry guidance tokens, checkpoints, a resume that repeats step 2, and an export that transformers
and our processor load."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REWARD = '''
def digit_share(reward_input):
    """The share of digits in the response: a reward an untrained model earns unevenly."""
    text = reward_input["response"]
    return {"overall": sum(c.isdigit() for c in text) / max(len(text), 1)}
'''


def run(tmp_path, run_dir, resume: str = "none", overrides: dict | None = None) -> list[dict]:
    """One CLI run of two steps (a checkpoint after each; `overrides` merged into the config);
    its logged step rows."""
    from omegaconf import OmegaConf

    data = tmp_path / "data"
    config = {
        "data": {"train_files": str(data / "data.jsonl"), "image_dir": str(data), "val_files": "",
                 "max_prompt_length": 64, "max_response_length": 6, "rollout_batch_size": 4, "shuffle": False},
        "algorithm": {"disable_kl": True, "max_mismatch_kl": 1e-6},
        "worker": {
            "actor": {"global_batch_size": 8, "micro_batch_size_per_device_for_update": 4,
                      "micro_batch_size_per_device_for_experience": 8,
                      "model": {"model_path": str(tmp_path / "model")}, "optim": {"lr": 1e-3}},
            "rollout": {"n": 2, "dtype": "float32", "gpu_memory_utilization": 0.02, "enforce_eager": True,
                        "offpolicy_guidance": {"enable": True, "model_path": str(tmp_path / "guidance"), "lam": 0.5,
                                               "dtype": "float32", "gpu_memory_utilization": 0.02,
                                               "guide_when": "group_fails", "fail_below": 1.0}},
            "reward": {"reward_function": f"{tmp_path / 'reward.py'}:digit_share", "reward_type": "sequential"},
        },
        "trainer": {"max_steps": 2, "save_freq": 1, "logger": ["file"], "save_checkpoint_path": str(run_dir),
                    "n_gpus_per_node": 1, "val_before_train": False, "resume": resume},
    }  # fmt: skip
    path = tmp_path / f"{run_dir.name}.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.merge(config, overrides or {})))
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main", f"config={path}"],
                          capture_output=True, text=True, timeout=840)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [
        json.loads(line) for line in (run_dir / "experiment_log.jsonl").read_text().splitlines()
    ]
    return [r for r in rows if "critic/score/mean" in r]


def test_two_steps_with_images_train_checkpoint_resume_and_export(tmp_path):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from verl.tasks.tiny_vlm import TinyVLMSpec, save_tiny_vlm, write_count_data
    from verl.utils.vision import load_processor

    save_tiny_vlm(str(tmp_path / "model"))
    save_tiny_vlm(str(tmp_path / "guidance"), TinyVLMSpec(seed=1))
    write_count_data(str(tmp_path / "data"), 16, seed=1)
    (tmp_path / "reward.py").write_text(REWARD)
    full = run(tmp_path, tmp_path / "full")
    assert [r["step"] for r in full] == [1, 2]
    for row in full:  # the engine samples what the actor computes, images included (float32)
        assert abs(row["mismatch/kl_v2"]) < 1e-6 and abs(row["mismatch/kl_v1"]) < 1e-4
        assert row["response_length/mean"] > 0
        assert row["guidance/offpolicy_token_ratio"] > 0 and row["guidance/lambda"] == 0.5
        assert row["guidance/guided_prompt_frac"] > 0  # the second stage re-ran failing prompts
    assert full[0]["actor/grad_norm"] > 0  # step 1 moved the weights step 2 sampled with
    export = tmp_path / "full" / "global_step_2" / "actor" / "hf"
    # the export loads in transformers, and both halves of the model moved
    before, after = (dict(Qwen2_5_VLForConditionalGeneration.from_pretrained(str(p)).named_parameters())
                     for p in (tmp_path / "model", export))  # fmt: skip
    assert set(before) == set(after)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any(k.startswith("model.visual.") for k in changed)
    assert any(k.startswith("model.language_model.") for k in changed)
    assert (
        load_processor(str(export)).image_token_id
        == load_processor(str(tmp_path / "model")).image_token_id
    )
    # resumed from the step-1 checkpoint: step 2 on the same prompts, to the same metrics
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full" / "global_step_1", resumed_dir / "global_step_1")
    resumed = run(tmp_path, resumed_dir, resume="auto")
    assert [r["step"] for r in resumed] == [2]
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "mismatch/kl_v1", "guidance/offpolicy_token_ratio"):  # fmt: skip
        assert resumed[0][key] == pytest.approx(full[1][key], rel=1e-4, abs=1e-6), key


def test_lora_with_images_trains_the_language_model_and_the_engine_follows(tmp_path):
    """LoRA on the tiny Qwen2.5-VL (rank 4, GRPO without guidance) on the embedded `count` rows
    (pictures held in memory as PIL images, `embedded://count`): step 2 samples from the merged
    weights the sync sent (the actor's log-probs equal the engine's: `mismatch/kl_v2` below 1e-6),
    and the export's vision tower is the base model's while its language model moved."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from verl.tasks.tiny_vlm import save_tiny_vlm

    save_tiny_vlm(str(tmp_path / "model"))
    (tmp_path / "reward.py").write_text(REWARD)
    lora = {"data": {"train_files": "embedded://count@train"},
            "worker": {"actor": {"model": {"lora": {"rank": 4, "alpha": 8}}, "optim": {"lr": 3e-2}},
                       "rollout": {"offpolicy_guidance": {"enable": False}}},
            "trainer": {"save_freq": 2}}  # fmt: skip
    rows = run(tmp_path, tmp_path / "lora", overrides=lora)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(abs(r["mismatch/kl_v2"]) < 1e-6 for r in rows)
    assert rows[0]["actor/grad_norm"] > 0
    before, after = (dict(Qwen2_5_VLForConditionalGeneration.from_pretrained(str(p)).named_parameters())
                     for p in (tmp_path / "model", tmp_path / "lora" / "global_step_2" / "actor" / "hf"))  # fmt: skip
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("model.language_model.") for k in changed)
    assert max((after[k] - before[k]).abs().max().item() for k in changed) > 1e-3  # a real move


def config_args(model: str, data: str, tmp_path) -> list[str]:
    return [f"data.train_files={data}", f"data.image_dir={tmp_path / 'data'}", "data.val_files=",
            "data.rollout_batch_size=2", f"worker.actor.model.model_path={model}",
            "worker.rollout.offpolicy_guidance.enable=true"]  # fmt: skip


def test_a_guidance_that_preprocesses_images_otherwise_is_refused_before_ray(tmp_path):
    """A guidance whose image processor differs from the draft's (another pixel budget): one line
    from `prepare`, which runs before Ray starts, naming the first difference."""
    from verl.tasks.tiny_vlm import TinyVLMSpec, save_tiny_vlm, write_count_data
    from verl.trainer.config import ConfigError, load_config
    from verl.trainer.main import prepare

    model = save_tiny_vlm(str(tmp_path / "model"))
    data = write_count_data(str(tmp_path / "data"), 4)
    other = save_tiny_vlm(str(tmp_path / "other"), TinyVLMSpec(max_pixels=36 * 28 * 28))
    config = load_config([*config_args(model, data, tmp_path), f"worker.rollout.offpolicy_guidance.model_path={other}"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"^worker.rollout.offpolicy_guidance.model_path: .* preprocesses images unlike the draft \(size: \{'longest_edge': 28224, 'shortest_edge': 3136\} against \{'longest_edge': 12544"):  # fmt: skip
        prepare(config)
