"""Two training steps on the real pretrained pair (verl/tasks/real_model.py) through the CLI,
multi-turn with the `lookup` tool.

The draft (SmolLM2-135M-Instruct without four middle layers) is the actor, the full model the
speculative guidance (default top-20 log-probs) in every policy turn; prompts go through the
model's own chat template with the tool instructions as the system message, tool results come
back as ChatML tool turns (episodes of at most 2 turns). The reward rises with the share of
digits in the response and, by one, when the looked-up value appears in it, so the two samples of
a prompt almost never tie and the GRPO advantages are non-zero: the exported weights must differ
from the draft's. (The engine-level multi-turn checks on this pair are in
tests/workers/rollout/test_multi_turn_real.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.e2e

QUESTIONS = [("What is the value of k07? Look it up.", "70"), ("Look up k03.", "22"),
             ("Find the value stored under k05.", "96"), ("What does the table hold for k01?", "48")]  # fmt: skip
REWARD = """
def answer_and_digits(reward_input):
    text = reward_input["response"]
    digits = sum(c.isdigit() for c in text) / max(len(text), 1)
    return {"overall": float(str(reward_input["ground_truth"]) in text) + digits}
"""


def run_config(real_pair, tmp_path) -> dict:
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"prompt": q + " Answer with the number.", "answer": a}) + "\n"
                            for q, a in QUESTIONS))  # fmt: skip
    (tmp_path / "reward.py").write_text(REWARD)
    return {
        "data": {"train_files": str(data), "val_files": "", "apply_chat_template": True,
                 "max_prompt_length": 128, "max_response_length": 32, "rollout_batch_size": 2},
        "algorithm": {"disable_kl": True},
        "worker": {
            "actor": {"global_batch_size": 4, "micro_batch_size_per_device_for_update": 4,
                      "micro_batch_size_per_device_for_experience": 4,
                      "model": {"model_path": str(real_pair.draft)}, "optim": {"lr": 1e-5}},
            "rollout": {"n": 2, "dtype": "float32", "gpu_memory_utilization": 0.02, "enforce_eager": True,
                        "offpolicy_guidance": {"enable": True, "model_path": str(real_pair.guidance),
                                               "dtype": "float32", "gpu_memory_utilization": 0.02,
                                               "mode": "speculative"},
                        "multi_turn": {"enable": True, "tools": ["lookup"], "tool_call_format": "embedded",
                                       "max_turns": 2, "max_tool_response_length": 16}},
            "reward": {"reward_function": f"{tmp_path / 'reward.py'}:answer_and_digits",
                       "reward_type": "sequential"},
        },
        "trainer": {"max_steps": 2, "logger": ["file"], "save_checkpoint_path": str(tmp_path / "run"),
                    "n_gpus_per_node": 1, "val_before_train": False, "resume": "none"},
    }  # fmt: skip


def test_two_multi_turn_cli_steps_on_the_real_pair_train_the_draft(real_pair, tmp_path):
    from omegaconf import OmegaConf
    from safetensors.torch import load_file

    config = tmp_path / "run.yaml"
    config.write_text(OmegaConf.to_yaml(OmegaConf.create(run_config(real_pair, tmp_path))))
    command = [sys.executable, "-m", "verl.trainer.main", f"config={config}"]
    # (the timeout only guards against a hang: under pytest-timeout's 900 s; about 2 min idle)
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=840,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, (
        f"{' '.join(command)} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    )

    run_dir = tmp_path / "run"
    rows = [
        json.loads(line) for line in (run_dir / "experiment_log.jsonl").read_text().splitlines()
    ]
    steps = [r for r in rows if "critic/score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    shown = ("critic/score/mean", "response_length/mean", "guidance/offpolicy_token_ratio",
             "guidance/accept_rate", "guidance/behavior_kl", "guidance/topk_tail_mass")  # fmt: skip
    print(f"two steps on the real pair: {elapsed:.0f} s;",
          [{k: round(r[k], 3) for k in shown if k in r} for r in steps])  # fmt: skip
    for key in ("guidance/offpolicy_token_ratio", "guidance/is_weight_mean", "guidance/accept_rate",
                "guidance/behavior_kl", "guidance/topk_tail_mass", "guidance/lambda",
                "guidance/target_tv", "guidance/draft_lookup_ratio"):  # fmt: skip
        assert all(key in r for r in steps), f"{key} missing"
    # behavior_kl reads the real KL(μ ‖ p) (0.29 from HF forwards in the run), never the
    # floor's nonsense (512.6 and 150.3 before), and the target is near q_λ at the default K
    assert all(-0.5 < r["guidance/behavior_kl"] < 2.0 for r in steps)  # a k1 estimate: noisy
    assert all(0.0 <= r["guidance/target_tv"] < 0.5 for r in steps)
    assert all(0.0 <= r["guidance/offpolicy_token_ratio"] <= 1.0 for r in steps)
    assert all(0 < r["response_length/mean"] <= 32 for r in steps)
    for key in ("multiturn/turns_mean", "multiturn/tool_calls_mean", "multiturn/tool_token_frac",
                "multiturn/truncated_frac", "multiturn/retokenized_token_frac"):  # fmt: skip
        assert all(key in r for r in steps), f"{key} missing"
    assert all(1.0 <= r["multiturn/turns_mean"] <= 2.0 for r in steps)

    before = load_file(str(real_pair.draft / "model.safetensors"))
    after = load_file(str(run_dir / "global_step_2" / "actor" / "hf" / "model.safetensors"))
    assert set(before) <= set(after), sorted(set(before) - set(after))[:5]
    changed = [k for k in before if not torch.equal(before[k], after[k].to(before[k].dtype))]
    assert len(changed) >= len(before) // 2, f"only {len(changed)} of {len(before)} tensors changed"
