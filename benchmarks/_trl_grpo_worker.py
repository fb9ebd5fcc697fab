"""TRL side of trl_side_by_side.py: GRPOTrainer on the embedded draft, run in the TRL virtualenv.

Imports only packages of that env (no `verl`). Reads a spec JSON (model, train rows, GRPOConfig
kwargs, output paths), trains, saves the final model and writes a result JSON.

Usage:
    .cache/trl-venv/bin/python benchmarks/_trl_grpo_worker.py SPEC.json
"""

from __future__ import annotations

import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def exact_match(completions: list[str], answer: list[str], **_: object) -> list[float]:
    """1.0 if the completion (decoded without special tokens, stripped) equals the answer."""
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]


class StepClock(TrainerCallback):
    """perf_counter at train begin (after set-up) and at the end of every optimizer step."""

    def __init__(self) -> None:
        self.begin = 0.0
        self.ends: list[float] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.begin = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


def time_calls(obj: object, name: str) -> list[float]:
    """Wrap the bound method `obj.name` so that each call's seconds are appended to the list returned."""
    seconds: list[float] = []
    inner = getattr(obj, name)

    def timed(*args, **kwargs):
        begin = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - begin)

    setattr(obj, name, timed)
    return seconds


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    rows = json.loads(Path(spec["train_rows"]).read_text())
    clock = StepClock()
    args = GRPOConfig(**spec["config"])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[clock],
    )
    setup_s = time.perf_counter() - start
    generation = time_calls(trainer, "_generate_and_score_completions")
    out = trainer.train()
    trainer.save_model(spec["model_out"])
    tokenizer.save_pretrained(spec["model_out"])
    resolved = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                "generation_batch_size", "num_generations", "loss_type", "epsilon", "epsilon_high", "delta",
                "beta", "scale_rewards", "max_steps", "optim", "bf16", "gradient_checkpointing")  # fmt: skip
    result = {
        "setup_s": setup_s,
        "train_begin": clock.begin,
        "step_ends": clock.ends,
        "optimizer_steps": trainer.state.global_step,
        "train_runtime_s": out.metrics.get("train_runtime"),
        "generate_and_score_s": generation,
        "torch_threads": torch.get_num_threads(),
        "resolved": {k: getattr(args, k) for k in resolved},
        "log_history": trainer.state.log_history,
        "versions": {
            p: version(p) for p in ("trl", "torch", "transformers", "accelerate", "datasets")
        },
    }
    Path(spec["result"]).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
