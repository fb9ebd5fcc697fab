"""Actor and reference configuration (EasyR1's worker.actor / worker.ref)."""

from __future__ import annotations

from dataclasses import dataclass, field

from verl.trainer.core_algos.policy_loss import PolicyLossConfig
from verl.utils.config_checks import DTYPE_ALIASES, check_choice, check_range, fail

DTYPES = ("float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_2")


@dataclass
class LoraConfig:
    """LoRA adapters on the actor (PEFT; verl/utils/lora.py); EasyR1's `worker.actor.model.lora`."""

    rank: int = 0
    """Adapter rank r (0: off, every weight trained)."""
    alpha: int = 16
    """Scale numerator: an adapted layer adds (alpha / rank)·B·A to its frozen weight."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (π_old is computed without it, so > 0 adds noise to the PPO ratio)."""
    target_modules: str = "all-linear"
    """Layers that get adapters: all-linear (every Linear but the LM head) or comma-separated module names (q_proj,v_proj)."""

    def validate(self, prefix: str) -> None:
        """Fail fast on bad values (the targets are checked against the model before Ray starts)."""
        if not isinstance(self.rank, int) or self.rank < 0:
            fail(f"{prefix}.rank", self.rank, "expected an integer >= 0 (0: LoRA off)")
        if self.rank:
            check_range(f"{prefix}.alpha", self.alpha, 0, low_open=True)
            check_range(f"{prefix}.dropout", self.dropout, 0, 1)
            if self.dropout == 1:
                fail(f"{prefix}.dropout", self.dropout, "expected a value in [0, 1)")


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
    freeze_vision_tower: bool = False
    """A vision-language model's vision tower keeps its weights (EasyR1's key); only the language model trains."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (rank 0: off)."""

    def validate(self, prefix: str) -> None:
        """Fail fast on bad values."""
        check_choice(
            f"{prefix}.attn_implementation",
            self.attn_implementation,
            ATTN_IMPLEMENTATIONS,
        )
        self.lora.validate(f"{prefix}.lora")


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
    training_steps: int | None = None
    """Steps the warm-up ratio and the cosine decay span (None: the run's steps, filled by the trainer once the data is loaded)."""

    def validate(self, prefix: str) -> None:
        """Fail fast on bad values."""
        check_range(f"{prefix}.lr", self.lr, 0.0, low_open=True)
        check_range(f"{prefix}.weight_decay", self.weight_decay, 0.0)
        check_range(f"{prefix}.lr_warmup_ratio", self.lr_warmup_ratio, 0.0, 1.0)
        if self.training_steps is not None:
            check_range(f"{prefix}.training_steps", self.training_steps, 1)
        for i, beta in enumerate(self.betas):
            check_range(f"{prefix}.betas[{i}]", beta, 0.0, 1.0)


@dataclass
class FSDPConfig:
    """FSDP2 sharding and precision."""

    enable_full_shard: bool = True
    """True: each decoder layer frees its gathered parameters after forward and gathers them again in backward (ZeRO-3); False: FSDP2 reshard_after_forward=False on the layers, what forward gathered stays until backward (FSDP1's SHARD_GRAD_OP, ZeRO-2: one all-gather per step instead of two, the whole unsharded model resident while computing). Gradients and optimizer state are sharded and parameters resharded after each stage either way."""
    torch_dtype: str | None = None
    """Dtype the weights are loaded in (None: float32 for the actor, bfloat16 on GPU for ref)."""
    mp_param_dtype: str = "bfloat16"
    """Mixed-precision compute dtype on GPU (CPU computes in float32)."""
    mp_reduce_dtype: str = "float32"
    """Gradient reduction dtype."""

    def validate(self, prefix: str) -> None:
        """Fail fast on bad values."""
        if self.torch_dtype is not None:
            check_choice(f"{prefix}.torch_dtype", self.torch_dtype, DTYPES, DTYPE_ALIASES)
        check_choice(f"{prefix}.mp_param_dtype", self.mp_param_dtype, DTYPES, DTYPE_ALIASES)
        check_choice(f"{prefix}.mp_reduce_dtype", self.mp_reduce_dtype, DTYPES, DTYPE_ALIASES)


@dataclass
class OffloadConfig:
    """CPU offloading between stages (GPU only)."""

    offload_params: bool = False
    """GPU: the sharded parameters (and gradients) live in host memory between stages, loaded onto the GPU for log-probs, the update and checkpoints (weight sync gathers them tensor by tensor), so the vLLM engines have that memory while they generate; no effect on CPU (one warning line at start)."""
    offload_optimizer: bool = False
    """GPU: the actor's AdamW state lives in host memory except during the update and checkpoints (the reference has none); no effect on CPU (one warning line at start)."""


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
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """The policy loss: its type, aggregation, clip ratios and the DPPO/CPPO/LUFFY knobs (verl's policy_loss block)."""
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
    distill_coef: float = 0.0
    """auto: algorithm.distill.coef in loss mode (0 otherwise): β of the distillation loss term."""
    distill_estimator: str = "k1"
    """auto: algorithm.distill.estimator."""
    distill_topk_forward: bool = False
    """auto: algorithm.distill.topk_forward (with coef > 0): the loss term is the top-K forward KL."""

    def validate(self, prefix: str) -> None:
        """Fail fast on bad values."""
        check_choice(f"{prefix}.strategy", self.strategy, ["fsdp"])
        for key in ("global_batch_size", "micro_batch_size_per_device_for_update",
                    "micro_batch_size_per_device_for_experience", "ppo_epochs", "max_token_len_per_device",
                    "sum_pi_squared_chunk_size"):  # fmt: skip
            check_range(f"{prefix}.{key}", getattr(self, key), 1)
        check_range(f"{prefix}.max_grad_norm", self.max_grad_norm, 0.0, low_open=True)
        if self.micro_batch_size_per_device_for_update > self.global_batch_size:
            fail(f"{prefix}.micro_batch_size_per_device_for_update", self.micro_batch_size_per_device_for_update,
                 f"must not exceed {prefix}.global_batch_size={self.global_batch_size}")  # fmt: skip
        self.policy_loss.validate(f"{prefix}.policy_loss")
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
