"""The trainer takes hub ids wherever it takes a model path (EasyR1's `Qwen/Qwen2.5-1.5B-Instruct`):
`check_models` (run by `prepare` before anything loads) resolves them through the local Hugging
Face cache, here a cache in tmp with tiny models under hub ids and HF_HUB_OFFLINE=1; a missing id
stops `main` with exit 2 and one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl.trainer.config import load_config
from verl.trainer.main import check_models, main
from verl.utils.model_path import add_to_hub_cache

DRAFT, GUIDANCE = "Org/tiny-draft", "Org/tiny-guidance"
ACTOR_KEY, GUIDANCE_KEY = (
    "worker.actor.model.model_path",
    "worker.rollout.offpolicy_guidance.model_path",
)
BASE = ["config=examples/qwen2_5_math.yaml", "config=configs/guidance_speculative.yaml"]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from verl.tasks.tiny_lm import TinyLMSpec, save_tiny_lm

    root = tmp_path_factory.mktemp("tiny")
    draft = save_tiny_lm(str(root / "draft"), TinyLMSpec(hidden_size=64, num_hidden_layers=1))
    guidance = save_tiny_lm(str(root / "guidance"), TinyLMSpec(num_hidden_layers=1, seed=2))
    return draft, guidance


@pytest.fixture
def cache(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the configs/ and examples/ paths
    return {
        DRAFT: add_to_hub_cache(tiny_models[0], DRAFT),
        GUIDANCE: add_to_hub_cache(tiny_models[1], GUIDANCE),
    }


def ids(draft: str = DRAFT, guidance: str = GUIDANCE) -> list[str]:
    return [*BASE, f"{ACTOR_KEY}={draft}", f"{GUIDANCE_KEY}={guidance}"]


def test_dry_run_keeps_hub_ids_and_check_models_resolves_them(cache, capsys):
    data = [
        "data.train_files=embedded://arithmetic@train",
        "data.val_files=",
    ]  # offline: no math12k
    assert main(["--dry-run", *ids(), *data]) == 0
    assert f"model_path: {DRAFT}\n" in capsys.readouterr().out  # printed as given
    config = load_config(ids())
    check_models(config)  # folders, config.json, the same tokenizer: all pass
    assert config.worker.actor.model.model_path == cache[DRAFT]
    assert config.worker.rollout.offpolicy_guidance.model_path == cache[GUIDANCE]


def test_tokenizer_path_takes_a_hub_id(cache):
    config = load_config([*ids(), f"worker.actor.model.tokenizer_path={GUIDANCE}@main"])
    check_models(config)
    assert config.worker.actor.model.tokenizer_path == cache[GUIDANCE]


def test_guidance_off_leaves_its_path_alone(cache):
    config = load_config(
        [*ids(guidance="Org/not-cached"), "worker.rollout.offpolicy_guidance.enable=false"]
    )
    check_models(config)
    assert config.worker.rollout.offpolicy_guidance.model_path == "Org/not-cached"


@pytest.mark.parametrize("key", [ACTOR_KEY, GUIDANCE_KEY])
def test_a_missing_id_stops_main_in_one_line_naming_the_key(key, cache, capsys):
    args = ids(draft="Org/absent") if key == ACTOR_KEY else ids(guidance="Org/absent")
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err]
    assert err.startswith(f"error: {key}: 'Org/absent' is not a local folder, and as a hub id")
    assert "HF_HUB_OFFLINE" in err and "valid: a local folder with config.json" in err


def test_a_cached_repo_without_config_json_is_no_model(cache, tmp_path, capsys):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    add_to_hub_cache(str(tmp_path / "tok"), "Org/tokenizer-only")
    assert main(ids(guidance="Org/tokenizer-only")) == 2
    err = capsys.readouterr().err
    assert f"error: {GUIDANCE_KEY}: " in err and "is not a local model folder" in err
