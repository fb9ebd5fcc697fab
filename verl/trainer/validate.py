"""Checks before Ray starts that read this machine and the user's files but load no weights.

`verl.trainer.main.check_inputs` (the `--dry-run`, and the first thing `prepare` runs) calls
them after the config's own validation (`PPOConfig.post_init`): what the machine can run
(`check_machine`), the folders a run writes and resumes from (`check_run_paths`), the reward
function's keyword arguments against its signature (`check_reward_kwargs`) and LoRA targets
on an embedded model not built yet, from its spec (`check_embedded_lora`). Each failure is one
ConfigError line naming the key, the value and what is valid.
"""

from __future__ import annotations

import inspect
import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from verl.utils.config_checks import ConfigError, fail


def check_machine(config) -> None:
    """`trainer.device=cuda` needs a CUDA device, and `attn_implementation=flash_attention_2`
    CUDA and flash-attn, on this machine; with `RAY_ADDRESS` set the driver may be a CPU node of
    a GPU cluster, so the device is left to the workers there."""
    import torch

    from verl.utils.attention import resolve_attn_implementation

    trainer = config.trainer
    if trainer.device == "cuda" and not os.environ.get("RAY_ADDRESS"):
        if not torch.cuda.is_available():
            fail("trainer.device", "cuda",
                 f"this machine has no CUDA device (torch {torch.__version__}); valid here: cpu, "
                 "auto (cuda where there is one), or RAY_ADDRESS=<head>:6379 to run on a GPU "
                 "cluster from this node")  # fmt: skip
    attn = config.worker.actor.model.attn_implementation
    if attn == "flash_attention_2":
        try:
            resolve_attn_implementation(attn, "cuda" if trainer.use_gpu else "cpu")
        except ValueError as error:
            raise ConfigError(str(error)) from None


def _writable_folder(key: str, path: str) -> None:
    """`path` is a folder this process can create or write: its nearest existing ancestor is a
    folder with write permission (`os.access`; nothing is created)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        fail(key, path, f"{probe} is a file, not a folder; valid: a folder this user may create")
    if not os.access(probe, os.W_OK | os.X_OK):
        where = "it is" if probe == os.path.abspath(path) else f"{probe} is"
        fail(key, path, f"{where} not writable by this user; valid: a folder this user may "
                        "write or create (checkpoints and the run's logs go there)")  # fmt: skip


def check_run_paths(config) -> None:
    """The folders a run writes and reads back: `trainer.save_checkpoint_path` writable (or
    creatable), `trainer.resume` auto, none or a complete checkpoint folder that exists here."""
    trainer = config.trainer
    _writable_folder("trainer.save_checkpoint_path", trainer.save_checkpoint_path)
    resume = trainer.resume
    if resume in ("auto", "none"):
        return
    valid = ("valid: auto (the latest complete checkpoint under trainer.save_checkpoint_path, if "
             "any), none, or a complete checkpoint folder (<save_checkpoint_path>/global_step_N)")  # fmt: skip
    if not os.path.isdir(resume):
        fail("trainer.resume", resume, f"no such folder; {valid}")
    from verl.utils.checkpoint import COMPLETE, is_complete

    if not is_complete(os.path.join(resume, "actor")):
        fail("trainer.resume", resume,
             f"not a complete checkpoint: {os.path.join(resume, 'actor', COMPLETE)} is missing "
             f"(a save that did not finish, or not a checkpoint); {valid}")  # fmt: skip


def _keywords(fn: Callable) -> list[str] | None:
    """The keyword arguments `fn` takes after its first (the input); None when it takes any
    (`**kwargs`)."""
    params = list(inspect.signature(fn).parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    first = positional[0] if positional else None
    return [p.name for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != first]  # fmt: skip


def check_reward_kwargs(fn: Callable, kwargs: Mapping[str, Any], spec: str, key: str) -> None:
    """`fn` (the reward function `spec` of config key `key`) can be called as the reward manager
    calls it, `fn(input, **worker.reward.reward_function_kwargs)`: checked on its signature, so a
    keyword it does not take fails now, not at the first reward call."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    try:
        signature.bind(None, **kwargs)
        return
    except TypeError as error:
        why = str(error)
    taken = _keywords(fn)
    unknown = [name for name in kwargs if taken is not None and name not in taken]
    if unknown:
        valid = ", ".join(taken) if taken else "none (it takes no keyword arguments)"
        name = unknown[0]
        fail(f"worker.reward.reward_function_kwargs.{name}", kwargs[name],
             f"{key}={spec!r} takes no argument {name!r}; valid: {valid}")  # fmt: skip
    raise ConfigError(f"{key}={spec!r} cannot be called as fn(input, **worker.reward."
                      f"reward_function_kwargs={dict(kwargs)!r}): {why}")  # fmt: skip


def check_embedded_lora(config, path: str, task: str) -> None:
    """LoRA's targets and rank against an embedded model not built yet (`path`, one of `task`'s
    models): its config comes from the task's spec (`TinyLMSpec`), the model is built on the
    meta device, so nothing is trained or loaded."""
    import torch

    from verl.tasks.embedded import TASKS
    from verl.tasks.tiny_lm import build_tiny_qwen2
    from verl.utils.lora import check_lora_targets

    lora = config.worker.actor.model.lora
    if not lora.rank:
        return
    with torch.device("meta"):
        model = build_tiny_qwen2(TASKS[task].pair.model)
    with tempfile.TemporaryDirectory() as folder:
        model.config.save_pretrained(folder)
        try:
            check_lora_targets(lora, folder)
        except ValueError as error:
            raise ConfigError(
                str(error).replace(folder, f"{path} (embedded, from its spec)")
            ) from None
