"""The guidance engine in a process of its own, so it computes while the draft engine steps.

The rollout keeps the draft engine in-process (weights are synced into it every step); the
guidance engine runs elsewhere and answers requests over a connection: the guidance scores one
group of sequences while the draft proposes the next group's tokens
(`speculative.overlapped_generate`). Under the trainer the guidance is a `GuidanceService` Ray
actor (`guidance_service.py`) shared by draft replicas over TCP; a `VLLMRollout` used on its own
starts it as a child process (`python -m verl.workers.rollout.guidance_server`) over a private
socket pair. On a 2-core CPU the two engines then run on both cores; on a GPU the guidance's
kernels overlap the draft's scheduling overhead and it can have its own tensor-parallel width.

Requests on a connection are answered in the order they were sent. The child exits when its
socket closes, so it never outlives the rollout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import traceback
import weakref
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

START_TIMEOUT_S = 900.0  # building a large guidance engine (and its compilation) takes a while


class GuidanceLost(RuntimeError):
    """The guidance engine's process or Ray actor went away mid-request."""


class GuidanceChannel:
    """Requests over one connection, answered in the order they were sent (raising the engine's
    errors). `submit(op, *args)` sends without waiting; `result()` waits for the oldest answer;
    `call` does both. Ops: "info", "capacity", "score", "expect", "close", "generate", "threads" (`_Server`)."""

    def __init__(self, conn: Connection, name: str) -> None:
        self._conn, self.name = conn, name
        self._pending = 0

    def _gone(self) -> str:
        """Why the other side is gone, for the error line."""
        return "its connection closed"

    def submit(self, op: str, *args) -> None:
        """Send a request without waiting for its answer."""
        try:
            self._conn.send((op, args))
        except OSError as exc:
            raise GuidanceLost(f"{self.name} is gone ({self._gone()})") from exc
        self._pending += 1

    def result(self, timeout: float | None = None):
        """The answer to the oldest request not yet answered."""
        if self._pending == 0:
            raise RuntimeError("no guidance request is waiting for an answer")
        if timeout is not None and not self._conn.poll(timeout):
            raise TimeoutError(f"{self.name} gave no answer within {timeout:.0f} s")
        try:
            status, payload = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise GuidanceLost(f"{self.name} died mid-request ({self._gone()})") from exc
        self._pending -= 1
        if status == "error":
            raise RuntimeError(f"{self.name} failed:\n{payload}")
        return payload

    def ready(self) -> bool:
        """The oldest answer can be read without waiting."""
        return self._pending > 0 and self._conn.poll(0)

    def call(self, op: str, *args):
        """Send a request and wait for its answer."""
        if self._pending:
            raise RuntimeError(f"{self._pending} guidance answer(s) not collected before {op!r}")
        self.submit(op, *args)
        return self.result()

    def wait_ready(self) -> dict:
        """Wait until the guidance engine is built; returns its facts (e.g. `vocab_size`)."""
        return self.call("info")

    def shutdown(self) -> None:
        """Close this connection (idempotent)."""
        self._conn.close()


class GuidanceProcess(GuidanceChannel):
    """The guidance engine in a child process of this one, over a private socket pair (a
    `VLLMRollout` used on its own, without Ray: tools and in-process tests). The child starts at
    once and imports vLLM; its engine is built on `start(llm_kwargs)` (at once when `llm_kwargs`
    is given here), so a caller can build another engine on the same GPU first."""

    def __init__(self, llm_kwargs: dict | None = None, env: dict[str, str] | None = None) -> None:
        parent, child = socket.socketpair()
        root = str(Path(__file__).resolve().parents[3])
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **(env or {}))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "verl.workers.rollout.guidance_server", str(child.fileno())],
            pass_fds=[child.fileno()],
            env=env,
        )
        child.close()
        super().__init__(Connection(parent.detach()), "guidance engine process")
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._conn)
        if llm_kwargs is not None:
            self.start(llm_kwargs)

    def start(self, llm_kwargs: dict) -> None:
        """Have the child build its engine (answered with the engine's info, `wait_ready`)."""
        self.submit("init", llm_kwargs)

    def wait_ready(self) -> dict:
        return self.result(timeout=START_TIMEOUT_S)

    def shutdown(self) -> None:
        """Stop the child process (idempotent)."""
        self._finalizer()

    def _gone(self) -> str:
        code = self._proc.poll()
        return "still running" if code is None else f"exit code {code}"


class GuidanceClient(GuidanceChannel):
    """A connection to a `GuidanceService` (the guidance engine as a Ray actor, maybe on
    another node), named for error lines by its replica index."""

    def __init__(self, address: tuple, authkey: bytes, name: str) -> None:
        from multiprocessing.connection import Client

        super().__init__(Client(address, authkey=authkey), name)


def _stop(proc: subprocess.Popen, conn: Connection) -> None:
    try:
        conn.send(("shutdown", ()))
    except OSError:
        pass
    conn.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class _Server:
    """Child side: one `vllm.LLM` with rewindable sessions (`vllm_sessions.SessionEngine`), built
    by `vllm_engine.build_llm` (V1 runner, no async scheduling, explicit KV budget, checked)."""

    def __init__(self, llm_kwargs: dict) -> None:
        from verl.workers.rollout.vllm_engine import build_llm
        from verl.workers.rollout.vllm_logging import drop_harmless_vllm_records
        from verl.workers.rollout.vllm_sessions import SessionEngine

        drop_harmless_vllm_records()
        self.llm, self.facts = build_llm(llm_kwargs)
        self.asleep = False
        self.sessions = SessionEngine(self.llm) if not llm_kwargs["enable_prefix_caching"] else None

    def info(self) -> dict:
        """The engine's vocabulary, model runner class, KV budget (bytes) and vocab rows."""
        from verl.workers.rollout.vllm_engine import vocab_size

        return {"vocab_size": vocab_size(self.llm), **self.facts}

    def sleep(self) -> None:
        """vLLM sleep mode, level 1 (KV cache freed, weights offloaded to CPU; level 2 would
        discard the weights), under the GPU's lock; idempotent."""
        from verl.workers.rollout.vllm_engine import device_lock

        if not self.asleep:
            with device_lock():
                self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        """Every allocation resident again, the weights before the KV cache, each under the
        GPU's lock; idempotent."""
        from verl.workers.rollout.vllm_engine import device_lock, is_sleeping

        if self.asleep:
            for tag in ("weights", "kv_cache"):
                with device_lock():
                    self.llm.wake_up(tags=[tag])
            if is_sleeping(self.llm):
                raise RuntimeError(
                    "the guidance engine still reports it is sleeping after waking every tag"
                )
            self.asleep = False

    def _awake(self, op: str) -> None:
        if self.asleep:
            raise RuntimeError(f"the guidance engine is asleep; wake_up before {op!r}")

    def threads(self, count: int) -> int:
        """CPU: compute with `count` threads from now on (torch._C's setter: vLLM replaces
        torch.set_num_threads by a no-op); returns the count in effect."""
        import torch

        torch._C.set_num_threads(count)
        return torch.get_num_threads()

    def capacity(self, max_tokens_per_session: int) -> int:
        return self.sessions.capacity(max_tokens_per_session)

    def score(
        self, chunks: list, rows: list[tuple[int, int]], num_logprobs: int, processing: dict
    ) -> tuple:
        """Run scoring chunks (session id, tokens, max_tokens=1, recompute_from) and return
        ((ids, log-probs) of the prompt log-prob rows rows[c] = (first, count) of each chunk c,
        stacked (N, K+1); (ids, log-probs) (C, K+1) of the top-K one position past each chunk's
        tokens; the number of tokens the engine computed). Every row is processed with
        `processing` (temperature, top_k, top_p) in the engine, as vLLM's sampler processes a
        sampled row: prompt rows by the session patch (`vllm_sessions.scoring_params`), the row
        past the tokens by the sampler (the engine reports processed log-probs)."""
        self._awake("score")
        from verl.workers.rollout.vllm_sessions import scoring_params

        first = {c[0]: row for c, (row, _) in zip(chunks, rows, strict=True)}

        def new_params(sid: str, max_tokens: int):  # a new session computes only the rows read
            return scoring_params(max_tokens, num_logprobs, processing, rows_from=first[sid])

        before = self.sessions.tokens_computed
        results = self.sessions.run(chunks, new_params)
        picked = [(results[c[0]].prompt_logprobs, first, count)
                  for c, (first, count) in zip(chunks, rows, strict=True)]  # fmt: skip
        ids = np.concatenate([lp.logprob_token_ids[f : f + n].numpy() for lp, f, n in picked])
        values = np.concatenate([lp.logprobs[f : f + n].numpy() for lp, f, n in picked])
        # the one sampled token's row: column 0 is this engine's own (unseeded) draw, so it is
        # replaced by the top-1 entry (a repeat), leaving the deterministic top-K listed
        next_ids = np.concatenate([results[c[0]].logprob_ids[0][:1] for c in chunks])
        next_values = np.concatenate([results[c[0]].logprobs[0][:1] for c in chunks])
        next_ids[:, 0], next_values[:, 0] = next_ids[:, 1], next_values[:, 1]
        return (ids, values), (next_ids, next_values), self.sessions.tokens_computed - before

    def close(self, session_ids=None) -> None:
        self.sessions.close(session_ids)

    def expect(self, openings: dict) -> None:
        """Sessions to open with images (`SessionEngine.expect`)."""
        self.sessions.expect(openings)

    def generate(self, requests: list[dict], params: list[dict]) -> list[tuple]:
        """Plain sampling: per request (vLLM's token-id prompt, with its `multi_modal_data` where
        it has images: `verl.utils.vision.engine_request`) the token ids and the log-prob of each
        sampled token."""
        self._awake("generate")
        from vllm.sampling_params import SamplingParams

        from verl.workers.rollout.vllm_sessions import sampled_log_probs

        outputs = self.llm.generate(
            requests, [SamplingParams(**kw) for kw in params], use_tqdm=False
        )
        return [sampled_log_probs(out.outputs[0]) for out in outputs]


def answer_one(conn: Connection, handle) -> bool:
    """Read one request from `conn` and send `handle(op, args)` back (an exception travels as
    ("error", traceback) for the other side to raise). False once the peer is gone or said
    "shutdown"."""
    try:
        op, args = conn.recv()
    except (EOFError, OSError):
        return False
    if op == "shutdown":
        return False
    try:
        reply = ("ok", handle(op, args))
    except Exception:
        reply = ("error", traceback.format_exc())
    try:
        conn.send(reply)
    except OSError:
        return False
    return True


def serve(fd: int) -> None:
    """The child's loop: build the engine on "init", answer requests until "shutdown" or EOF."""
    import vllm  # noqa: F401  (imported while the parent builds its own engine)

    box: list[_Server] = []

    def handle(op: str, args: tuple):
        if op == "init":
            box.append(_Server(*args))
            op, args = "info", ()
        return getattr(box[0], op)(*args)

    conn = Connection(fd)
    while answer_one(conn, handle):
        pass
    exit_now(box[0].llm if box else None)


def exit_now(llm) -> None:
    """End the child at once: its engine's core shut down (vLLM's process-wide distributed state
    with it), then `os._exit`, without the interpreter's teardown of a heap of torch, transformers
    and vLLM objects, or `close_llm`'s collection passes that return memory to a process that is
    ending (together about 3 s of every guided rollout's shutdown). The child holds nothing that
    must be written: its output streams are flushed first."""
    if llm is not None:
        from verl.workers.rollout.vllm_engine import shutdown_core

        try:
            shutdown_core(llm)
        except Exception as error:  # a failed clean-up must not keep the child alive
            print(f"guidance engine process: engine shutdown failed: {error!r}", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
