"""The rollout as Ray actors: `RolloutWorker` owns one replica's draft engine, `GuidanceService`
actors the guidance engines (`guidance_service.py`), and `RolloutGroup` drives them all."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable

import numpy as np
import ray
import torch
from ray.util.queue import Queue

from verl.protocol import DataProto
from verl.utils.heap import freeze_heap
from verl.utils.shared_tensors import from_shared
from verl.utils.worker_logs import redirect_worker_output
from verl.workers.placement import Placement
from verl.workers.rollout.config import RolloutConfig


class RolloutWorker:
    """Generates sequences with `VLLMRollout` and takes weight updates from the actor."""

    def __init__(self, model_path: str, config: RolloutConfig, num_replicas: int = 1,
                 own_guidance: bool = True, cpu_share: float = 1.0) -> None:  # fmt: skip
        redirect_worker_output("rollout")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        share = cpu_share / num_replicas  # CPU: the replicas share the rollout's part of the cores
        if not torch.cuda.is_available() and share < 1:
            cores = max(1, int(len(os.sched_getaffinity(0)) * share))
            os.environ["VERL_ROLLOUT_CORES"] = str(cores)
        from transformers import AutoTokenizer

        from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.rollout = VLLMRollout(
            model_path, config, tokenizer.eos_token_id, tokenizer.pad_token_id, own_guidance
        )
        freeze_heap()  # the engine's start-up objects: no full collection walks them mid-rollout

    def node_id(self) -> str:
        """The Ray node this replica runs on."""
        return ray.get_runtime_context().get_node_id()

    def connect_guidance(self, address: tuple, authkey: bytes, name: str) -> None:
        """Reach the guidance through the `GuidanceService` at `address` (named `name` in errors)."""
        self.rollout.connect_guidance(address, authkey, name)

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """`VLLMRollout.generate_sequences` (EasyR1 layout, guidance tensors when enabled); the
        engines then sleep while the actor computes (`free_cache_engine`, CUDA only)."""
        out = self.rollout.generate_sequences(prompts)
        self.rollout.sleep()
        return out

    def sync_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a whole state dict into the draft engine (tests, tools)."""
        self.rollout.sync_weights(state_dict)

    def sync_weights_streamed(
        self, queue, num_buckets: int, partial: bool = False
    ) -> dict[str, int]:
        """Load the actor's weights bucket by bucket as the trainer puts them on `queue` (each an
        object ref, mapped here from the object store and dropped before the next): one reload of
        the draft engine that copies nothing but into its own weights (`partial`: a LoRA sync,
        some layers not sent). Returns this process's peak extra private memory (bytes)."""

        def stream():
            for _ in range(num_buckets):
                (ref,) = queue.get()
                yield from from_shared(ray.get(ref))  # views of the object store, not copies
                del ref

        with PeakMemory() as peak:
            self.rollout.sync_weights(stream(), partial)
        return {"peak_extra_bytes": peak.extra}

    def shutdown(self) -> None:
        """Stop the guidance engine's process (it also exits on its own if this actor dies) and
        the draft engine's core; the actor is killed right after (`RolloutGroup.shutdown`), so
        its memory goes with the process."""
        self.rollout.shutdown(exiting=True)


QUEUE_DEPTH = 2
"""Weight-sync buckets that may wait for a replica (the one it loads is one more)."""


class PeakMemory:
    """Peak private resident memory of this process (resident minus shared pages: the object
    store's shared-memory pages a process reads are not its own) above its level at entry,
    sampled every millisecond on a thread: `extra`, in bytes."""

    def __enter__(self) -> PeakMemory:
        import psutil

        self._proc, self._stop = psutil.Process(), threading.Event()
        self._base = self.peak = self._private()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _private(self) -> int:
        info = self._proc.memory_info()
        return info.rss - info.shared

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._private())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._private())

    @property
    def extra(self) -> int:
        """Bytes above the level at entry."""
        return self.peak - self._base


SUMMED = ("emitted_tokens", "guidance_tokens_computed", "guidance_tokens_submitted", "rounds",
          "sequence_rounds", "proposed_tokens", "accepted_tokens", "bonus_tokens", "topk_rows", "draft_lookups")  # fmt: skip
"""Counts in a replica's meta_info that add up over replicas (rounds: rounds run, all replicas)."""


def merge_rollout_meta(metas: list[dict]) -> dict:
    """One meta_info for a batch generated by several replicas: counts summed, rates recomputed
    from the summed counts (accept rate = accepted / proposed; guidance tokens per emitted token;
    top-K tail mass weighted by rows), `lam` shared."""
    merged = {k: v for k, v in metas[0].items() if k not in SUMMED}
    for key in SUMMED:
        if any(key in m for m in metas):
            merged[key] = sum(m.get(key, 0) for m in metas)
    if "proposed_tokens" in merged:
        merged["accept_rate"] = merged["accepted_tokens"] / max(merged["proposed_tokens"], 1)
        merged["guidance_tokens_per_emitted"] = merged["guidance_tokens_computed"] / max(
            merged["emitted_tokens"], 1
        )
    if any("target_tv" in m for m in metas):  # per emitted token
        weighted = sum(m["target_tv"] * m["emitted_tokens"] for m in metas if "target_tv" in m)
        merged["target_tv"] = weighted / max(merged["emitted_tokens"], 1)
    if "topk_rows" in merged:
        weighted = sum(m["topk_tail_mass"] * m["topk_rows"] for m in metas if "topk_rows" in m)
        merged["topk_tail_mass"] = weighted / max(merged["topk_rows"], 1)
    return merged


def replica_rows(rows: int, num_replicas: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) prompt rows per replica, sizes differing by at most one (a prompt
    row stands for its whole group of `n` samples, so groups are never split)."""
    bounds = np.cumsum([0] + [len(a) for a in np.array_split(np.arange(rows), num_replicas)])
    return [(int(a), int(b)) for a, b in itertools.pairwise(bounds)]


class RolloutGroup:
    """`num_replicas` `RolloutWorker` Ray actors, each with its own draft engine, and with guidance
    `offpolicy_guidance.num_replicas` `GuidanceService` actors (draft replica i uses service
    i mod that number). A batch of prompts is split by whole prompts (all `n` samples of a prompt
    on one replica) and comes back in its order; sequences are seeded by their row in the whole
    batch (`sequence_seeds`), so the tokens depend neither on the number of draft replicas nor on
    how many guidance services they share. A guidance service that dies fails the call with
    `GuidanceLost`; the group then restarts the services and retries once before giving up.
    Engines that share a GPU start one after the other: colocated guidance services only once
    every draft engine is built (dedicated ones while the drafts build)."""

    def __init__(self, num_replicas: int, model_path: str, config: RolloutConfig, num_cpus: float = 1,
                 num_gpus: float = 0, guidance_gpus: float = 0, placement: Placement | None = None,
                 guidance_placement: Placement | None = None, cpu_share: float = 1.0) -> None:  # fmt: skip
        self.model_path, self.config, self._guidance_gpus = model_path, config, guidance_gpus
        self.placement, self.guidance_placement, self.services = placement, guidance_placement, []
        self.service_where: list[tuple] = []  # each guidance service's Ray node and placement group
        self._serving: list[ray.ObjectRef] = []
        guided = config.offpolicy_guidance.enable
        remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(RolloutWorker)
        self.replicas = [
            remote.options(**self._slot(j, num_replicas)).remote(model_path, config, num_replicas, not guided, cpu_share)
            for j in range(num_replicas)
        ]  # fmt: skip
        self.queues = [Queue(QUEUE_DEPTH, actor_options={"num_cpus": 0}) for _ in self.replicas]
        dedicated = guidance_placement is not None
        if guided and dedicated:  # on GPUs of their own: built while the draft engines are
            self._start_guidance()
        ray.get([r.__ray_ready__.remote() for r in self.replicas])
        if guided and not dedicated:  # on the drafts' GPUs: once every draft engine is built
            self._start_guidance()
        if guided:
            self._connect_guidance()

    def _start_guidance(self) -> None:
        """Start `offpolicy_guidance.num_replicas` services (their engines build in the background)."""
        from verl.workers.rollout.engine_config import engine_args
        from verl.workers.rollout.guidance_service import GuidanceService

        drafts = len(self.replicas)
        count = self.config.offpolicy_guidance.num_replicas or drafts  # (None: one per replica)
        _, kwargs, _ = engine_args(self.model_path, self.config)
        # CPU: the services have half the cores (each replica's draft engine the rest of its share)
        threads = None if torch.cuda.is_available() else max(1, len(os.sched_getaffinity(0)) // 2)
        remote = ray.remote(num_cpus=0, num_gpus=self._guidance_gpus)(GuidanceService)
        # service j beside its first draft replica (j): on that replica's GPU, or on a dedicated
        # GPU of the same node when the guidance has GPUs of its own
        where = [self._slot(j, drafts) for j in range(count)]
        if self.guidance_placement is not None:
            nodes = [self.placement.node_of(self.placement.replica_rank(j, drafts)) if self.placement
                     else None for j in range(count)]  # fmt: skip
            slots = self.guidance_placement.ranks_by_node(nodes)
            where = [{"scheduling_strategy": self.guidance_placement.slot(k)} for k in slots]
        shared = self.guidance_placement is None
        self.services = [remote.options(**where[j]).remote(kwargs, len(range(j, drafts, count)), threads, shared)
                         for j in range(count)]  # fmt: skip

    def _slot(self, replica: int, num_replicas: int) -> dict:
        """Ray options that put draft replica `replica` (or its service) in its placement bundle."""
        if self.placement is None:
            return {}
        rank = self.placement.replica_rank(replica, num_replicas)
        return {"scheduling_strategy": self.placement.slot(rank)}

    def _connect_guidance(self) -> None:
        """Wait for the services, start them serving, and connect every draft replica to its own."""
        addresses = ray.get([s.address.remote() for s in self.services])
        self.service_where = [(info["node_id"], info["placement_group"]) for *_, info in addresses]
        self._serving = [s.serve.remote() for s in self.services]
        count = len(self.services)
        ray.get([r.connect_guidance.remote(*addresses[i % count][:2], f"guidance replica {i % count}")
                 for i, r in enumerate(self.replicas)])  # fmt: skip

    def restart_guidance(self) -> None:
        """Kill every guidance service (a dead one included) and start and connect new ones."""
        for service in self.services:
            ray.kill(service)
        self._serving = []
        self._start_guidance()
        self._connect_guidance()

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Every replica generates its rows at once; one DataProto in the prompts' order. A lost
        guidance service is restarted once and the batch generated again."""
        from verl.workers.rollout.guidance_server import GuidanceLost

        try:
            return self._generate(prompts)
        except GuidanceLost as exc:
            print(
                f"warning: {_first_line(exc)}; restarting the guidance and retrying once",
                flush=True,
            )
            self.restart_guidance()
            try:
                return self._generate(prompts)
            except GuidanceLost as again:
                raise GuidanceLost(
                    f"{_first_line(again)}, again after a restart; giving up"
                ) from None

    def _generate(self, prompts: DataProto) -> DataProto:
        first = int(prompts.meta_info.get("first_row", 0))
        refs = []
        for replica, (a, b) in zip(self.replicas, replica_rows(len(prompts), len(self.replicas))):
            if b > a:
                part = prompts.index_select(slice(a, b))
                part.meta_info = {**prompts.meta_info, "first_row": first + a}
                refs.append(replica.generate_sequences.remote(part))
        try:
            outs = ray.get(refs)
        except Exception:
            ray.wait(refs, num_returns=len(refs))  # let every replica finish (or fail) first
            raise
        metas = [out.meta_info for out in outs]
        for out in outs:
            out.meta_info = {}
        merged = DataProto.concat(outs)
        merged.meta_info = merge_rollout_meta(metas)
        return merged

    def sync_weights(
        self,
        plan: list[list[str]],
        produce: Callable[[list[str]], ray.ObjectRef],
        partial: bool = False,
    ) -> list[int]:
        """Stream new weights into every replica: `produce(names)` makes one bucket (an object
        ref, put once by its maker), every replica reads it from its queue, and at most
        `QUEUE_DEPTH` buckets wait per replica, so neither this process (which never reads a
        bucket) nor a replica ever holds the whole model. Returns each replica's peak extra bytes."""
        done = [
            r.sync_weights_streamed.remote(q, len(plan), partial)
            for r, q in zip(self.replicas, self.queues, strict=True)
        ]
        for names in plan:
            ref = produce(names)
            for queue in self.queues:
                queue.put([ref])  # in a list: the ref travels, the bucket stays in the object store
            del ref
        return [m["peak_extra_bytes"] for m in ray.get(done)]

    def shutdown(self) -> None:
        """Close every replica's guidance connection (or child process), then kill the actors
        and the guidance services (a stuck one included)."""
        try:
            ray.get([r.shutdown.remote() for r in self.replicas], timeout=60)
        except Exception:  # a dead or stuck replica is killed below either way
            pass
        for actor in (*self.replicas, *(q.actor for q in self.queues), *self.services):
            ray.kill(actor)
        self.replicas, self.queues, self.services, self._serving = [], [], [], []


def _first_line(exc: BaseException) -> str:
    """An error's own message, first line (a Ray task error carries the remote traceback too)."""
    text = str(getattr(exc, "cause", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
