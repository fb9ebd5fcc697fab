"""The guidance service as a Ray actor: a service killed mid-rollout fails the call at once with
one line naming it, `RolloutGroup` restarts it once and the retried call gives the tokens a clean
call gives (every sequence has its own seeds); killed again during the retry, the group gives
up with one line."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import ray
from test_vllm_rollout import PROMPTS, VOCAB, assert_same_sequences, prompt_batch, rollout_config

from verl.utils.tiny_lm import TinyLMSpec, save_tiny_lm
from verl.workers.rollout.guidance_server import GuidanceLost
from verl.workers.rollout.worker import RolloutGroup

pytestmark = pytest.mark.e2e
HANG_S = 30.0
"""A lost service must surface well within this: its connection closes the moment it dies."""


def _killer(group: RolloutGroup, delay: float, times: int, killed: list[float]) -> threading.Thread:
    """A thread that kills the group's serving guidance service `delay` s into each of `times`
    calls (the first, then each restart's retry), noting when."""

    def run() -> None:
        for _ in range(times):
            while not group._serving:  # a restart is starting new services
                time.sleep(0.02)
            service = group.services[0]
            time.sleep(delay)
            ray.kill(service)
            killed.append(time.perf_counter())
            while group.services and group.services[0] == service:
                time.sleep(0.02)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_killed_guidance_service_is_restarted_once_then_given_up_on(
    tmp_path, capsys, rollout_gpus
):
    from transformers import AutoTokenizer

    draft = save_tiny_lm(str(tmp_path / "d"), TinyLMSpec(hidden_size=64, num_hidden_layers=1, vocab_size=VOCAB, seed=1))  # fmt: skip
    guide = save_tiny_lm(str(tmp_path / "g"), TinyLMSpec(hidden_size=128, num_hidden_layers=1, vocab_size=VOCAB, seed=2))  # fmt: skip
    tok = AutoTokenizer.from_pretrained(draft)
    config = dataclasses.replace(rollout_config(guide), response_length=160, n=16)
    prompts = [f"{i}{p}" for i in range(4) for p in PROMPTS]  # 20 x 16 x 160 tokens: seconds a call
    batch = prompt_batch(
        tok, prompts, n=16, temperature=1.0, global_step=1, lam=0.5, ignore_eos=True
    )
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    group = None
    try:
        group = RolloutGroup(1, draft, config, **rollout_gpus(1, 1))
        group.generate_sequences(batch)  # (the first call also warms the engines up)
        t0 = time.perf_counter()
        clean = group.generate_sequences(batch)
        clean_s = time.perf_counter() - t0
        assert clean_s > 1.5, (
            f"a call takes {clean_s:.1f} s: too short to kill the service mid-call"
        )

        # killed a third into the call: restarted once; the retry gives the clean call's tokens
        killed: list[float] = []
        _killer(group, clean_s / 3, 1, killed).join(timeout=0)
        retried = group.generate_sequences(batch)
        assert len(killed) == 1
        assert_same_sequences(clean, retried)
        out = capsys.readouterr().out.strip().splitlines()
        assert out[-1].startswith("warning: guidance replica 0 died mid-request"), out[-1]
        assert out[-1].endswith("restarting the guidance and retrying once"), out[-1]

        # killed again a third into the retry: one line, within seconds of that kill
        killed = []
        _killer(group, clean_s / 3, 2, killed)
        with pytest.raises(GuidanceLost) as lost:
            group.generate_sequences(batch)
        gave_up = time.perf_counter()
        assert len(killed) == 2 and gave_up - killed[1] < HANG_S, (killed, gave_up)
        message = str(lost.value)
        assert "\n" not in message and message.startswith("guidance replica 0 died mid-request")
        assert message.endswith("again after a restart; giving up"), message
    finally:
        if group is not None:
            group.shutdown()
        ray.shutdown()
