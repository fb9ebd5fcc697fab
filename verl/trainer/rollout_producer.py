"""Asynchronous training's rollout producer: a thread that generates the next batches while the
actor trains on the current one (`async_training.staleness` = k >= 1).

Versions: the engines' weights are version v after the actor's v-th update has been synced (the
initial weights are version 0; a resumed run starts at its step). The batch of step s may be
generated once the engines hold version >= s - 1 - k, so the actor, which trains step s at
version s - 1, never sees a sample more than k versions old; the producer waits rather than run
further ahead. A batch is generated under one version: a weight sync waits for the generation
in flight to end (`exclusive`) and the producer starts no new one while a sync waits, so every
token of a response carries the version (and μ) it was sampled under.

The producer also owns the order of the data: it draws the batches from the dataloader and ships
with each the loader's state just after it was drawn, so that a checkpoint taken after step s
resumes at batch s + 1 (the batches generated ahead are generated again, under the resumed
weights, never trained twice).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from verl.protocol import DataProto
from verl.utils import metric_names as M

VERSION_KEY = "policy_version"
"""(B,) long in a generated batch: the weight version of the engines that sampled each response."""


@dataclass
class Produced:
    """One generated batch and what the trainer needs from its making."""

    step: int
    """The 1-based step the batch was generated for (its schedules: λ, prefix fraction, τ)."""
    batch: DataProto
    """The rollout's output, with `policy_version`."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The generation's metrics (timing_s/gen, guidance/accept_rate, ...)."""
    resume_state: dict = field(default_factory=dict)
    """What a checkpoint after this step must hold to resume at the next batch (the
    dataloader's state after this batch was drawn, the gate's τ for the next batch)."""


class ProducerFailed(RuntimeError):
    """The producer thread stopped on an error; its message is the error's first line."""


_END = object()


class RolloutProducer:
    """Runs `generate(batch, step, metrics) -> DataProto` in a thread over `batches` (items
    `(step, batch, resume_state)`), at most `staleness` versions ahead of the actor."""

    def __init__(self, generate: Callable[[DataProto, int, dict], DataProto],
                 batches: Iterator[tuple[int, DataProto, Callable[[], dict]]], staleness: int,
                 version: int) -> None:  # fmt: skip
        self._generate, self._batches, self.staleness = generate, batches, staleness
        self.version = version
        self._cond = threading.Condition()
        self._generating = self._waiting = self._stopped = False
        self._idle = 0.0  # seconds waited since the last batch was put
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)

    def start(self) -> RolloutProducer:
        """Start generating."""
        self._thread.start()
        return self

    # ---------------------------------------------------------------- producer side
    def _wait_turn(self, step: int) -> bool:
        """Block until step `step` may be generated (bound met, no sync waiting); False: stopped."""
        start = time.perf_counter()
        with self._cond:
            while not self._stopped and (self._waiting or self.version < step - 1 - self.staleness):
                self._cond.wait()
            self._generating = not self._stopped
            self._idle += time.perf_counter() - start
            return not self._stopped

    def _run(self) -> None:
        try:
            for step, batch, resume_state in self._batches:
                if not self._wait_turn(step):
                    return
                try:
                    version, metrics = self.version, {}
                    out = self._generate(batch, step, metrics)
                finally:
                    with self._cond:
                        self._generating = False
                        self._cond.notify_all()
                out.batch[VERSION_KEY] = torch.full((len(out),), version, dtype=torch.long)
                metrics[M.ASYNC_PRODUCER_IDLE_S] = self._idle
                self._idle = 0.0
                self._queue.put(Produced(step, out, metrics, resume_state()))
            self._queue.put(_END)
        except BaseException as error:  # the trainer raises it in one line
            self._queue.put(error)

    # ---------------------------------------------------------------- trainer side
    def get(self) -> Produced | None:
        """The next batch in step order (None after the last), with the trainer's wait in its
        metrics (`async/trainer_idle_s`, `async/queued_batches`); `ProducerFailed` in one line
        when the producer stopped on an error."""
        start = time.perf_counter()
        queued = self._queue.qsize()
        item = self._queue.get()
        if item is _END:
            return None
        if isinstance(item, BaseException):
            text = str(item).strip().splitlines()
            raise ProducerFailed(
                f"the rollout producer stopped: {type(item).__name__}: {text[0] if text else ''}"
            ) from item
        item.metrics[M.ASYNC_TRAINER_IDLE_S] = time.perf_counter() - start
        item.metrics[M.ASYNC_QUEUED_BATCHES] = float(queued)
        return item

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """The engines to the caller alone (a weight sync, a validation): the generation in
        flight ends first, and none starts until the block is left."""
        with self._cond:
            self._waiting = True
            while self._generating:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._waiting = False
                self._cond.notify_all()

    def advance(self, version: int) -> None:
        """The engines now hold `version` (called inside `exclusive`, after the sync)."""
        with self._cond:
            self.version = version
            self._cond.notify_all()

    def close(self, timeout: float = 600.0) -> None:
        """Stop after the generation in flight (if any) and wait for the thread."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout)


def staleness_metrics(
    versions: torch.Tensor, trained_version: int, bound: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per response, whether it is within the bound, and async/staleness_{mean,max}, dropped_frac.

    staleness_i = trained_version - versions_i, with trained_version the actor's version when it
    trains the batch (step s trains at version s - 1). Shapes: versions (B,) long -> keep (B,) bool.
    Example: versions [3, 3, 2], trained at 4, bound 1: staleness [1, 1, 2], mean 4/3, max 2,
    keep [T, T, F], dropped 1/3.
    """
    stale = (trained_version - versions).float()
    keep = stale <= bound
    return keep, {
        M.ASYNC_STALENESS_MEAN: stale.mean().item(),
        M.ASYNC_STALENESS_MAX: stale.max().item(),
        M.ASYNC_DROPPED_FRAC: 1.0 - keep.float().mean().item(),
    }
