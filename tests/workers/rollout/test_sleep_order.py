"""Sleep mode's order on stand-in engines that record their calls (CPU; the real engines' memory is
checked in the GPU tier, test_sleep_mode.py): level 1 only, the weights wake before the KV cache,
no generation unless the draft engine is fully awake, and the engines of one GPU (the draft here,
the guidance in its own process or Ray actor) never sleep or wake at the same time."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from verl.workers.rollout import vllm_engine
from verl.workers.rollout.config import RolloutConfig
from verl.workers.rollout.guidance_server import _Server
from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout


class Engine:
    """A stand-in `vllm.LLM` in sleep mode: records sleep/wake calls (`log`, shared), reports
    sleeping until every tag woke (unless `stuck` names a tag that never wakes), and takes
    `pause` seconds per call so that overlapping calls would show."""

    def __init__(self, name: str, log: list, pause: float = 0.0, stuck: str | None = None):
        self.name, self.log, self.pause, self.stuck = name, log, pause, stuck
        self.asleep: set[str] = set()
        self.llm_engine = SimpleNamespace(is_sleeping=lambda: bool(self.asleep))

    def _record(self, what: str) -> None:
        self.log.append(f"{self.name} {what} begins")
        time.sleep(self.pause)
        self.log.append(f"{self.name} {what} ends")

    def sleep(self, level: int) -> None:
        assert level == 1
        self._record("sleep")
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self._record(f"wake {'+'.join(tags or ['all'])}")
        self.asleep -= set(tags or ["weights", "kv_cache"]) - {self.stuck}
        return not self.asleep


class Guidance:
    """A stand-in guidance channel that records the ops it is asked for."""

    def __init__(self, log: list):
        self.log = log

    def call(self, op: str, *args):
        self.log.append(f"guidance {op}")


def rollout(
    log: list, pause: float = 0.0, stuck: str | None = None, guided: bool = True
) -> VLLMRollout:
    out = VLLMRollout.__new__(VLLMRollout)  # no engines built: only the sleep-mode bookkeeping
    out.config, out.sleep_mode = RolloutConfig(), True
    out.engines = SimpleNamespace(draft=Engine("draft", log, pause, stuck),
                                  guidance=Guidance(log) if guided else None)  # fmt: skip
    out._awake = {"weights", "kv_cache"}
    return out


def calls(log: list) -> list[str]:
    return [e.removesuffix(" begins") for e in log if not e.endswith(" ends")]


def test_sleep_is_level_1_and_the_weights_wake_before_the_kv_cache():
    log = []
    r = rollout(log)
    r.sleep()
    r.sleep()  # idempotent
    r.wake_up(("weights",))  # a weight sync: the KV cache stays asleep, so does the guidance
    assert r._awake == {"weights"}
    r.wake_up()
    assert calls(log) == ["draft sleep", "guidance sleep", "draft wake weights", "draft wake kv_cache",
                          "guidance wake_up"]  # fmt: skip
    log.clear()
    r.sleep()
    r.wake_up(("kv_cache",))  # asked for the KV cache alone: its weights wake first
    assert calls(log) == ["draft sleep", "guidance sleep", "draft wake weights", "draft wake kv_cache",
                          "guidance wake_up"]  # fmt: skip
    with pytest.raises(
        ValueError, match=r"unknown sleep-mode tags \['cache'\]; valid: weights, kv_cache"
    ):
        r.wake_up(("cache",))


def test_no_generation_unless_the_draft_engine_is_fully_awake():
    """vLLM #44395: generating after waking only the weights is an illegal memory access. The
    rollout refuses, by its own record and by what the engine reports (a stand-in whose KV cache
    does not come back), before any request."""
    r = rollout([], stuck="kv_cache")
    r.sleep()
    r._awake = {"weights"}  # what a sync leaves
    with pytest.raises(RuntimeError) as info:
        r._check_awake()
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(
        "the draft engine is not awake to generate: kv_cache still asleep"
    )
    r.wake_up()  # the stand-in's KV cache stays asleep though the call returned
    with pytest.raises(RuntimeError, match=r"\(the engine reports it is sleeping\) still asleep"):
        r.generate_sequences(SimpleNamespace(meta_info={}))  # fails before reading the batch


def test_the_guidance_server_sleeps_at_level_1_wakes_in_order_and_refuses_work_asleep():
    log = []
    server = _Server.__new__(_Server)  # no engine built: a stand-in one
    server.llm, server.asleep, server.sessions = Engine("guidance", log), False, None
    server.sleep()
    server.sleep()
    with pytest.raises(RuntimeError, match="the guidance engine is asleep; wake_up before 'score'"):
        server.score([], [], 1, {})
    server.wake_up()
    assert calls(log) == ["guidance sleep", "guidance wake weights", "guidance wake kv_cache"]
    stuck = _Server.__new__(_Server)
    stuck.llm, stuck.asleep = Engine("guidance", [], stuck="weights"), False
    stuck.sleep()
    with pytest.raises(RuntimeError, match="still reports it is sleeping"):
        stuck.wake_up()


def test_engines_on_one_gpu_sleep_and_wake_one_at_a_time(monkeypatch, tmp_path):
    """vLLM #36753: two engines on one GPU racing in sleep/wake. The draft (a `VLLMRollout`) and
    the guidance (its `_Server`) sleep and wake in two threads at once, each call taking 20 ms;
    with the GPU's lock (a stand-in device key: the same for both) no call overlaps another.
    The lock is an flock on a file, so it holds across processes as across these threads."""
    monkeypatch.setattr(vllm_engine, "device_key", lambda: "stand-in-gpu")
    monkeypatch.setattr(vllm_engine.tempfile, "gettempdir", lambda: str(tmp_path))
    log = []
    draft = rollout(log, pause=0.02, guided=False)
    server = _Server.__new__(_Server)
    server.llm, server.asleep = Engine("guidance", log, pause=0.02), False

    def cycle(sleep, wake):
        for _ in range(3):
            sleep()
            wake()

    threads = [threading.Thread(target=cycle, args=(draft.sleep, draft.wake_up)),
               threading.Thread(target=cycle, args=(server.sleep, server.wake_up))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(log) == 2 * 2 * 3 * 3  # (sleep + 2 wakes) x 3 cycles x 2 engines, begin and end
    for begin, end in zip(log[::2], log[1::2], strict=True):  # every call ends before the next
        assert begin.endswith(" begins") and end == begin.replace(" begins", " ends"), log
    assert (tmp_path / "verl-gpu-stand-in-gpu.lock").exists()
