"""The PPO/GRPO trainer: one driver process over Ray workers, one step = docs/design.md#one-training-step.

    rollout (draft + guidance)  ->  reward (async)  ->  old log-probs (+ Σπ²)  ->  ref log-probs
    ->  off-policy corrections (behavior, IS weights, masks, guidance/* and mismatch/* metrics)
    ->  advantages  ->  actor update  ->  weight sync to the draft engine  ->  log, checkpoint

Each stage is timed (`timing_s/<stage>`). Workers: `FSDPWorker` ranks (actor, with the reference
colocated when a KL term needs it) and a `RolloutGroup` of `RolloutWorker` replicas holding the vLLM engines.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
import ray
import torch

from verl.protocol import DataProto
from verl.trainer.config import PPOConfig, to_dict
from verl.trainer.core_algos.advantage import (
    GUIDED_ADVANTAGES,
    get_adv_estimator_fn,
    guided_advantage_weight,
)
from verl.trainer.core_algos.distill import compute_distill_metrics, distill_advantages
from verl.trainer.core_algos.guidance import (
    compute_gate_metrics,
    compute_guidance_diagnostics,
    compute_guidance_metrics,
    entropy_threshold,
    lam_at_step,
    unguided_entropies,
)
from verl.trainer.core_algos.kl import apply_kl_penalty, compute_mismatch_metrics
from verl.trainer.core_algos.offpolicy import (
    compute_geometric_mask,
    compute_importance_weights,
    compute_rejection_mask,
)
from verl.trainer.core_algos.sum_pi_squared import compute_variance_proxy_metrics
from verl.trainer.metrics import (
    compute_data_metrics,
    compute_throughput_metrics,
    response_lengths,
    timed,
)
from verl.trainer.rollout_producer import (
    VERSION_KEY,
    Produced,
    ProducerFailed,
    RolloutProducer,
    staleness_metrics,
)
from verl.trainer.two_stage import generate_two_stage, group_success, needs_two_stages
from verl.utils import metric_names as M
from verl.utils.checkpoint import is_complete
from verl.utils.dataset import RLDataset, build_dataloader
from verl.utils.heap import freeze_heap, thaw_heap
from verl.utils.tracking import Tracking
from verl.workers.actor.dp_actor import MISMATCH_MASK_KEY
from verl.workers.fsdp_workers import FSDPWorker
from verl.workers.placement import Placement
from verl.workers.reward.function import FunctionRewardManager
from verl.workers.rollout.multi_turn_mode import multi_turn_metrics
from verl.workers.rollout.worker import RolloutGroup
from verl.workers.worker_group import RayWorkerGroup, reduce_metrics

STEP_DIR = "global_step_{}"
LATEST = "latest_checkpointed_iteration.txt"


class StaleRolloutWeights(RuntimeError):
    """The draft engine's sampling log-probs are not the actor's (`algorithm.max_mismatch_kl`)."""


def check_mismatch_kl(metrics: dict[str, float], bound: float | None, step: int) -> None:
    """Raise `StaleRolloutWeights` in one line when the step's `mismatch/kl_v2` (½·mean of the
    squared gap between the draft engine's and the actor's log-probs of the same tokens) exceeds
    `bound`; None turns the check off. Rounding alone gives about 1e-12 in float32 on CPU and
    1e-4 to 1e-3 in bfloat16; an engine on weights that a sync missed or a wake-up lost is far
    off (TRL #5312, verl #7904)."""
    value = metrics.get(M.MISMATCH_KL_V2)
    if bound is None or value is None or not value > bound:  # (a NaN is no evidence either way)
        return
    raise StaleRolloutWeights(
        f"step {step}: {M.MISMATCH_KL_V2} = {value:.4g} exceeds algorithm.max_mismatch_kl = "
        f"{bound:g}: the draft engine's log-probs are not the actor's (stale or lost rollout "
        "weights: a weight sync that missed a tensor, a wake-up that dropped them); valid: a bound "
        "above this run's normal mismatch, or null to turn the check off"
    )


def step_guidance(config: PPOConfig, step: int, total_steps: int) -> tuple[float, float | None]:
    """This step's guidance strength λ and mentor weight, decided here and nowhere else.

    `step` is the 1-based number of the step being run. λ follows `lam_schedule` over
    `lam_schedule_steps` (`lam_at_step`); with `algorithm.guided_advantage=mentor` the weight is
    MENTOR's w(step) and λ is 0 once it has decayed to 0 (the rollout turns unguided). The
    rollout applies the λ it receives; the weight is None when the recipe is not mentor.
    """
    guidance, algo = config.worker.rollout.offpolicy_guidance, config.algorithm
    lam = lam_at_step(step, total_steps, guidance.lam, guidance.lam_end, guidance.lam_schedule,
                      guidance.lam_schedule_steps)  # fmt: skip
    if algo.guided_advantage != "mentor":
        return lam, None
    weight = guided_advantage_weight(step, algo.guided_advantage_decay_steps)
    return (lam if weight > 0 else 0.0), weight


def step_prefix(config: PPOConfig, step: int, total_steps: int) -> float:
    """This step's teacher-prefix fraction: `prefix_fraction` → `prefix_fraction_end` under
    `prefix_schedule`, over λ's span (`lam_schedule_steps`; `lam_at_step`)."""
    guidance = config.worker.rollout.offpolicy_guidance
    return lam_at_step(step, total_steps, guidance.prefix_fraction, guidance.prefix_fraction_end,
                       guidance.prefix_schedule, guidance.lam_schedule_steps)  # fmt: skip


class RayPPOTrainer:
    """Builds the workers, then `fit()` runs validation, training steps, logging and checkpoints."""

    def __init__(self, config: PPOConfig, train_data: RLDataset, val_data: RLDataset | None,
                 reward: FunctionRewardManager, val_reward: FunctionRewardManager) -> None:  # fmt: skip
        self.config, self.reward, self.val_reward = config, reward, val_reward
        trainer = config.trainer
        self.world_size = trainer.nnodes * trainer.n_gpus_per_node
        self.train_loader = build_dataloader(train_data, config.data.rollout_batch_size,
                                             config.data.shuffle, config.data.seed, drop_last=True)  # fmt: skip
        self.val_loader = None
        if val_data is not None:
            self.val_loader = build_dataloader(
                val_data, config.data.val_batch_size, False, 0, False
            )
        steps_per_epoch = len(self.train_loader)
        self.total_steps = trainer.max_steps or steps_per_epoch * trainer.total_epochs
        optim = config.worker.actor.optim
        if optim.training_steps is None:  # the LR schedule spans the run unless the user set it
            optim.training_steps = self.total_steps
        self.run_dir = trainer.save_checkpoint_path
        # steps done; while a step runs, its 1-based number (the first step is step 1)
        self.global_step = 0
        self.use_gpu = trainer.use_gpu
        self._bucket_plan: list[list[str]] | None = None
        self.placement: Placement | None = None  # FSDP ranks, draft replicas (+ guidance)
        self.rollout_placement: Placement | None = None  # dedicated draft GPUs
        self.guidance_placement: Placement | None = None  # dedicated guidance GPUs
        self.seen_indices: list[list[int]] = []  # dataset rows of each step (resume checks)
        self._resume_state: dict | None = None  # asynchronous: the last trained batch's state
        guidance = config.worker.rollout.offpolicy_guidance
        first_tau = guidance.first_step_entropy_threshold  # τ of the entropy gate at step 1
        self.entropy_tau = guidance.entropy_threshold if first_tau is None else first_tau

    # ------------------------------------------------------------------ workers
    def init_workers(self) -> None:
        """Actor (+ colocated reference) FSDP ranks, the draft replicas and the guidance services."""
        cfg = self.config
        role = "actor_ref" if cfg.uses_reference else "actor"
        rollout = cfg.worker.rollout
        own = rollout.n_gpus_per_node  # draft engines on GPUs of their own
        # a GPU's share of a rank, and of a draft replica with its guidance: half each of the
        # rank's GPU, or a whole GPU each when the drafts have GPUs of their own
        share = (1.0 if own else 0.5) if self.use_gpu else 0
        cpus = 1 if self.use_gpu else 1 / rollout.num_replicas  # on CPU the replicas share cores
        guided = rollout.offpolicy_guidance.enable
        dedicated = rollout.offpolicy_guidance.n_gpus_per_node if guided else 0
        gpu = {"GPU": 1} if self.use_gpu else {}
        # (CPU: every share is a token of the same cores; a rank's bundle keeps its replica's token
        # wherever the replica runs, so the ranks alone decide how many of them fit on a node)
        token = 0.25
        if self.use_gpu or cfg.trainer.nnodes > 1:  # a bundle per GPU: its rank, replica, guidance
            rank_cpus = 1 + (0 if own and self.use_gpu else cpus)
            self.placement = Placement.create(
                cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, {"CPU": rank_cpus, **gpu}
            )
        if own:  # the draft replicas on GPUs of their own, one each
            cpus = 1 if self.use_gpu else token
            self.rollout_placement = Placement.create(
                cfg.trainer.nnodes, own, {"CPU": cpus, **gpu}, near=self.placement
            )
        if dedicated:  # the guidance engines on GPUs of their own, one each
            slot = gpu or {"CPU": token}
            self.guidance_placement = Placement.create(
                cfg.trainer.nnodes, dedicated, slot, near=self.placement
            )
            guidance = 1 if self.use_gpu else 0
        else:  # on a GPU the rollout's share is split between a draft replica and its guidance
            guidance = share / 2 if guided else 0
        # CPU, asynchronous: the actor and the rollout compute at once; the actor keeps every
        # core (its step is the longer side) and the rollout's engines get half of them, which
        # measured faster than half each (benchmarks/README.md#asynchronous-training-bench_asyncpy)
        overlap = bool(cfg.async_training.staleness) and not self.use_gpu
        self.actor_wg = RayWorkerGroup(FSDPWorker, self.world_size, cfg.worker, role=role, placement=self.placement,
                                       num_cpus_per_worker=1, num_gpus_per_worker=share)  # fmt: skip
        for notices in self.actor_wg.execute_all("init_model"):  # rank 0's only: printed once
            for notice in notices:
                print(f"warning: {notice}", file=sys.stderr, flush=True)
        self.rollout = RolloutGroup(rollout.num_replicas, cfg.worker.actor.model.model_path, rollout, num_cpus=cpus,
                                    num_gpus=share - (0 if dedicated else guidance), guidance_gpus=guidance,
                                    placement=self.rollout_placement or self.placement,
                                    guidance_placement=self.guidance_placement,
                                    cpu_share=0.5 if overlap else 1.0)  # fmt: skip

    def shutdown(self) -> None:
        """Stop this trainer's Ray actors (Ray itself keeps running)."""
        self.actor_wg.shutdown()
        self.rollout.shutdown()
        for placement in (self.placement, self.rollout_placement, self.guidance_placement):
            if placement is not None:
                placement.remove()

    def _sync_weights(self) -> None:
        """The actor's weights to every rollout replica in buckets (`weight_sync_bucket_mb`)."""
        if self._bucket_plan is None:  # names and shapes never change within a run
            mb = self.config.worker.rollout.weight_sync_bucket_mb
            self._bucket_plan = self.actor_wg.execute_all("weight_bucket_plan", mb)[0]
        lora = bool(self.config.worker.actor.model.lora.rank)  # only the adapted modules travel
        self.rollout.sync_weights(self._bucket_plan, self._weight_bucket, partial=lora)

    def _weight_bucket(self, names: list[str]) -> ray.ObjectRef:
        """One bucket made by the actor ranks (a collective): rank 0's result, never read here."""
        first, *others = self.actor_wg.submit_all("weight_bucket", names)
        ray.get(others)  # the other ranks' share of the gather is done (and their errors raised)
        return first

    # ------------------------------------------------------------------ one step
    def _generate(self, batch: DataProto, step: int, metrics: dict) -> DataProto:
        """The rollout of the batch of step `step` (1-based), under that step's schedules (λ,
        prefix fraction, MENTOR's weight) and the gate's current τ."""
        cfg = self.config
        batch.non_tensor_batch["uid"] = np.array(
            [f"{step}-{i}" for i in range(len(batch))], dtype=object
        )
        guidance = cfg.worker.rollout.offpolicy_guidance
        lam, _ = step_guidance(cfg, step, self.total_steps)
        prefix = step_prefix(cfg, step, self.total_steps)
        batch.meta_info.update(global_step=step, lam=lam, prefix_fraction=prefix,
                               entropy_threshold=self.entropy_tau)  # fmt: skip
        with timed("gen", metrics):
            if needs_two_stages(guidance, lam, prefix):  # the draft alone first, then the failing
                out = generate_two_stage(self.rollout, self.reward, batch, guidance,
                                         cfg.worker.rollout.n, metrics)  # fmt: skip
            else:
                out = self.rollout.generate_sequences(batch)
        if guidance.enable and (guidance.prefix_fraction > 0 or guidance.prefix_fraction_end > 0):
            metrics[M.GUIDANCE_PREFIX_FRACTION] = prefix
        meta = out.meta_info
        self._gate_stats(out, meta.get("lam", 0.0), metrics)
        if "accept_rate" in meta:  # speculative rounds ran
            metrics[M.GUIDANCE_ACCEPT_RATE] = meta["accept_rate"]
            lookups = meta.get("draft_lookups", 0) / max(meta["emitted_tokens"], 1)
            metrics[M.GUIDANCE_DRAFT_LOOKUP_RATIO] = lookups
        if "topk_tail_mass" in meta:
            metrics[M.GUIDANCE_TOPK_TAIL_MASS] = meta["topk_tail_mass"]
        if "target_tv" in meta:
            metrics[M.GUIDANCE_TARGET_TV] = meta["target_tv"]
        metrics.update(multi_turn_metrics(out.batch))
        out.meta_info = {"temperature": cfg.worker.rollout.temperature, "lam": meta.get("lam", 0.0)}
        return out

    def _gate_stats(self, out: DataProto, lam: float, metrics: dict) -> None:
        """guidance/lambda_mean (λ_t as set), target_lambda_mean (λ'_t) and the gate's metrics; τ
        of the next step's gate (a percentile of this step's draft entropies on unguided
        responses, known before that rollout starts)."""
        guidance, b = self.config.worker.rollout.offpolicy_guidance, out.batch
        if "guidance_lam" not in b.keys():
            return
        gated = guidance.lam_gate != "none"
        metrics.update(compute_gate_metrics(b["guidance_strength"], b["draft_entropy"], b["guided_responses"],
                                            b["response_mask"], lam, self.entropy_tau if gated else None,
                                            b["guidance_lam"]))  # fmt: skip
        if gated and guidance.entropy_percentile is not None:
            entropies = unguided_entropies(
                b["draft_entropy"], b["guided_responses"], b["response_mask"]
            )
            if len(entropies):
                self.entropy_tau = entropy_threshold(entropies, guidance.entropy_threshold,
                                                     guidance.entropy_percentile)  # fmt: skip

    def _off_policy(self, batch: DataProto, metrics: dict) -> None:
        """Behavior log-probs, importance weights, rejection masks, guidance/* and mismatch/*."""
        cfg, algo, b = self.config, self.config.algorithm, batch.batch
        mask = b["response_mask"]
        keep, fresh = torch.ones_like(mask), mask  # fresh: sampled by the weights trained here
        if VERSION_KEY in b.keys():  # asynchronous: responses of older weights
            trained = self.global_step - 1
            within, stale = staleness_metrics(b[VERSION_KEY], trained, cfg.async_training.staleness)
            metrics.update(stale)
            keep, fresh = keep * within[:, None], mask * (b[VERSION_KEY] == trained)[:, None]
        guidance = cfg.worker.rollout.offpolicy_guidance
        if guidance.enable:  # mix mode: the draft's p of the guidance's responses is unknown
            draft = b["rollout_log_probs"] if guidance.mode == "speculative" else None
            metrics.update(compute_guidance_metrics(
                b["offpolicy_mask"], mask, b["behavior_log_probs"], draft,
                b.get("guidance_missing_mask"), lam=batch.meta_info["lam"]))  # fmt: skip
        else:
            b["behavior_log_probs"] = b["rollout_log_probs"]  # μ is the draft engine's sampler
        if algo.proximal == "rollout":  # the update's first forward is the only actor-side π_old
            b[MISMATCH_MASK_KEY] = fresh.float()
            batch.meta_info["mismatch_forced_threshold"] = algo.mismatch_forced_threshold
        elif fresh.any():  # engine vs actor at one version (stale responses add the policy's drift)
            metrics.update(compute_mismatch_metrics(b["rollout_log_probs"], b["old_log_probs"], fresh,
                                                    b.get("offpolicy_mask"), algo.mismatch_forced_threshold))  # fmt: skip
        behavior = b["behavior_log_probs"]
        if cfg.uses_importance_weights:
            weights, weight_metrics = compute_importance_weights(
                b["old_log_probs"], behavior, mask, algo.tis_level,
                algo.importance_clamp_min, algo.importance_clamp_max)  # fmt: skip
            b["importance_weights"] = weights
            metrics.update(weight_metrics)
        if algo.mis_level != "none":
            mis = compute_rejection_mask(b["old_log_probs"], behavior, mask, algo.mis_level,
                                         algo.mis_threshold_lower, algo.mis_threshold_upper)  # fmt: skip
            metrics[M.MISMATCH_MIS_MASKED_FRAC] = 1.0 - (mis * mask).sum().item() / max(
                mask.sum().item(), 1
            )
            keep = keep * mis
        if algo.geometric_mask:
            geo = compute_geometric_mask(b["old_log_probs"], behavior, mask,
                                         algo.geometric_mask_lower, algo.geometric_mask_upper)  # fmt: skip
            has = mask.sum(-1) > 0
            metrics[M.MISMATCH_GEO_MASKED_SEQ_FRAC] = (geo.amax(-1)[has] == 0).float().mean().item()
            keep = keep * geo
        if algo.mis_level != "none" or algo.geometric_mask or not keep.all():
            b["rollout_mask"] = keep

    def _advantages(self, batch: DataProto, metrics: dict) -> None:
        cfg, algo, b = self.config, self.config.algorithm, batch.batch
        rewards = b["token_level_scores"]
        if cfg.uses_reference and not algo.use_kl_loss:
            rewards, kl_metrics = apply_kl_penalty(rewards, b["old_log_probs"], b["ref_log_probs"],
                                                   b["response_mask"], algo.kl_coef, algo.kl_penalty)  # fmt: skip
            metrics.update(kl_metrics)
        b["token_level_rewards"] = rewards
        advantages, returns = get_adv_estimator_fn(algo.adv_estimator)(
            token_level_rewards=rewards, response_mask=b["response_mask"],
            index=batch.non_tensor_batch["uid"], epsilon=algo.adv_epsilon, gamma=algo.gamma,
            norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo, old_log_probs=b["old_log_probs"],
            sum_pi_squared=b.get("sum_pi_squared"), rollout_is_weights=b.get("importance_weights"),
            otb_epsilon=algo.otb_epsilon, otb_handle_zero_tail=algo.otb_handle_zero_tail,
        )  # fmt: skip
        _, weight = step_guidance(cfg, self.global_step, self.total_steps)
        if weight is not None:  # mentor: guided responses only count where they beat the others
            guided = b["guided_responses"]
            advantages = GUIDED_ADVANTAGES.get(algo.guided_advantage)(
                advantages=advantages, token_level_rewards=rewards, response_mask=b["response_mask"],
                index=batch.non_tensor_batch["uid"], guided=guided, weight=weight, cap=algo.guided_advantage_cap,
                epsilon=algo.adv_epsilon, norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo)  # fmt: skip
            returns = advantages
            metrics[M.GUIDANCE_GUIDED_ADV_WEIGHT] = weight
            if guided.any():
                metrics[M.GUIDANCE_GUIDED_ADV_MEAN] = advantages[guided][:, 0].mean().item()
        self._subset_scores(batch, metrics)
        distill, term = algo.distill, None
        if distill.coef > 0:  # the guidance as teacher, after the outcome normalisation
            teacher, missing = b["guidance_log_probs"], b.get("guidance_missing_mask")
            if distill.mode == "reward":
                advantages, term = distill_advantages(advantages, b["old_log_probs"], teacher, b["response_mask"],
                                                      missing, distill.coef, distill.estimator)  # fmt: skip
            metrics.update(compute_distill_metrics(b["old_log_probs"], teacher, b["response_mask"], missing,
                                                   b.get("importance_weights"), distill.estimator, term))  # fmt: skip
        b["advantages"], b["returns"] = advantages, returns
        # what the update gets from the guidance tokens (guidance/guided_*)
        if cfg.worker.rollout.offpolicy_guidance.enable:
            metrics.update(compute_guidance_diagnostics(
                b["offpolicy_mask"], b["response_mask"], b["old_log_probs"], b["behavior_log_probs"],
                advantages, b["token_level_scores"].sum(-1), batch.non_tensor_batch["uid"].tolist(),
                (algo.importance_clamp_min, algo.importance_clamp_max), b.get("importance_weights"),
                b.get("sum_pi_squared")))  # fmt: skip
        if "sum_pi_squared" in b.keys():
            metrics.update(compute_variance_proxy_metrics(advantages, b["response_mask"], b["old_log_probs"],
                                                          b["sum_pi_squared"], b.get("importance_weights")))  # fmt: skip

    def _subset_scores(self, batch: DataProto, metrics: dict) -> None:
        """guidance/subset_*_score: mean reward of the guided subset and of the draft-only rest
        (with `guided_samples` or a selective `guide_when`)."""
        b, guidance = batch.batch, self.config.worker.rollout.offpolicy_guidance
        selective = guidance.guide_when != "always"
        if "guided_responses" not in b.keys() or (
            guidance.guided_samples is None and not selective
        ):
            return
        scores, guided = b["token_level_scores"].sum(-1), b["guided_responses"]
        if guided.any():
            metrics[M.GUIDANCE_SUBSET_GUIDED_SCORE] = scores[guided].mean().item()
        if (~guided).any():
            metrics[M.GUIDANCE_SUBSET_UNGUIDED_SCORE] = scores[~guided].mean().item()

    def train_step(self, batch: DataProto) -> dict[str, float]:
        """One step (docs/design.md#one-training-step) on a batch of prompts; returns its metrics."""
        metrics: dict[str, float] = {}
        start = time.perf_counter()
        self.seen_indices.append(batch.non_tensor_batch["index"].tolist())
        batch = self._generate(batch, self.global_step, metrics)
        return self._train(batch, metrics, start, self._sync_weights)

    def _train(
        self, batch: DataProto, metrics: dict, start: float, sync: Callable[[], None]
    ) -> dict[str, float]:
        """Everything of a step after its rollout, on the generated `batch`; `sync()` moves the
        updated weights to the engines. `start`: when the step began (perf/time_per_step)."""
        reward_future = self.reward.compute_async(batch)  # beside the log-prob work below
        if self.config.algorithm.proximal == "recompute":
            with timed("old_log_prob", metrics):
                batch = batch.union(self.actor_wg.dispatch("compute_log_prob", batch))
        else:  # bypass: π_old is the draft engine's own log-prob of each sampled token
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"].clone()
        if self.config.uses_reference:
            with timed("ref", metrics):
                batch = batch.union(self.actor_wg.dispatch("compute_ref_log_prob", batch))
        with timed("reward", metrics):
            batch.batch["token_level_scores"], components = reward_future.result()
        metrics.update(group_success(batch.batch["token_level_scores"].sum(-1), self.config.worker.rollout.n,
                                     self.config.worker.rollout.offpolicy_guidance.fail_below))  # fmt: skip
        with timed("off_policy", metrics):
            self._off_policy(batch, metrics)
        check_mismatch_kl(metrics, self.config.algorithm.max_mismatch_kl, self.global_step)
        with timed("adv", metrics):
            self._advantages(batch, metrics)
        with timed("update_actor", metrics):
            metrics.update(reduce_metrics(self.actor_wg.execute_dp("update_actor", batch)))
        if self.config.algorithm.proximal == "rollout":  # mismatch/* came with the update
            check_mismatch_kl(metrics, self.config.algorithm.max_mismatch_kl, self.global_step)
        with timed("sync_weights", metrics):
            sync()
        metrics.update(compute_data_metrics(batch, components))
        metrics.update(
            compute_throughput_metrics(batch, time.perf_counter() - start, self.world_size)
        )
        return metrics

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Draft-only generation (no guidance) on the validation set: val/* metrics."""
        if self.val_loader is None:
            return {}
        overrides = self.config.worker.rollout.val_override_config
        scores, lengths, components, samples = [], [], {}, []
        for batch_dict in self.val_loader:
            batch = DataProto.from_single_dict(batch_dict)
            batch.meta_info = {"n": overrides.get("n", 1), "guidance": False, "global_step": self.global_step,
                               "temperature": overrides.get("temperature", self.config.worker.rollout.temperature)}  # fmt: skip
            out = self.rollout.generate_sequences(batch)
            token_scores, parts = self.val_reward.compute(out)
            scores.append(token_scores.sum(-1))
            self._val_samples(out, scores[-1], batch.meta_info["n"], samples)
            lengths.append(response_lengths(out))  # tool tokens of multi-turn episodes included
            for key, values in parts.items():
                components.setdefault(key, []).extend(values)
        metrics = {"val/reward_score": torch.cat(scores).mean().item(),
                   "val/response_length": torch.cat(lengths).float().mean().item()}  # fmt: skip
        for key, values in components.items():
            if key != "overall":
                metrics[f"val/score/{key}"] = sum(values) / len(values)
        if getattr(self, "tracker", None) is not None:
            self.tracker.log_generations(samples, self.global_step)
        return metrics

    def _val_samples(self, out: DataProto, scores: torch.Tensor, n: int, samples: list) -> None:
        """Add to `samples` the first response of each prompt, in the validation set's fixed
        order, until it holds `trainer.val_generations_to_log`: the same prompts every time."""
        rows = list(range(0, len(out), n))[
            : self.config.trainer.val_generations_to_log - len(samples)
        ]
        if not rows:
            return
        b, extra = out.batch, out.non_tensor_batch
        lengths = response_lengths(out).long().tolist()  # the whole trajectory of an episode
        texts = self.val_reward.tokenizer.batch_decode(
            [b["responses"][i][: lengths[i]].tolist() for i in rows],
            skip_special_tokens=self.val_reward.config.skip_special_tokens)  # fmt: skip
        for i, text in zip(rows, texts, strict=True):
            samples.append({"prompt": str(extra["raw_prompt"][i]), "response": text,
                            "ground_truth": str(extra["ground_truth"][i]), "score": float(scores[i])})  # fmt: skip

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> str:
        """Actor shards + dataloader position under global_step_<n>, written then renamed."""
        final = os.path.join(self.run_dir, STEP_DIR.format(self.global_step))
        tmp = final + ".partial"
        shutil.rmtree(tmp, ignore_errors=True)
        self.actor_wg.execute_all("save_checkpoint", os.path.join(tmp, "actor"))
        # asynchronous: the state of the last batch trained, not of the batches generated ahead
        state = self._resume_state or {"dataloader": self.train_loader.state_dict(),
                                       "entropy_tau": self.entropy_tau}  # fmt: skip
        torch.save(
            {"global_step": self.global_step, **state}, os.path.join(tmp, "trainer_state.pt")
        )
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        with open(os.path.join(self.run_dir, LATEST), "w") as f:
            f.write(str(self.global_step))
        self._prune_checkpoints()
        return final

    def _checkpoints(self) -> list[int]:
        steps = []
        for name in os.listdir(self.run_dir) if os.path.isdir(self.run_dir) else []:
            if name.startswith("global_step_") and name[12:].isdigit():
                if is_complete(os.path.join(self.run_dir, name, "actor")):
                    steps.append(int(name[12:]))
        return sorted(steps)

    def _prune_checkpoints(self) -> None:
        limit = self.config.trainer.save_limit
        if limit > 0:
            for step in self._checkpoints()[:-limit]:
                shutil.rmtree(os.path.join(self.run_dir, STEP_DIR.format(step)), ignore_errors=True)

    def _resume_path(self) -> str | None:
        resume = self.config.trainer.resume
        if resume == "none":
            return None
        if resume != "auto":
            if not is_complete(os.path.join(resume, "actor")):
                raise FileNotFoundError(
                    f"trainer.resume: {resume!r} is not a complete checkpoint folder"
                )
            return resume
        steps = self._checkpoints()
        return os.path.join(self.run_dir, STEP_DIR.format(steps[-1])) if steps else None

    def load_checkpoint(self) -> bool:
        """Resume from trainer.resume (auto: the latest complete checkpoint). True if resumed."""
        path = self._resume_path()
        if path is None:
            return False
        self.actor_wg.execute_all("load_checkpoint", os.path.join(path, "actor"))
        state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
        self.global_step = state["global_step"]
        self.entropy_tau = state.get("entropy_tau", self.entropy_tau)
        self.train_loader.load_state_dict(state["dataloader"])
        self._sync_weights()
        return True

    # ------------------------------------------------------------------ the run
    def fit(self) -> dict[str, float]:
        """Validate, train `total_steps` steps (resuming if asked), checkpoint; last metrics out."""
        trainer = self.config.trainer
        resumed = self.load_checkpoint()
        tracker = Tracking(trainer.logger, trainer.project_name, trainer.experiment_name, self.run_dir,
                           to_dict(self.config), self.total_steps, self.global_step)  # fmt: skip
        self.tracker, last = tracker, {}
        try:
            if resumed:
                tracker.message(f"resumed from step {self.global_step}")
            if trainer.val_before_train and not resumed:
                last = self.validate()
                tracker.log(last, self.global_step)
                self.first_val = dict(last)
            if trainer.val_only:
                return last
            freeze_heap()  # the start-up's objects: no full collection walks them mid-step
            if self.config.async_training.staleness:
                last = self._fit_async() or last
            while self.global_step < self.total_steps:
                for batch_dict in self.train_loader:
                    last = self._run_step(DataProto.from_single_dict(batch_dict))
                    if self.global_step >= self.total_steps:
                        break
            if self.val_loader is not None and (
                trainer.val_freq <= 0 or self.global_step % trainer.val_freq
            ):
                val = self.validate()
                tracker.log(val, self.global_step)
                last.update(val)
            if trainer.save_freq <= 0 or self.global_step % trainer.save_freq:
                self.save_checkpoint()
            return last
        finally:
            thaw_heap()
            tracker.finish()

    def _run_step(self, batch: DataProto) -> dict[str, float]:
        self.global_step += 1
        return self._finish_step(self.train_step(batch))

    def _finish_step(self, metrics: dict[str, float]) -> dict[str, float]:
        """Validate, log and checkpoint after a step, as the trainer's settings ask."""
        trainer = self.config.trainer
        if trainer.val_freq > 0 and self.global_step % trainer.val_freq == 0:
            metrics.update(self.validate())
        self.tracker.log(metrics, self.global_step)
        if trainer.save_freq > 0 and self.global_step % trainer.save_freq == 0:
            self.save_checkpoint()
        return metrics

    # ------------------------------------------------------------------ asynchronous
    def _fit_async(self) -> dict[str, float]:
        """Train the remaining steps on batches a `RolloutProducer` generates ahead (at most
        `async_training.staleness` versions); a producer that fails leaves a complete checkpoint
        of the last step trained, then `ProducerFailed` ends the run in one line."""
        staleness = self.config.async_training.staleness
        producer = RolloutProducer(
            self._generate, self._batches_ahead(), staleness, self.global_step
        )
        last: dict[str, float] = {}
        producer.start()
        try:
            while True:
                start = time.perf_counter()
                item = producer.get()
                if item is None:
                    return last
                last = self._async_step(item, producer, start)
        except ProducerFailed:
            if self.global_step and self.global_step not in self._checkpoints():
                self.save_checkpoint()
            raise
        finally:
            producer.close()

    def _async_step(
        self, item: Produced, producer: RolloutProducer, start: float
    ) -> dict[str, float]:
        """Train step `item.step` on its batch; the weight sync waits for the generation in
        flight and moves the engines to this step's version."""
        self.global_step += 1
        if item.step != self.global_step:
            raise RuntimeError(
                f"the producer sent step {item.step}'s batch for step {self.global_step}"
            )
        state = dict(item.resume_state)
        self.seen_indices.append(state.pop("indices"))

        def sync() -> None:
            with producer.exclusive():
                self._sync_weights()
                producer.advance(self.global_step)

        metrics = self._train(item.batch, item.metrics, start, sync)
        self._resume_state = state
        return self._finish_step(metrics)

    def _batches_ahead(self) -> Iterator[tuple[int, DataProto, Callable[[], dict]]]:
        """(step, prompts, state) for every step left: `state()`, called once the batch is
        generated, is what a checkpoint after that step holds (the loader's state just after
        the batch was drawn, the gate's τ for the next batch) and the batch's prompt rows."""
        step = self.global_step
        while step < self.total_steps:
            for batch_dict in self.train_loader:
                step += 1
                batch = DataProto.from_single_dict(batch_dict)
                loader, rows = (
                    self.train_loader.state_dict(),
                    batch.non_tensor_batch["index"].tolist(),
                )
                yield step, batch, lambda loader=loader, rows=rows: {
                    "dataloader": loader, "entropy_tau": self.entropy_tau, "indices": rows}  # fmt: skip
                if step >= self.total_steps:
                    return
