"""Asynchronous training (`async_training.staleness` >= 1) on the real Ray + FSDP + vLLM path.

Four runs share this module's Ray session: a guided (speculative, λ 0.5) run at staleness 1 that
checkpoints every step, the same run resumed from its step-2 checkpoint, a draft-only run at
staleness 2 whose producer fails while generating its fourth batch, and a guided multi-turn run
(tool episodes) at staleness 1. Each trained batch is kept
(a wrapper around the trainer's `_train`), and every trained token's sampling log-prob is checked
against an independent Hugging Face forward of the draft at the version the batch records: the
initial draft (version 0) or the checkpoint of step v (version v).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.trainer.test_e2e_training import TRAIN_KEYS, assert_trained, check_run, train
from verl.trainer.rollout_producer import VERSION_KEY

pytestmark = pytest.mark.e2e

ASYNC_KEYS = ["async/staleness_mean", "async/staleness_max", "async/dropped_frac",
              "async/trainer_idle_s", "async/producer_idle_s", "async/queued_batches"]  # fmt: skip
KEPT = ("input_ids", "attention_mask", "prompts", "response_mask", "rollout_log_probs", VERSION_KEY,
        "behavior_log_probs", "offpolicy_mask")  # fmt: skip


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from verl.trainer.config import load_config
    from verl.trainer.main import start_ray

    start_ray(load_config())
    yield
    ray.shutdown()


def keep_batches(kept: list[dict], fail_at: int | None = None):
    """A `before_fit` that records every batch the trainer trains (and, with `fail_at`, makes the
    producer's generation of that step raise)."""

    def hook(trainer) -> None:
        train_on, generate = trainer._train, trainer._generate

        def recorded(batch, metrics, start, sync):
            kept.append({k: batch.batch[k].clone() for k in (*KEPT, "tool_mask") if k in batch.batch.keys()}
                        | {"step": trainer.global_step})  # fmt: skip
            return train_on(batch, metrics, start, sync)

        def failing(batch, step, metrics):
            if step == fail_at:
                raise RuntimeError(f"engine lost while generating step {step}")
            return generate(batch, step, metrics)

        trainer._train, trainer._generate = recorded, failing

    return hook


def hf_log_probs(path: str, batch: dict) -> torch.Tensor:
    """log π(response token) under the model at `path`, (B, T) float64, 0 past each response."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt_len, out = batch["prompts"].shape[1], torch.zeros(batch["response_mask"].shape, dtype=torch.float64)  # fmt: skip
    for i in range(len(out)):
        keep = batch["attention_mask"][i].bool()
        ids, start = batch["input_ids"][i][keep], int(keep[:prompt_len].sum())
        with torch.no_grad():
            logp = torch.log_softmax(lm(ids[None]).logits[0].double(), -1)
        n = len(ids) - start
        out[i, :n] = logp[start - 1 : -1].gather(1, ids[start:, None])[:, 0]
    return out


def check_bound(kept: list[dict], staleness: int, first: int = 0) -> None:
    """The recorded versions never fall, start at the engines' first version, and lag the
    trained version (step - 1) by 0..`staleness`, some batch by at least 1 (the producer ran
    ahead). (Which batch lags how far depends on the two sides' speeds: not asserted.)"""
    versions = [int(b[VERSION_KEY][0]) for b in kept]
    lags = [b["step"] - 1 - v for b, v in zip(kept, versions, strict=True)]
    assert versions == sorted(versions) and versions[0] == first, versions
    assert all(0 <= lag <= staleness for lag in lags) and max(lags) >= 1, lags


def version_path(assets, run_dir: str, version: int) -> str:
    """The draft's weights at `version`: the initial model, or the export of step `version`."""
    if version == 0:
        return assets["draft"]
    return os.path.join(run_dir, f"global_step_{version}", "actor", "hf")


def check_behavior_versions(assets, run_dir: str, kept: list[dict]) -> float:
    """Every trained token's sampling log-prob equals the HF draft's at the batch's recorded
    version (float32 engines, 2e-4); returns the largest gap to the actor's version at training
    time, which the recorded one is not when the batch is stale."""
    gap_to_trained = 0.0
    for batch in kept:
        versions = batch[VERSION_KEY].unique().tolist()
        assert len(versions) == 1, versions  # a batch is generated under one version
        mask = batch["response_mask"].bool()
        sampled = batch["rollout_log_probs"].double()
        at_version = hf_log_probs(version_path(assets, run_dir, versions[0]), batch)
        assert (sampled - at_version)[mask].abs().max() < 2e-4, batch["step"]
        if versions[0] < batch["step"] - 1:
            at_trained = hf_log_probs(version_path(assets, run_dir, batch["step"] - 1), batch)
            gap_to_trained = max(gap_to_trained, (sampled - at_trained)[mask].abs().max().item())
    return gap_to_trained


GUIDED = {"async_training": {"staleness": 1}, "worker": {"rollout": {"offpolicy_guidance": {"lam": 0.5}}},
          "trainer": {"max_steps": 3, "save_freq": 1}}  # fmt: skip


@pytest.fixture(scope="module")
def guided_async_run(assets, ray_session, tmp_path_factory):
    run_dir, kept = str(tmp_path_factory.mktemp("async") / "guided"), []
    trainer, _, rows = train(assets, run_dir, before_fit=keep_batches(kept), **GUIDED)
    return run_dir, trainer, rows, kept


def test_guided_staleness_one_trains_on_exact_behavior_of_the_recorded_version(
    assets, guided_async_run
):
    """Staleness 1: step 1 trains on fresh samples, every later step on samples one version old;
    their log-probs are the draft's at that older version (not at the trained one), every
    metric is logged and documented, and the parameters changed."""
    run_dir, trainer, rows, kept = guided_async_run
    # mismatch/* compares the engine and the actor at one version: only on fresh samples
    fresh_only = [k for k in TRAIN_KEYS if not k.startswith("mismatch/")]
    steps = check_run("guided async", rows, [*ASYNC_KEYS, "guidance/is_weight_mean"], 3, fresh_only)
    assert "mismatch/kl_v1" in steps[0] and not any(
        "mismatch/kl_v1" in r for r in steps if r["async/staleness_max"] > 0
    )
    assert (
        steps[0]["async/staleness_max"] == 0.0
        and max(r["async/staleness_max"] for r in steps) == 1.0
    )
    assert all(r["async/dropped_frac"] == 0.0 for r in steps)
    assert trainer.config.algorithm.tis_level == "token"  # π_old/μ corrects the stale samples
    assert [b["step"] for b in kept] == [1, 2, 3]
    check_bound(kept, 1)
    assert (
        check_behavior_versions(assets, run_dir, kept) > 1e-2
    )  # the check can tell versions apart
    assert_trained(assets, run_dir, rows, step=3)


def test_resume_mid_pipeline_trains_each_batch_once(assets, guided_async_run, tmp_path):
    """Resumed from the step-2 checkpoint, step 3 trains on the same prompts as the full run; the
    batch generated ahead was not kept, so step 3's is generated again under the resumed weights
    (version 2, staleness 0)."""
    import shutil

    full_dir, full, _, _ = guided_async_run
    resumed_dir = str(tmp_path / "resumed")
    shutil.copytree(
        os.path.join(full_dir, "global_step_2"), os.path.join(resumed_dir, "global_step_2")
    )
    kept = []
    extra = {
        **GUIDED,
        "trainer": {**GUIDED["trainer"], "resume": "auto", "val_before_train": False},
    }
    second, _, rows = train(assets, resumed_dir, before_fit=keep_batches(kept), **extra)
    assert second.seen_indices == full.seen_indices[2:]
    assert [b["step"] for b in kept] == [3] and int(kept[0][VERSION_KEY][0]) == 2
    steps = {r["step"]: r for r in rows if "critic/score/mean" in r}
    assert sorted(steps) == [3] and steps[3]["async/staleness_max"] == 0.0


def test_draft_only_staleness_two_and_a_failing_producer(assets, ray_session, tmp_path):
    """Staleness 2 without guidance: the producer runs two batches ahead (step 3 trains on a
    sample of version 0, two versions old) and every token's log-prob is exact at its version.
    The producer then fails while generating step 4: the run ends with `ProducerFailed` in one
    line, after a complete checkpoint of step 3."""
    from verl.trainer.rollout_producer import ProducerFailed
    from verl.utils.checkpoint import is_complete

    run_dir, kept = str(tmp_path / "draft_only"), []
    extra = {"async_training": {"staleness": 2}, "worker": {"rollout": {"offpolicy_guidance": {"enable": False}}},
             "trainer": {"max_steps": 5, "save_freq": 1}}  # fmt: skip
    with pytest.raises(ProducerFailed) as failed:
        train(assets, run_dir, before_fit=keep_batches(kept, fail_at=4), **extra)
    assert str(failed.value) == (
        "the rollout producer stopped: RuntimeError: engine lost while generating step 4"
    )
    assert [b["step"] for b in kept] == [1, 2, 3]
    check_bound(kept, 2)
    assert is_complete(os.path.join(run_dir, "global_step_3", "actor"))
    assert check_behavior_versions(assets, run_dir, kept) > 1e-2


def test_guided_multi_turn_staleness_one_keeps_mu_exact_at_the_recorded_version(
    assets, ray_session, tmp_path
):
    """Multi-turn tool episodes (the `lookup` tool, char models edited to close calls often)
    guided token by token at λ = 0.5, staleness 1: every trained policy token's p is the draft's
    HF log-prob at the version its batch records, and its μ is log((1-λ)p + λq) with q the
    guidance's HF log-prob over the whole episode (tool results included as context); the tool
    tokens are in the sequences and out of the mask."""
    from verl.tasks.tiny_lm import save_call_prone_lm

    calling = {**assets, "draft": save_call_prone_lm(str(tmp_path / "draft")),
               "guidance": save_call_prone_lm(str(tmp_path / "guidance"), seed=5, weight=12.0)}  # fmt: skip
    extra = {"async_training": {"staleness": 1},
             "data": {"max_response_length": 64, "rollout_batch_size": 4},
             "worker": {"actor": {"global_batch_size": 8, "micro_batch_size_per_device_for_experience": 16},
                        "rollout": {"n": 2, "offpolicy_guidance": {"lam": 0.5},
                                    "multi_turn": {"enable": True, "tools": ["lookup"], "tool_call_format": "embedded",
                                                   "max_turns": 2, "max_tool_response_length": 16}}},
             "trainer": {"max_steps": 3, "save_freq": 1, "val_before_train": False}}  # fmt: skip
    run_dir, kept = str(tmp_path / "multi_turn"), []
    _, _, rows = train(calling, run_dir, before_fit=keep_batches(kept), **extra)
    steps = check_run(
        "multi-turn async",
        rows,
        ASYNC_KEYS,
        3,
        [k for k in TRAIN_KEYS if not k.startswith("mismatch/")],
    )
    assert all(r["multiturn/tool_calls_mean"] > 0 for r in steps)
    check_bound(kept, 1)
    assert check_behavior_versions(calling, run_dir, kept) > 1e-3  # p at the recorded version
    lam = 0.5
    for batch in kept:
        assert (batch["tool_mask"].sum() > 0) and not (
            batch["tool_mask"].bool() & batch["response_mask"].bool()
        ).any()
        mask = batch["response_mask"].bool()
        p = hf_log_probs(version_path(calling, run_dir, int(batch[VERSION_KEY][0])), batch)
        q = hf_log_probs(calling["guidance"], batch)
        mu = torch.logaddexp(p + torch.log1p(torch.tensor(-lam)), q + torch.log(torch.tensor(lam)))
        assert (batch["behavior_log_probs"].double() - mu)[mask].abs().max() < 2e-4, batch["step"]
        assert batch["offpolicy_mask"].bool()[mask].any()  # the guidance wrote some policy tokens
