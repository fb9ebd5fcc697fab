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


def replacing(args: list[str], override: str) -> list[str]:
    """`args` with `override` in place of the argument that sets the same key (a key given twice
    would add a warning line: `test_empty_and_repeated_overlays_and_repeated_keys_are_said`)."""
    key = override.split("=", 1)[0] + "="
    return [a for a in args if not a.startswith(key)] + [override]


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
    context = ROOT / "verl" / "workers" / "rollout" / "context.py"
    assert _string_keys(context, "guidance_processing") == set(GUIDANCE_SAMPLING_FIELDS)
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
    assert main(["--dry-run", *replacing(tiny, arg)]) == 2
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
    args = ["--dry-run", *replacing(tiny, f"{GUIDANCE}.model_path=Org/big-guidance"),
            "data.val_files=Org/math@test"]  # fmt: skip
    assert main(args) == 2  # HF_HUB_OFFLINE: the run could not download them
    assert "HF_HUB_OFFLINE forbids a download" in error_line(capsys)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert main(args) == 0
    closing = capsys.readouterr().out.splitlines()[-1]
    assert closing.endswith("; not cached here, downloaded by the run: Org/big-guidance, Org/math@test; nothing loaded")  # fmt: skip


# ------------------------------------------------------------------ 10. values handed to vLLM or torch


@pytest.mark.parametrize(
    ("arg", "hint"),
    [("worker.rollout.dtype=bf16", " ('bf16' is written 'bfloat16')"), ("worker.rollout.dtype=foo", ""),
     (f"{GUIDANCE}.dtype=fp16", " ('fp16' is written 'float16')"),
     ("worker.actor.fsdp.mp_param_dtype=bf16", " ('bf16' is written 'bfloat16')")],
)  # fmt: skip
def test_a_dtype_the_engine_does_not_take_is_refused(arg, hint, capsys):
    key, value = arg.split("=")
    assert main(["--dry-run", GUIDED, arg]) == 2
    err = error_line(capsys)
    assert err.startswith(f"error: {key}={value!r} is not valid; valid: ") and err.endswith(hint)
    assert "bfloat16" in err and ("auto, half, float16, bfloat16, float, float32" in err) == (
        "rollout" in key
    )


def test_the_rollout_dtypes_are_vllms():
    """VLLM_DTYPES is vLLM's `ModelDType` (read from its source: importing vLLM takes seconds)."""
    import importlib.util
    import re

    from verl.workers.rollout.config import VLLM_DTYPES

    origin = importlib.util.find_spec("vllm").submodule_search_locations[0]
    source = Path(origin, "config", "model.py").read_text()
    literal = re.search(r"^ModelDType = Literal\[(.*?)\]", source, re.M | re.S).group(1)
    assert tuple(re.findall(r'"([^"]+)"', literal)) == VLLM_DTYPES


# ------------------------------------------------------------------ 11. this machine, the run's folders


def test_cuda_without_a_gpu_is_refused_unless_a_cluster_runs_it(tiny, monkeypatch, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["--dry-run", *tiny, "trainer.device=cuda"]) == 2
    err = error_line(capsys)
    assert err.startswith(
        "error: trainer.device='cuda' is not valid; this machine has no CUDA device"
    )
    assert "valid here: cpu, auto" in err and "RAY_ADDRESS" in err
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")  # the driver of a GPU cluster may have none
    assert main(["--dry-run", *tiny, "trainer.device=cuda"]) == 0


def test_flash_attention_without_cuda_is_refused_by_the_dry_run(tiny, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert (
        main(["--dry-run", *tiny, "worker.actor.model.attn_implementation=flash_attention_2"]) == 2
    )
    assert error_line(capsys) == ("error: worker.actor.model.attn_implementation='flash_attention_2' "
                                  "cannot be used: this process has no CUDA device; valid here: auto, sdpa, eager")  # fmt: skip


def test_a_checkpoint_folder_that_cannot_be_written_is_refused(tiny, tmp_path, monkeypatch, capsys):
    (tmp_path / "a_file").write_text("")
    assert (
        main(["--dry-run", *tiny, f"trainer.save_checkpoint_path={tmp_path / 'a_file' / 'ckpt'}"])
        == 2
    )
    assert f"is not valid; {tmp_path / 'a_file'} is a file, not a folder" in error_line(capsys)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    access = os.access  # root ignores the mode bits: os.access answers as a user would be answered
    monkeypatch.setattr(os, "access", lambda p, mode: access(p, mode) and Path(p) != locked)
    assert main(["--dry-run", *tiny, f"trainer.save_checkpoint_path={locked / 'run'}"]) == 2
    err = error_line(capsys)
    assert err.startswith(f"error: trainer.save_checkpoint_path='{locked / 'run'}' is not valid; {locked} "
                          "is not writable by this user")  # fmt: skip


def test_a_resume_path_is_checked_by_the_dry_run(tiny, tmp_path, capsys):
    assert main(["--dry-run", *tiny, "trainer.resume=/nonexistent"]) == 2
    err = error_line(capsys)
    assert err.startswith(
        "error: trainer.resume='/nonexistent' is not valid; no such folder; valid: auto"
    )
    (tmp_path / "global_step_3" / "actor").mkdir(parents=True)  # a save that did not finish
    assert main(["--dry-run", *tiny, f"trainer.resume={tmp_path / 'global_step_3'}"]) == 2
    assert "not a complete checkpoint: " in error_line(capsys)
    (tmp_path / "global_step_3" / "actor" / "COMPLETE").write_text("")
    assert main(["--dry-run", *tiny, f"trainer.resume={tmp_path / 'global_step_3'}"]) == 0


# ------------------------------------------------------------------ 12. reward arguments, LoRA before the build


def test_a_reward_argument_the_function_does_not_take_is_refused(tiny, assets, capsys):
    assert main(["--dry-run", *tiny, "worker.reward.reward_function_kwargs.foo=1"]) == 2
    assert error_line(capsys) == ("error: worker.reward.reward_function_kwargs.foo=1 is not valid; "
                                  "worker.reward.reward_function='arithmetic' takes no argument 'foo'; "
                                  "valid: none (it takes no keyword arguments)")  # fmt: skip
    args = [
        *tiny,
        "worker.reward.reward_function=math",
        "worker.reward.reward_function_kwargs={foo: 1}",
    ]
    assert main(["--dry-run", *args]) == 2
    assert error_line(capsys).endswith("takes no argument 'foo'; valid: format_weight")
    kwargs = "worker.reward.reward_function_kwargs={format_weight: 0.1}"
    assert main(["--dry-run", *tiny, "worker.reward.reward_function=math", kwargs]) == 0


def test_lora_targets_on_an_embedded_model_are_checked_before_it_is_built(capsys):
    """The guided example's draft is built by the run (.cache/embedded): its module names come
    from the task's model spec, before any build."""
    args = ["--dry-run", GUIDED, f"{LORA}.rank=4", f"{LORA}.target_modules=foo_proj"]
    assert main(args) == 2
    err = error_line(capsys)
    assert err.startswith(f"error: {LORA}.target_modules: 'foo_proj' names no module of ")
    assert "valid: all-linear or Linear names: down_proj, gate_proj, k_proj" in err


# ------------------------------------------------------------------ 13. user files that do not import or read


@pytest.mark.parametrize(
    ("body", "what"),
    [("def f(x):\n    return (\n", "2: SyntaxError: '(' was never closed"),
     ("import nowhere_pkg_48\n", "1: importing it raised ModuleNotFoundError: No module named 'nowhere_pkg_48'")],
)  # fmt: skip
@pytest.mark.parametrize("key", ["reward", "tool"])
def test_a_user_file_that_does_not_import_names_its_line(key, body, what, tiny, tmp_path, capsys):
    bad = tmp_path / "user.py"
    bad.write_text(body)
    if key == "reward":
        args, name = [f"worker.reward.reward_function={bad}:f"], "worker.reward.reward_function"
    else:
        args = [
            "worker.rollout.multi_turn.enable=true",
            f"worker.rollout.multi_turn.tools=[{bad}:f]",
        ]
        name = "worker.rollout.multi_turn.tools"
    assert main(["--dry-run", *tiny, *args]) == 2
    err = error_line(capsys)
    assert err.startswith(f"error: {name}=") and err.endswith(f"does not resolve: {bad}:{what}")


def test_a_config_file_that_cannot_be_read_is_one_line(tmp_path, monkeypatch, capsys):
    from omegaconf import OmegaConf

    locked = tmp_path / "locked.yaml"
    locked.write_text("trainer:\n  max_steps: 2\n")
    locked.chmod(0o000)
    if os.geteuid() == 0:  # root reads it anyway: the error a user gets, raised where it would be
        load = OmegaConf.load

        def refuse(path):
            if str(path) == str(locked):
                raise PermissionError(13, "Permission denied", str(path))
            return load(path)

        monkeypatch.setattr(OmegaConf, "load", refuse)
    assert main(["--dry-run", GUIDED, f"config={locked}"]) == 2
    assert error_line(capsys) == (f"error: config file '{locked}' cannot be read: Permission denied; "
                                  "valid: a readable YAML file")  # fmt: skip


def test_a_data_file_that_cannot_be_parsed_is_one_line(tmp_path, tiny, capsys):
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": broken\n')
    assert main([*tiny, f"data.train_files={bad}"]) == 2  # a real run: rows are read before Ray
    assert error_line(capsys).startswith(
        f"error: data.train_files: '{bad}' cannot be read: ArrowInvalid: "
    )


def test_a_batch_larger_than_the_data_is_the_only_line(tmp_path, tiny, capsys):
    """No progress bar of the data loading before the error."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+2=", "answer": "3"}\n')
    args = [*tiny, f"data.train_files={data}", "data.rollout_batch_size=8", "worker.rollout.n=2"]
    assert main(args) == 2
    assert error_line(capsys) == (f"error: data.rollout_batch_size=8 is larger than the 2 usable training "
                                  f"prompts of '{data}'; valid: 1..2 (prompts per step)")  # fmt: skip


# ------------------------------------------------------------------ 14. the command line's own form


def test_empty_and_repeated_overlays_and_repeated_keys_are_said(tmp_path, capsys):
    """Accepted (the launchers put their keys first and the user's after, the last winning), each
    with one warning line."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    otb = ROOT / "configs" / "otb.yaml"
    args = ["--dry-run", GUIDED, f"config={empty}", f"config={otb}", f"config={otb}",
            "worker.rollout.n=4", "worker.rollout.n=8", "trainer.max_steps=2", "trainer.max_steps=2"]  # fmt: skip
    assert main(args) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"warning: config file {otb} is given twice; it is merged again where it reappears, over the files before it",
        "warning: worker.rollout.n is given twice on the command line (worker.rollout.n=4, then "
        "worker.rollout.n=8); the last wins: 8",
        f"warning: config file {empty} is empty: it sets nothing",
    ]  # fmt: skip
    from omegaconf import OmegaConf

    assert OmegaConf.create(captured.out).worker.rollout.n == 8


def test_a_list_key_given_one_name_says_the_list_form(capsys):
    assert main(["--dry-run", GUIDED, "trainer.logger=console"]) == 2
    assert error_line(capsys) == ("error: trainer.logger='console' is not valid; expected a list: "
                                  "trainer.logger=[console] (several: trainer.logger=[a,b]; in YAML, a list)")  # fmt: skip
