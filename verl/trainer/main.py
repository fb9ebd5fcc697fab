"""Command line (EasyR1 style): `python3 -m verl.trainer.main config=examples/grpo_guided.yaml key=value ...`

Everything a user can get wrong is checked before Ray starts: the config (one-line errors),
the models (hub ids resolved to local folders, `verl.utils.model_path`), the guidance
tokenizer, the datasets and the reward function. Then Ray starts locally (or joins the cluster
in `RAY_ADDRESS`), the trainer runs, and plots are written. `--dry-run` runs the checks that
load nothing and stops (`check_inputs`); `--help` prints USAGE.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass

from verl.tasks.embedded import CACHE_DIR, TASKS, build_embedded, task_dir
from verl.trainer.config import ConfigError, PPOConfig, load_config
from verl.utils.dataset import ImageSettings, PromptEncoder, RLDataset, resolve_data
from verl.utils.worker_logs import WORKER_LOG_ENV
from verl.workers.reward.config import RewardConfig

USAGE = """\
usage: python -m verl.trainer.main [config=FILE.yaml ...] [key=value ...] [--dry-run]

  config=FILE.yaml  a YAML config; repeat it for overlays, merged in order
                    (config=examples/grpo_guided.yaml config=configs/otb.yaml)
  key=value         set one key after the files (worker.rollout.n=8; data.val_files= : empty;
                    each key once; a list as trainer.logger=[console,wandb])
  --dry-run         check without loading or starting anything, print the final config, and
                    end with one '# dry run:' line saying what was checked: the config; every
                    model path (a folder with config.json or a hub id in the local cache; a hub
                    id or name@split not cached here passes as one the run downloads, unless
                    HF_HUB_OFFLINE=1; an embedded model not built yet passes, the run builds it;
                    a local path that does not exist fails; LoRA targets against the model's
                    config); every data source (file, folder, embedded task or name@split; rows
                    are not read); the reward functions (a reward file is imported, the function
                    looked up, reward_function_kwargs checked on its signature); the
                    format-prompt file; this machine (trainer.device=cuda, flash_attention_2);
                    the run's folders (save_checkpoint_path writable, trainer.resume complete).
                    Weights, tokenizers and rows are left to the run.
  -h, --help        this text

Every key and its default: configs/defaults.yaml; the guidance, correction and distillation
knobs: README_guidance.md. A bad input exits with code 2 and one 'error:' line, before Ray starts.
"""

LAUNCHER_KEYS_ENV = "VERL_LAUNCHER_KEYS"
"""Set by the launchers that derive config keys from their variables (examples/*.sh, through
scripts/launcher_gpus.sh): `key=how;key=how`, e.g. `trainer.n_gpus_per_node=N_GPUS -
GUIDANCE_GPUS = 8 - 2`; an error naming such a key names the variables too (`launcher_hint`)."""


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


def _unbuilt_embedded(config: PPOConfig) -> dict[str, str]:
    """Model paths inside the embedded cache that are not built yet -> the task whose build
    makes them (a task's models are the draft/guidance folders of task_dir(task))."""
    paths = [config.worker.actor.model.model_path]
    if config.worker.rollout.offpolicy_guidance.enable:
        paths.append(config.worker.rollout.offpolicy_guidance.model_path)
    cache = os.path.abspath(CACHE_DIR)
    missing = [
        p for p in paths if p and not os.path.isdir(p) and os.path.abspath(p).startswith(cache)
    ]
    folders = {os.path.abspath(task_dir(task)): task for task in TASKS}
    return {
        p: folders[os.path.dirname(os.path.abspath(p))]
        for p in missing
        if os.path.dirname(os.path.abspath(p)) in folders
    }


def _build_embedded_if_needed(config: PPOConfig) -> None:
    """Model paths inside the embedded cache are built on first use (`verl/tasks/embedded.py`)."""
    for task in sorted(set(_unbuilt_embedded(config).values())):
        build_embedded(task=task)


def _check_attn_implementation(config: PPOConfig) -> None:
    """flash_attention_2 needs CUDA here: one line now, not a traceback from every rank at load."""
    from verl.utils.attention import resolve_attn_implementation

    attn = config.worker.actor.model.attn_implementation
    if attn == "flash_attention_2":
        resolve_attn_implementation(attn, "cuda" if config.trainer.use_gpu else "cpu")


def _check_lora(config: PPOConfig, actor_path: str) -> None:
    """LoRA's targets and rank against the actor's model (built on the meta device: no weights)."""
    if config.worker.actor.model.lora.rank:
        from verl.utils.lora import check_lora_targets

        check_lora_targets(config.worker.actor.model.lora, actor_path)


def check_models(config: PPOConfig) -> None:
    """Resolve every model path key to a local folder, in place (hub ids through the Hugging
    Face cache, downloaded when missing and the hub is reachable), then check the folders and
    that the guidance shares the draft's tokenizer. One-line errors; no model is loaded."""
    from verl.utils.model_path import resolve_config_model_paths
    from verl.workers.rollout.engine_config import check_same_tokenizer

    _check_attn_implementation(config)
    _build_embedded_if_needed(config)
    resolve_config_model_paths(config)
    actor_path = config.worker.actor.model.model_path
    _check_model_folder("worker.actor.model.model_path", actor_path)
    _check_lora(config, actor_path)
    guidance = config.worker.rollout.offpolicy_guidance
    if guidance.enable:
        _check_model_folder("worker.rollout.offpolicy_guidance.model_path", guidance.model_path)
        check_same_tokenizer(actor_path, guidance.model_path)


def resolve_rewards(config: PPOConfig) -> list[str]:
    """Check that `worker.reward.reward_function` (and `val_reward_function` when set) resolve: a
    built-in name, or a file that defines the function (the file is imported), callable with
    `reward_function_kwargs` (its signature). Returns the specs; ConfigError in one line naming
    the key otherwise."""
    from verl.trainer.validate import check_reward_kwargs
    from verl.workers.reward.function import load_reward_function

    specs = []
    for name in ("reward_function", "val_reward_function"):
        spec, key = getattr(config.worker.reward, name), f"worker.reward.{name}"
        if spec is None and name == "val_reward_function":
            continue
        try:
            fn = load_reward_function(spec)
        except (ValueError, FileNotFoundError, AttributeError) as error:
            why = str(error).removeprefix("worker.reward.reward_function: ")
            raise ConfigError(f"{key}={spec!r} does not resolve: {why}") from None
        check_reward_kwargs(fn, config.worker.reward.reward_function_kwargs, spec, key)
        specs.append(spec)
    return specs


def tool_instructions(config: PPOConfig) -> str | None:
    """The system message of a multi-turn run's chat prompts: its tools and how to call them in
    its format (`ToolCallFormat.instructions`); None without multi-turn or a chat template (the
    embedded tasks' plain prompts carry their own convention)."""
    from verl.workers.rollout.multi_turn import get_format, load_tools

    multi_turn = config.worker.rollout.multi_turn
    if not (multi_turn.enable and config.data.apply_chat_template):
        return None
    tools = load_tools(multi_turn.tools, "worker.rollout.multi_turn.tools")
    return get_format(multi_turn.tool_call_format).instructions(
        [t.schema() for t in tools.values()]
    )


def resolve_tools(config: PPOConfig) -> list[str]:
    """Load `worker.rollout.multi_turn.tools` when multi-turn is on (files are imported); the
    names loaded, or ConfigError in one line naming the key."""
    from verl.workers.rollout.multi_turn import load_tools

    multi_turn, key = config.worker.rollout.multi_turn, "worker.rollout.multi_turn.tools"
    if not multi_turn.enable:
        return []
    try:
        return list(load_tools(multi_turn.tools, key))
    except (ValueError, FileNotFoundError, AttributeError, ImportError, TypeError) as error:
        why = str(error).splitlines()[0].removeprefix(f"{key}: ")
        raise ConfigError(f"{key}={list(multi_turn.tools)!r} does not resolve: {why}") from None


def check_inputs(config: PPOConfig, download: bool = False) -> str:
    """Check what a run would load, loading nothing: model paths, data sources, reward functions,
    the format-prompt file (`--dry-run`; USAGE says how). `prepare` runs it first with `download`
    (hub ids and datasets not cached are fetched, as the run needs them), so a bad input fails at
    once. This machine and the run's folders are checked first (`verl.trainer.validate`).
    Returns the dry run's closing line; a failure raises a one-line error naming the key."""
    from verl.trainer.validate import check_embedded_lora, check_machine, check_run_paths
    from verl.utils.model_path import config_model_paths, resolve_model_path

    check_machine(config)
    check_run_paths(config)
    unbuilt, pending, built_later = _unbuilt_embedded(config), [], []
    models = config_model_paths(config)
    for key, value in models:
        if value in unbuilt:
            built_later.append(value)
            if key == "worker.actor.model.model_path":  # LoRA from the model's spec
                check_embedded_lora(config, value, unbuilt[value])
            continue
        path = resolve_model_path(value, key, download=download)
        if path is None:
            pending.append(value)
        else:
            _check_model_folder(key, path)
            if key == "worker.actor.model.model_path":
                _check_lora(config, path)
    data = [("data.train_files", config.data.train_files)]
    if config.data.val_files:
        data.append(("data.val_files", config.data.val_files))
    for key, spec in data:
        if resolve_data(spec, key, download=download) is None:
            pending.append(spec)
    prompt = config.data.format_prompt
    if prompt and not os.path.isfile(prompt):
        raise FileNotFoundError(f"data.format_prompt: file {prompt!r} not found")
    rewards = " and ".join(repr(spec) for spec in resolve_rewards(config))
    tools = resolve_tools(config)
    notes = [f"not cached here, downloaded by the run: {', '.join(pending)}"] if pending else []
    if built_later:
        notes.append(f"embedded, built by the run: {', '.join(built_later)}")
    if tools:
        notes.append(f"tools {', '.join(tools)}")
    return (f"dry run: config valid; checked {len(models)} model paths, {len(data)} data sources, "
            f"reward {rewards}{''.join(f'; {note}' for note in notes)}; nothing loaded")  # fmt: skip


def check_image_run(config: PPOConfig, images: ImageSettings) -> None:
    """A run on data with images: a guidance that preprocesses an image as the draft does."""
    guidance = config.worker.rollout.offpolicy_guidance
    if not guidance.enable:
        return
    from verl.utils.model_path import resolve_model_path
    from verl.utils.vision import load_processor

    path = resolve_model_path(guidance.model_path, "worker.rollout.offpolicy_guidance.model_path")
    ours = images.processor.image_processor.to_dict()
    theirs = load_processor(path).image_processor.to_dict()
    differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    if differ:
        raise ConfigError(f"worker.rollout.offpolicy_guidance.model_path: {path!r} preprocesses images unlike the draft ({differ[0]}: {theirs.get(differ[0])!r} against {ours.get(differ[0])!r}); valid: a guidance with the draft's image processor")  # fmt: skip


def prepare(config: PPOConfig) -> Prepared:
    """Checks and builds everything that needs no Ray: models on disk, data, reward functions.
    The checks that load nothing (`check_inputs`) come first, so a bad path fails at once."""
    from transformers import AutoTokenizer

    from verl.utils.model_path import resolve_model_path
    from verl.workers.reward.function import FunctionRewardManager

    if config.trainer.nnodes > 1 and not os.environ.get("RAY_ADDRESS"):
        raise ConfigError(
            f"trainer.nnodes = {config.trainer.nnodes} needs a running Ray cluster: start one "
            "(`ray start --head` here, `ray start --address=<head>:6379` on the other nodes) and "
            "set RAY_ADDRESS=<head>:6379"
        )
    check_inputs(config, download=True)  # this machine's own limits first, then what it loads
    check_models(config)
    actor_path = config.worker.actor.model.model_path
    tokenizer = AutoTokenizer.from_pretrained(
        config.worker.actor.model.tokenizer_path or actor_path
    )
    data = config.data
    encoder = PromptEncoder(tokenizer, data.max_prompt_length, data.apply_chat_template,
                            data.format_prompt, tool_instructions(config))  # fmt: skip
    images = ImageSettings(resolve_model_path(actor_path, "worker.actor.model.model_path"), data.image_key,
                           data.image_dir, data.min_pixels, data.max_pixels)  # fmt: skip
    train = RLDataset(data.train_files, encoder, data.prompt_key, data.answer_key,
                      data.filter_overlong_prompts, key="data.train_files", images=images)  # fmt: skip
    val = None
    if data.val_files:
        val = RLDataset(data.val_files, encoder, data.prompt_key, data.answer_key,
                        data.filter_overlong_prompts, key="data.val_files", images=images)  # fmt: skip
    if config.worker.actor.model.freeze_vision_tower:
        from transformers import AutoConfig

        if getattr(AutoConfig.from_pretrained(images.model_path), "vision_config", None) is None:
            raise ConfigError(f"worker.actor.model.freeze_vision_tower: {actor_path!r} has no vision tower; valid: false for a text model")  # fmt: skip
    if train.images is not None:
        check_image_run(config, images)
    if len(train) < data.rollout_batch_size:
        raise ValueError(f"data.rollout_batch_size={data.rollout_batch_size} is larger than the "
                         f"{len(train)} usable training prompts of {data.train_files!r}; valid: "
                         f"1..{len(train)} (prompts per step)")  # fmt: skip
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
    """Join `RAY_ADDRESS` when set, else start a local Ray with enough logical CPUs: a new one
    even where another local Ray runs (`address="local"`; Ray would otherwise join that one and
    refuse the CPU count)."""
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
    per_node = (config.trainer.n_gpus_per_node + config.worker.rollout.n_gpus_per_node
                + (guidance.n_gpus_per_node if guidance.enable else 0))  # fmt: skip
    workers = config.trainer.nnodes * per_node
    quiet = bool(os.environ.get(WORKER_LOG_ENV))  # the workers write to files (`make demo`)
    if quiet:
        env["env_vars"][WORKER_LOG_ENV] = os.environ[WORKER_LOG_ENV]
    # no idle workers prestarted for this driver: an actor did not reuse one (measured: it got a new
    # process while both prestarted workers stayed idle), so each would only cost its start-up
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, workers + 1), include_dashboard=False,
             runtime_env=env, log_to_driver=not quiet, _system_config={"prestart_worker_first_driver": False},
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


def launcher_hint(message: str) -> str:
    """`; launcher: key = VARIABLES = values` for each key of `LAUNCHER_KEYS_ENV` that `message`
    names ("" when none, or when no launcher set it)."""
    hints = []
    for item in os.environ.get(LAUNCHER_KEYS_ENV, "").split(";"):
        key, _, how = item.partition("=")
        if key.strip() and re.search(rf"(?<![\w.]){re.escape(key.strip())}(?![\w])", message):
            hints.append(f"{key.strip()} = {how.strip()}")
    return f"; launcher: {', '.join(hints)}" if hints else ""


def main(argv: list[str] | None = None) -> int:
    """Parse, check (before Ray), run. Exit 2 on a bad configuration or input, with one line.
    `--dry-run`: validate the final config and check what a run would load without loading it
    (`check_inputs`), print the config as YAML (hub ids as given) and a closing `# dry run:` line.
    `-h`/`--help`: USAGE."""
    args = sys.argv[1:] if argv is None else argv
    if "-h" in args or "--help" in args:
        print(USAGE, end="")
        return 0
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C (SIGINT) stops a run even when it was started from a shell that ignores SIGINT
        # for background jobs (`make test &`, `nohup ... &`): the child inherits SIG_IGN, and
        # Python then installs no KeyboardInterrupt handler
        signal.signal(signal.SIGINT, signal.default_int_handler)
    check_only = "--dry-run" in args
    args = [a for a in args if a != "--dry-run"]
    try:
        config = load_config(args)
        if check_only:
            from omegaconf import OmegaConf

            from verl.trainer.config import to_dict

            closing = check_inputs(config)
            print(OmegaConf.to_yaml(OmegaConf.create(to_dict(config))), end="")
            print(f"# {closing}")
            return 0
        prepared = prepare(config)
    except (ConfigError, FileNotFoundError, ValueError, KeyError) as error:
        message = str(error.args[0] if isinstance(error, KeyError) and error.args else error)
        print(f"error: {message}{launcher_hint(message)}", file=sys.stderr)
        return 2
    from verl.trainer.ray_trainer import StaleRolloutWeights
    from verl.trainer.rollout_producer import ProducerFailed
    from verl.workers.reward.function import RewardError
    from verl.workers.rollout.guidance_server import GuidanceLost

    try:
        run(prepared)
    except (RewardError, GuidanceLost, StaleRolloutWeights, ProducerFailed) as error:  # one line
        print(f"error: {error}", file=sys.stderr)
        return 1
    except TrainingInterrupted as stop:
        print(stop, file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
