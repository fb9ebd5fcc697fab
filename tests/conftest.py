"""Test tiers: plain unit tests, `vllm`, `e2e`, `gpu` (skipped cleanly when CUDA is absent)."""

from __future__ import annotations

import math
import os

import pytest
import torch

# Every Ray a test starts (`ray.init`, `Cluster`, a CLI run's) prestarts no idle workers: an actor
# never reuses one, so each would only cost its start-up (`verl.trainer.main.start_ray` does the same).
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")

# `make test` runs the suite on 2 pytest-xdist workers. A test file is one unit of work
# (`FileGroups`), so a module's engines and runs are built once, on one worker. The files below
# start several engine processes or a Ray cluster of their own at a time: they make one unit, so
# never two of them run at once (two at once went past the 23.5 GiB of a CI machine).
HEAVY = ("tests/trainer/test_two_nodes.py", "tests/trainer/test_real_training.py",
         "tests/workers/test_weight_sync.py")  # fmt: skip
# The longest units go first, longest first (seconds of the suite's own run, summed per unit from
# `--junitxml` of a fresh-clone `make test`), so that neither worker is left with a long one at
# the end while the other idles (xdist never moves a unit once queued, and its own reordering, by
# test count, is off); the rest keep their order. A long unit missing here runs where collection
# puts it: test_async_training.py (106 s) was missing, and on that run's times this order ends
# the suite 24 s sooner (the two workers 837 and 834 s, against 861 and 810 s).
FIRST = ("heavy", "tests/trainer/test_e2e_training.py", "tests/workers/rollout/test_vllm_rollout.py",
         "tests/workers/rollout/test_real_rollout.py", "tests/trainer/test_vision_training.py",
         "tests/trainer/test_async_training.py", "tests/workers/test_fsdp_workers.py",
         "tests/workers/rollout/test_vision_rollout.py", "tests/workers/rollout/test_multi_turn_real.py",
         "tests/test_launchers.py", "tests/workers/rollout/test_speculative.py",
         "tests/workers/rollout/test_guidance_service.py",
         "tests/workers/rollout/test_guidance_server.py", "tests/workers/rollout/test_padded_vocab.py",
         "tests/tasks/test_real_model.py", "tests/utils/test_checkpoint.py",
         "tests/workers/rollout/test_multi_turn_vision.py",
         "tests/workers/rollout/test_multi_turn_guided.py")  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    """Under `-n N` on at least N cores, each xdist worker (and every process it starts: Ray,
    engines, CLI runs) computes on its own 1/N of the cores. Two workers that each spread threads
    over every core make OpenMP threads spin-wait for cores the other worker holds: two processes
    of 2 threads each ran a tiny model's forward 3.8x slower than with one core each."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 0))
    cores = sorted(os.sched_getaffinity(0))
    if not worker.startswith("gw") or count < 2 or len(cores) < count:
        return
    share = set(cores[int(worker[2:]) % count :: count])
    # every thread of this process, so that whatever any of them starts inherits the share
    for thread in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(thread), share)
    torch.set_num_threads(len(share))


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Under `make test` (`VERL_MACHINE_PROBE=1`), once the suite is done: how fast the machine
    ran (`benchmarks/machine_probe.py`, each probe once: about 10 s), so that the suite's time
    can be read against it."""
    if os.environ.get("VERL_MACHINE_PROBE") != "1" or hasattr(config, "workerinput"):
        return
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("machine_probe", os.path.join(root, "benchmarks", "machine_probe.py"))  # fmt: skip
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    terminalreporter.write_line(probe.line(probe.probe(repeats=1), repeats=1))


def work_unit(nodeid: str) -> str:
    """The unit of work of a test: "heavy" for the files in HEAVY, else its file."""
    path = nodeid.split("::")[0]
    return "heavy" if path in HEAVY else path


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`-n N` (`--dist load`, the default, or loadfile): whole units per worker. (xdist's own
    `loadgroup` renames node ids, which pytest 9 no longer reads, so it schedules test by test.)"""
    if config.getvalue("dist") not in ("load", "loadfile", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # the units in collection order (FIRST), not by size

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return FileGroups(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {unit: i for i, unit in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(work_unit(item.nodeid), len(FIRST)))  # stable
    if torch.cuda.is_available():
        return
    no_cuda = pytest.mark.skip(reason="needs CUDA (gpu tier)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_cuda)


@pytest.fixture(scope="session")
def rollout_gpus():
    """`rollout_gpus(replicas, services=0)`: the GPU keyword arguments of a test's `RolloutGroup`.
    On CPU none. On a CUDA machine every engine (draft replicas and guidance services) gets an
    equal share of the visible GPUs, at most one each: with Ray's default of no GPU, an actor
    does not see the GPUs at all and vLLM's CUDA build cannot start there."""

    def shares(replicas: int, services: int = 0) -> dict[str, float]:
        if not torch.cuda.is_available():
            return {}
        per_gpu = math.ceil((replicas + services) / torch.cuda.device_count())
        share = 1.0 / per_gpu  # engines that pack evenly, per_gpu of them on each GPU
        return {"num_gpus": share, "guidance_gpus": share if services else 0.0}

    return shares


@pytest.fixture(scope="session")
def real_pair():
    """The real pretrained pair (`verl.tasks.real_model.RealPair`): `.guidance` is the folder of
    SmolLM2-135M-Instruct, `.draft` the same model without four middle decoder layers; same
    tokenizer and chat template. Built once under the repository's `.cache/real/` (about 30 s on
    2 cores) and reused by later sessions while the recipe is unchanged."""
    from verl.tasks.real_model import build_pair

    return build_pair()


@pytest.fixture(scope="module")
def real_hf(real_pair):
    """(tokenizer, HF draft, HF guidance) of the real pair, float32, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_pair.draft)
    hf = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
          for p in (real_pair.draft, real_pair.guidance)]  # fmt: skip
    return tok, *hf
