"""Bad inputs on the real command line (`python -m verl.trainer.main`, or its `main()` in-process):
each fails before Ray starts with exit code 2 and one `error:` line naming the key (or the
launcher's variable), the value and what is valid; `--help` and `--dry-run` say what they do."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest

from verl.trainer.config import load_config
from verl.trainer.main import launcher_hint, main
from verl.utils.dataset import load_rows
from verl.utils.model_path import add_to_hub_cache
from verl.workers.rollout.config import GUIDANCE_SAMPLING_FIELDS, VAL_OVERRIDE_FIELDS

ROOT = Path(__file__).resolve().parents[2]
GUIDED = f"config={ROOT / 'examples' / 'grpo_guided.yaml'}"
GUIDANCE = "worker.rollout.offpolicy_guidance"


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """An empty hub cache in tmp, and HF_HUB_OFFLINE=1."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


@pytest.fixture
def tiny(assets):
    """The guided example with the tiny local draft / guidance pair of conftest.py."""
    return [GUIDED, f"worker.actor.model.model_path={assets['draft']}",
            f"{GUIDANCE}.model_path={assets['guidance']}"]  # fmt: skip


def error_line(capsys) -> str:
    """The one line main() wrote to stderr (asserted to be one)."""
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err], err
    assert err.startswith("error: "), err
    return err


def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    """`python -m verl.trainer.main ARGS` in a subprocess."""
    return subprocess.run([sys.executable, "-m", "verl.trainer.main", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, **env})  # fmt: skip


# ------------------------------------------------------------------ 1. n = 1 with a grouped estimator


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "optimal_token_baseline"])
def test_one_response_per_prompt_is_refused_for_a_grouped_estimator(estimator, capsys):
    args = ["--dry-run", GUIDED, "worker.rollout.n=1", f"algorithm.adv_estimator={estimator}"]
    assert main(args) == 2
    err = error_line(capsys)
    assert err.startswith("error: worker.rollout.n=1 is not valid; ")
    assert f"algorithm.adv_estimator={estimator!r}" in err and "n >= 2" in err
    assert "reinforce_plus_plus" in err  # what works with n = 1


def test_one_response_per_prompt_is_fine_without_groups():
    config = load_config([GUIDED, "worker.rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus"])  # fmt: skip
    assert config.worker.rollout.n == 1


def test_the_trainer_no_longer_warns_at_run_time():
    source = (ROOT / "verl" / "trainer" / "ray_trainer.py").read_text()
    assert "_warned_single_sample" not in source


# ------------------------------------------------------------------ 2. sampling override fields


def test_a_misspelled_guidance_sampling_field_is_refused(capsys):
    assert main(["--dry-run", GUIDED, f"{GUIDANCE}.sampling_overrides={{temprature: 0.7}}"]) == 2
    err = error_line(capsys)
    assert err.startswith(
        f"error: {GUIDANCE}.sampling_overrides={{'temprature': 0.7}} is not valid"
    )
    assert "unknown field 'temprature' (did you mean 'temperature'?)" in err
    assert "valid: temperature, top_k, top_p" in err


def test_a_sampling_field_the_run_ignores_is_refused_in_val_override_config(capsys):
    assert main(["--dry-run", GUIDED, "worker.rollout.val_override_config={max_tokens: 8}"]) == 2
    err = error_line(capsys)
    assert "worker.rollout.val_override_config=" in err and "unknown field 'max_tokens'" in err
    assert "valid: n, temperature" in err


@pytest.mark.parametrize(
    ("arg", "key"),
    [(f"{GUIDANCE}.sampling_overrides={{temperature: 0}}", f"{GUIDANCE}.sampling_overrides.temperature"),
     (f"{GUIDANCE}.sampling_overrides={{top_p: 1.5}}", f"{GUIDANCE}.sampling_overrides.top_p"),
     ("worker.rollout.val_override_config={n: 0}", "worker.rollout.val_override_config.n")],
)  # fmt: skip
def test_a_bad_sampling_value_names_its_field(arg, key, capsys):
    assert main(["--dry-run", GUIDED, arg]) == 2
    assert error_line(capsys).startswith(f"error: {key}=")


def test_valid_overrides_load():
    config = load_config([GUIDED, f"{GUIDANCE}.sampling_overrides={{temperature: 0.7, top_k: 5, top_p: 0.9}}",
                          "worker.rollout.val_override_config={n: 2, temperature: 0}"])  # fmt: skip
    assert config.worker.rollout.offpolicy_guidance.sampling_overrides["top_k"] == 5


def _string_keys(path: Path, function: str) -> set[str]:
    """The string keys of dict literals and of `.get("...")` calls inside `function` of a file."""
    tree = ast.parse(path.read_text())
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    keys = set()
    for node in ast.walk(body):
        if isinstance(node, ast.Dict):
            keys |= {k.value for k in node.keys if isinstance(k, ast.Constant)}
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get" and node.args:
            if (
                isinstance(node.args[0], ast.Constant)
                and getattr(node.func.value, "id", "") == "overrides"
            ):
                keys.add(node.args[0].value)
    return keys


def test_the_valid_fields_are_the_ones_the_code_applies():
    rollout = ROOT / "verl" / "workers" / "rollout" / "vllm_rollout_spmd.py"
    assert _string_keys(rollout, "_guidance_processing") == set(GUIDANCE_SAMPLING_FIELDS)
    trainer = ROOT / "verl" / "trainer" / "ray_trainer.py"
    assert set(VAL_OVERRIDE_FIELDS) <= _string_keys(trainer, "validate")


# ------------------------------------------------------------------ 3. YAML syntax error


def test_a_yaml_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "overlay.yaml"
    bad.write_text("worker:\n  rollout:\n    n: [4, 8\n  actor:\n    ppo_epochs: 1\n")
    proc = cli(GUIDED, f"config={bad}")
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.splitlines() == [err]
    assert err.startswith(f"error: config file {bad}:4:")
    assert "YAML syntax error" in err and "at line 3" in err


# ------------------------------------------------------------------ 4. a hub dataset not in the cache


def test_an_uncached_hub_dataset_fails_at_once_offline(tiny, offline, capsys, monkeypatch):
    import socket

    attempts = []

    def refuse(where, *args, **kwargs):  # any network access (a name lookup, a connection)
        attempts.append(where)
        raise OSError(f"this test allows no network access ({where})")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", lambda sock, address: refuse(address))
    monkeypatch.setattr(socket.socket, "connect_ex", lambda sock, address: refuse(address))
    assert main([*tiny, "data.train_files=hiyouga/math12k@train"]) == 2  # a real run, not dry
    err = error_line(capsys)
    assert attempts == []  # offline: not one connection tried, so no network retries either
    assert err.startswith(
        "error: data.train_files: 'hiyouga/math12k@train' is not a file or folder"
    )
    assert "HF_HUB_OFFLINE forbids a download" in err
    assert "valid: a .jsonl/.json/.parquet file, a dataset folder, embedded://" in err
    assert "name@split of a Hugging Face dataset in the local cache" in err


def test_an_unreachable_hub_fails_at_once_without_hf_hub_offline(
    tiny, offline, monkeypatch, capsys
):
    monkeypatch.delenv("HF_HUB_OFFLINE")

    def no_network(repo_id, local_files_only=False, **kwargs):
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        raise OSError("Got: ConnectError: [Errno -2] Name or service not known\nmore")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    assert main([*tiny, "data.val_files=Org/absent@test"]) == 2
    err = error_line(capsys)
    assert err.startswith("error: data.val_files: 'Org/absent@test' is not a file or folder")
    assert "the download failed (OSError: Got: ConnectError" in err and "more" not in err


def test_a_cached_hub_dataset_loads_its_split(offline, tmp_path):
    folder = tmp_path / "tiny_math"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    (folder / "test.jsonl").write_text('{"problem": "2+2", "answer": "4"}\n')
    add_to_hub_cache(str(folder), "Org/tiny-math", repo_type="dataset")
    assert load_rows("Org/tiny-math@test", "data.val_files") == [{"problem": "2+2", "answer": "4"}]
    with pytest.raises(ValueError, match=r"^data.train_files: 'Org/tiny-math@dev' .*split"):
        load_rows("Org/tiny-math@dev", "data.train_files")


# ------------------------------------------------------------------ 5. a missing data file


@pytest.mark.parametrize("key", ["data.train_files", "data.val_files"])
def test_a_missing_data_file_names_its_key(key, tiny, capsys):
    assert main([*tiny, f"{key}=data/missing.jsonl"]) == 2  # a real run, not dry
    err = error_line(capsys)
    assert err.startswith(f"error: {key}: 'data/missing.jsonl' is not a file or folder")
    assert "valid: a .jsonl/.json/.parquet file" in err


# ------------------------------------------------------------------ 6. guided_samples > n


def test_guided_samples_beyond_n_names_rollout_n(capsys):
    assert main(["--dry-run", GUIDED, f"{GUIDANCE}.guided_samples=12", "worker.rollout.n=8"]) == 2
    err = error_line(capsys)
    assert err.startswith(f"error: {GUIDANCE}.guided_samples=12 is not valid")
    assert "expected a value in [0, 8] (worker.rollout.n = 8: " in err


# ------------------------------------------------------------------ 7. launcher variables (python side)


def test_an_error_on_a_launcher_key_names_the_launcher_variables(monkeypatch):
    monkeypatch.setenv("VERL_LAUNCHER_KEYS", "trainer.n_gpus_per_node=N_GPUS - GUIDANCE_GPUS = 8 - 2;"
                       "trainer.nnodes=NNODES = 1")  # fmt: skip
    message = "x over trainer.nnodes x trainer.n_gpus_per_node = 6 workers"
    assert launcher_hint(message) == (
        "; launcher: trainer.n_gpus_per_node = N_GPUS - GUIDANCE_GPUS = 8 - 2, trainer.nnodes = NNODES = 1"
    )
    assert launcher_hint(f"{GUIDANCE}.n_gpus_per_node=9 is not valid") == ""
    monkeypatch.delenv("VERL_LAUNCHER_KEYS")
    assert launcher_hint(message) == ""


# ------------------------------------------------------------------ 8. --help


def test_help_prints_usage_and_exits_0(capsys):
    proc = cli("--help")
    assert proc.returncode == 0 and proc.stderr == ""
    for part in ("config=FILE.yaml", "key=value", "--dry-run", "configs/defaults.yaml",
                 "README_guidance.md", "HF_HUB_OFFLINE"):  # fmt: skip
        assert part in proc.stdout, part
    assert main(["-h"]) == 0 and capsys.readouterr().out == proc.stdout


# ------------------------------------------------------------------ 9. --dry-run checks


def test_dry_run_checks_models_data_and_reward_and_says_so(tiny, assets, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    args = [*tiny, f"data.train_files={data}", f"worker.reward.reward_function={assets['reward']}"]
    assert main(["--dry-run", *args]) == 0
    closing = capsys.readouterr().out.splitlines()[-1]
    assert closing == (f"# dry run: config valid; checked 2 model paths, 2 data sources, reward "
                       f"{assets['reward']!r}; nothing loaded")  # fmt: skip


@pytest.mark.parametrize(
    ("arg", "start"),
    [("worker.actor.model.model_path=/nowhere/model", "error: worker.actor.model.model_path: '/nowhere/model' is not a local folder"),
     (f"{GUIDANCE}.model_path=Org/absent", f"error: {GUIDANCE}.model_path: 'Org/absent' is not a local folder, and as a hub id"),
     ("data.train_files=/nowhere/train.parquet", "error: data.train_files: '/nowhere/train.parquet' is not a file or folder"),
     ("data.val_files=Org/absent@test", "error: data.val_files: 'Org/absent@test' is not a file or folder, and as a hub dataset"),
     ("worker.reward.reward_function=/nowhere/r.py:fn", "error: worker.reward.reward_function='/nowhere/r.py:fn' does not resolve: file"),
     ("worker.reward.val_reward_function=nope", "error: worker.reward.val_reward_function='nope' does not resolve: unknown reward function"),
     ("data.format_prompt=/nowhere/t.jinja", "error: data.format_prompt: file '/nowhere/t.jinja' not found")],
)  # fmt: skip
def test_dry_run_fails_in_one_line_on_what_a_run_could_not_load(arg, start, tiny, offline, capsys):
    assert main(["--dry-run", *tiny, arg]) == 2
    assert error_line(capsys).startswith(start)


LORA = "worker.actor.model.lora"


@pytest.mark.parametrize(
    ("args", "start"),
    [([f"{LORA}.rank=4", f"{LORA}.target_modules=q_proj,qproj"], f"error: {LORA}.target_modules: 'qproj' names no module of"),
     ([f"{LORA}.rank=4", f"{LORA}.target_modules=lm_head"], f"error: {LORA}.target_modules: 'lm_head' is the LM head tied"),
     ([f"{LORA}.rank=100000"], f"error: {LORA}.rank=100000 exceeds the smallest side"),
     ([f"{LORA}.rank=-2"], f"error: {LORA}.rank=-2 is not valid; expected an integer >= 0")],
)  # fmt: skip
@pytest.mark.parametrize("dry", [True, False])
def test_a_lora_the_model_cannot_take_fails_before_ray(args, start, dry, tiny, capsys):
    assert main([*(["--dry-run"] if dry else []), *tiny, *args]) == 2  # a real run: before Ray
    assert error_line(capsys).startswith(start)


def test_dry_run_names_a_missing_reward_function(tiny, assets, capsys):
    path = assets["reward"].rsplit(":", 1)[0]
    assert main(["--dry-run", *tiny, f"worker.reward.reward_function={path}:absent"]) == 2
    assert "defines no function 'absent'" in error_line(capsys)


def test_dry_run_passes_a_hub_id_not_cached_here_unless_offline(tiny, offline, monkeypatch, capsys):
    args = [
        "--dry-run",
        *tiny,
        f"{GUIDANCE}.model_path=Org/big-guidance",
        "data.val_files=Org/math@test",
    ]
    assert main(args) == 2  # HF_HUB_OFFLINE: the run could not download them
    assert "HF_HUB_OFFLINE forbids a download" in error_line(capsys)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert main(args) == 0
    closing = capsys.readouterr().out.splitlines()[-1]
    assert closing.endswith("; not cached here, downloaded by the run: Org/big-guidance, Org/math@test; nothing loaded")  # fmt: skip
