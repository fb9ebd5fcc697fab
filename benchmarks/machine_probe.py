"""How fast this machine is right now, in the two kinds of work the test suite is made of.

The suite's wall time is mostly process start-ups (every engine, Ray actor and command-line run
imports torch, transformers and vLLM) and small torch kernels on one core; on the 2-core machines
here both swing by 2x from one day to the next, so a suite time means little without the speed
it ran at. Two probes, each on one core, each the median of `repeats`:

- `import_s`: a fresh Python process importing torch and transformers' auto classes;
- `torch_s`: 200 forward + backward passes of a tiny decoder (hidden 64, 1 layer, 8 x 32 tokens).

`make test` prints them after the suite, each run once (`tests/conftest.py`, `VERL_MACHINE_PROBE=1`), so that its
time can be read against the speed it ran at:

    .venv/bin/python benchmarks/machine_probe.py
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time

IMPORTS = "import torch, transformers; from transformers import AutoModelForCausalLM"
TORCH_LOOP = """
import time, torch
torch.set_num_threads(1)
from verl.tasks.tiny_lm import TinyLMSpec, build_tiny_qwen2
model = build_tiny_qwen2(TinyLMSpec(hidden_size=64, num_hidden_layers=1, vocab_size=128, seed=0))
ids = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))
start = time.perf_counter()
for _ in range(200):
    model(ids).logits.float().logsumexp(-1).mean().backward()
print(time.perf_counter() - start)
"""


def one_core() -> list[str]:
    """`taskset` onto the first core this process may use (nothing where taskset is missing)."""
    core = min(os.sched_getaffinity(0))
    return ["taskset", "-c", str(core)] if shutil.which("taskset") else []


def import_seconds() -> float:
    """Wall seconds of a fresh interpreter importing `IMPORTS`, on one core."""
    start = time.perf_counter()
    subprocess.run([*one_core(), sys.executable, "-c", IMPORTS], check=True, capture_output=True)
    return time.perf_counter() - start


def torch_seconds() -> float:
    """Seconds of `TORCH_LOOP`'s 200 steps (timed inside the process, imports excluded)."""
    out = subprocess.run([*one_core(), sys.executable, "-c", TORCH_LOOP], check=True,
                         capture_output=True, text=True)  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def probe(repeats: int = 3) -> dict[str, float]:
    """{"import_s", "torch_s"}: the median over `repeats` of each probe."""
    return {
        "import_s": statistics.median(import_seconds() for _ in range(repeats)),
        "torch_s": statistics.median(torch_seconds() for _ in range(repeats)),
    }


def line(result: dict[str, float], repeats: int = 3) -> str:
    how = f"median of {repeats}" if repeats > 1 else "once"
    return (f"machine probe (one core, {how}): torch + transformers import "
            f"{result['import_s']:.2f} s, tiny-decoder loop {result['torch_s']:.2f} s")  # fmt: skip


if __name__ == "__main__":
    result = probe()
    print(line(result))
    print(json.dumps(result))
