"""Model paths as EasyR1 takes them: a local folder, or a Hugging Face hub id `org/name[@revision]`.

A hub id is resolved to its snapshot folder in the local Hugging Face cache (`HF_HUB_CACHE`, else
`HF_HOME/hub`, else `~/.cache/huggingface/hub`) and, when it is not there and the machine may go
online (`HF_HUB_OFFLINE` unset), downloaded into that cache first. The trainer resolves every model
path key once, before anything loads (`resolve_config_model_paths`, called by
`verl.trainer.main.prepare`), so the rest of the code only ever sees local folders. Anything else
fails in one line naming the key, the value and what is valid. The same cache-or-download rule
(`hub_snapshot`) serves the `name@split` datasets of `verl.utils.dataset`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil

WEIGHT_FORMATS_SKIPPED = ("*.gguf", "*.onnx", "*.h5", "*.msgpack", "*.ot", "*.pth", "original/*",
                          "onnx/*", "openvino/*", "coreml/*")  # fmt: skip
"""Files a download leaves out: formats neither transformers' PyTorch path nor vLLM reads here."""

_SNAPSHOT = re.compile(r"(?:^|/)models--([^/]+)/snapshots/([^/]+)/?$")
"""A snapshot folder of the hub cache layout: `.../models--org--name/snapshots/<commit>`."""


def hub_cache_dir() -> str:
    """The hub cache folder, read from the environment now (huggingface_hub reads it at import)."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return os.path.expandvars(os.path.expanduser(cache))


def hub_offline() -> bool:
    """`HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) set to a true value."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def parse_hub_id(value: str) -> tuple[str, str | None] | None:
    """`org/name[@revision]` (or a bare `name`) -> (repo id, revision); None when `value` cannot
    be a hub id (an absolute or explicitly relative path, more than one `/`, invalid characters)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not value or value.startswith(("/", ".", "~")) or "\\" in value:
        return None
    repo_id, _, revision = value.partition("@")
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return repo_id, (revision or None)


def _snapshot_id(value: str) -> str | None:
    """`org/name@commit` for a hub-cache snapshot folder (missing here: another node's cache)."""
    match = _SNAPSHOT.search(value.rstrip("/") + "/")
    if match is None:
        return None
    parts = match.group(1).split("--")
    return f"{'/'.join(parts)}@{match.group(2)}" if len(parts) <= 2 else None


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def hub_snapshot(
    repo_id: str,
    revision: str | None = None,
    repo_type: str = "model",
    download: bool = True,
    ignore_patterns: list[str] | None = None,
) -> str | None:
    """The local snapshot folder of a hub repo: from the cache, else downloaded into it when
    `download` and the hub may be reached (`HF_HUB_OFFLINE` unset). With `download=False`, None
    for a repo that is not cached but that a download could fetch. Raises LookupError (why, one
    line) when it is not cached and cannot be had: HF_HUB_OFFLINE, or the download failed."""
    from huggingface_hub import snapshot_download

    where = dict(repo_id=repo_id, revision=revision, cache_dir=hub_cache_dir())
    if repo_type != "model":
        where["repo_type"] = repo_type
    try:
        return snapshot_download(**where, local_files_only=True)
    except Exception:  # not cached (LocalEntryNotFoundError) or an unusable cache entry
        pass
    if hub_offline():
        raise LookupError("not in the local cache, and HF_HUB_OFFLINE forbids a download")
    if not download:
        return None
    try:
        return snapshot_download(**where, ignore_patterns=ignore_patterns)
    except Exception as error:  # no network, unknown repo or revision, gated, disk full, ...
        raise LookupError(
            f"not in the local cache, and the download failed ({_first_line(error)})"
        ) from None


def resolve_model_path(value: str | None, key: str, download: bool = True) -> str | None:
    """A local folder, returned as is; else the local snapshot folder of the hub id `value`
    (`org/name[@revision]`), downloaded first when it is not cached and the hub may be reached.
    A snapshot folder of the hub cache that is missing here (the driver's path on another node)
    is resolved as `org/name@commit`, the same revision. With `download=False` (`--dry-run`)
    nothing is downloaded: None for a hub id that a run would download. Raises
    FileNotFoundError in one line naming `key`, `value` and what is valid."""
    if value and os.path.isdir(value):
        return value
    valid = (
        "valid: a local folder with config.json, or a Hugging Face hub id org/name[@revision] "
        f"present in the local cache ({hub_cache_dir()}) or reachable on the hub"
    )
    hub_id = parse_hub_id(value or "") or parse_hub_id(_snapshot_id(value or "") or "")
    if hub_id is None:
        raise FileNotFoundError(f"{key}: {value!r} is not a local folder; {valid}")
    repo_id, revision = hub_id
    try:
        return hub_snapshot(repo_id, revision, download=download,
                            ignore_patterns=list(WEIGHT_FORMATS_SKIPPED))  # fmt: skip
    except LookupError as why:
        raise FileNotFoundError(
            f"{key}: {value!r} is not a local folder, and as a hub id it is {why}; {valid}"
        ) from None


def config_model_paths(config) -> list[tuple[str, str | None]]:
    """(key, value) of every model path a run of the `PPOConfig` loads: the actor's model and
    tokenizer (the reference policy loads the actor's model) and, with guidance on, the guidance."""
    model, guidance = config.worker.actor.model, config.worker.rollout.offpolicy_guidance
    paths = [("worker.actor.model.model_path", model.model_path)]
    if model.tokenizer_path:
        paths.append(("worker.actor.model.tokenizer_path", model.tokenizer_path))
    if guidance.enable:
        paths.append(("worker.rollout.offpolicy_guidance.model_path", guidance.model_path))
    return paths


def resolve_config_model_paths(config) -> None:
    """Resolve, in place, every model path key of a `PPOConfig` (`config_model_paths`)."""
    for key, value in config_model_paths(config):
        *parents, leaf = key.split(".")
        holder = functools.reduce(getattr, parents, config)
        setattr(holder, leaf, resolve_model_path(value, key))


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed
        shutil.copy2(src, dst)
    return dst


def add_to_hub_cache(folder: str, repo_id: str, revision: str = "main",
                     cache_dir: str | None = None, repo_type: str = "model") -> str:  # fmt: skip
    """Place a local model (or, with repo_type="dataset", dataset) folder in the hub cache under
    `repo_id` at `revision` (a fake commit hash; files hard-linked where possible), so that hub
    ids resolve to it offline: a machine that cannot reach the hub, and the tests. Returns the
    snapshot folder."""
    cache_dir = cache_dir or hub_cache_dir()
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    repo = os.path.join(cache_dir, f"{repo_type}s--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", commit)
    shutil.copytree(folder, snapshot, copy_function=_link_or_copy, dirs_exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", revision), "w") as f:
        f.write(commit)
    return snapshot


def auto_model_class(config_or_path):
    """transformers' auto class for a model config (or a folder): `AutoModelForCausalLM`, or
    `AutoModelForImageTextToText` for a vision-language model (Qwen2.5-VL), which the former
    does not map."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = (
        AutoConfig.from_pretrained(config_or_path)
        if isinstance(config_or_path, str)
        else config_or_path
    )
    if type(config) not in AutoModelForCausalLM._model_mapping and type(config) in AutoModelForImageTextToText._model_mapping:  # fmt: skip
        return AutoModelForImageTextToText
    return AutoModelForCausalLM
