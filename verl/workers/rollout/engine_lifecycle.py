"""The rollout's engines from start to shutdown: the draft engine in this process, the guidance
engine in a process of its own (or a `GuidanceService` reached over TCP), built one after the
other, put to sleep and woken in order (`free_cache_engine` on CUDA), refreshed with the actor's
weights, checked awake before generating, and given their share of the CPU cores.

`EngineLifecycle` holds this state for `VLLMRollout`, which generates on top of it. Everything it
does to a live engine past `vllm.LLM`'s public API goes through `vllm_engine.py` (`build_llm`,
`reload_weights`, `is_sleeping`) or `vllm_sessions.py` (`SessionEngine`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from contextlib import contextmanager

import torch

from verl.workers.rollout.config import RolloutConfig
from verl.workers.rollout.context import Engines
from verl.workers.rollout.engine_config import check_same_tokenizer, engine_args, sleeps
from verl.workers.rollout.guidance_server import GuidanceClient, GuidanceProcess
from verl.workers.rollout.vllm_engine import (
    build_llm,
    close_llm,
    device_lock,
    is_sleeping,
    reload_weights,
    shutdown_core,
)
from verl.workers.rollout.vllm_logging import drop_harmless_vllm_records
from verl.workers.rollout.vllm_sessions import SessionEngine

WAKE_ORDER = ("weights", "kv_cache")
"""Sleep-mode memory in the order it wakes: a KV cache never wakes before its weights."""


def rollout_cores() -> int:
    """CPU cores this replica's engines may use: its share when several replicas (or, in an
    asynchronous run, the actor) share the machine (`VERL_ROLLOUT_CORES`, set by
    `RolloutWorker`), else every core it may run on."""
    return int(os.environ.get("VERL_ROLLOUT_CORES", 0)) or len(os.sched_getaffinity(0))


def split_cpu_threads() -> dict[str, str]:
    """CPU only: give the draft (this process) and the guidance process half the cores each, so
    the two engines never oversubscribe the machine while they overlap. Returns the guidance
    process's environment additions (its OMP_NUM_THREADS); nothing on a GPU machine."""
    if torch.cuda.is_available():
        return {}
    cores = rollout_cores()
    guidance = max(1, cores // 2)
    # torch._C's setter: vLLM replaces torch.set_num_threads by a no-op once an engine started here
    torch._C.set_num_threads(max(1, cores - guidance))
    return {"OMP_NUM_THREADS": str(guidance)}


class EngineLifecycle:
    """Draft engine (+ a connection to the guidance engine): build, sleep / wake, weight sync,
    the awake check and the cores each engine computes with.

    `own_guidance`: start the guidance engine as a child process here (used on its own); else
    the guidance is a service reached after `connect_guidance` (the trainer's `RolloutGroup`).
    State: `config`, `engines` (draft `vllm.LLM`, guidance channel), `draft_sessions` (speculative
    mode, multi-turn), `num_logprobs` (K), `draft_facts` / `guidance_facts`, `sleep_mode`, `_awake`."""

    def __init__(self, model_path: str, config: RolloutConfig, own_guidance: bool = True) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        drop_harmless_vllm_records()
        guidance = config.offpolicy_guidance
        if guidance.enable:
            check_same_tokenizer(model_path, guidance.model_path)
        self.config = config
        self.speculative = guidance.enable and guidance.mode == "speculative"
        draft_args, guidance_args, self.num_logprobs = engine_args(model_path, config)
        engine = None
        if guidance_args is not None and own_guidance:  # its process imports vLLM meanwhile
            engine = GuidanceProcess(env=split_cpu_threads())
        elif guidance_args is not None:
            split_cpu_threads()  # this engine's share of the cores (the service has the rest)
        try:  # one engine after the other: neither sizes memory while the other allocates
            draft, self.draft_facts = build_llm(draft_args)
            self.guidance_facts = None
            if engine is not None:
                engine.start(guidance_args)
                self.guidance_facts = engine.wait_ready()
        except BaseException:
            if engine is not None:
                engine.shutdown()
            raise
        self.engines = Engines(draft, engine)
        sessions = self.speculative or config.multi_turn.enable
        self.draft_sessions = SessionEngine(draft) if sessions else None
        self.sleep_mode = sleeps(config)
        self._awake = {"weights", "kv_cache"}  # the draft engine's memory that is resident

    def sleep(self) -> None:
        """`free_cache_engine` on CUDA: free the KV cache and offload the weights to CPU, here and
        in the guidance engine (which sleeps once every replica it serves sleeps)."""
        if not self.sleep_mode or not self._awake:
            return
        with device_lock():  # one sleep or wake at a time on this GPU (the guidance's included)
            self.engines.draft.sleep(level=self.config.sleep_level)
        self._awake = set()
        if self.engines.guidance is not None:  # after the draft's, under its own lock
            self.engines.guidance.call("sleep")

    def wake_up(self, tags: tuple[str, ...] = WAKE_ORDER) -> None:
        """Make the draft engine's `tags` memory resident again (weights before a weight sync,
        everything before generating), one tag at a time in `WAKE_ORDER` (a KV cache wakes its
        weights first) under the GPU's lock; the guidance wakes after the draft's KV cache."""
        unknown = set(tags) - set(WAKE_ORDER)
        if unknown:
            raise ValueError(
                f"unknown sleep-mode tags {sorted(unknown)}; valid: {', '.join(WAKE_ORDER)}"
            )
        wanted = {"weights", *tags} if "kv_cache" in tags else set(tags)
        missing = [t for t in WAKE_ORDER if t in wanted and t not in self._awake]
        for tag in missing:
            with device_lock():
                self.engines.draft.wake_up(tags=[tag])
            self._awake.add(tag)
        if "kv_cache" in missing and self.engines.guidance is not None:
            self.engines.guidance.call("wake_up")

    def _check_awake(self) -> None:
        """Refuse to generate unless the draft engine is fully awake, by this object's record and
        by the engine's own state (after waking only the weights, vLLM #44395: an illegal memory
        access on CUDA)."""
        asleep = [t for t in WAKE_ORDER if t not in self._awake]
        if not asleep and self.sleep_mode and is_sleeping(self.engines.draft):
            asleep = ["(the engine reports it is sleeping)"]
        if asleep:
            raise RuntimeError(
                f"the draft engine is not awake to generate: {', '.join(asleep)} still asleep; "
                "wake_up() every tag (weights, then kv_cache) before generate_sequences"
            )

    def connect_guidance(self, address: tuple, authkey: bytes, name: str) -> None:
        """Use the `GuidanceService` at `address` from now on (a restarted one included)."""
        if self.engines.guidance is not None:
            self.engines.guidance.shutdown()
        self.engines.guidance = GuidanceClient(address, authkey, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self, exiting: bool = False) -> None:
        """Stop the guidance engine's process, or close the connection to the service, and shut
        the draft engine down so that its memory is freed now (`close_llm`), or with `exiting`
        (the process ends right after) only its core (`shutdown_core`: no collection passes,
        about 1.6 s); the rollout is unusable afterwards."""
        if self.engines.guidance is not None:
            self.engines.guidance.shutdown()
        if self.engines.draft is not None:
            draft, self.engines.draft, self.draft_sessions = self.engines.draft, None, None
            (shutdown_core if exiting else close_llm)(draft)

    def sync_weights(
        self,
        weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        partial: bool = False,
    ) -> None:
        """Load new actor weights into the draft engine (the in-process weight sync of
        docs/design.md#one-training-step), from a state dict or a stream of (name, tensor) pairs
        consumed once, in order (`vllm_engine.reload_weights`)."""
        self.wake_up(("weights",))
        reload_weights(self.engines.draft, weights, partial)

    @contextmanager
    def cores_to(self, engine: str):
        """CPU only: every core to `engine` ("draft" or "guidance") while the other idles, then
        the usual split back (`split_cpu_threads`)."""
        if torch.cuda.is_available():
            yield
            return
        cores = rollout_cores()
        if engine == "draft":
            torch._C.set_num_threads(cores)
        else:
            self.engines.guidance.call("threads", cores)
        try:
            yield
        finally:
            share = int(split_cpu_threads()["OMP_NUM_THREADS"])
            if engine == "guidance":
                self.engines.guidance.call("threads", share)
