"""A 2-step multi-turn, tool-using, guided training run through the CLI (`python -m
verl.trainer.main`), Ray + FSDP + the vLLM draft engine and the guidance service on CPU, with tiny
char models edited to close calls often (`]`, the embedded format's stop string, the two with
different strengths), so episodes have tool turns and the guidance writes some policy tokens."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile

import pytest
import torch
import yaml

from verl.utils.metric_names import is_known

pytestmark = pytest.mark.e2e

REWARD = """
def digit_share(reward_input):
    text = reward_input["response"]
    return {"overall": sum(c.isdigit() for c in text) / max(len(text), 1)}
"""
MULTITURN_KEYS = ["multiturn/turns_mean", "multiturn/tool_calls_mean", "multiturn/tool_error_frac",
                  "multiturn/truncated_frac", "multiturn/tool_token_frac"]  # fmt: skip


GUIDED_KEYS = ["guidance/offpolicy_token_ratio", "guidance/is_weight_mean", "guidance/behavior_kl",
               "guidance/accept_rate"]  # fmt: skip


def calling_model(path: str, seed: int = 1, weight: float = 40.0) -> str:
    """A tiny char model where `]` (head weight `weight`) dominates wherever hidden dim 0 is
    positive."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.utils.tiny_lm import TinyLMSpec, save_tiny_lm

    save_tiny_lm(path, TinyLMSpec(hidden_size=64, num_hidden_layers=1, vocab_size=100, seed=seed))
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    close = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids("]")
    with torch.no_grad():
        lm.model.norm.weight.zero_()
        lm.model.norm.weight[0] = 1.0
        lm.lm_head.weight[:, 0] = 0.0
        lm.lm_head.weight[close, 0] = weight
    lm.save_pretrained(path)
    return path


def test_two_step_guided_multi_turn_run_trains_and_logs_its_metrics(tmp_path):
    from safetensors.torch import load_file

    draft = calling_model(str(tmp_path / "draft"))
    guide = calling_model(str(tmp_path / "guidance"), seed=5, weight=12.0)
    (tmp_path / "reward.py").write_text(REWARD)
    run_dir = str(tmp_path / "run")
    config = {
        "data": {"train_files": "embedded://arithmetic@train", "val_files": "", "apply_chat_template": False,
                 "max_prompt_length": 8, "max_response_length": 64, "rollout_batch_size": 4},
        "algorithm": {"disable_kl": True},
        "worker": {
            "actor": {"global_batch_size": 8, "micro_batch_size_per_device_for_update": 8,
                      "micro_batch_size_per_device_for_experience": 16,
                      "model": {"model_path": draft}, "optim": {"lr": 1e-3}},
            "rollout": {"n": 2, "dtype": "float32", "gpu_memory_utilization": 0.02, "enforce_eager": True,
                        "offpolicy_guidance": {"enable": True, "model_path": guide, "dtype": "float32",
                                               "gpu_memory_utilization": 0.02, "lam": 0.5},
                        "multi_turn": {"enable": True, "tools": ["lookup"], "tool_call_format": "embedded",
                                       "max_turns": 2, "max_tool_response_length": 16}},
            "reward": {"reward_function": f"{tmp_path / 'reward.py'}:digit_share", "reward_type": "sequential"},
        },
        "trainer": {"max_steps": 2, "logger": ["file"], "save_checkpoint_path": run_dir,
                    "n_gpus_per_node": 1, "val_before_train": False, "resume": "none"},
    }  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    env = {
        **os.environ,
        "RAY_TMPDIR": tempfile.mkdtemp(prefix="mt", dir="/tmp"),
    }  # short: socket paths
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main", f"config={tmp_path / 'run.yaml'}"],
                          capture_output=True, text=True, env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(run_dir, "experiment_log.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = [row for row in rows if "actor/pg_loss" in row]
    assert len(steps) == 2
    for row in steps:
        for key in MULTITURN_KEYS + GUIDED_KEYS:
            assert key in row and is_known(key), key
            assert row[key] is not None and math.isfinite(row[key]), (key, row[key])
        assert row["multiturn/tool_calls_mean"] > 0
        assert 0 < row["multiturn/tool_token_frac"] < 1
        assert (
            0 < row["guidance/offpolicy_token_ratio"] < 1
        )  # the guidance wrote some policy tokens
    before = load_file(os.path.join(draft, "model.safetensors"))
    after = load_file(os.path.join(run_dir, "global_step_2", "actor", "hf", "model.safetensors"))
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) >= len(before) // 2, f"only {changed} changed"
