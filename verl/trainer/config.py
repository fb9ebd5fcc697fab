"""PPO/GRPO configuration (EasyR1 style): nested dataclasses merged with OmegaConf.

Merge order: structured defaults <- YAML (`config=path.yaml`, repeatable: a base, then overlays
such as `config=configs/otb.yaml`, in order) <- CLI dot-list (`worker.rollout.n=8`; an empty
value, `data.val_files=`, is "" for a str key whose default is "" and None for an optional key).
`load_config` then runs the one post-init pass (`PPOConfig.post_init`) that fills derived
("auto") keys and validates everything, so a bad value fails in one line that names the key, the
value and the valid choices, before Ray or any engine starts.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence, Set
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from omegaconf.nodes import StringNode

from verl.tasks.embedded import TASKS, embedded_task
from verl.trainer.core_algos.advantage import (
    ADV_ESTIMATORS,
    GUIDED_ADVANTAGES,
    is_grouped,
    needs_sum_pi_squared,
)
from verl.trainer.core_algos.distill import DISTILL_MODES
from verl.trainer.core_algos.kl import KL_ESTIMATORS
from verl.trainer.core_algos.offpolicy import RATIO_LEVELS
from verl.trainer.core_algos.policy_loss import PolicyLossConfig
from verl.utils.config_checks import ConfigError, check_choice, check_range, fail
from verl.workers.config import WorkerConfig

PROXIMAL_SOURCES = ("recompute", "rollout")
"""Where π_old comes from (`algorithm.proximal`)."""


@dataclass
class DataConfig:
    """Prompts and answers."""

    train_files: str = ""
    """Training data: jsonl/parquet path, a local `datasets` folder, or `name@split`."""
    val_files: str = ""
    """Validation data, same forms as train_files ("": none; `data.val_files=` on the CLI)."""
    prompt_key: str = "prompt"
    """Column holding the prompt."""
    answer_key: str = "answer"
    """Column holding the ground truth."""
    format_prompt: str | None = None
    """Template file applied to each prompt (None: chat template only)."""
    apply_chat_template: bool = True
    """Wrap each prompt in the tokenizer's chat template (False: the raw text)."""
    max_prompt_length: int = 512
    """Longest prompt in tokens; longer ones are filtered (and counted)."""
    max_response_length: int = 512
    """Longest response in tokens."""
    rollout_batch_size: int = 512
    """Prompts per training step."""
    val_batch_size: int = -1
    """Prompts per validation batch (-1: all at once)."""
    shuffle: bool = True
    """Shuffle training prompts each epoch."""
    seed: int = 1
    """Data-order seed."""
    filter_overlong_prompts: bool = True
    """Drop prompts longer than max_prompt_length instead of refusing the run."""
    image_key: str = "images"
    """Column of each row's images (EasyR1's): paths, bytes or PIL images, one per `<image>` in the prompt (none in the data: text)."""
    image_dir: str | None = None
    """Folder that relative image paths are under (None: the working directory)."""
    min_pixels: int | None = None
    """Smallest image area after resizing, in pixels (None: the model processor's own)."""
    max_pixels: int | None = None
    """Largest image area after resizing, in pixels (None: the model processor's own)."""

    def validate(self, prefix: str) -> None:
        """Fail fast on bad values."""
        check_range(f"{prefix}.max_prompt_length", self.max_prompt_length, 1)
        for key in ("min_pixels", "max_pixels"):
            if getattr(self, key) is not None:
                check_range(f"{prefix}.{key}", getattr(self, key), 28 * 28)
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            fail(
                f"{prefix}.min_pixels",
                self.min_pixels,
                f"at most data.max_pixels = {self.max_pixels}",
            )
        check_range(f"{prefix}.max_response_length", self.max_response_length, 1)
        check_range(f"{prefix}.rollout_batch_size", self.rollout_batch_size, 1)
        if self.val_batch_size != -1:
            check_range(f"{prefix}.val_batch_size", self.val_batch_size, 1)


@dataclass
class DistillConfig:
    """On-policy distillation from the guidance: a per-token reverse KL toward its log-probs."""

    coef: float = 0.0
    """β, the weight of the reverse KL toward the guidance (0: off; needs guidance enabled)."""
    mode: str = "reward"
    """reward: A_t += -β·k_t after the outcome normalisation; loss: β·k_t joins the actor loss (DISTILL_MODES)."""
    estimator: str = "k1"
    """Sampled-token reverse-KL estimator (KL_ESTIMATORS): k1 or k3 (unbiased); reward mode wants k1."""
    topk_forward: bool = False
    """Loss mode: the forward KL over the guidance's top-K at each position instead (teacher-only rollouts, λ = 0)."""

    def validate(self, prefix: str) -> None:
        """Fail fast on bad values."""
        check_range(f"{prefix}.coef", self.coef, 0.0)
        check_choice(f"{prefix}.mode", self.mode, DISTILL_MODES.names())
        check_choice(f"{prefix}.estimator", self.estimator, KL_ESTIMATORS.names())


@dataclass
class AlgorithmConfig:
    """Advantages, KL and the off-policy corrections (docs/design.md#guidance-math)."""

    adv_estimator: str = "grpo"
    """Advantage estimator, a name of the estimator registry."""
    gamma: float = 1.0
    """Discount of REINFORCE++ returns."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO divides by the group std (False: Dr. GRPO)."""
    adv_epsilon: float = 1e-6
    """ε of the GRPO std normalisation."""
    otb_epsilon: float = 1e-8
    """ε of the OTB baseline denominator."""
    otb_handle_zero_tail: bool = True
    """OTB: no baseline where only one sample of the group is still alive."""
    disable_kl: bool = False
    """No KL term at all (no reference model)."""
    use_kl_loss: bool = True
    """KL as a loss term (True) or as a penalty in the reward (False)."""
    kl_penalty: str = "k3"
    """KL estimator, a name of the KL registry."""
    kl_coef: float = 1e-2
    """KL coefficient β."""
    importance_clamp_min: float = 0.0
    """Lower truncation of the importance weight π_old/μ."""
    importance_clamp_max: float = 2.0
    """Upper truncation of the importance weight π_old/μ (TIS threshold)."""
    importance_detach: bool = True
    """Treat the importance weight as a constant in the loss."""
    tis_level: str = "auto"
    """Truncated IS level: token, sequence, geometric, none, or auto (token with guidance, else none)."""
    mis_level: str = "none"
    """Masked IS: drop tokens/responses whose ratio leaves [mis_threshold_lower, mis_threshold_upper]."""
    mis_threshold_lower: float = 0.5
    """Lower bound of the masked-IS band."""
    mis_threshold_upper: float = 2.0
    """Upper bound of the masked-IS band."""
    geometric_mask: bool = False
    """Drop responses whose geometric-mean ratio exp(mean log π_old/μ) leaves the band below."""
    geometric_mask_lower: float = 0.5
    """Lower bound of the geometric-mean ratio."""
    geometric_mask_upper: float = 2.0
    """Upper bound of the geometric-mean ratio."""
    opsm_delta: float | None = None
    """OPSM: drop responses with A < 0 and mean log(μ/π_θ) > δ (None: off)."""
    proximal: str = "recompute"
    """π_old of the decoupled loss: recompute (the actor's forward on the batch before the update) or rollout (the draft engine's log-probs of the sampled tokens, verl's bypass mode: one forward less per step; the mismatch metrics then come from the update's first mini-batch)."""
    mismatch_forced_threshold: float = -0.01
    """Tokens sampled with log-prob above this are 'forced' and left out of mismatch KLs."""
    max_mismatch_kl: float | None = 0.05
    """Fail the step when mismatch/kl_v2 exceeds this: stale or lost rollout weights (None: off)."""
    guided_advantage: str = "standard"
    """Advantages of guided responses (GUIDED_ADVANTAGES): standard (the estimator's, all alike) or mentor (unguided: GRPO among themselves; guided: max(r - unguided mean, 0) x a cosine-decayed weight)."""
    guided_advantage_decay_steps: int = 120
    """mentor: S, the guided responses' weight at step n (1-based) is ½(1 + cos(π n/S)), 0 from step S on, where the rollout turns unguided."""
    guided_advantage_cap: float | None = None
    """mentor: a group's guided advantages are scaled down to sum to at most this, before the weight (MENTOR's expert_cap: 99; None: no cap)."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from the guidance model (README_guidance.md)."""

    def validate(self, prefix: str) -> None:
        """Fail fast on bad values."""
        check_choice(f"{prefix}.adv_estimator", self.adv_estimator, ADV_ESTIMATORS.names())
        check_choice(f"{prefix}.guided_advantage", self.guided_advantage, GUIDED_ADVANTAGES.names())
        check_range(f"{prefix}.guided_advantage_decay_steps", self.guided_advantage_decay_steps, 1)
        if self.guided_advantage_cap is not None:
            cap = self.guided_advantage_cap
            check_range(f"{prefix}.guided_advantage_cap", cap, 0.0, low_open=True)
        check_choice(f"{prefix}.kl_penalty", self.kl_penalty, KL_ESTIMATORS.names())
        check_choice(f"{prefix}.proximal", self.proximal, PROXIMAL_SOURCES)
        check_choice(f"{prefix}.tis_level", self.tis_level, ["auto", "none", *RATIO_LEVELS.names()])
        check_choice(f"{prefix}.mis_level", self.mis_level, ["none", *RATIO_LEVELS.names()])
        check_range(f"{prefix}.gamma", self.gamma, 0.0, 1.0)
        check_range(f"{prefix}.kl_coef", self.kl_coef, 0.0)
        check_range(f"{prefix}.importance_clamp_min", self.importance_clamp_min, 0.0)
        if self.importance_clamp_min > self.importance_clamp_max:
            fail(f"{prefix}.importance_clamp_min", self.importance_clamp_min,
                 f"must not exceed {prefix}.importance_clamp_max={self.importance_clamp_max}")  # fmt: skip
        for name in ("mis_threshold", "geometric_mask"):
            low, high = getattr(self, f"{name}_lower"), getattr(self, f"{name}_upper")
            check_range(f"{prefix}.{name}_lower", low, 0.0, low_open=True)
            if low > high:
                fail(f"{prefix}.{name}_lower", low, f"must not exceed {prefix}.{name}_upper={high}")
        if self.opsm_delta is not None:
            check_range(f"{prefix}.opsm_delta", self.opsm_delta, 0.0)
        if self.max_mismatch_kl is not None:
            check_range(f"{prefix}.max_mismatch_kl", self.max_mismatch_kl, 0.0, low_open=True)
        self.distill.validate(f"{prefix}.distill")


@dataclass
class TrainerConfig:
    """The training run: length, logging, validation, checkpoints, cluster shape."""

    total_epochs: int = 1
    """Passes over the training data."""
    max_steps: int | None = None
    """Stop after this many steps (None: total_epochs decides)."""
    project_name: str = "easy_r1"
    """Logger project."""
    experiment_name: str = "demo"
    """Logger run name."""
    logger: list[str] = field(default_factory=lambda: ["console", "file"])
    """Loggers: console, file, wandb, tensorboard."""
    nnodes: int = 1
    """Nodes in the Ray cluster."""
    n_gpus_per_node: int = 1
    """Workers per node (GPUs, or CPU workers when no GPU is present)."""
    device: str = "auto"
    """auto (cuda when available), cuda or cpu."""
    val_freq: int = -1
    """Validate every N steps (-1: never)."""
    val_before_train: bool = True
    """Validate once before the first step."""
    val_only: bool = False
    """Only validate, do not train."""
    val_generations_to_log: int = 0
    """After each validation, the first response of the first N validation prompts (the same prompts every time) with prompt, ground truth and score: wandb table val/generations, <run>/val_generations.jsonl (file logger), one line each on the console (0: none)."""
    save_freq: int = -1
    """Checkpoint every N steps (-1: only at the end)."""
    save_limit: int = -1
    """Keep only the last N checkpoints (-1: all)."""
    save_checkpoint_path: str | None = None
    """Checkpoint folder (None: checkpoints/<project>/<experiment>)."""
    resume: str = "auto"
    """auto (latest checkpoint if any), none, or a checkpoint path."""

    @property
    def use_gpu(self) -> bool:
        """`device` resolved: cuda, or auto on a machine with a GPU."""
        import torch

        return self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())

    def validate(self, prefix: str) -> None:
        """Fail fast on bad values."""
        check_range(f"{prefix}.total_epochs", self.total_epochs, 1)
        check_range(f"{prefix}.nnodes", self.nnodes, 1)
        check_range(f"{prefix}.n_gpus_per_node", self.n_gpus_per_node, 1)
        check_choice(f"{prefix}.device", self.device, ["auto", "cuda", "cpu"])
        if self.max_steps is not None:
            check_range(f"{prefix}.max_steps", self.max_steps, 1)
        check_range(f"{prefix}.val_generations_to_log", self.val_generations_to_log, 0)
        for name in self.logger:
            check_choice(f"{prefix}.logger", name, ["console", "file", "wandb", "tensorboard"])


@dataclass
class AsyncTrainingConfig:
    """Asynchronous training: a rollout producer generates the next batches while the actor trains."""

    staleness: int = 0
    """Weight versions a trained sample may lag the actor: 0 runs the synchronous trainer (generate, train, sync, generate); k >= 1 lets the rollout generate the batches of the next k steps while the actor trains on the current one, on the weights it has (`docs/design.md#asynchronous-training`)."""

    def validate(self, prefix: str) -> None:
        """Fail fast on bad values."""
        check_range(f"{prefix}.staleness", self.staleness, 0)


@dataclass
class PPOConfig:
    """The whole configuration of a run."""

    data: DataConfig = field(default_factory=DataConfig)
    """Data."""
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    """Actor, reference, rollout, reward."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages, KL and off-policy corrections."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Run length, logging, checkpoints."""
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    """Rollouts ahead of training (staleness 0: synchronous)."""

    def derived_keys(self) -> list[tuple[str, str, Any]]:
        """(key, the key it derives from, its value): copies of one setting that workers read.

        Each setting has one owner, the second key; `post_init` fills the first from it. A value
        set on the first key by hand is refused when it differs (`_fill_derived`)."""
        algo, distill, data = self.algorithm, self.algorithm.distill, self.data
        topk = distill.topk_forward and distill.coef > 0
        loss, actor = "worker.actor.policy_loss", "worker.actor"
        g = "worker.rollout.offpolicy_guidance"
        return [
            ("worker.rollout.prompt_length", "data.max_prompt_length", data.max_prompt_length),
            ("worker.rollout.response_length", "data.max_response_length", data.max_response_length),
            ("worker.rollout.multi_turn.chat_template", "data.apply_chat_template", data.apply_chat_template),
            (f"{actor}.use_kl_loss", "algorithm.use_kl_loss (and not algorithm.disable_kl)",
             algo.use_kl_loss and not algo.disable_kl),
            (f"{actor}.kl_penalty", "algorithm.kl_penalty", algo.kl_penalty),
            (f"{actor}.kl_coef", "algorithm.kl_coef", algo.kl_coef),
            (f"{loss}.importance_clamp_min", "algorithm.importance_clamp_min", algo.importance_clamp_min),
            (f"{loss}.importance_clamp_max", "algorithm.importance_clamp_max", algo.importance_clamp_max),
            (f"{loss}.importance_detach", "algorithm.importance_detach", algo.importance_detach),
            (f"{loss}.opsm_delta", "algorithm.opsm_delta", algo.opsm_delta),
            (f"{actor}.distill_coef", "algorithm.distill.coef (loss mode; 0 in reward mode)",
             distill.coef if distill.mode == "loss" else 0.0),
            (f"{actor}.distill_estimator", "algorithm.distill.estimator", distill.estimator),
            (f"{actor}.distill_topk_forward", "algorithm.distill.topk_forward (with coef > 0)", topk),
            (f"{g}.keep_topk", "algorithm.distill.topk_forward (with coef > 0)", topk),
        ]  # fmt: skip

    def _fill_derived(self, user_keys: Set[str]) -> None:
        """Fill every derived key from its owner; refuse, in one line naming both keys, a value
        the user set there that differs (set in `user_keys`, or unlike the field's default)."""
        defaults = PPOConfig()
        for key, source, value in self.derived_keys():
            parent, _, leaf = key.rpartition(".")
            holder = attrgetter(parent)(self)
            current = getattr(holder, leaf)
            was_set = key in user_keys or current != getattr(attrgetter(parent)(defaults), leaf)
            if was_set and current != value:
                fail(key, current, f"it copies {source} = {value!r}, which is where this setting is "
                     f"made: set that instead and leave {key} out")  # fmt: skip
            setattr(holder, leaf, value)

    def post_init(self, user_keys: Set[str] = frozenset()) -> PPOConfig:
        """The one pass that fills derived keys (never over a value the user set: a conflicting
        one is refused), then validates every section. `user_keys`: the dotted keys the user
        gave (YAML files, CLI). Returns self."""
        algo, rollout = self.algorithm, self.worker.rollout
        guidance = rollout.offpolicy_guidance
        self._fill_derived(user_keys)
        if algo.tis_level == "auto":  # π_old/μ corrects guided and stale samples alike
            stale = self.async_training.staleness > 0
            algo.tis_level = "token" if guidance.enable or stale else "none"
        if rollout.num_replicas is None:  # one engine per tensor-parallel group of GPUs; 1 on CPU
            own = self.trainer.nnodes * rollout.n_gpus_per_node  # (or one per dedicated GPU)
            world = own or self.trainer.nnodes * self.trainer.n_gpus_per_node
            rollout.num_replicas = (
                max(1, world // rollout.tensor_parallel_size) if self.trainer.use_gpu or own else 1
            )
        if guidance.num_replicas is None:  # one guidance engine per draft replica or dedicated GPU
            dedicated = self.trainer.nnodes * guidance.n_gpus_per_node
            guidance.num_replicas = min(dedicated or rollout.num_replicas, rollout.num_replicas)
        if self.worker.reward.reward_function is None:
            task = embedded_task(self.data.train_files)
            self.worker.reward.reward_function = TASKS[task].reward if task else "math"
        if self.trainer.save_checkpoint_path is None:
            self.trainer.save_checkpoint_path = os.path.join(
                "checkpoints", self.trainer.project_name, self.trainer.experiment_name
            )
        self.validate()
        return self

    def validate(self) -> None:
        """Check every section, then the rules that span sections."""
        self.data.validate("data")
        self.worker.validate("worker")
        self.algorithm.validate("algorithm")
        self.trainer.validate("trainer")
        self.async_training.validate("async_training")
        self._validate_async()
        world = self.trainer.nnodes * self.trainer.n_gpus_per_node
        responses = self.data.rollout_batch_size * self.worker.rollout.n
        if responses % world:
            fail("data.rollout_batch_size", self.data.rollout_batch_size,
                 f"rollout_batch_size x worker.rollout.n = {responses} responses must split evenly over "
                 f"trainer.nnodes x trainer.n_gpus_per_node = {world} workers")  # fmt: skip
        self._validate_group_size()
        self._validate_proximal()
        self._validate_distill()
        self._validate_guided_advantage()
        self._validate_replicas(world)
        guidance = self.worker.rollout.offpolicy_guidance
        dedicated = self.trainer.nnodes * guidance.n_gpus_per_node
        if dedicated and guidance.num_replicas is not None and guidance.num_replicas > dedicated:
            fail("worker.rollout.offpolicy_guidance.num_replicas", guidance.num_replicas,
                 f"expected at most trainer.nnodes x offpolicy_guidance.n_gpus_per_node = {dedicated} "
                 "(one engine per dedicated GPU)")  # fmt: skip
        if (
            needs_sum_pi_squared(self.algorithm.adv_estimator)
            and not self.worker.actor.calculate_sum_pi_squared
        ):
            fail("worker.actor.calculate_sum_pi_squared", False,
                 f"algorithm.adv_estimator={self.algorithm.adv_estimator!r} needs Σπ²; set it to true")  # fmt: skip

    def _validate_async(self) -> None:
        """A rollout that runs ahead needs its samples corrected by π_old/μ and, on a GPU, an engine
        that keeps its memory while the actor trains."""
        staleness = self.async_training.staleness
        if staleness == 0:
            return
        if self.algorithm.tis_level == "none":
            fail("algorithm.tis_level", "none",
                 f"async_training.staleness={staleness} trains on samples of older weights: the "
                 "importance weight π_old/μ must correct them; valid: auto, token or sequence")  # fmt: skip
        if self.trainer.use_gpu and self.worker.rollout.free_cache_engine:
            fail("worker.rollout.free_cache_engine", True,
                 f"with async_training.staleness={staleness} the draft engine generates while the "
                 "actor trains, so it cannot give its memory back between generations; set it false")  # fmt: skip
        if self.trainer.val_only:
            fail("async_training.staleness", staleness,
                 "trainer.val_only=true trains nothing, so nothing runs ahead; valid: 0")  # fmt: skip

    def _validate_proximal(self) -> None:
        """π_old from the rollout needs the draft's own log-prob of every token at full vocabulary
        (no top-p/top-k: the engine's processed log-probs would be of the truncated distribution)
        and nothing that only the actor's forward gives (Σπ²)."""
        if self.algorithm.proximal == "recompute":
            return
        rollout, key = self.worker.rollout, "algorithm.proximal"
        guidance = rollout.offpolicy_guidance
        if guidance.enable and guidance.mode != "speculative":
            fail(key, "rollout", f"needs the draft's log-prob of every token, which offpolicy_guidance.mode="
                 f"{guidance.mode!r} does not record (the guidance's tokens are not scored by the draft); "
                 "valid: recompute, or mode=speculative")  # fmt: skip
        if rollout.top_p < 1.0 or rollout.top_k > 0:
            fail(key, "rollout", f"worker.rollout.top_p={rollout.top_p}, top_k={rollout.top_k} truncate the "
                 "distribution the engine reports, so its log-probs are not π_old's; valid: recompute, "
                 "or top_p=1.0 and top_k=-1")  # fmt: skip
        if self.worker.actor.calculate_sum_pi_squared:
            fail(key, "rollout", "worker.actor.calculate_sum_pi_squared=true needs the actor's forward "
                 "before the update (Σπ² comes with π_old); valid: recompute")  # fmt: skip

    def _validate_group_size(self) -> None:
        """A grouped estimator's baseline pools the n responses of a prompt: one is no group."""
        name, n = self.algorithm.adv_estimator, self.worker.rollout.n
        if n < 2 and is_grouped(name):
            alone = [e for e in ADV_ESTIMATORS.names() if not is_grouped(e)]
            fail("worker.rollout.n", n,
                 f"algorithm.adv_estimator={name!r} compares the responses of each prompt: expected "
                 f"n >= 2 (or an estimator without groups: {', '.join(alone)})")  # fmt: skip

    def _validate_guided_advantage(self) -> None:
        """mentor compares each group's guided responses with its unguided ones: both must exist."""
        if self.algorithm.guided_advantage == "standard":
            return
        key, rollout = "algorithm.guided_advantage", self.worker.rollout
        guidance, name = rollout.offpolicy_guidance, self.algorithm.guided_advantage
        if not guidance.enable or guidance.mode != "speculative":
            fail(
                key,
                name,
                "needs speculative guidance (worker.rollout.offpolicy_guidance.enable=true, mode=speculative)",
            )
        m = guidance.guided_samples
        if m is None or not 0 < m <= rollout.n - 2:  # MENTOR asserts "GRPO needs rollout.n > 1"
            fail(key, name, f"needs worker.rollout.offpolicy_guidance.guided_samples in 1..{rollout.n - 2} with "
                 f"worker.rollout.n={rollout.n}: at least one guided and two unguided responses per prompt, "
                 f"since the unguided ones get GRPO among themselves (got guided_samples={m})")  # fmt: skip
        if self.algorithm.adv_estimator != "grpo":
            fail(
                key,
                name,
                f"builds on GRPO; set algorithm.adv_estimator=grpo (got {self.algorithm.adv_estimator!r})",
            )

    def _validate_replicas(self, world: int) -> None:
        """On GPUs each draft replica holds its own GPUs (tensor_parallel_size of them): more than
        the cluster's would wait forever for a placement that can never be granted."""
        rollout = self.worker.rollout
        own = self.trainer.nnodes * rollout.n_gpus_per_node
        if own and rollout.num_replicas is not None and rollout.num_replicas > own:
            fail("worker.rollout.num_replicas", rollout.num_replicas,
                 f"expected at most trainer.nnodes x worker.rollout.n_gpus_per_node = {own} (one draft "
                 "engine per dedicated GPU)")  # fmt: skip
        if not self.trainer.use_gpu or rollout.num_replicas is None or own:
            return
        most = world // rollout.tensor_parallel_size
        if rollout.num_replicas > most:
            width = (
                f" / worker.rollout.tensor_parallel_size = {rollout.tensor_parallel_size}"
                if rollout.tensor_parallel_size > 1
                else ""
            )
            fail("worker.rollout.num_replicas", rollout.num_replicas,
                 f"expected at most {most}: trainer.nnodes x trainer.n_gpus_per_node = {world} GPUs{width}, "
                 "one draft engine per GPU (more would wait forever for a GPU placement)")  # fmt: skip

    def _validate_distill(self) -> None:
        """Distillation needs the guidance as teacher; no outcome advantage needs distillation."""
        coef = self.algorithm.distill.coef
        if coef > 0 and not self.worker.rollout.offpolicy_guidance.enable:
            fail("algorithm.distill.coef", coef,
                 "distillation reads the guidance's log-probs: set worker.rollout.offpolicy_guidance.enable=true "
                 "(with offpolicy_guidance.lam=0 the guidance only scores)")  # fmt: skip
        distill, guidance = self.algorithm.distill, self.worker.rollout.offpolicy_guidance
        if distill.topk_forward:
            always_zero = guidance.lam == 0 and (
                guidance.lam_schedule == "constant" or guidance.lam_end == 0
            )
            needs = [(distill.mode == "loss", "algorithm.distill.mode=loss"),
                     (always_zero, "worker.rollout.offpolicy_guidance.lam=0 at every step"),
                     (guidance.teacher_scoring == "prefill", "worker.rollout.offpolicy_guidance.teacher_scoring=prefill")]  # fmt: skip
            missing = [what for ok, what in needs if not ok]
            if missing:
                fail("algorithm.distill.topk_forward", True,
                     f"reads the top-K rows of the teacher-only rollout's prefill; needs {', '.join(missing)}")  # fmt: skip
        if ADV_ESTIMATORS.canonical(self.algorithm.adv_estimator) == "none" and coef == 0:
            fail("algorithm.adv_estimator", "none",
                 "gives every token advantage 0: set algorithm.distill.coef > 0 (pure distillation)")  # fmt: skip

    @property
    def uses_importance_weights(self) -> bool:
        """Importance weights are built (guidance on or rollout correction requested)."""
        return self.algorithm.tis_level not in ("none", "auto")

    @property
    def uses_reference(self) -> bool:
        """A reference policy is needed (a KL loss or a KL penalty in the reward)."""
        return not self.algorithm.disable_kl and self.algorithm.kl_coef > 0


def _explain(error: OmegaConfBaseException) -> str:
    """One line from an OmegaConf error: the full key and what went wrong."""
    key = getattr(error, "full_key", None) or "?"
    msg = str(getattr(error, "msg", None) or error).splitlines()[0]
    if "not in" in msg or "Key '" in msg:
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        moved = _moved_loss_key(key)
        if moved:
            return moved
        node = OmegaConf.structured(PPOConfig)
        valid = ""
        try:
            sub = OmegaConf.select(node, parent) if parent else node
            valid = f"; valid keys under '{parent or '<root>'}': {', '.join(sorted(sub.keys()))}"
        except Exception:  # the parent itself may be the unknown part
            pass
        return f"unknown config key '{key}'{valid}"
    if "is not a ListConfig" in msg:  # a scalar where the schema holds a list
        value = getattr(error, "value", None)
        return (f"{key}={value!r} is not valid; expected a list: {key}=[{value}] "
                f"(several: {key}=[a,b]; in YAML, a list)")  # fmt: skip
    return f"{key}: {msg}"


def _moved_loss_key(key: str) -> str | None:
    """The one-line answer for an EasyR1/verl-style flat loss key under worker.actor (which this
    project nests in worker.actor.policy_loss, or owns in algorithm.*), else None."""
    parent, _, leaf = key.rpartition(".")
    if parent != "worker.actor" or leaf not in {f.name for f in fields(PolicyLossConfig)}:
        return None
    if hasattr(AlgorithmConfig, leaf):  # importance clamps, detach, OPSM: the trainer reads them
        return (f"unknown config key '{key}': this setting is made in algorithm.{leaf} "
                "(the trainer and the loss both read it)")  # fmt: skip
    return f"unknown config key '{key}': the loss settings are under worker.actor.policy_loss; use worker.actor.policy_loss.{leaf}"


def _schema_node(schema: DictConfig, key: str) -> Any:
    """The schema's node for dotted `key`, or None when no such key exists."""
    parent, _, leaf = key.rpartition(".")
    try:
        holder = OmegaConf.select(schema, parent) if parent else schema
        return holder._get_node(leaf) if isinstance(holder, DictConfig) else None
    except Exception:  # an unknown or non-dict parent: OmegaConf's merge names it
        return None


def _parse_dotlist(schema: DictConfig, dotlist: Sequence[str]) -> DictConfig:
    """The CLI's `a.b=c` arguments as a config, with `key=` (an empty value) read by the schema.

    OmegaConf reads an empty value as None. For a str key whose default is "" (data.val_files:
    "" means no validation set) `key=` means ""; for an optional key it means None; another str
    key refuses it in one line, since an empty name or path there is a mistake.
    """
    parsed = OmegaConf.from_dotlist(list(dotlist))
    for arg in dotlist:
        key, value = arg.split("=", 1)
        node = _schema_node(schema, key) if value == "" else None
        if not isinstance(node, StringNode) or node._is_optional():
            continue
        if node._value() != "":
            raise ConfigError(
                f"{key}: empty value; give a string (only keys whose default is empty, such as "
                "data.val_files, accept `key=`)"
            )
        OmegaConf.update(parsed, key, "", merge=False)
    return parsed


def _load_yaml(path: str) -> DictConfig:
    """A config file as a DictConfig; ConfigError in one line for a missing or unreadable file, a
    YAML syntax error (file, line and column) or a file that is not a mapping of keys."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} not found")
    try:
        loaded = OmegaConf.load(path)
    except (OSError, UnicodeDecodeError) as error:  # no read permission, not text
        why = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
        raise ConfigError(
            f"config file {path!r} cannot be read: {why}; valid: a readable YAML file"
        ) from None
    except yaml.YAMLError as error:
        mark, start = getattr(error, "problem_mark", None), getattr(error, "context_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        what = getattr(error, "problem", None) or str(error).splitlines()[0]
        if getattr(error, "context", None) and start is not None:
            what += f" ({error.context} at line {start.line + 1})"
        raise ConfigError(f"config file {path}{where}: YAML syntax error: {what}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {path!r}: expected a mapping of keys (key: value), got a list")  # fmt: skip
    return loaded


def split_args(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(config files, `key=value` overrides) of the command line's arguments, in order.

    ConfigError in one line for an argument without `=`. The last value of a key given twice
    wins, as the launchers rely on (their keys first, then the user's `"$@"`), with one warning
    line naming both values; so does a config file given twice (merged again where it
    reappears)."""
    yaml_paths, dotlist, seen = [], [], {}
    for arg in args:
        if "=" not in arg:
            raise ConfigError(
                f"argument {arg!r} is not of the form key=value (e.g. worker.rollout.n=8)"
            )
        key, value = arg.split("=", 1)
        key = key.strip()
        if key == "config":
            if os.path.abspath(value) in map(os.path.abspath, yaml_paths):
                print(f"warning: config file {value} is given twice; it is merged again where it "
                      "reappears, over the files before it", file=sys.stderr)  # fmt: skip
            yaml_paths.append(value)
            continue
        if key in seen and seen[key] != value:
            print(f"warning: {key} is given twice on the command line ({key}={seen[key]}, then "
                  f"{arg}); the last wins: {value}", file=sys.stderr)  # fmt: skip
        seen[key] = value
        dotlist.append(arg)
    return yaml_paths, dotlist


def load_config(args: Sequence[str] = (), overrides: dict[str, Any] | None = None) -> PPOConfig:
    """Parse `config=path.yaml` and `a.b=c` arguments (and a dict of overrides) into a PPOConfig.

    Raises ConfigError with a one-line message on a missing file, an unknown key, a value of the
    wrong type or an invalid value.
    """
    schema = OmegaConf.structured(PPOConfig)
    yaml_paths, dotlist = split_args(args)
    user_keys: set[str] = set()
    try:
        merged = schema
        for yaml_path in yaml_paths:  # a base, then overlays (configs/*.yaml), in order
            layer = _load_yaml(yaml_path)
            if not layer:
                print(
                    f"warning: config file {yaml_path} is empty: it sets nothing", file=sys.stderr
                )
            user_keys |= _dotted_keys(layer)
            merged = OmegaConf.merge(merged, layer)
        if dotlist:
            layer = _parse_dotlist(schema, dotlist)
            user_keys |= _dotted_keys(layer)
            merged = OmegaConf.merge(merged, layer)
        if overrides:
            layer = OmegaConf.create(overrides)
            user_keys |= _dotted_keys(layer)
            merged = OmegaConf.merge(merged, layer)
        config: PPOConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError(_explain(error)) from None
    return config.post_init(user_keys)


def _dotted_keys(node: Any, prefix: str = "") -> set[str]:
    """Every dotted key a YAML/CLI layer sets (a dict-valued key such as sampling_overrides
    counts as its own key as well as its members)."""
    keys = set()
    if isinstance(node, DictConfig):
        for name in node.keys():
            key = f"{prefix}{name}"
            keys.add(key)
            keys |= _dotted_keys(node._get_node(name), f"{key}.")
    return keys


def to_dict(config: PPOConfig) -> dict[str, Any]:
    """Plain nested dict of a config (for loggers and checkpoints)."""
    return OmegaConf.to_container(OmegaConf.structured(config), resolve=True)


def defaults_yaml() -> str:
    """Every key with its default value, as YAML (the content of configs/defaults.yaml)."""
    header = "# Every configuration key with its default. Generated: python -m verl.trainer.config > configs/defaults.yaml\n"
    return header + OmegaConf.to_yaml(OmegaConf.structured(PPOConfig))


if __name__ == "__main__":
    print(defaults_yaml(), end="")
