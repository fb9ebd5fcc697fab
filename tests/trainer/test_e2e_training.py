"""End-to-end training through the real Ray + FSDP + vLLM path on CPU, with tiny models.

Every run is 2 steps (4 for the run resumed) on the embedded arithmetic prompts. The reward is a
user function (`digit_share`, loaded from a file) whose value varies across random samples, so
advantages are non-zero and parameters must change.

A run costs about 40 s on 2 cores, mostly starting its worker processes and building its two vLLM
engines, so settings that act on different parts of a step share a run and each one's metrics are
checked on it: the speculative run (`stacked_run`) also has the optimal-token baseline, OPSM, the
CPPO loss, LUFFY shaping and the distillation loss, and is the 4-step run that `test_resume_...`
resumes; the two-replica run also distills in reward mode. Settings that exclude each other keep
runs of their own (guidance off, mix mode, pure distillation by reward) or ride on a run that
checks something else: the interrupted run distills by the top-K forward loss, and MENTOR's two
recipes are the two-node runs of test_two_nodes.py. The multi-turn run (its own edited models)
and the stale-weight run (a sync that skips a tensor) share this module's Ray session too.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from verl.utils.metric_names import is_known

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from verl.trainer.config import load_config
    from verl.trainer.main import start_ray

    start_ray(load_config())
    yield
    ray.shutdown()


def overrides(assets, run_dir: str, **extra) -> dict:
    base = {
        "data": {"train_files": "embedded://arithmetic@train", "val_files": "",
                 "apply_chat_template": False, "max_prompt_length": 8, "max_response_length": 6,
                 "rollout_batch_size": 8, "val_batch_size": 64},
        "algorithm": {"disable_kl": True},
        "worker": {
            "actor": {"global_batch_size": 16, "micro_batch_size_per_device_for_update": 8,
                      "micro_batch_size_per_device_for_experience": 32,
                      "model": {"model_path": assets["draft"]}, "optim": {"lr": 1e-3}},
            "rollout": {"n": 4, "dtype": "float32", "gpu_memory_utilization": 0.02, "enforce_eager": True,
                        "offpolicy_guidance": {"enable": True, "model_path": assets["guidance"], "dtype": "float32",
                                               "gpu_memory_utilization": 0.02, "logprobs": 128}},
            "reward": {"reward_function": assets["reward"], "reward_type": "sequential"},
        },
        "trainer": {"max_steps": 2, "logger": ["file"], "save_checkpoint_path": run_dir,
                    "n_gpus_per_node": 1, "val_before_train": True, "resume": "none"},
    }  # fmt: skip
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(extra)))


def train(assets, run_dir: str, before_fit=None, **extra):
    """One run in this process's Ray session; returns (trainer, last metrics, logged rows).
    `before_fit(trainer)` runs once the workers are up."""
    from verl.trainer.config import load_config
    from verl.trainer.main import prepare
    from verl.trainer.ray_trainer import RayPPOTrainer

    prepared = prepare(load_config(overrides=overrides(assets, run_dir, **extra)))
    trainer = RayPPOTrainer(
        prepared.config, prepared.train, prepared.val, prepared.reward, prepared.val_reward
    )
    trainer.init_workers()
    try:
        if before_fit is not None:
            before_fit(trainer)
        last = trainer.fit()
    finally:
        trainer.shutdown()
    with open(os.path.join(run_dir, "experiment_log.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return trainer, last, rows


def weights(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def assert_trained(assets, run_dir: str, rows: list[dict], step: int = 2) -> None:
    before = weights(assets["draft"])
    after = weights(os.path.join(run_dir, f"global_step_{step}", "actor", "hf"))
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) >= len(before) // 2, f"only {changed} changed"
    for row in rows:  # every logged value is finite (the file logger writes non-finite as null)
        bad = {
            k: v
            for k, v in row.items()
            if v is None or (isinstance(v, float) and not math.isfinite(v))
        }
        assert not bad, f"non-finite metrics at step {row['step']}: {bad}"


TRAIN_KEYS = ["actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean",
              "timing_s/gen", "timing_s/update_actor", "perf/throughput", "mismatch/kl_v1"]  # fmt: skip
DISTILL_KEYS = ["distill/reverse_kl", "distill/teacher_log_prob", "distill/missing_frac",
                "distill/advantage_abs"]  # fmt: skip
MENTOR_KEYS = ["guidance/lambda_mean", "guidance/entropy_threshold",
               "guidance/subset_unguided_score", "guidance/guided_adv_weight"]  # fmt: skip


def overlay(name: str, **extra) -> dict:
    """configs/<name>.yaml as an override dict, merged with `extra` (the e2e run's sizes)."""
    from omegaconf import OmegaConf

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    loaded = OmegaConf.load(os.path.join(root, "configs", f"{name}.yaml"))
    return OmegaConf.to_container(OmegaConf.merge(loaded, OmegaConf.create(extra)))


SELECTIVE_KEYS = ["guidance/guided_prompt_frac", "guidance/first_stage_score", "critic/score/group_any_success",
                  "guidance/first_stage_any_success", "guidance/guided_prompts_first_score",
                  "guidance/subset_guided_score", "guidance/subset_unguided_score", "guidance/prefix_fraction"]  # fmt: skip
GUIDED_KEYS = ["guidance/offpolicy_token_ratio", "guidance/is_weight_mean", "guidance/is_clip_frac",
               "guidance/behavior_kl", "guidance/lambda"]  # fmt: skip
SPECULATIVE_KEYS = [*GUIDED_KEYS, "guidance/accept_rate", "guidance/topk_tail_mass",
                    "guidance/guided_is_weight_mean", "guidance/guided_seq_score"]  # fmt: skip


def check_run(name: str, rows: list[dict], keys: list[str], steps: int = 2, train_keys: list[str] = TRAIN_KEYS) -> list[dict]:  # fmt: skip
    """Every step logged its training metrics (`train_keys`) and `keys`, and every logged name is
    documented; returns the step rows."""
    stepped = [r for r in rows if "critic/score/mean" in r]
    assert [r["step"] for r in stepped] == list(range(1, steps + 1))
    for key in train_keys + keys:
        assert all(key in r for r in stepped), f"{name}: {key} missing"
    logged = {k for r in rows for k in r if k != "step"}
    undocumented = sorted(k for k in logged if not is_known(k))  # metric_reference covers is_known
    assert not undocumented, f"{name}: not in the metric reference: {undocumented}"
    return stepped


RUNS = [
    # plain GRPO with π_old from the rollout (no separate forward: mismatch/* from the update)
    ("guidance_off", {"worker": {"rollout": {"offpolicy_guidance": {"enable": False}}},
                      "data": {"val_files": "embedded://arithmetic@test"},
                      "algorithm": {"proximal": "rollout"},
                      "trainer": {"val_generations_to_log": 3}}, []),
    # mix mode, and (orthogonal) LoRA (configs/lora.yaml) with the KL loss on: the reference is
    # the base model, adapters off
    ("mix+lora", overlay("lora", worker={"actor": {"model": {"lora": {"rank": 8}}, "optim": {"lr": 1e-2}},
                                         "rollout": {"offpolicy_guidance": {"mode": "mix", "mix_num_samples": 1}}},
                         algorithm={"disable_kl": False, "use_kl_loss": True, "kl_coef": 0.1}),
     [k for k in GUIDED_KEYS if k != "guidance/behavior_kl"] + ["guidance/missing_logprob_ratio", "actor/kl_loss"]),
    # two draft replicas sharing one guidance service, distilling in reward mode; two-stage
    # rollouts (guide_when group_fails, every group "failing" below 1.5) whose 2 guided responses
    # of 4 start with a teacher prefix of 0.25·8 = 2 tokens, shortened to 0 by the last step
    ("two_replicas+distill_reward+group_fails+prefix",
     {"worker": {"rollout": {"num_replicas": 2, "offpolicy_guidance": {
         "num_replicas": 1, "guide_when": "group_fails", "fail_below": 1.5, "guided_samples": 2,
         "prefix_fraction": 0.25, "prefix_fraction_end": 0.0, "prefix_schedule": "linear"}}},
      "data": {"val_files": "embedded://arithmetic@test"}, "algorithm": {"distill": {"coef": 0.5}}},
     [*GUIDED_KEYS, "guidance/accept_rate", *DISTILL_KEYS, *SELECTIVE_KEYS]),
    ("distill_pure", {"algorithm": {"adv_estimator": "none", "distill": {"coef": 1.0}},
                      "worker": {"rollout": {"offpolicy_guidance": {"lam": 0.0}}}}, DISTILL_KEYS),
]  # fmt: skip
"""(name, overrides, keys every step logs) of the 2-step runs that need a run of their own (the
top-K forward distillation, which excludes the others too, is the interrupted run's)."""
TOPK_FORWARD = {"algorithm": {"adv_estimator": "none", "distill": {"coef": 1.0, "mode": "loss", "topk_forward": True}},
                "worker": {"rollout": {"offpolicy_guidance": {"lam": 0.0}}}}  # fmt: skip
TOPK_FORWARD_KEYS = [*DISTILL_KEYS[:3], "actor/distill_loss"]


@pytest.mark.parametrize(("name", "extra", "keys"), RUNS, ids=[name for name, *_ in RUNS])
def test_two_step_run_trains_and_logs_finite_metrics(
    assets, ray_session, tmp_path, name, extra, keys
):
    if name.startswith("two_replicas") and torch.cuda.is_available():  # a replica holds a GPU
        if torch.cuda.device_count() < 2:
            pytest.skip("two draft replicas need two GPUs on a CUDA machine")
        extra = {**extra, "trainer": {"n_gpus_per_node": 2}}
    run_dir = str(tmp_path / name)
    _, _, rows = train(assets, run_dir, **extra)
    assert_trained(assets, run_dir, rows)
    steps = check_run(name, rows, keys)
    if name.startswith("two_replicas"):  # (one guidance service) validation uses both replicas
        assert "val/reward_score" in rows[0] and "val/reward_score" in rows[-1]
    if name == "guidance_off":  # (validates before training and at the end)
        assert "val/reward_score" in rows[0] and rows[0]["step"] == 0
        assert "val/reward_score" in rows[-1] and rows[-1]["step"] == 2
        assert not any(k.startswith("guidance/") for r in steps for k in r)
        assert not any("timing_s/old_log_prob" in r for r in steps)  # no π_old forward ran
        assert all(0 <= r["mismatch/kl_v2"] < 1e-6 for r in steps)  # float32: rounding only
        with open(os.path.join(run_dir, "val_generations.jsonl")) as f:  # the same 3 each time
            samples = [json.loads(line) for line in f]
        assert [s["step"] for s in samples] == [0, 0, 0, 2, 2, 2]
        prompts = [(s["prompt"], s["ground_truth"]) for s in samples]
        assert prompts[:3] == prompts[3:] and len(set(prompts)) == 3
        for s in samples:  # the reward's score of the response shown (digit_share)
            share = sum(c.isdigit() for c in s["response"]) / max(len(s["response"]), 1)
            assert s["score"] == pytest.approx(share)
    if "group_fails" in name:  # every prompt guided: 2 of its 4 responses replaced
        assert all(r["guidance/guided_prompt_frac"] == 1.0 for r in steps)
        assert [r["guidance/prefix_fraction"] for r in steps] == [0.25, 0.0]
        assert all(0.0 < r["guidance/lambda_mean"] for r in steps)
    if name == "distill_pure":  # λ = 0: the guidance only scores, every token is the draft's
        assert all(
            r["guidance/offpolicy_token_ratio"] == 0 and r["distill/missing_frac"] == 0
            for r in steps
        )
    if name.endswith("lora"):
        check_lora(assets, run_dir, steps)
    if name.startswith(
        "mix"
    ):  # one of the n=4 samples per prompt is the guidance's: 1/4 of the tokens
        assert all(r["guidance/offpolicy_seq_ratio"] == pytest.approx(0.25) for r in steps)
        # the guidance never scores the draft's responses: their tokens are missing, not p; the
        # draft never scores the guidance's, so there is no behavior KL against p
        token_share = [r["guidance/offpolicy_token_ratio"] for r in steps]
        for r, share in zip(steps, token_share, strict=True):
            assert r["guidance/missing_logprob_ratio"] == pytest.approx(1 - share, abs=1e-6)
        assert not any("guidance/behavior_kl" in r for r in steps)


def check_lora(assets, run_dir: str, steps: list[dict]) -> None:
    """The export holds the merged model, in which only the adapted Linear weights moved (norms,
    biases, embeddings are the base's), and the adapter alone, which PEFT loads onto the base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = os.path.join(run_dir, "global_step_2", "actor", "hf")
    before, after = weights(assets["draft"]), weights(hf)
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(k.endswith("_proj.weight") for k in moved), sorted(moved)
    base = AutoModelForCausalLM.from_pretrained(assets["draft"], dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, os.path.join(hf, "lora_adapter")).merge_and_unload()
    for key, tensor in adapted.state_dict().items():
        if key in after:  # (the tied LM head is the embeddings' tensor, saved once)
            torch.testing.assert_close(tensor, after[key], rtol=0, atol=1e-6)
    assert all(r["actor/kl_loss"] >= 0 for r in steps) and steps[-1]["actor/kl_loss"] > 0


STACKED = {
    "algorithm": {"adv_estimator": "optimal_token_baseline", "opsm_delta": 0.0,
                  "distill": {"coef": 0.5, "mode": "loss", "estimator": "k3"}},
    "worker": {"actor": {"calculate_sum_pi_squared": True,
                         "policy_loss": {"loss_type": "cppo", "luffy_shaping": True}}},
    "trainer": {"max_steps": 4, "save_freq": 2, "val_before_train": False},
}  # fmt: skip
"""Speculative guidance (the default) with settings that act on different parts of a step: the
optimal-token baseline (advantages), OPSM (a sequence mask), CPPO (the token loss), LUFFY (the
guidance tokens' loss) and the k3 distillation loss; 4 steps, checkpoints at 2 and 4."""
STACKED_KEYS = [*SPECULATIVE_KEYS,
                "variance_proxy/proxy2_total_power", "guidance/guided_grad_share",  # otb
                "actor/opsm_masked_seq_frac",  # opsm
                "actor/luffy_token_frac",  # luffy
                *DISTILL_KEYS[:3], "actor/distill_loss"]  # distillation, loss mode  # fmt: skip


@pytest.fixture(scope="module")
def stacked_run(assets, ray_session, tmp_path_factory):
    """The stacked run (`STACKED`), once per module: (run dir, trainer, logged rows)."""
    run_dir = str(tmp_path_factory.mktemp("stacked") / "full")
    trainer, _, rows = train(assets, run_dir, **STACKED)
    return run_dir, trainer, rows


def test_stacked_settings_each_log_their_metrics_on_one_run(assets, stacked_run):
    run_dir, trainer, rows = stacked_run
    policy_loss = trainer.config.worker.actor.policy_loss
    assert policy_loss.loss_type == "cppo" and policy_loss.luffy_shaping
    assert trainer.config.algorithm.adv_estimator == "optimal_token_baseline"
    steps = check_run("stacked", rows, STACKED_KEYS, steps=4)
    assert_trained(assets, run_dir, rows, step=2)
    assert_trained(assets, run_dir, rows, step=4)
    # the distillation loss leaves the outcome advantage alone
    assert not any("distill/advantage_abs" in r for r in steps)
    # LUFFY shapes the guidance's tokens: some exactly when the guidance emitted some
    for r in steps:
        assert (r["actor/luffy_token_frac"] > 0) == (r["guidance/offpolicy_token_ratio"] > 0)
        assert r["actor/luffy_token_frac"] <= 1


def test_resume_continues_with_the_same_data_and_metrics(assets, stacked_run, tmp_path):
    """The stacked 4-step run, resumed from its step-2 checkpoint (copied into a new run folder,
    `resume: auto`), trains steps 3 and 4 on the same prompts to the same metrics."""
    import shutil

    full_dir, full, full_rows = stacked_run
    resumed_dir = str(tmp_path / "resumed")
    shutil.copytree(
        os.path.join(full_dir, "global_step_2"), os.path.join(resumed_dir, "global_step_2")
    )
    second, _, rows = train(assets, resumed_dir, **{**STACKED, "trainer": {**STACKED["trainer"], "resume": "auto"}})  # fmt: skip
    assert second.seen_indices == full.seen_indices[2:]  # the same prompts, in the same order
    resumed = {r["step"]: r for r in rows if "critic/score/mean" in r}
    assert sorted(resumed) == [3, 4]
    full_steps = {r["step"]: r for r in full_rows if "critic/score/mean" in r}
    for step in (3, 4):
        for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm",
                    "guidance/offpolicy_token_ratio", "guidance/is_weight_mean", "actor/distill_loss",
                    "variance_proxy/proxy2_total_power", "actor/luffy_token_frac"):  # fmt: skip
            assert resumed[step][key] == pytest.approx(full_steps[step][key], rel=1e-4, abs=1e-6), (step, key)  # fmt: skip


MULTITURN_KEYS = ["multiturn/turns_mean", "multiturn/tool_calls_mean", "multiturn/tool_error_frac",
                  "multiturn/truncated_frac", "multiturn/tool_token_frac", "guidance/accept_rate"]  # fmt: skip


def test_two_step_guided_multi_turn_run_trains_and_logs_its_metrics(assets, ray_session, tmp_path):
    """Multi-turn with the `lookup` tool and speculative guidance (λ = 0.5), on char models
    edited to close calls often, the two with different strengths: episodes have tool turns and
    the guidance writes some policy tokens; π_old is the draft engine's (`algorithm.proximal:
    rollout`), checked against the update's forward. (The real pair's multi-turn run, through the command
    line, is tests/trainer/test_real_training.py.)"""
    from verl.tasks.tiny_lm import save_call_prone_lm

    calling = {**assets, "draft": save_call_prone_lm(str(tmp_path / "draft")),
               "guidance": save_call_prone_lm(str(tmp_path / "guidance"), seed=5, weight=12.0)}  # fmt: skip
    extra = {"data": {"max_response_length": 64, "rollout_batch_size": 4},
             "worker": {"actor": {"global_batch_size": 8, "micro_batch_size_per_device_for_experience": 16},
                        "rollout": {"n": 2, "offpolicy_guidance": {"lam": 0.5},
                                    "multi_turn": {"enable": True, "tools": ["lookup"], "tool_call_format": "embedded",
                                                   "max_turns": 2, "max_tool_response_length": 16}}},
             "algorithm": {"proximal": "rollout"},  # π_old: the draft engine's log-probs
             "trainer": {"val_before_train": False}}  # fmt: skip
    run_dir = str(tmp_path / "run")
    _, _, rows = train(calling, run_dir, **extra)
    assert_trained(calling, run_dir, rows)
    for row in check_run("multi_turn", rows, [*GUIDED_KEYS, *MULTITURN_KEYS]):
        assert row["multiturn/tool_calls_mean"] > 0
        assert 0 < row["multiturn/tool_token_frac"] < 1
        assert 0 < row["guidance/offpolicy_token_ratio"] < 1  # the guidance wrote some tokens
        assert 0 <= row["mismatch/kl_v2"] < 1e-6  # the engine's π_old is the actor's (float32)


@pytest.mark.parametrize("proximal", ["recompute", "rollout"])
def test_a_sync_that_skips_a_tensor_fails_the_next_step(assets, ray_session, tmp_path, proximal):
    """The stale-weight detector (`algorithm.max_mismatch_kl`) on a real 2-step run whose weight
    sync leaves out one tensor: step 1 (engine and actor on the same initial weights, float32:
    kl_v2 about 1e-12) passes a bound of 1e-6, step 2 (after the update, the engine's down_proj
    is not the actor's) fails in one line; with π_old from the rollout the check reads the
    update's first mini-batch and fires after that update, before the sync and the log.
    (Its unit tests: tests/trainer/test_stale_weights.py.)"""
    from verl.trainer.ray_trainer import StaleRolloutWeights
    from verl.utils import metric_names as M

    skipped, started = "model.layers.0.mlp.down_proj.weight", []

    def skip_one_tensor(trainer) -> None:
        plan = trainer.actor_wg.execute_all("weight_bucket_plan", 1.0)[0]
        assert any(skipped in bucket for bucket in plan)
        trainer._bucket_plan = [kept for b in plan if (kept := [n for n in b if n != skipped])]
        started.append(trainer)

    extra = {"worker": {"rollout": {"offpolicy_guidance": {"enable": False}}},
             "algorithm": {"max_mismatch_kl": 1e-6, "proximal": proximal}, "trainer": {"val_before_train": False}}  # fmt: skip
    run_dir = str(tmp_path / "run")
    with pytest.raises(StaleRolloutWeights) as error:
        train(assets, run_dir, before_fit=skip_one_tensor, **extra)
    assert started[0].global_step == 2
    message = str(error.value)
    assert message.startswith("step 2: mismatch/kl_v2 = ") and "\n" not in message
    with open(os.path.join(run_dir, "experiment_log.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1]  # step 1 passed the same bound and was logged
    assert rows[0][M.MISMATCH_KL_V2] < 1e-6


BAD_CONFIGS = [
    (["algorithm.adv_estimator=nope"], "algorithm.adv_estimator"),
    (["worker.actor.policy_loss.loss_type=nope"], "worker.actor.policy_loss.loss_type"),
    (["worker.rollout.offpolicy_guidance.enable=true"], "offpolicy_guidance.model_path"),
    (["algorithm.adv_estimator=optimal_token_baseline"], "calculate_sum_pi_squared"),
    (["algorithm.importance_clamp_min=3.0", "algorithm.importance_clamp_max=2.0"], "importance_clamp"),
]  # fmt: skip
BAD_CONFIG_RUNNER = """
import contextlib, io, json, sys
import ray
from verl.trainer.main import main
results = []
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(args)
    results.append({"code": code, "stderr": err.getvalue(), "ray": ray.is_initialized()})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def bad_config_results() -> list[dict]:
    """`main` on each of `BAD_CONFIGS` in one fresh Python process (one start-up for all five),
    in order: its exit code, its stderr, and whether Ray was initialized after it."""
    cases = json.dumps([args for args, _ in BAD_CONFIGS])
    proc = subprocess.run([sys.executable, "-c", BAD_CONFIG_RUNNER, cases], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(BAD_CONFIGS)
    return results


@pytest.mark.parametrize("case", range(len(BAD_CONFIGS)), ids=[a[0] for a, _ in BAD_CONFIGS])
def test_bad_config_fails_before_ray_with_one_line(bad_config_results, case):
    message = BAD_CONFIGS[case][1]
    result = bad_config_results[case]
    assert result["code"] == 2 and not result["ray"], result
    lines = [line for line in result["stderr"].strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], result["stderr"][-2000:]


HANG_S = 600
"""Only a hang guard: under pytest-timeout's 900 s, so that a stuck child is killed here."""


def test_ctrl_c_ends_with_one_line_naming_the_step_and_the_checkpoint(assets, tmp_path):
    """SIGINT to `python -m verl.trainer.main` after its second checkpoint: exit 130, and the last
    line of stderr names the step, the last complete checkpoint and how to resume. The run is pure
    distillation by the top-K forward loss (`TOPK_FORWARD`): its first two steps log their metrics
    and train, as a 2-step run's would."""
    import signal
    import time

    from omegaconf import OmegaConf

    run_dir = tmp_path / "interrupted"
    config = overrides(assets, str(run_dir), **TOPK_FORWARD, trainer={"max_steps": 200, "save_freq": 1,
                       "val_before_train": False, "resume": "auto", "logger": ["file"]})  # fmt: skip
    (tmp_path / "run.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
    proc = subprocess.Popen([sys.executable, "-m", "verl.trainer.main", f"config={tmp_path / 'run.yaml'}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    start = time.monotonic()
    while not (run_dir / "global_step_2").is_dir():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        if time.monotonic() - start > HANG_S:  # a hang guard (about 40 s on 2 idle cores)
            proc.kill()
            pytest.fail(f"no second checkpoint in {HANG_S} s; run dir holds {sorted(os.listdir(run_dir))}")  # fmt: skip
        time.sleep(0.5)
    waited = time.monotonic() - start
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    last = stderr.strip().splitlines()[-1]
    log = run_dir / "experiment_log.jsonl"
    steps = log.read_text().count("\n") if log.exists() else 0
    assert proc.returncode == 130, (
        f"exit {proc.returncode}; SIGINT sent {waited:.0f} s after start, {steps} log rows; {stderr[-3000:]}"
    )
    assert last.startswith("interrupted at step "), stderr[-3000:]
    assert (
        "last complete checkpoint: " in last
        and "global_step_" in last
        and "run the same command" in last
    )
    step = int(last.split("; last complete checkpoint: ")[1].split("global_step_")[1].split()[0])
    assert (run_dir / f"global_step_{step}" / "actor").is_dir() and step >= 2
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    first_two = [r for r in rows if r["step"] <= 2]
    assert_trained(assets, str(run_dir), first_two)
    check_run("distill_topk_forward", first_two, TOPK_FORWARD_KEYS)


MENTOR_RUNS = {
    "mentor": (3, MENTOR_KEYS),
    "mentor_exact": (2, [*MENTOR_KEYS, "guidance/is_weight_mean"]),
}
"""MENTOR's two recipes (configs/<name>.yaml) as 2-step runs: (decay steps S, keys every step logs).
They run on the two-node cluster of test_two_nodes.py, one per placement."""


def mentor_overrides(name: str, **extra) -> dict:
    """configs/<name>.yaml for a 2-step run (2 of n = 4 responses guided, S from `MENTOR_RUNS`)
    merged with `extra`."""
    from omegaconf import OmegaConf

    mine = {"worker": {"rollout": {"offpolicy_guidance": {"guided_samples": 2}}},
            "algorithm": {"guided_advantage_decay_steps": MENTOR_RUNS[name][0]}}  # fmt: skip
    merged = OmegaConf.merge(OmegaConf.create(mine), OmegaConf.create(extra))
    return overlay(name, **OmegaConf.to_container(merged))


def check_mentor(name: str, steps: list[dict]) -> None:
    """MENTOR's recipe over 2 steps (n = 4, 2 guided): step 1 guides with MENTOR's first-step
    τ = 999 (a gate barely open: λ_t = H_t/999), its unguided responses' draft entropies set step
    2's τ (P95, at least the floor 1.5). The weight at step n is ½(1 + cos(π n/S)), n counted from
    1 as MENTOR does: `mentor` has S = 3, weights ½(1 + cos(π/3)) = 0.75 then ½(1 + cos(2π/3)) =
    0.25; `mentor_exact` has S = 2, weights ½(1 + cos(π/2)) = 0.5 then 0, so its step 2 is
    unguided (λ = 0, no guidance token) and its step 1 has importance weights."""
    first, second = steps
    assert first["guidance/entropy_threshold"] == 999.0
    assert second["guidance/entropy_threshold"] >= 1.5
    # λ_t = min(1, H_t/999) with H_t <= log 128 = 4.85 for the tiny vocabulary: at most 0.0049
    assert first["guidance/lambda"] == 1.0 and 0 < first["guidance/lambda_mean"] < 0.0049
    for key in ("gate_mean", "gate_open_frac", "subset_guided_score", "draft_entropy_mean"):
        assert f"guidance/{key}" in first, key
    assert first["guidance/gate_open_frac"] == 0.0
    if name == "mentor":
        assert first["guidance/guided_adv_weight"] == pytest.approx(0.75, abs=1e-12)
        assert second["guidance/guided_adv_weight"] == pytest.approx(0.25, abs=1e-12)
        assert all("guidance/is_weight_mean" not in r for r in steps)  # tis_level none
    else:
        assert first["guidance/guided_adv_weight"] == pytest.approx(0.5, abs=1e-12)
        assert second["guidance/guided_adv_weight"] == 0.0
        assert second["guidance/lambda"] == 0.0 and second["guidance/offpolicy_token_ratio"] == 0.0
        assert second["guidance/lambda_mean"] == 0.0
