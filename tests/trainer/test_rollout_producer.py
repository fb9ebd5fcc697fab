"""The rollout producer's protocol (versions, the staleness gate, exclusive syncs, failures), with
a plain function as the generation: the scheduling alone, no engine. The real engines run it in
tests/trainer/test_async_training.py."""

from __future__ import annotations

import threading

import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.rollout_producer import (
    VERSION_KEY,
    ProducerFailed,
    RolloutProducer,
    staleness_metrics,
)
from verl.utils import metric_names as M


def test_staleness_metrics_by_hand():
    # versions [3, 3, 2] trained at version 4: staleness [1, 1, 2]; mean 4/3, max 2; bound 1
    # keeps the first two, drops 1 of 3
    keep, metrics = staleness_metrics(torch.tensor([3, 3, 2]), 4, 1)
    assert keep.tolist() == [True, True, False]
    assert metrics[M.ASYNC_STALENESS_MEAN] == pytest.approx(4 / 3, abs=1e-7)
    assert metrics[M.ASYNC_STALENESS_MAX] == 2.0
    assert metrics[M.ASYNC_DROPPED_FRAC] == pytest.approx(1 / 3, abs=1e-7)


class Recorder:
    """A generation that records the version it ran under and whether a sync overlapped it."""

    def __init__(self, producer_ref: list, fail_at: int | None = None) -> None:
        self.producer_ref, self.fail_at = producer_ref, fail_at
        self.running = threading.Event()
        self.seen: list[tuple[int, int]] = []

    def __call__(self, batch: DataProto, step: int, metrics: dict) -> DataProto:
        if step == self.fail_at:
            raise RuntimeError(f"engine lost at step {step}\nsecond line")
        self.running.set()
        self.seen.append((step, self.producer_ref[0].version))
        self.running.clear()
        return DataProto.from_single_dict({"x": torch.zeros(2, 1)})


def batches(steps: int, first: int = 0):
    for step in range(first + 1, steps + 1):
        yield (
            step,
            DataProto.from_single_dict({"x": torch.zeros(2, 1)}),
            lambda step=step: {"indices": [step]},
        )


def drive(producer: RolloutProducer, recorder: Recorder) -> list[tuple[int, int]]:
    """The trainer's side: take each batch, 'train' it, sync inside `exclusive` (asserting no
    generation runs meanwhile) and advance the version; (step, version stamped) per batch."""
    got = []
    while (item := producer.get()) is not None:
        got.append((item.step, int(item.batch.batch[VERSION_KEY][0])))
        assert item.resume_state == {"indices": [item.step]}
        with producer.exclusive():
            assert not recorder.running.is_set()
            producer.advance(item.step)
    return got


@pytest.mark.parametrize("staleness", [1, 2, 3])
def test_every_batch_is_generated_within_the_bound_and_stamped_with_its_version(staleness):
    ref: list = [None]
    recorder = Recorder(ref)
    producer = ref[0] = RolloutProducer(recorder, batches(20), staleness, version=0)
    producer.start()
    got = drive(producer, recorder)
    producer.close()
    assert [s for s, _ in got] == list(range(1, 21))
    assert got == recorder.seen  # the stamp is the version the generation started under
    for step, version in got:  # trained at step - 1: lag 0..staleness
        assert 0 <= step - 1 - version <= staleness, (step, version)
    assert [v for _, v in got] == sorted(v for _, v in got)


def test_a_resumed_producer_starts_at_the_resumed_version():
    ref: list = [None]
    recorder = Recorder(ref)
    producer = ref[0] = RolloutProducer(recorder, batches(8, first=5), 1, version=5)
    producer.start()
    got = drive(producer, recorder)
    producer.close()
    assert got[0] == (6, 5) and [s for s, _ in got] == [6, 7, 8]


def test_a_failing_generation_is_raised_in_one_line_after_the_batches_before_it():
    ref: list = [None]
    recorder = Recorder(ref, fail_at=3)
    producer = ref[0] = RolloutProducer(recorder, batches(6), 2, version=0)
    producer.start()
    steps = [producer.get().step, producer.get().step]
    with pytest.raises(ProducerFailed) as failed:
        producer.get()
    producer.close()
    assert steps == [1, 2]
    assert str(failed.value) == "the rollout producer stopped: RuntimeError: engine lost at step 3"


def test_close_stops_a_producer_waiting_at_the_gate():
    ref: list = [None]
    recorder = Recorder(ref)
    producer = ref[0] = RolloutProducer(recorder, batches(10), 1, version=0)
    producer.start()
    assert producer.get().step == 1 and producer.get().step == 2  # step 3 waits for version 1
    producer.close(timeout=30)
    assert not producer._thread.is_alive()
    assert [s for s, _ in recorder.seen] == [1, 2]
