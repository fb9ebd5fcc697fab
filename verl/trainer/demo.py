"""`make demo`: guided GRPO on the embedded tiny task, end to end, on whatever machine this is.

1. Builds once (cached under `.cache/embedded/`) a weak draft and a strong guidance model for
   reversed-digit addition (`verl/tasks/embedded.py`), with the project's own code.
2. Trains the draft with guided GRPO (speculative mode) through the real Ray + FSDP + vLLM path,
   with `examples/grpo_guided.yaml` (GPU when there is one, CPU otherwise).
3. Prints a short table titled with the run's mode: validation accuracy before / after, and the
   rows that apply (share of guidance tokens, mean importance weight and λ when guidance acted;
   the reverse KL to the guidance with distillation), and the paths of the plots.

Extra `key=value` arguments override the config, e.g. `python -m verl.trainer.demo trainer.max_steps=10`
(through make: `make demo ARGS="trainer.max_steps=10"`); an overlay picks another embedded task,
whose models are built the same way: `make demo ARGS="config=examples/count_guided.yaml"` trains
a tiny vision-language draft to count squares in pictures (`verl/tasks/embedded_vision.py`).
"""

from __future__ import annotations

import json
import os
import sys
import time

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "grpo_guided.yaml")


def _rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "experiment_log.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_mode(config) -> str:
    """What the run trained with, in words: the summary's title."""
    guidance, distill = config.worker.rollout.offpolicy_guidance, config.algorithm.distill
    outcome = config.algorithm.adv_estimator != "none"
    if not guidance.enable:
        return f"{config.algorithm.adv_estimator.upper()} (guidance off)"
    if guidance.lam == 0 and (guidance.lam_schedule == "constant" or guidance.lam_end == 0):
        sampling = "the draft's own rollouts (λ = 0, the guidance only scores)"
    else:
        sampling = f"{guidance.mode} guidance"
    teacher = f"on-policy distillation ({distill.mode} mode)" if distill.coef > 0 else ""
    parts = [config.algorithm.adv_estimator.upper() if outcome else "", teacher]
    return " + ".join(p for p in parts if p) + f", {sampling}"


def task_name(config) -> str:
    """The data the run trained on, in words: `embedded <task> task`, or the training files."""
    from verl.tasks.embedded import embedded_task

    task = embedded_task(config.data.train_files)
    return f"embedded {task} task" if task else config.data.train_files


def validation_mode(config) -> str:
    """How validation sampled the draft: greedy, or at temperature T with n samples per prompt."""
    rollout = config.worker.rollout
    sampling = {"temperature": rollout.temperature, "n": 1, **rollout.val_override_config}
    if sampling["temperature"] == 0:
        return "draft alone, greedy"
    return f"draft, T = {sampling['temperature']:g}, n = {sampling['n']}"


def summarize(run_dir: str, config) -> str:
    """The final table, from the run's experiment_log.jsonl: rows that apply to the run's mode."""
    rows = _rows(run_dir)
    vals = [r for r in rows if "val/reward_score" in r]
    train = [r for r in rows if "critic/score/mean" in r]

    def mean(key: str) -> float:
        values = [r[key] for r in train if r.get(key) is not None]
        return sum(values) / max(len(values), 1)

    def first_last(key: str, fmt: str) -> str:
        return f"{format(train[0].get(key, 0), fmt)} -> {format(train[-1].get(key, 0), fmt)}"

    plots = sorted(
        os.path.join(run_dir, "plots", p) for p in os.listdir(os.path.join(run_dir, "plots"))
    )
    guided = any(r.get("guidance/lambda", 0) > 0 for r in train)
    lines = [
        "",
        f"=== {run_mode(config)}, {task_name(config)} ===",
        f"{'validation accuracy (' + validation_mode(config) + ')':45s} {vals[0]['val/reward_score']:.1%} -> {vals[-1]['val/reward_score']:.1%}"
        f"  (steps {vals[0]['step']} -> {vals[-1]['step']})",
        f"{'training reward (' + ('guided rollouts' if guided else 'rollouts') + ')':45s} {first_last('critic/score/mean', '.1%')}",
    ]  # fmt: skip
    if guided:
        lines += [
            f"{'share of guidance tokens (mean over steps)':45s} {mean('guidance/offpolicy_token_ratio'):.1%}",
            f"{'mean importance weight':45s} {mean('guidance/is_weight_mean'):.3f}",
            f"{'lambda (first -> last step)':45s} {first_last('guidance/lambda', '.2f')}",
        ]  # fmt: skip
    if any("distill/reverse_kl" in r for r in train):
        lines.append(f"{'reverse KL to the guidance (first -> last)':45s} {first_last('distill/reverse_kl', '.3f')}")  # fmt: skip
    lines += [
        f"{'run folder':45s} {run_dir}",
        "plots:",
        *(f"  {p}" for p in plots),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from verl.tasks.embedded import TASKS, build_embedded, embedded_task
    from verl.trainer.config import ConfigError, load_config
    from verl.trainer.main import TrainingInterrupted, prepare, run
    from verl.utils.worker_logs import WORKER_LOG_ENV

    args = sys.argv[1:] if argv is None else argv
    start = time.perf_counter()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        config = load_config([f"config={os.path.normpath(CONFIG)}",
                              f"trainer.save_checkpoint_path=checkpoints/demo/{stamp}", *args])  # fmt: skip
        if task := embedded_task(config.data.train_files):
            models, measure = build_embedded(task=task), TASKS[task].measure
            print(f"embedded {task} models: draft {models['draft_accuracy']:.1%} / guidance "
                  f"{models['guidance_accuracy']:.1%} test accuracy ({measure}, before RL)")  # fmt: skip
        prepared = prepare(config)
    except (ConfigError, FileNotFoundError, ValueError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    logs = os.path.join(config.trainer.save_checkpoint_path, "worker_logs")
    os.environ.setdefault(WORKER_LOG_ENV, logs)  # the engines' output to files, not the console
    print(
        f"training: progress below; the workers' full output goes to {os.environ[WORKER_LOG_ENV]}/"
    )
    try:
        run(prepared)
    except TrainingInterrupted as stop:
        print(stop, file=sys.stderr)
        return 130
    print(summarize(config.trainer.save_checkpoint_path, config))
    print(f"total time {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
