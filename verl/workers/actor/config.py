"""Actor and reference configuration (EasyR1's worker.actor / worker.ref)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from verl.trainer.core_algos.policy_loss import LOSS_AGG_MODES, POLICY_LOSSES, PolicyLossConfig
from verl.utils.config_checks import check_choice, check_range, fail

DTYPES = ("float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_2")


@dataclass
class ModelConfig:
    """The Hugging Face causal LM the actor trains."""

    model_path: str | None = None
    """Local folder of the model (config + weights), or its hub id org/name[@revision]: resolved through the local Hugging Face cache, downloaded when missing and the hub is reachable."""
    tokenizer_path: str | None = None
    """Local folder or hub id of the tokenizer (None: model_path)."""
    trust_remote_code: bool = False
    """Allow custom modelling code from the model folder."""
    attn_implementation: str = "auto"
    """Attention kernel: auto (flash_attention_2 on GPU when installed, else sdpa), sdpa, eager, flash_attention_2."""
    enable_gradient_checkpointing: bool = True
    """Recompute activations in backward to save memory."""

    def validate(self, prefix: str) -> None:
        """Fail fast on bad values."""
        check_choice(
            f"{prefix}.attn_implementation",
            self.attn_implementation,
            ATTN_IMPLEMENTATIONS,
        )


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = 1e-6
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = 1e-2
    """AdamW weight decay."""
    lr_warmup_ratio: float = 0.0
    """Share of training steps spent warming up linearly."""
    lr_warmup_steps: int | None = None
    """Warm-up steps (overrides lr_warmup_ratio when set)."""
    min_lr_ratio: float | None = None
    """Cosine floor as a share of lr (None: constant after warm-up)."""
    training_steps: int = -1
    """auto: total training steps, set by the trainer."""

    def validate(self, prefix: str) -> None:
        """Fail fast on bad values."""
        check_range(f"{prefix}.lr", self.lr, 0.0, low_open=True)
        check_range(f"{prefix}.weight_decay", self.weight_decay, 0.0)
        check_range(f"{prefix}.lr_warmup_ratio", self.lr_warmup_ratio, 0.0, 1.0)
        for i, beta in enumerate(self.betas):
            check_range(f"{prefix}.betas[{i}]", beta, 0.0, 1.0)


@dataclass
class FSDPConfig:
    """FSDP2 sharding and precision."""

    enable_full_shard: bool = True
    """Shard parameters, gradients and optimizer state (ZeRO-3); False shards optimizer state only."""
    torch_dtype: str | None = None
    """Dtype the weights are loaded in (None: float32 for the actor, bfloat16 on GPU for ref)."""
    mp_param_dtype: str = "bfloat16"
    """Mixed-precision compute dtype on GPU (CPU computes in float32)."""
    mp_reduce_dtype: str = "float32"
    """Gradient reduction dtype."""

    def validate(self, prefix: str) -> None:
        """Fail fast on bad values."""
        if self.torch_dtype is not None:
            check_choice(f"{prefix}.torch_dtype", self.torch_dtype, DTYPES)
        check_choice(f"{prefix}.mp_param_dtype", self.mp_param_dtype, DTYPES)
        check_choice(f"{prefix}.mp_reduce_dtype", self.mp_reduce_dtype, DTYPES)


@dataclass
class OffloadConfig:
    """CPU offloading between stages (GPU only)."""

    offload_params: bool = False
    """Move parameters to CPU when the actor is idle."""
    offload_optimizer: bool = False
    """Move optimizer state to CPU when the actor is idle."""


@dataclass
class ActorConfig:
    """The policy being trained (the draft)."""

    strategy: str = "fsdp"
    """Training backend."""
    global_batch_size: int = 256
    """Responses per optimizer step (PPO mini-batch), across all ranks."""
    micro_batch_size_per_device_for_update: int = 4
    """Responses per forward/backward in update_policy."""
    micro_batch_size_per_device_for_experience: int = 16
    """Responses per forward in compute_log_prob."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    ppo_epochs: int = 1
    """Passes over the batch per step."""
    padding_free: bool = True
    """Pack responses without padding when the attention kernel allows it."""
    dynamic_batching: bool = False
    """Build micro-batches by a token budget instead of a fixed count."""
    max_token_len_per_device: int = 16384
    """Token budget of a micro-batch with dynamic batching."""
    loss_type: str = "ppo"
    """Policy loss, a name of the policy-loss registry."""
    loss_agg_mode: str = "token-mean"
    """Loss aggregation, a name of the aggregation registry."""
    loss_horizon: int | None = None
    """Fixed horizon of seq-mean-token-sum-norm (None: response_length)."""
    clip_ratio_low: float = 0.2
    """PPO lower clip ε_low."""
    clip_ratio_high: float = 0.28
    """PPO upper clip ε_high (clip-higher)."""
    clip_ratio_dual: float = 3.0
    """PPO dual-clip constant c > 1 for negative advantages."""
    tv_delta: float = 0.15
    """DPPO/CPPO total-variation radius δ."""
    is_ratio_cap: float = 20.0
    """DPPO/CPPO truncation of π_θ/μ."""
    cppo_w_min: float = 0.8
    """CPPO position weight at the last token."""
    cppo_budget: float = 0.02
    """CPPO base prefix budget δ_b."""
    cppo_budget_quantile: float = 0.9
    """CPPO quantile of the response's divergences setting its budget."""
    luffy_shaping: bool = False
    """LUFFY policy shaping of guidance tokens, f(π) = π/(π+γ)."""
    luffy_gamma: float = 0.1
    """LUFFY shaping constant γ."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (0: off)."""
    use_kl_loss: bool = False
    """auto: algorithm.use_kl_loss and not algorithm.disable_kl."""
    kl_penalty: str = "k3"
    """auto: algorithm.kl_penalty."""
    kl_coef: float = 0.0
    """auto: algorithm.kl_coef."""
    calculate_sum_pi_squared: bool = False
    """Also return Σπ² per position from compute_log_prob (needed by OTB and variance proxies)."""
    sum_pi_squared_checkpointing: bool = False
    """With Σπ²: run the LM head in chunks from the final hidden states, never holding all logits."""
    sum_pi_squared_chunk_size: int = 1024
    """Rows of (B·T, V) logits processed at once for Σπ²."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 settings."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """CPU offloading."""
    importance_clamp_min: float = 0.0
    """auto: algorithm.importance_clamp_min."""
    importance_clamp_max: float = 2.0
    """auto: algorithm.importance_clamp_max."""
    importance_detach: bool = True
    """auto: algorithm.importance_detach."""
    opsm_delta: float | None = None
    """auto: algorithm.opsm_delta."""
    distill_coef: float = 0.0
    """auto: algorithm.distill.coef in loss mode (0 otherwise): β of the distillation loss term."""
    distill_estimator: str = "k1"
    """auto: algorithm.distill.estimator."""
    distill_topk_forward: bool = False
    """auto: algorithm.distill.topk_forward (with coef > 0): the loss term is the top-K forward KL."""

    def policy_loss_config(self) -> PolicyLossConfig:
        """The loss hyper-parameters, as the algorithm core wants them (same field names)."""
        return PolicyLossConfig(**{f.name: getattr(self, f.name) for f in fields(PolicyLossConfig)})

    def validate(self, prefix: str) -> None:
        """Fail fast on bad values."""
        check_choice(f"{prefix}.strategy", self.strategy, ["fsdp"])
        check_choice(f"{prefix}.loss_type", self.loss_type, POLICY_LOSSES.names())
        check_choice(f"{prefix}.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES.names())
        for key in ("global_batch_size", "micro_batch_size_per_device_for_update",
                    "micro_batch_size_per_device_for_experience", "ppo_epochs", "max_token_len_per_device",
                    "sum_pi_squared_chunk_size"):  # fmt: skip
            check_range(f"{prefix}.{key}", getattr(self, key), 1)
        check_range(f"{prefix}.max_grad_norm", self.max_grad_norm, 0.0, low_open=True)
        check_range(f"{prefix}.clip_ratio_low", self.clip_ratio_low, 0.0, 1.0)
        check_range(f"{prefix}.clip_ratio_high", self.clip_ratio_high, 0.0)
        check_range(f"{prefix}.clip_ratio_dual", self.clip_ratio_dual, 1.0, low_open=True)
        check_range(f"{prefix}.tv_delta", self.tv_delta, 0.0, 1.0, low_open=True)
        check_range(f"{prefix}.is_ratio_cap", self.is_ratio_cap, 0.0, low_open=True)
        check_range(f"{prefix}.cppo_w_min", self.cppo_w_min, 0.0, 1.0, low_open=True)
        check_range(f"{prefix}.cppo_budget", self.cppo_budget, 0.0, low_open=True)
        check_range(f"{prefix}.cppo_budget_quantile", self.cppo_budget_quantile, 0.0, 1.0)
        check_range(f"{prefix}.luffy_gamma", self.luffy_gamma, 0.0, low_open=True)
        if self.loss_horizon is not None:
            check_range(f"{prefix}.loss_horizon", self.loss_horizon, 1)
        if self.micro_batch_size_per_device_for_update > self.global_batch_size:
            fail(f"{prefix}.micro_batch_size_per_device_for_update", self.micro_batch_size_per_device_for_update,
                 f"must not exceed {prefix}.global_batch_size={self.global_batch_size}")  # fmt: skip
        self.model.validate(f"{prefix}.model")
        self.optim.validate(f"{prefix}.optim")
        self.fsdp.validate(f"{prefix}.fsdp")


@dataclass
class RefConfig:
    """The frozen reference policy (only built when a KL term is used)."""

    micro_batch_size_per_device_for_experience: int = 16
    """Responses per forward in compute_ref_log_prob."""
    padding_free: bool = True
    """Pack responses without padding when possible."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 settings."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """CPU offloading."""

    def validate(self, prefix: str) -> None:
        """Fail fast on bad values."""
        check_range(
            f"{prefix}.micro_batch_size_per_device_for_experience",
            self.micro_batch_size_per_device_for_experience,
            1,
        )
        self.fsdp.validate(f"{prefix}.fsdp")
