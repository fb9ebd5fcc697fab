"""Command line (EasyR1 style): `python3 -m verl.trainer.main config=examples/x.yaml key=value ...`

Everything a user can get wrong is checked before Ray starts: the config (one-line errors),
the models (hub ids resolved to local folders, `verl.utils.model_path`), the guidance
tokenizer, the datasets and the reward function. Then Ray starts locally (or joins the cluster
in `RAY_ADDRESS`), the trainer runs, and plots are written.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass

from verl.trainer.config import ConfigError, PPOConfig, load_config
from verl.utils.dataset import PromptEncoder, RLDataset
from verl.utils.embedded import CACHE_DIR, TASKS, build_embedded, task_dir
from verl.utils.worker_logs import WORKER_LOG_ENV
from verl.workers.reward.config import RewardConfig


@dataclass
class Prepared:
    """What the driver builds before Ray starts."""

    config: PPOConfig
    tokenizer: object
    train: RLDataset
    val: RLDataset | None
    reward: object
    val_reward: object


def _check_model_folder(key: str, path: str | None) -> None:
    """`path` (already resolved to a local folder) holds a model: its config.json at least."""
    if not path or not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"{key}: {path!r} is not a local model folder (config.json, weights, tokenizer); "
            "valid: such a folder, or the hub id org/name[@revision] of a model"
        )


def _build_embedded_if_needed(config: PPOConfig) -> None:
    """Model paths inside the embedded cache are built on first use (`verl/utils/embedded.py`)."""
    paths = [config.worker.actor.model.model_path]
    if config.worker.rollout.offpolicy_guidance.enable:
        paths.append(config.worker.rollout.offpolicy_guidance.model_path)
    cache = os.path.abspath(CACHE_DIR)
    missing = [
        p for p in paths if p and not os.path.isdir(p) and os.path.abspath(p).startswith(cache)
    ]
    for task in TASKS:  # a task's models are the draft/guidance folders of task_dir(task)
        if any(
            os.path.dirname(os.path.abspath(p)) == os.path.abspath(task_dir(task)) for p in missing
        ):
            build_embedded(task=task)


def check_models(config: PPOConfig) -> None:
    """Resolve every model path key to a local folder, in place (hub ids through the Hugging
    Face cache, downloaded when missing and the hub is reachable), then check the folders and
    that the guidance shares the draft's tokenizer. One-line errors; no model is loaded."""
    from verl.utils.fsdp_utils import resolve_attn_implementation
    from verl.utils.model_path import resolve_config_model_paths
    from verl.workers.rollout.vllm_rollout_spmd import check_same_tokenizer

    attn = config.worker.actor.model.attn_implementation
    if attn == "flash_attention_2":  # one line here, not a traceback from every rank at load
        resolve_attn_implementation(attn, "cuda" if config.trainer.use_gpu else "cpu")
    _build_embedded_if_needed(config)
    resolve_config_model_paths(config)
    actor_path = config.worker.actor.model.model_path
    _check_model_folder("worker.actor.model.model_path", actor_path)
    guidance = config.worker.rollout.offpolicy_guidance
    if guidance.enable:
        _check_model_folder("worker.rollout.offpolicy_guidance.model_path", guidance.model_path)
        check_same_tokenizer(actor_path, guidance.model_path)


def prepare(config: PPOConfig) -> Prepared:
    """Checks and builds everything that needs no Ray: models on disk, data, reward functions."""
    from transformers import AutoTokenizer

    from verl.workers.reward.function import FunctionRewardManager

    if config.trainer.nnodes > 1 and not os.environ.get("RAY_ADDRESS"):
        raise ConfigError(
            f"trainer.nnodes = {config.trainer.nnodes} needs a running Ray cluster: start one "
            "(`ray start --head` here, `ray start --address=<head>:6379` on the other nodes) and "
            "set RAY_ADDRESS=<head>:6379"
        )
    check_models(config)
    actor_path = config.worker.actor.model.model_path
    tokenizer = AutoTokenizer.from_pretrained(
        config.worker.actor.model.tokenizer_path or actor_path
    )
    data = config.data
    encoder = PromptEncoder(
        tokenizer, data.max_prompt_length, data.apply_chat_template, data.format_prompt
    )
    train = RLDataset(
        data.train_files, encoder, data.prompt_key, data.answer_key, data.filter_overlong_prompts
    )
    val = None
    if data.val_files:
        val = RLDataset(
            data.val_files, encoder, data.prompt_key, data.answer_key, data.filter_overlong_prompts
        )
    if len(train) < data.rollout_batch_size:
        raise ValueError(f"data.rollout_batch_size={data.rollout_batch_size} is larger than the "
                         f"{len(train)} usable training prompts of {data.train_files!r}")  # fmt: skip
    reward = FunctionRewardManager(config.worker.reward, tokenizer)
    return Prepared(
        config,
        tokenizer,
        train,
        val,
        reward,
        FunctionRewardManager(val_reward_config(config.worker.reward), tokenizer),
    )


def val_reward_config(reward: RewardConfig) -> RewardConfig:
    """The reward config validation scores with: `val_reward_function` in place of
    `reward_function` when set (built-ins are scored one response per call either way)."""
    if reward.val_reward_function is None:
        return reward
    return dataclasses.replace(reward, reward_function=reward.val_reward_function)


def start_ray(config: PPOConfig) -> None:
    """Join `RAY_ADDRESS` when set, else start a local Ray with enough logical CPUs."""
    import ray

    if ray.is_initialized():
        return
    env = {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false",
                        # vLLM's INFO lines would bury the progress bar; export it to see them
                        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}}  # fmt: skip
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=env)
        return
    guidance = config.worker.rollout.offpolicy_guidance
    per_node = config.trainer.n_gpus_per_node + (guidance.n_gpus_per_node if guidance.enable else 0)
    workers = config.trainer.nnodes * per_node
    quiet = bool(os.environ.get(WORKER_LOG_ENV))  # the workers write to files (`make demo`)
    if quiet:
        env["env_vars"][WORKER_LOG_ENV] = os.environ[WORKER_LOG_ENV]
    ray.init(num_cpus=max(os.cpu_count() or 1, workers + 1), include_dashboard=False,
             runtime_env=env, log_to_driver=not quiet,
             logging_level=logging.ERROR if quiet else logging.INFO)  # fmt: skip


class TrainingInterrupted(Exception):
    """Ctrl-C during a run; its message is the one line a user needs: the step and how to resume."""


def interrupted_message(trainer, config: PPOConfig) -> str:
    """One line after Ctrl-C: the step reached, the last complete checkpoint, how to resume."""
    if trainer is None:
        return "interrupted while starting the workers; nothing was trained"
    done = trainer._checkpoints()
    where = f"interrupted at step {trainer.global_step} of {trainer.total_steps}"
    if not done:
        return f"{where}; no complete checkpoint in {trainer.run_dir} yet (trainer.save_freq), so a new run starts from step 0"
    latest = os.path.join(trainer.run_dir, f"global_step_{done[-1]}")
    how = (
        "run the same command again"
        if config.trainer.resume == "auto"
        else "add trainer.resume=auto"
    )
    return (
        f"{where}; last complete checkpoint: {latest} (step {done[-1]}); to resume from it, {how}"
    )


def run(prepared: Prepared) -> dict[str, float]:
    """Start Ray, build the workers, train; Ray is shut down even when a step fails. Ctrl-C
    raises `TrainingInterrupted` with one line (step, last complete checkpoint, how to resume)."""
    import ray

    from verl.trainer.ray_trainer import RayPPOTrainer

    start_ray(prepared.config)
    trainer = None
    try:
        trainer = RayPPOTrainer(prepared.config, prepared.train, prepared.val, prepared.reward,
                                prepared.val_reward)  # fmt: skip
        trainer.init_workers()
        metrics = trainer.fit()
        _plot(trainer.run_dir)
        return metrics
    except KeyboardInterrupt:
        raise TrainingInterrupted(interrupted_message(trainer, prepared.config)) from None
    finally:
        try:
            ray.shutdown()
        except KeyboardInterrupt:  # a second Ctrl-C while Ray stops: it is stopping anyway
            pass


def _plot(run_dir: str) -> None:
    from verl.tools.plot_metrics import plot_run

    log = os.path.join(run_dir, "experiment_log.jsonl")
    if os.path.isfile(log):
        for path in plot_run(run_dir):
            print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    """Parse, check (before Ray), run. Exit 2 on a bad configuration or input, with one line.
    `--dry-run`: load and validate the final config, print it as YAML, and stop (no models,
    data or Ray are touched; hub ids are printed as given: `check_models` resolves them)."""
    args = sys.argv[1:] if argv is None else argv
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C (SIGINT) stops a run even when it was started from a shell that ignores SIGINT
        # for background jobs (`make test &`, `nohup ... &`): the child inherits SIG_IGN, and
        # Python then installs no KeyboardInterrupt handler
        signal.signal(signal.SIGINT, signal.default_int_handler)
    dry_run = "--dry-run" in args
    args = [a for a in args if a != "--dry-run"]
    try:
        config = load_config(args)
        if dry_run:
            from omegaconf import OmegaConf

            from verl.trainer.config import to_dict

            print(OmegaConf.to_yaml(OmegaConf.create(to_dict(config))), end="")
            return 0
        prepared = prepare(config)
    except (ConfigError, FileNotFoundError, ValueError, KeyError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"error: {message}", file=sys.stderr)
        return 2
    from verl.trainer.ray_trainer import StaleRolloutWeights
    from verl.workers.reward.function import RewardError
    from verl.workers.rollout.guidance_server import GuidanceLost

    try:
        run(prepared)
    except (RewardError, GuidanceLost, StaleRolloutWeights) as error:  # stopped: one line
        print(f"error: {error}", file=sys.stderr)
        return 1
    except TrainingInterrupted as stop:
        print(stop, file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
