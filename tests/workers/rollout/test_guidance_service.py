"""The guidance service as a Ray actor: a service that dies mid-rollout fails the call when its
connection closes (no timeout), with one line naming it; `RolloutGroup` restarts it once and the
retried call gives the tokens a clean call gives (every sequence has its own seeds); dead again
during the retry, the group gives up with one line.

The service dies where the test needs it, with no timing involved: the services are a subclass
of `GuidanceService` that exits inside a "score" request (the draft replica has sent it and waits
on, or keeps sending, the round's requests) while a count in a file is above zero. The draft
replica learns of the death in one of two ways, both correct and both one line: reading the
answer ("died mid-request") or sending its next request ("is gone"); which one depends on where
its overlapped rounds stand, so each is accepted with its exact wording."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import ray
from test_vllm_rollout import PROMPTS, VOCAB, assert_same_sequences, prompt_batch, rollout_config

from verl.tasks.tiny_lm import TinyLMSpec, save_tiny_lm
from verl.workers.rollout.guidance_server import GuidanceLost
from verl.workers.rollout.worker import RolloutGroup

pytestmark = pytest.mark.e2e
LOST = r"guidance replica 0 (died mid-request|is gone) \(its connection closed\)"
"""The two ways a replica learns its service died (`GuidanceChannel.result` / `.submit`)."""


def dying_service(folder):
    """A `GuidanceService` class whose actors note each start in `folder` and, while
    `folder/deaths` holds a count above 0, take one off it and exit inside their next "score"
    request (noting that too). Defined here, so Ray ships it to the actor by value."""
    from verl.workers.rollout.guidance_service import GuidanceService

    class DyingGuidanceService(GuidanceService):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            with open(os.path.join(folder, "events"), "a") as f:
                f.write("started\n")  # (read by the test once the group has connected)

        def _handle(self, prefix: str, op: str, args: tuple):
            deaths = os.path.join(folder, "deaths")
            if op == "score" and os.path.exists(deaths):
                with open(deaths) as f:
                    left = int(f.read())
                if left > 0:
                    with open(deaths, "w") as f:
                        f.write(str(left - 1))
                    with open(os.path.join(folder, "events"), "a") as f:
                        f.write("died in score\n")
                    os._exit(1)  # mid-request: the request was read, its answer never comes
            return super()._handle(prefix, op, args)

    return DyingGuidanceService


def warning_lines(capsys) -> list[str]:
    """The group's warning lines printed since the last look (Ray's raylet adds its own line
    about the worker that exited)."""
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: ")]


def test_a_killed_guidance_service_is_restarted_once_then_given_up_on(
    tmp_path, capsys, monkeypatch, rollout_gpus
):
    from transformers import AutoTokenizer

    from verl.workers.rollout import guidance_service, worker

    folder = tmp_path / "service"
    folder.mkdir()
    service_class = dying_service(str(folder))
    monkeypatch.setattr(guidance_service, "GuidanceService", service_class)
    if hasattr(worker, "GuidanceService"):  # (should the group import it at module level)
        monkeypatch.setattr(worker, "GuidanceService", service_class)

    def events() -> list[str]:
        return (folder / "events").read_text().splitlines()

    draft = save_tiny_lm(str(tmp_path / "d"), TinyLMSpec(hidden_size=64, num_hidden_layers=1, vocab_size=VOCAB, seed=1))  # fmt: skip
    guide = save_tiny_lm(str(tmp_path / "g"), TinyLMSpec(hidden_size=128, num_hidden_layers=1, vocab_size=VOCAB, seed=2))  # fmt: skip
    tok = AutoTokenizer.from_pretrained(draft)
    config = dataclasses.replace(rollout_config(guide), response_length=24, n=4)
    batch = prompt_batch(tok, PROMPTS, n=4, temperature=1.0, global_step=1, lam=0.5, ignore_eos=True)  # fmt: skip
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        ignore_reinit_error=True,
    )
    group = None
    try:
        group = RolloutGroup(1, draft, config, **rollout_gpus(1, 1))
        clean = group.generate_sequences(batch)
        assert clean.batch["offpolicy_mask"].any()  # guided: the call sent "score" requests
        assert events() == ["started"]

        # dies inside the call's first "score" request: restarted once, and the retry (on the
        # new service) gives the clean call's tokens
        (folder / "deaths").write_text("1")
        retried = group.generate_sequences(batch)
        assert events() == ["started", "died in score", "started"]
        assert_same_sequences(clean, retried)
        (warning,) = warning_lines(capsys)
        assert re.fullmatch(f"warning: {LOST}; restarting the guidance and retrying once", warning)

        # dies in the call and again in the retry (the third service): GuidanceLost in one line
        (folder / "deaths").write_text("2")
        with pytest.raises(GuidanceLost) as lost:
            group.generate_sequences(batch)
        assert events() == ["started", "died in score"] * 3  # the third service's retry died too
        assert (folder / "deaths").read_text() == "0"
        # the line comes from the connection closing (`GuidanceLost`), not from a timeout
        message = str(lost.value)
        assert re.fullmatch(f"{LOST}, again after a restart; giving up", message), message
        (again,) = warning_lines(capsys)
        assert re.fullmatch(f"warning: {LOST}; restarting the guidance and retrying once", again)
        with capsys.disabled():  # which of the two ways each death surfaced
            print(f"\nfirst death: {warning}\nsecond: {again}\nthird: {message}")
    finally:
        if group is not None:
            group.shutdown()
        ray.shutdown()
