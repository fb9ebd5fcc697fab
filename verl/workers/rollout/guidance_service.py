"""The guidance engine as a Ray actor shared by draft replicas.

`GuidanceService` builds one guidance `vllm.LLM` and answers every connected draft replica over
TCP (`multiprocessing.connection`, with a random key), one request at a time in arrival order on
the actor's main thread. Each replica's sessions live under its own prefix, its "close" frees
only them, and "capacity" gives it its share of the KV cache. Ray places, starts and kills the
actor; a replica whose service dies gets `GuidanceLost` at once (its connection closes) and
`RolloutGroup` restarts the services once before giving up.
"""

from __future__ import annotations

import os
import queue
import threading
from multiprocessing.connection import Listener, wait

from verl.utils.worker_logs import redirect_worker_output
from verl.workers.rollout.guidance_server import _Server, answer_one


class GuidanceService:
    """One guidance engine for `num_clients` draft replicas (call `address`, then `serve`). On a
    GPU it shares with actor ranks (`shares_gpu`) it sleeps while they train."""

    def __init__(self, llm_kwargs: dict, num_clients: int, threads: int | None = None,
                 shares_gpu: bool = True) -> None:  # fmt: skip
        redirect_worker_output("guidance")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        import ray

        self.server = _Server(llm_kwargs)
        if threads:  # CPU: this engine's share of the cores
            self.server.threads(threads)
        self.num_clients, self.shares_gpu = num_clients, shares_gpu
        self._sleeping: set[str] = set()  # replicas that asked the engine to sleep
        self._authkey = os.urandom(16)
        self._listener = Listener((ray.util.get_node_ip_address(), 0), authkey=self._authkey)
        self._new: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        """Take connections as they come (the handshake checks the key) for `serve` to answer."""
        while True:
            try:
                self._new.put(self._listener.accept())
            except OSError:  # a peer that failed the handshake, or the listener closed
                if self._listener._listener is None:
                    return

    def address(self) -> tuple[tuple, bytes, dict]:
        """(host, port), the key, and the engine's facts (`vocab_size`; where it runs: Ray
        `node_id` and `placement_group` id or None)."""
        import ray

        context = ray.get_runtime_context()
        where = {
            "node_id": context.get_node_id(),
            "placement_group": context.get_placement_group_id(),
        }
        return self._listener.address, self._authkey, {**self.server.info(), **where}

    def serve(self) -> None:
        """Answer every connection until this actor is killed (never returns): a replica's
        requests in its order, all of them one at a time on this thread."""
        handlers, conns = {}, []
        while True:
            while not self._new.empty():
                conn = self._new.get()
                prefix = f"r{len(handlers)}/"
                handlers[conn] = lambda op, args, p=prefix: self._handle(p, op, args)
                conns.append(conn)
            for conn in wait(conns, timeout=0.05):  # (with none yet: a 50 ms nap)
                if not answer_one(conn, handlers[conn]):
                    conns.remove(conn)
                    conn.close()

    def _handle(self, prefix: str, op: str, args: tuple):
        """A replica's request, its session ids put under `prefix`."""
        server = self.server
        if op == "score":
            chunks = [(prefix + sid, *rest) for sid, *rest in args[0]]
            return server.score(chunks, *args[1:])
        if op == "expect":
            return server.expect({prefix + sid: im for sid, im in args[0].items()})
        if op == "close":
            ids = args[0] if args and args[0] is not None else None
            open_ids = server.sessions.session_ids if server.sessions is not None else []
            mine = [s for s in open_ids if s.startswith(prefix)]
            return server.close(mine if ids is None else [prefix + s for s in ids])
        if op == "capacity":
            return max(1, server.capacity(*args) // self.num_clients)
        if op == "sleep":  # on a shared GPU, once every replica it serves is asleep
            self._sleeping.add(prefix)
            if self.shares_gpu and len(self._sleeping) == self.num_clients:
                server.sleep()
            return None
        if op == "wake_up":
            self._sleeping.discard(prefix)
            return server.wake_up()
        if op in ("info", "threads", "generate"):
            return getattr(server, op)(*args)
        raise ValueError(f"unknown guidance request {op!r}")
