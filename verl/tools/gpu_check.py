"""`make gpu-check`: what this project cannot run on its own machines, run on a user's CUDA box.

Four parts, each in its own process with its log beside the report:

1. the FSDP actor alone (`verl/tools/gpu_actor_check.py` on `MODEL_PATH`): float32 log-probs,
   entropy and Σπ² against a plain forward, bfloat16's error against a plain bfloat16 cast, a
   PPO step in each precision (needs no vLLM or Ray);
2. the gpu test tier (`pytest -m gpu`);
3. a colocated 2-step guided run: the draft `MODEL_PATH` (default Qwen/Qwen2.5-0.5B-Instruct)
   trained with the guidance `GUIDANCE_PATH` (default Qwen/Qwen2.5-1.5B-Instruct, the draft's
   tokenizer) sharing `GPU_CHECK_GPUS` GPUs (default 1), on `TRAIN_FILES` (default
   hiyouga/math12k@train), 8 prompts x 4 samples of up to 256 tokens a step; hub ids or folders;
4. the rollout benchmark (`benchmarks/bench_guided_rollout.py`): guided / draft-only wall time.

One report, `outputs/gpu_check/report.md` (`--out`): versions (python, torch and its CUDA, vLLM,
transformers, Ray, flash-attn, GPUs and driver), each part's outcome, the vLLM lines that name
the model runner and the KV-cache budgets, the rollout's memory keys, each GPU process's peak
memory (nvidia-smi, every 0.5 s) during step 1 and during step 2 (which starts by waking the
engines), the run's mismatch/kl_v2 and timings per step, and the benchmark's ratios.

    make gpu-check                                    # all three parts
    MODEL_PATH=... GUIDANCE_PATH=... make gpu-check   # another same-tokenizer pair
    python -m verl.tools.gpu_check --parts run        # one part (actor, gpu-tier, run, bench)

Without a CUDA device it stops at once with one line (exit 1). Exit 0 when every part passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("actor", "gpu-tier", "run", "bench")
DEFAULTS = {
    "MODEL_PATH": "Qwen/Qwen2.5-0.5B-Instruct",
    "GUIDANCE_PATH": "Qwen/Qwen2.5-1.5B-Instruct",
    "TRAIN_FILES": "hiyouga/math12k@train",
    "GPU_CHECK_GPUS": "1",
}
TIMEOUT_S = {"actor": 900, "gpu-tier": 1800, "run": 3600, "bench": 1800}
"""Each part's limit: a part that runs past it is stopped and reported as timed out."""
RUNNER_LINE = re.compile(r"model runner|modelrunner|runner v[12]\b|runner class", re.I)
KV_LINE = re.compile(
    r"kv cache|kv_cache|cache blocks|num_gpu_blocks|gpu_memory_utilization|memory profiling", re.I
)
WAKE_LINE = re.compile(r"\bwak(e|ing)\b|\bsleep", re.I)
RATIO_LINE = re.compile(r"^(?P<name>\S.*?): wall time (?P<ratio>[0-9.]+)x (?P<base>.+?) \(")


def no_cuda_reason() -> str | None:
    """None on a machine where torch sees a CUDA device, else the one line that says why not."""
    try:
        import torch
    except ImportError as error:  # (the env is not installed)
        return f"gpu-check: torch does not import ({error}); run `make env` first"
    if torch.cuda.is_available():
        return None
    return (
        f"gpu-check: no CUDA device visible to torch {torch.__version__} (built with CUDA "
        f"{torch.version.cuda}); run it on a machine with an NVIDIA GPU"
    )


def settings(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables this check reads, with their defaults filled in."""
    env = os.environ if env is None else env
    return {key: env.get(key) or default for key, default in DEFAULTS.items()}


def train_args(values: dict[str, str], run_dir: str) -> list[str]:
    """The 2-step run's `verl.trainer.main` arguments: the GPU launchers' configs, the guidance
    colocated (sharing every GPU), small batches, no validation, no wandb."""
    return [
        f"config={ROOT / 'examples' / 'qwen2_5_math.yaml'}",
        f"config={ROOT / 'configs' / 'guidance_speculative.yaml'}",
        f"worker.actor.model.model_path={values['MODEL_PATH']}",
        f"worker.rollout.offpolicy_guidance.model_path={values['GUIDANCE_PATH']}",
        f"data.train_files={values['TRAIN_FILES']}",
        "data.val_files=",
        "data.rollout_batch_size=8",
        "data.max_prompt_length=512",
        "data.max_response_length=256",
        "worker.rollout.n=4",
        "worker.actor.global_batch_size=16",
        "worker.actor.micro_batch_size_per_device_for_update=4",
        "worker.actor.micro_batch_size_per_device_for_experience=16",
        "worker.rollout.offpolicy_guidance.n_gpus_per_node=0",
        f"trainer.n_gpus_per_node={values['GPU_CHECK_GPUS']}",
        "trainer.nnodes=1",
        "trainer.max_steps=2",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume=none",
        "trainer.logger=[console,file]",
        "trainer.experiment_name=gpu_check",
        f"trainer.save_checkpoint_path={run_dir}",
    ]


# ---------------------------------------------------------------------- reading the logs
def matching_lines(text: str, pattern: re.Pattern, limit: int = 12) -> list[str]:
    """The distinct lines of `text` that match `pattern`, in order, at most `limit`."""
    seen: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if pattern.search(line) and line not in seen:
            seen.append(line)
    return seen[:limit]


def bench_ratios(text: str) -> list[tuple[str, float, str]]:
    """(setting, wall-time ratio, baseline) of each line of the benchmark's summary."""
    out = []
    for line in text.splitlines():
        match = RATIO_LINE.match(line.strip())
        if match:
            out.append((match["name"], float(match["ratio"]), match["base"]))
    return out


def summary_section(text: str) -> str:
    """The benchmark's output from its `=== summary` line on (all of it when there is none)."""
    at = text.find("=== summary")
    return (text[at:] if at >= 0 else text).strip()


def step_rows(log_path: Path) -> list[dict]:
    """The training steps' rows of an `experiment_log.jsonl` (empty when there is none)."""
    if not log_path.is_file():
        return []
    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    return [row for row in rows if "critic/score/mean" in row]


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


def failure_tail(status: object, text: str, lines: int = 25) -> list[str]:
    """A failed part's last `lines` lines of output as a code block (nothing when it passed)."""
    if status == 0:
        return []
    return ["Its last lines:", "", "```", *text.strip().splitlines()[-lines:], "```", ""]


# ---------------------------------------------------------------------- GPU memory
def process_name(pid: int) -> str:
    """A Ray actor's class (from its process title `ray::Class.method`), else the command."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"
    if cmd.startswith("ray::"):
        return cmd.split()[0].split(".")[0]
    return cmd[:60]


class GpuMemorySampler:
    """Every `period` s: each GPU process's used memory (nvidia-smi), its peak per phase; the
    phase is the number of steps `log_path` holds (0: step 1, 1: step 2, 2: after)."""

    def __init__(self, log_path: Path, period: float = 0.5) -> None:
        self.log_path, self.period = log_path, period
        self.peaks: dict[int, dict[int, int]] = {}  # phase -> pid -> MiB
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GpuMemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]  # fmt: skip
        while not self._stop.wait(self.period):
            try:
                out = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            phase = len(step_rows(self.log_path))
            for line in out.strip().splitlines():
                parts = [p.strip() for p in line.split(",")]
                if len(parts) != 2 or not parts[0].isdigit() or not parts[1].isdigit():
                    continue
                pid, mib = int(parts[0]), int(parts[1])
                self.names.setdefault(pid, process_name(pid))
                peak = self.peaks.setdefault(phase, {})
                peak[pid] = max(peak.get(pid, 0), mib)

    def table(self) -> list[str]:
        """Markdown rows: process, peak MiB in step 1, in step 2."""
        pids = sorted({pid for peaks in self.peaks.values() for pid in peaks})
        rows = ["| process (pid) | peak MiB, step 1 | peak MiB, step 2 (from the wake) |",
                "| --- | --- | --- |"]  # fmt: skip
        for pid in pids:
            one, two = self.peaks.get(0, {}).get(pid), self.peaks.get(1, {}).get(pid)
            rows.append(f"| {self.names.get(pid, '?')} ({pid}) | {one or '-'} | {two or '-'} |")
        return rows if pids else ["(nvidia-smi listed no GPU process: in a container it may not see them)"]  # fmt: skip


# ---------------------------------------------------------------------- the parts
def run_logged(command: list[str], log: Path, timeout: int, env: dict | None = None) -> int | str:
    """Run `command` with its output streamed to the console and to `log`; its exit status, or
    'timed out' after `timeout` s (the process group is stopped)."""
    print(f"gpu-check: {' '.join(command)}  (log: {log})", flush=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
        stopped = threading.Event()

        def stop() -> None:
            stopped.set()
            os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(timeout, stop)
        timer.start()
        try:
            for line in proc.stdout:
                out.write(line)
                sys.stdout.write(line)
            proc.wait()
        finally:
            timer.cancel()
    return f"timed out after {timeout} s" if stopped.is_set() else proc.returncode


def actor_lines(path: Path) -> list[str]:
    """The actor check's figures per model, from its JSON report (none if it wrote none)."""
    if not path.is_file():
        return []
    lines = []
    for r in json.loads(path.read_text())["models"]:
        fp32, bf16, plain = r["float32"], r["bfloat16"], r["plain_bf16"]["log_probs"]
        lines += [f"- `{r['model']}` ({r['response_tokens']} response tokens): float32 worker "
                  f"|Δ log π| max {fp32['log_probs']['max']:.2e}; bfloat16 worker mean "
                  f"{bf16['log_probs']['mean']:.4f}, max {bf16['log_probs']['max']:.4f} (plain "
                  f"bfloat16 cast {plain['mean']:.4f}, {plain['max']:.4f}); surrogate gain of a "
                  f"step {fp32['surrogate_gain']:.3g} / {bf16['surrogate_gain']:.3g}; peak "
                  f"{bf16['peak_gib']} GiB; failures: {'; '.join(r['failures']) or 'none'}"]  # fmt: skip
    return [*lines, ""]


def versions() -> list[str]:
    """Version lines of the stack and the GPUs."""
    lines = [f"python {platform.python_version()}"]
    import torch

    lines.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()})")  # fmt: skip
    for name in ("vllm", "transformers", "ray", "tensordict"):
        try:
            lines.append(f"{name} {__import__(name).__version__}")
        except Exception as error:  # (reported, not raised)
            lines.append(f"{name}: does not import ({type(error).__name__}: {error})")
    from verl.utils.attention import flash_attn_import_error

    why = flash_attn_import_error()
    lines.append("flash-attn imports (attn auto: flash_attention_2)" if why is None else f"flash-attn: not used ({why}; attn auto: sdpa)")  # fmt: skip
    smi = shutil.which("nvidia-smi")
    if smi:
        query = [smi, "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout
        lines += [f"GPU {line.strip()}" for line in out.strip().splitlines()]
    return lines


def rollout_memory_keys(args: list[str]) -> list[str]:
    """The run's rollout keys that size the engines' memory (the KV-cache budgets), as loaded."""
    from verl.trainer.config import load_config, to_dict

    def flat(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from flat(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    rollout = to_dict(load_config(args))["worker"]["rollout"]
    pick = re.compile(r"memory|kv|max_num_batched_tokens|max_model_len|sleep|free_cache")
    return [f"worker.rollout.{k} = {v}" for k, v in flat(rollout) if pick.search(k)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}"
    )
    parser.add_argument("--out", default=str(ROOT / "outputs" / "gpu_check"), help="report folder")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        print(f"gpu-check: --parts {','.join(unknown)} not valid; valid: {', '.join(PARTS)}", file=sys.stderr)  # fmt: skip
        return 2
    reason = no_cuda_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    values = settings()
    report = ["# gpu-check report", "", f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, commit {commit()}", "",
              "## Versions", "", *[f"- {line}" for line in versions()], ""]  # fmt: skip
    outcomes: dict[str, object] = {}
    env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO")}

    if "actor" in parts:
        log, result = out / "actor.log", out / "actor.json"
        command = [sys.executable, "-m", "verl.tools.gpu_actor_check", "--model", values["MODEL_PATH"], "--out", str(result)]  # fmt: skip
        outcomes["actor"] = status = run_logged(command, log, TIMEOUT_S["actor"], env)
        report += ["## FSDP actor alone (`verl/tools/gpu_actor_check.py`)", "",
                   f"exit {status}: {last_line(log.read_text())}", "",
                   *actor_lines(result), *failure_tail(status, log.read_text())]  # fmt: skip

    if "gpu-tier" in parts:
        log = out / "gpu_tier.log"
        status = run_logged([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"],
                            log, TIMEOUT_S["gpu-tier"], env)  # fmt: skip
        outcomes["gpu-tier"] = status
        text = log.read_text()
        report += ["## gpu test tier (`pytest -m gpu`)", "", f"exit {status}: {last_line(text)}", "",
                   *failure_tail(status, text)]  # fmt: skip

    if "run" in parts:
        log, run_dir = out / "run.log", out / "run"
        shutil.rmtree(run_dir, ignore_errors=True)
        train = train_args(values, str(run_dir))
        with GpuMemorySampler(run_dir / "experiment_log.jsonl") as memory:
            status = run_logged([sys.executable, "-m", "verl.trainer.main", *train], log, TIMEOUT_S["run"], env)  # fmt: skip
        outcomes["run"] = status
        text = log.read_text()
        rows = step_rows(run_dir / "experiment_log.jsonl")
        for step_dir in run_dir.glob(
            "global_step_*"
        ):  # the final checkpoint: gigabytes, not needed
            shutil.rmtree(step_dir, ignore_errors=True)
        report += [f"## Colocated 2-step guided run ({values['GPU_CHECK_GPUS']} GPU)", "",
                   f"draft `{values['MODEL_PATH']}`, guidance `{values['GUIDANCE_PATH']}`, data `{values['TRAIN_FILES']}`; "
                   f"exit {status}, {len(rows)} of 2 steps logged; last line: {last_line(text)}", "",
                   *failure_tail(status, text),
                   "Model runner (vLLM's lines):", "",
                   *[f"    {line}" for line in matching_lines(text, RUNNER_LINE) or ["(no line names it)"]], "",
                   "KV-cache budgets (config, then vLLM's lines):", "",
                   *[f"    {line}" for line in rollout_memory_keys(train)],
                   *[f"    {line}" for line in matching_lines(text, KV_LINE)], "",
                   "Sleep / wake lines:", "",
                   *[f"    {line}" for line in matching_lines(text, WAKE_LINE) or ["(none)"]], "",
                   "Peak GPU memory per process (nvidia-smi every 0.5 s):", "", *memory.table(), ""]  # fmt: skip
        keys = ("mismatch/kl_v2", "guidance/accept_rate", "guidance/offpolicy_token_ratio",
                "timing_s/gen", "timing_s/update_actor", "timing_s/sync_weights", "perf/time_per_step")  # fmt: skip
        if rows:
            report += ["| step | " + " | ".join(keys) + " |", "| --- |" + " --- |" * len(keys)]
            for row in rows:
                cells = [f"{row[k]:.4g}" if isinstance(row.get(k), float) else "-" for k in keys]
                report.append(f"| {row['step']} | " + " | ".join(cells) + " |")
            report.append("")

    if "bench" in parts:
        log = out / "bench.log"
        command = [sys.executable, "benchmarks/bench_guided_rollout.py", "--repeats", "5"]
        status = run_logged(command, log, TIMEOUT_S["bench"], env)
        outcomes["bench"] = status
        text = log.read_text()
        ratios = bench_ratios(text)
        report += ["## Rollout benchmark (`benchmarks/bench_guided_rollout.py --repeats 5`)", "",
                   f"exit {status}; " + ("; ".join(f"{n}: {r:.2f}x {b}" for n, r, b in ratios) or "no ratio line"), ""]  # fmt: skip
        report += ["```", summary_section(text), "```", ""] if status == 0 else failure_tail(status, text)  # fmt: skip

    passed = all(status == 0 for status in outcomes.values())
    verdict = ", ".join(
        f"{p}: {'passed' if s == 0 else f'FAILED ({s})'}" for p, s in outcomes.items()
    )
    report[4:4] = [f"**{verdict}**", ""]
    path = out / "report.md"
    path.write_text("\n".join(report) + "\n")
    print(f"gpu-check: {verdict}; report: {path}")
    return 0 if passed else 1


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "?"  # fmt: skip
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
