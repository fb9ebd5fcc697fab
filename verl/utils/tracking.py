"""Experiment loggers: console (a progress bar), file (`experiment_log.jsonl`), wandb, tensorboard.

Validation samples (`trainer.val_generations_to_log`) go to `log_generations`: the file logger
writes them to `val_generations.jsonl` beside the metrics (which stay one flat row per call),
wandb to the table `val/generations`, the console one short line each."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from verl.utils import metric_names as M

LOGGERS = ("console", "file", "wandb", "tensorboard")
GENERATIONS_FILE = "val_generations.jsonl"
"""The file logger's validation samples: one JSON object per sample, with its step."""
GENERATION_COLUMNS = ("step", "prompt", "response", "ground_truth", "score")
"""The fields of a logged validation sample (besides the step, what `log_generations` takes)."""
GENERATIONS_TABLE = M.VAL_GENERATIONS
"""The wandb table of validation samples."""


def _short(text: str, width: int = 60) -> str:
    """One line of at most `width` characters (newlines shown as ⏎)."""
    text = str(text).replace("\n", "⏎")
    return text if len(text) <= width else text[: width - 1] + "…"


class Tracking:
    """Sends each step's metrics to every configured logger (valid names: `LOGGERS`)."""

    def __init__(self, loggers: list[str], project: str, experiment: str, run_dir: str,
                 config: dict[str, Any], total_steps: int, start_step: int = 0) -> None:  # fmt: skip
        unknown = [name for name in loggers if name not in LOGGERS]
        if unknown:
            raise ValueError(f"trainer.logger: {unknown} not valid; valid: {', '.join(LOGGERS)}")
        self.loggers, self.run_dir = list(loggers), run_dir
        os.makedirs(run_dir, exist_ok=True)
        self._bar = self._file = self._wandb = self._tb = None
        self._generation_rows: list[list[Any]] = []  # every validation's samples (wandb's table)
        if "console" in loggers:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="training", unit="step")
        if "file" in loggers:
            self.log_path = os.path.join(run_dir, "experiment_log.jsonl")
            self._file = open(self.log_path, "a")
        if "wandb" in loggers:
            import wandb

            self._wandb = wandb.init(project=project, name=experiment, config=config, dir=run_dir)
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record `metrics` for `step` everywhere (non-finite values are written as null/NaN)."""
        if self._file is not None:
            clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
            self._file.write(json.dumps({"step": step, **clean}) + "\n")
            self._file.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
        if self._bar is not None and "critic/score/mean" in metrics:  # a training step
            postfix = {"reward": f"{metrics['critic/score/mean']:.3f}"}
            if "guidance/offpolicy_token_ratio" in metrics:
                postfix["guided"] = f"{metrics['guidance/offpolicy_token_ratio']:.3f}"
            if "distill/reverse_kl" in metrics:
                postfix["teacher_kl"] = f"{metrics['distill/reverse_kl']:.3f}"
            self._bar.set_postfix(postfix)
            self._bar.update(max(step - self._bar.n, 0))

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        """Validation samples of `step`, each with a prompt, response, ground_truth and score: a
        JSON line each in `<run_dir>/val_generations.jsonl` (file), the wandb table
        `val/generations` with the rows of every validation so far (wandb), a short line each
        (console). Nothing without samples."""
        if not samples:
            return
        rows = [[step, *(sample[key] for key in GENERATION_COLUMNS[1:])] for sample in samples]
        if self._file is not None:
            with open(os.path.join(self.run_dir, GENERATIONS_FILE), "a") as f:
                for row in rows:
                    f.write(json.dumps(dict(zip(GENERATION_COLUMNS, row, strict=True))) + "\n")
        if self._wandb is not None:
            import wandb

            self._generation_rows.extend(rows)
            table = wandb.Table(columns=list(GENERATION_COLUMNS), data=list(self._generation_rows))
            self._wandb.log({GENERATIONS_TABLE: table}, step=step)
        if self._bar is not None:
            for _, prompt, response, truth, score in rows:
                self._bar.write(f"val step {step} | score {score:g} | {_short(prompt)} -> "
                                f"{_short(response)} (truth {_short(truth, 30)})")  # fmt: skip

    def message(self, text: str) -> None:
        """A line of text on the console (above the progress bar)."""
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def finish(self) -> None:
        """Close files and runs."""
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()
