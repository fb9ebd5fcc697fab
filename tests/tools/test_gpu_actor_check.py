"""`python -m verl.tools.gpu_actor_check` on CPU (gloo; mixed precision applies on GPU only), its
one-line errors, and its pass/fail rule on hand-written reports."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from verl.tasks.tiny_lm import TinyLMSpec, save_tiny_lm
from verl.tools import gpu_actor_check as G


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_runs_the_worker_in_process_and_reports(tmp_path, lora_rank):
    """The whole check on a tiny model, without and with LoRA adapters (rank 4, every linear
    layer: they start at B = 0, so the float32 worker equals the plain forward either way, the
    step moves the adapters and the reference, adapters off, stays where it was)."""
    model = save_tiny_lm(
        str(tmp_path / "tiny"), TinyLMSpec(hidden_size=64, num_hidden_layers=2, seed=5)
    )
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "verl.tools.gpu_actor_check", "--model", model,
                           "--out", str(out), "--lora-rank", str(lora_rank)],
                          capture_output=True, text=True, timeout=600, cwd=G.ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("gpu-actor-check: 1 model(s) on cpu, 0 failure(s)")
    (report,) = json.loads(out.read_text())["models"]
    assert report["device"] == "cpu" and report["failures"] == []
    assert report["sequences"] == len(G.PROMPTS) * G.SAMPLES and report["response_tokens"] > 0
    for dtype in ("float32", "bfloat16"):  # both float32 on CPU: the packed worker = plain HF
        row = report[dtype]
        for key in ("log_probs", "entropy", "sum_pi_squared", "ref_log_probs", "ref_after_step"):
            assert row[key]["max"] < G.FP32_ATOL, (dtype, key, row[key])
        assert row["surrogate_gain"] > 0 and row["mean_abs_shift"] > 0
    assert report["lora_rank"] == lora_rank
    # the plain bfloat16 cast is measurably off float32 (what the GPU's bound scales with)
    assert report["plain_bf16"]["log_probs"]["mean"] > 10 * report["float32"]["log_probs"]["mean"]
    assert report["step_shift_cosine_bf16_vs_fp32"] > 0.9
    assert report["step_shift_norm_ratio_bf16_vs_fp32"] == pytest.approx(1, abs=1e-6)


@pytest.mark.parametrize(
    ("args", "start"),
    [
        (["--model", "/no/such/model"], "gpu-actor-check: --model /no/such/model is neither"),
        (["--gguf", "/no/file.gguf"], "gpu-actor-check: --gguf /no/file.gguf is not a file"),
        (["--lora-rank", "-1"], "gpu-actor-check: --lora-rank -1 is not valid"),
    ],
)
def test_bad_paths_are_refused_in_one_line(args, start, capsys):
    assert G.main(args) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(start)


def test_hub_ids_pass_the_path_check():
    assert G.model_reachable("Qwen/Qwen2.5-0.5B-Instruct")
    assert not G.model_reachable("not a hub id")


def _report(
    fp32_err=1e-6, bf16_mean=0.010, bf16_max=0.05, plain_mean=0.008, plain_max=0.04, gain=1.0
):
    row = lambda err, mean, gain: {  # noqa: E731
        "log_probs": {"max": err, "mean": mean}, "entropy": {"max": err, "mean": mean},
        "sum_pi_squared": {"max": err, "mean": mean}, "ref_log_probs": {"max": err, "mean": mean},
        "metrics": {"actor/pg_loss": 0.4}, "surrogate_gain": gain,
    }  # fmt: skip
    report = {
        "float32": row(fp32_err, fp32_err / 2, gain),
        "bfloat16": row(bf16_max, bf16_mean, gain),
    }
    report["plain_bf16"] = {"log_probs": {"max": plain_max, "mean": plain_mean}}
    return report


def test_failure_rule_on_hand_written_reports():
    assert G.failures(_report()) == []
    # float32 worker off by 2e-4 >= FP32_ATOL = 1e-4: all four quantities flagged
    assert len(G.failures(_report(fp32_err=2e-4))) == 4
    # bfloat16 mean bound: 1.5 x 0.008 + 1e-3 = 0.013; 0.0129 passes, 0.0131 fails
    assert G.failures(_report(bf16_mean=0.0129)) == []
    assert "bfloat16 worker log π" in G.failures(_report(bf16_mean=0.0131))[0]
    # bfloat16 max bound: 2 x 0.04 + 1e-2 = 0.09
    assert G.failures(_report(bf16_max=0.089)) == []
    assert len(G.failures(_report(bf16_max=0.091))) == 1
    # a step that does not raise Σ A·Δlog π fails in both precisions
    assert len(G.failures(_report(gain=0.0))) == 2
