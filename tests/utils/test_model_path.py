"""Model paths: a local folder stays as is; a hub id `org/name[@revision]` resolves to its
snapshot in the local Hugging Face cache (HF_HUB_CACHE, offline here), or is downloaded when the
hub may be reached; anything else fails in one line naming the key, the value and what is valid."""

from __future__ import annotations

import os

import huggingface_hub
import pytest

from verl.utils.model_path import (
    add_to_hub_cache,
    hub_cache_dir,
    parse_hub_id,
    resolve_model_path,
)

KEY = "worker.actor.model.model_path"


@pytest.fixture
def model(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    return str(folder)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty hub cache in tmp; the hub unreachable by configuration (HF_HUB_OFFLINE=1)."""
    path = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return str(path)


def one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text, text
    return text


def test_a_local_folder_stays_as_is(model, cache):
    assert resolve_model_path(model, KEY) == model


def test_hub_id_resolves_to_its_snapshot_in_the_local_cache(model, cache):
    snapshot = add_to_hub_cache(model, "Org/tiny-model")
    assert snapshot.startswith(cache) and "models--Org--tiny-model/snapshots/" in snapshot
    assert resolve_model_path("Org/tiny-model", KEY) == snapshot
    assert os.path.isfile(os.path.join(snapshot, "config.json"))
    # a revision (branch or tag) names its own snapshot; `main` is the default
    tagged = add_to_hub_cache(model, "Org/tiny-model", revision="v1")
    assert tagged != snapshot and resolve_model_path("Org/tiny-model@v1", KEY) == tagged
    # a commit hash is looked up among the snapshots directly
    commit = os.path.basename(tagged)
    assert resolve_model_path(f"Org/tiny-model@{commit}", KEY) == tagged


def test_cache_location_follows_hf_home_when_hf_hub_cache_is_unset(model, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_cache_dir() == str(tmp_path / "hf" / "hub")
    snapshot = add_to_hub_cache(model, "Org/other")
    assert snapshot.startswith(str(tmp_path / "hf" / "hub"))
    assert resolve_model_path("Org/other", KEY) == snapshot


def test_missing_hub_id_offline_fails_in_one_line(cache):
    with pytest.raises(FileNotFoundError) as error:
        resolve_model_path("Org/missing-model", KEY)
    text = one_line(error)
    assert text.startswith(f"{KEY}: 'Org/missing-model' is not a local folder")
    assert "HF_HUB_OFFLINE" in text and "valid: a local folder with config.json" in text
    assert cache in text  # where it looked


@pytest.mark.parametrize("value", ["/models/draft", "./draft", "~/draft", "a/b/c", "", None])
def test_a_missing_path_that_is_no_hub_id_fails_in_one_line(value, cache):
    with pytest.raises(FileNotFoundError) as error:
        resolve_model_path(value, KEY)
    text = one_line(error)
    assert text.startswith(f"{KEY}: {value!r} is not a local folder; valid: ")
    assert "hub id org/name[@revision]" in text


def test_parse_hub_id():
    assert parse_hub_id("Qwen/Qwen2.5-1.5B-Instruct") == ("Qwen/Qwen2.5-1.5B-Instruct", None)
    assert parse_hub_id("Qwen/Qwen2.5-7B-Instruct@main") == ("Qwen/Qwen2.5-7B-Instruct", "main")
    assert parse_hub_id("gpt2") == ("gpt2", None)
    for not_an_id in ("/abs/path", "../rel", "a/b/c", "org/na me", "org--x/y", ""):
        assert parse_hub_id(not_an_id) is None, not_an_id


def test_online_a_missing_id_is_downloaded_into_the_cache(model, cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []

    def fake_download(repo_id, revision=None, cache_dir=None, local_files_only=False, **kwargs):
        calls.append((repo_id, revision, cache_dir, local_files_only))
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        return add_to_hub_cache(model, repo_id, revision or "main", cache_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    path = resolve_model_path("Org/remote@v2", KEY)
    assert calls == [("Org/remote", "v2", cache, True), ("Org/remote", "v2", cache, False)]
    assert path.startswith(cache) and os.path.isfile(os.path.join(path, "config.json"))


def test_online_a_failed_download_fails_in_one_line(cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")

    def failing_download(repo_id, local_files_only=False, **kwargs):
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        raise OSError("Repository Not Found for url: https://huggingface.co/...\nmore detail")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing_download)
    with pytest.raises(FileNotFoundError) as error:
        resolve_model_path("Org/nope", KEY)
    text = one_line(error)
    assert "'Org/nope'" in text and "the download failed (OSError: Repository Not Found" in text
    assert "more detail" not in text and "valid: " in text


def test_a_snapshot_folder_missing_here_resolves_as_the_same_commit(model, cache, tmp_path):
    """The driver's resolved folder on another node (another HF_HOME): same repo, same commit."""
    snapshot = add_to_hub_cache(model, "Org/tiny-model")
    commit = os.path.basename(snapshot)
    elsewhere = f"/home/other/.cache/huggingface/hub/models--Org--tiny-model/snapshots/{commit}"
    assert resolve_model_path(elsewhere, KEY) == snapshot
    with pytest.raises(FileNotFoundError, match="is not a local folder, and as a hub id"):
        resolve_model_path(elsewhere.replace("tiny-model", "absent"), KEY)


def test_load_hf_model_takes_hub_ids(cache, tmp_path):
    import torch

    from verl.tasks.tiny_lm import save_tiny_lm
    from verl.utils.fsdp_utils import load_hf_model

    add_to_hub_cache(save_tiny_lm(str(tmp_path / "tiny")), "Org/tiny-lm")
    model = load_hf_model("Org/tiny-lm", torch.float32, "sdpa")
    assert model.config.vocab_size == 128
    with pytest.raises(FileNotFoundError, match=r"^model path: 'Org/absent' is not a local folder"):
        load_hf_model("Org/absent", torch.float32)
