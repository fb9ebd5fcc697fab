"""`make gpu-check` (verl/tools/gpu_check.py): without CUDA one line; its 2-step run is a valid
config with the default hub ids; the report's readers on hand-written log lines."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from verl.tools import gpu_check as G


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_it_stops_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "verl.tools.gpu_check"], capture_output=True,
                          text=True, timeout=120, cwd=G.ROOT)  # fmt: skip
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("gpu-check: no CUDA device visible to torch ")
    assert line.endswith("run it on a machine with an NVIDIA GPU")


def test_unknown_part_is_refused_in_one_line(capsys):
    assert G.main(["--parts", "run,nope"]) == 2
    assert (
        capsys.readouterr().err
        == "gpu-check: --parts nope not valid; valid: actor, gpu-tier, run, bench\n"
    )


def test_the_two_step_run_is_a_valid_config_with_the_default_pair(tmp_path, capsys):
    from verl.trainer.config import load_config
    from verl.trainer.main import main

    values = G.settings({})
    assert values["MODEL_PATH"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert values["GUIDANCE_PATH"] == "Qwen/Qwen2.5-1.5B-Instruct"
    args = G.train_args(values, str(tmp_path / "run"))
    assert main([*args, "--dry-run"]) == 0  # validates without touching models or data
    capsys.readouterr()
    config = load_config(args)
    guidance = config.worker.rollout.offpolicy_guidance
    assert guidance.enable and guidance.mode == "speculative" and guidance.n_gpus_per_node == 0
    assert config.worker.actor.model.model_path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert guidance.model_path == "Qwen/Qwen2.5-1.5B-Instruct"
    assert config.trainer.max_steps == 2 and config.data.val_files == ""
    assert "wandb" not in config.trainer.logger
    mine = G.settings({"MODEL_PATH": "/m/draft", "GPU_CHECK_GPUS": "2"})
    assert "worker.actor.model.model_path=/m/draft" in G.train_args(mine, "r")
    assert "trainer.n_gpus_per_node=2" in G.train_args(mine, "r")
    keys = G.rollout_memory_keys(args)
    assert "worker.rollout.gpu_memory_utilization = 0.4" in keys
    assert "worker.rollout.offpolicy_guidance.gpu_memory_utilization = 0.3" in keys


H100_REPORT = G.ROOT / "benchmarks" / "results" / "gpu_actor_check_h100.json"
VLLM_LOG = """\
(RolloutWorker pid=11) INFO 11-25 10:00:01 [vllm.py:812] Model Runner V2 requires Triton; using the V1 model runner instead
(RolloutWorker pid=11) INFO 11-25 10:00:09 [gpu_worker.py:301] Available KV cache memory: 20.51 GiB
(RolloutWorker pid=11) vLLM engine of /m/draft built: model runner class GPUModelRunner, KV cache 22022043648 bytes, vocab rows all
(RolloutWorker pid=11) INFO 11-25 10:00:09 [kv_cache_utils.py:1087] GPU KV cache size: 1,792,128 tokens
(RolloutWorker pid=11) INFO 11-25 10:00:09 [kv_cache_utils.py:1087] GPU KV cache size: 1,792,128 tokens
training:  50%|#####     | 1/2 [00:30<00:30, reward=0.125]
"""

BENCH_LOG = """\
torch 2.11.0, 64 prompts x 8 tokens, 64 new tokens, top-20 log-probs, float32
draft-only             median    0.40 s  (0.41, 0.40)

=== summary (ratios from one run) ===
guided k=4 g=4: wall time 1.85x draft-only (goal <= 2.0; 95 % bootstrap interval 1.70-2.01, <= 2.0 in 96% of resamples; per-repeat ratios: median 1.84, quartiles 1.80-1.90; fastest repeats 1.83x); 2.41 guidance tokens computed per emitted token (goal <= 2)
"""


def test_log_readers_pick_the_runner_kv_lines_and_ratios():
    lines = VLLM_LOG.splitlines()  # (vllm_engine.build_llm prints the runner class it checked)
    assert G.matching_lines(VLLM_LOG, G.RUNNER_LINE) == [lines[0], lines[2]]
    kv = G.matching_lines(VLLM_LOG, G.KV_LINE)
    assert kv == lines[1:4]  # the repeated line once
    assert G.bench_ratios(BENCH_LOG) == [("guided k=4 g=4", 1.85, "draft-only")]
    assert G.summary_section(BENCH_LOG).startswith("=== summary")
    assert G.last_line(BENCH_LOG).startswith("guided k=4 g=4: wall time")


def test_step_rows_and_the_memory_table(tmp_path):
    log = tmp_path / "experiment_log.jsonl"
    assert G.step_rows(log) == []
    rows = [{"step": 0, "val/reward_score": 0.1}, {"step": 1, "critic/score/mean": 0.5}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert G.step_rows(log) == [rows[1]]  # training steps only
    sampler = G.GpuMemorySampler(log)
    assert sampler.table()[0].startswith("(nvidia-smi listed no GPU process")
    sampler.peaks = {0: {7: 30000, 8: 9000}, 1: {7: 41000}}
    sampler.names = {7: "ray::RolloutWorker", 8: "ray::FSDPWorker"}
    assert sampler.table()[2:] == ["| ray::RolloutWorker (7) | 30000 | 41000 |",
                                   "| ray::FSDPWorker (8) | 9000 | - |"]  # fmt: skip


def test_the_report_is_assembled_from_the_parts_logs(tmp_path, monkeypatch, capsys):
    """Everything but the GPU: the three parts' processes are stood in for by canned logs (the
    run also writes its experiment log), and the report says what each part gave."""
    logs = {
        "actor.log": "gpu-actor-check: 2 model(s) on cuda, 0 failure(s)\n",
        "gpu_tier.log": "1 passed, 2 skipped in 9.0s\n",
        "run.log": VLLM_LOG,
        "bench.log": BENCH_LOG,
    }
    commands = []

    def run_logged(command, log, timeout, env=None):
        commands.append(command)
        log.write_text(logs[log.name])
        if log.name == "actor.log":  # the actor check's JSON: the one recorded on an H100
            (log.parent / "actor.json").write_text(H100_REPORT.read_text())
        if log.name == "run.log":
            run = log.parent / "run"
            (run / "global_step_2").mkdir(parents=True)
            rows = [
                {"step": s, "critic/score/mean": 0.5, "mismatch/kl_v2": 1e-3 * s} for s in (1, 2)
            ]
            (run / "experiment_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return 0 if log.name != "bench.log" else 1

    monkeypatch.setattr(G, "no_cuda_reason", lambda: None)
    monkeypatch.setattr(G, "run_logged", run_logged)
    monkeypatch.setattr(G, "versions", lambda: ["python 3.11", "torch 2.11.0 (CUDA 12.8)"])
    monkeypatch.setattr(G.GpuMemorySampler, "_run", lambda self: None)  # no nvidia-smi here
    assert G.main(["--out", str(tmp_path)]) == 1  # the benchmark "failed"
    report = (tmp_path / "report.md").read_text()
    assert "**actor: passed, gpu-tier: passed, run: passed, bench: FAILED (1)**" in report
    assert "exit 0: gpu-actor-check: 2 model(s) on cuda, 0 failure(s)" in report
    assert "bfloat16 worker mean 0.0417, max 0.2584" in report
    assert "exit 0: 1 passed, 2 skipped in 9.0s" in report
    assert "Model Runner V2 requires Triton" in report and "1,792,128 tokens" in report
    assert "worker.rollout.gpu_memory_utilization = 0.4" in report
    assert "| 1 | 0.001 |" in report and "| 2 | 0.002 |" in report  # mismatch/kl_v2 per step
    assert "guided k=4 g=4: 1.85x draft-only" in report
    assert report.count("Its last lines:") == 1  # the failed part's output, the benchmark's
    assert report.rstrip().endswith(f"```\n{BENCH_LOG.strip()}\n```")
    assert not (tmp_path / "run" / "global_step_2").exists()  # the final checkpoint is dropped
    assert commands[0][1:5] == [
        "-m",
        "verl.tools.gpu_actor_check",
        "--model",
        "Qwen/Qwen2.5-0.5B-Instruct",
    ]
    assert [c[1:4] for c in commands[1:]] == [["-m", "pytest", "-m"], ["-m", "verl.trainer.main",
            commands[2][3]], ["benchmarks/bench_guided_rollout.py", "--repeats", "5"]]  # fmt: skip
    assert capsys.readouterr().out.endswith(f"report: {tmp_path / 'report.md'}\n")


def test_the_actor_part_summarises_the_h100_report():
    lines = G.actor_lines(H100_REPORT)
    assert len(lines) == 3 and lines[-1] == ""  # two models, then a blank line
    assert "float32 worker |Δ log π| max 1.17e-05" in lines[0]
    assert (
        "bfloat16 worker mean 0.0077, max 0.0630 (plain bfloat16 cast 0.0084, 0.0631)" in lines[0]
    )
    assert (
        "bfloat16 worker mean 0.0417, max 0.2584 (plain bfloat16 cast 0.0403, 0.2061)" in lines[1]
    )
    assert lines[1].endswith("failures: none")
    assert G.actor_lines(G.ROOT / "no_such_report.json") == []
