"""Rollout configuration: the draft vLLM engine and the optional guidance engine
(docs/design.md#guidance-math)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl.trainer.core_algos.guidance import (
    BEHAVIORS,
    GUIDANCE_MODES,
    LAM_GATES,
    LAM_SCHEDULES,
    TOPK_TARGETS,
)
from verl.trainer.core_algos.guide_when import GUIDE_WHEN, PREFIX_DRAWS
from verl.utils.config_checks import DTYPE_ALIASES, check_choice, check_fields, check_range, fail
from verl.workers.rollout.multi_turn.config import MultiTurnConfig

TEACHER_SCORING = ("overlap", "prefill")
"""How the guidance scores the draft's tokens at λ = 0 (`VLLMRollout.generate_sequences`)."""

GUIDANCE_SAMPLING_FIELDS = ("temperature", "top_k", "top_p")
"""The fields `offpolicy_guidance.sampling_overrides` may set: the guidance processes its log-probs
(and samples, in mix mode) with these and no other (`RolloutContext.guidance_processing`)."""

VLLM_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
"""The dtypes `vllm.LLM(dtype=...)` takes (vLLM's `ModelDType`; a test compares the two)."""

VAL_OVERRIDE_FIELDS = ("n", "temperature")
"""The fields `val_override_config` may set: validation reads these two (`RayPPOTrainer.validate`)."""


def check_sampling_fields(
    key: str, fields: dict[str, Any], valid: tuple[str, ...], greedy: bool = False
) -> None:
    """A dict of sampling overrides: fields of `valid` only, each with a valid value (temperature
    0, greedy decoding, only where `greedy`)."""
    check_fields(key, fields, valid, " (the fields this run applies; vLLM's other SamplingParams fields would be ignored)")  # fmt: skip
    for name, value in fields.items():
        if name in ("temperature", "top_p") and (
            isinstance(value, bool) or not isinstance(value, int | float)
        ):
            fail(f"{key}.{name}", value, "expected a number")
        if name == "temperature":
            check_range(f"{key}.temperature", value, 0.0, low_open=not greedy)
        elif name == "top_p":
            check_range(f"{key}.top_p", value, 0.0, 1.0, low_open=True)
        elif name == "top_k" and value != -1 and (not isinstance(value, int) or value < 1):
            fail(f"{key}.top_k", value, "expected -1 (off) or a whole number >= 1")
        elif name == "n" and (not isinstance(value, int) or value < 1):
            fail(f"{key}.n", value, "expected a whole number >= 1")


@dataclass
class OffPolicyGuidanceConfig:
    """A second, stronger model that may override the draft's tokens during rollout."""

    enable: bool = False
    """Turn guidance on. Off means vanilla GRPO rollout everywhere."""
    model_path: str | None = None
    """Local folder or hub id (org/name[@revision], resolved through the local HF cache) of the guidance model; must share the draft's tokenizer."""
    tensor_parallel_size: int = 1
    """Tensor-parallel width of the guidance engine (1: one GPU per engine; wider is not supported yet)."""
    gpu_memory_utilization: float = 0.3
    """Share of GPU memory the guidance engine may use."""
    num_replicas: int | None = None
    """Guidance engines (Ray actors) shared by the draft replicas, replica i using engine i mod this (None: auto = one per draft replica, or one per dedicated GPU)."""
    n_gpus_per_node: int = 0
    """GPUs per node of the guidance's own, one engine on each (0: colocated, on the draft replicas' GPUs)."""
    dtype: str = "bfloat16"
    """Weights/activations dtype of the guidance engine (VLLM_DTYPES; float32 on CPU)."""
    enforce_eager: bool | None = None
    """Guidance engine without torch.compile/CUDA graphs (None: the rollout's `enforce_eager`)."""
    logprobs: int = 256
    """Top-K log-probs per position (K): the guidance's listed set S, over which the sampled target renormalises q (μ exact either way; the vocabulary size makes the target q_λ itself)."""
    topk_target: str = "draft_tail"
    """Speculative mode, what is sampled where q is known on S only (TOPK_TARGETS): renormalize (t = (1-λ)p + λq̃) or draft_tail (t = (1-λQ_S)p + λq·1_S, the unlisted mass to the draft); μ exact either way."""
    sampling_overrides: dict[str, Any] = field(default_factory=dict)
    """Sampling fields that differ for the guidance: temperature, top_k, top_p (GUIDANCE_SAMPLING_FIELDS)."""
    mode: str = "speculative"
    """Guidance mode: token-level speculative mixing or sequence-level mix (GUIDANCE_MODES)."""
    lam: float = 0.5
    """Guidance strength λ in [0, 1] at the first step: emitted tokens follow (1-λ)·p + λ·q (the trainer schedules it and sends each step's λ to the rollout)."""
    lam_schedule: str = "constant"
    """Schedule of λ over training steps (LAM_SCHEDULES)."""
    lam_end: float = 0.0
    """λ at the end of the schedule (ignored by `constant`)."""
    lam_schedule_steps: int | None = None
    """S: λ moves from `lam` at step 1 to `lam_end` at step 1 + S and stays there (None: S = the run's steps - 1, so its last step uses `lam_end`)."""
    lam_gate: str = "none"
    """Speculative mode: per-position λ_t = λ·gate(H_t), H_t the draft's entropy where it proposes (LAM_GATES; entropy: min(1, H_t/τ), MENTOR)."""
    entropy_threshold: float = 1.5
    """τ of the entropy gate, or its floor when `entropy_percentile` is set."""
    first_step_entropy_threshold: float | None = None
    """Entropy gate: τ of the first training step, before any entropy percentile is known (None: `entropy_threshold`; MENTOR: 999, a gate barely open)."""
    entropy_percentile: float | None = None
    """Entropy gate: τ = max(this percentile of the previous step's draft entropies on unguided responses, `entropy_threshold`) (None: τ fixed; MENTOR: 95)."""
    guided_samples: int | None = None
    """Speculative mode: the first m of each prompt's n responses are guided, the rest draft-only in the same rollout (None: all n)."""
    guide_when: str = "always"
    """Which prompts get guided responses (GUIDE_WHEN): always, or group_fails: the draft first answers every prompt n times alone and only prompts whose n responses all fail get m guided ones in place of their first m (m: `guided_samples` in speculative mode, `mix_num_samples` in mix), in the same step."""
    fail_below: float = 0.5
    """guide_when group_fails: a first-stage response fails when its reward is below this."""
    prefix_fraction: float = 0.0
    """Speculative mode, teacher prefix: λ_t = 1 on the first j of each guided response's tokens, j = round(this · response_length) (or drawn, `prefix_draw`), the step's λ after (0: no prefix)."""
    prefix_fraction_end: float = 0.0
    """The prefix fraction at the end of `prefix_schedule` (ignored by `constant`)."""
    prefix_schedule: str = "constant"
    """Schedule of the prefix fraction over training steps (LAM_SCHEDULES, over the same span as λ: `lam_schedule_steps`)."""
    prefix_draw: str = "fixed"
    """How j is drawn per guided response (PREFIX_DRAWS): fixed j, or uniform on {0, ..., j} from the response's own seed."""
    num_speculative_tokens: int = 1
    """Draft tokens proposed per round before the guidance scores them (k; 1 was the fastest measured on the real pair and as fast as 2 or 3 on the tiny one, benchmarks/README.md; a GPU whose guidance call costs several draft steps may want more)."""
    bonus_token: bool = True
    """Speculative mode: draft one token past the proposals while they are scored, for a bonus token of q_λ."""
    pipeline_groups: int = 2
    """Speculative mode: staggered groups of the batch, so the guidance scores some while the draft steps others (2 was the fastest measured on both pairs, benchmarks/README.md)."""
    mix_num_samples: int = 1
    """Mix mode: responses per prompt generated entirely by the guidance."""
    behavior: str = "exact"
    """Behavior log-prob rule: exact mixture log q_λ, or provenance (BEHAVIORS)."""
    keep_topk: bool = False
    """auto: algorithm.distill.topk_forward: hand the trainer the guidance's top-K row of every response token."""
    teacher_scoring: str = "prefill"
    """Speculative mode at λ = 0 (the guidance only scores): overlap (rounds, scoring beside drafting) or prefill (whole responses, then one guidance prefill each)."""

    def validate(self, prefix: str, rollout_n: int) -> None:
        """Fail fast on bad values; `rollout_n` bounds `mix_num_samples`."""
        check_choice(f"{prefix}.mode", self.mode, GUIDANCE_MODES.names())
        check_choice(f"{prefix}.behavior", self.behavior, BEHAVIORS.names())
        check_choice(f"{prefix}.lam_schedule", self.lam_schedule, LAM_SCHEDULES.names())
        check_choice(f"{prefix}.teacher_scoring", self.teacher_scoring, TEACHER_SCORING)
        check_choice(f"{prefix}.dtype", self.dtype, VLLM_DTYPES, DTYPE_ALIASES)
        check_range(f"{prefix}.lam", self.lam, 0.0, 1.0)
        check_range(f"{prefix}.lam_end", self.lam_end, 0.0, 1.0)
        check_range(
            f"{prefix}.gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True
        )
        if self.tensor_parallel_size != 1:
            fail(f"{prefix}.tensor_parallel_size", self.tensor_parallel_size,
                 "expected 1: a guidance engine holds one GPU (more engines: offpolicy_guidance.num_replicas)")  # fmt: skip
        if self.num_replicas is not None:
            check_range(f"{prefix}.num_replicas", self.num_replicas, 1)
        check_range(f"{prefix}.n_gpus_per_node", self.n_gpus_per_node, 0)
        check_range(f"{prefix}.logprobs", self.logprobs, 1)
        check_range(f"{prefix}.num_speculative_tokens", self.num_speculative_tokens, 1)
        check_range(f"{prefix}.pipeline_groups", self.pipeline_groups, 1)
        if not 0 <= self.mix_num_samples <= rollout_n:
            fail(f"{prefix}.mix_num_samples", self.mix_num_samples,
                 f"expected a value in [0, {rollout_n}] (worker.rollout.n = {rollout_n})")  # fmt: skip
        check_choice(f"{prefix}.lam_gate", self.lam_gate, LAM_GATES.names())
        check_range(f"{prefix}.entropy_threshold", self.entropy_threshold, 0.0, low_open=True)
        if self.entropy_percentile is not None:
            check_range(f"{prefix}.entropy_percentile", self.entropy_percentile, 0.0, 100.0)
        if self.first_step_entropy_threshold is not None:
            check_range(f"{prefix}.first_step_entropy_threshold", self.first_step_entropy_threshold,
                        0.0, low_open=True)  # fmt: skip
        if self.guided_samples is not None:
            if not 0 <= self.guided_samples <= rollout_n:
                fail(f"{prefix}.guided_samples", self.guided_samples,
                     f"expected a value in [0, {rollout_n}] (worker.rollout.n = {rollout_n}: the first m of each prompt's n responses are guided)")  # fmt: skip
            if self.mode != "speculative":
                fail(f"{prefix}.guided_samples", self.guided_samples,
                     f"applies to mode=speculative only (mode={self.mode!r}: use mix_num_samples); set it to null")  # fmt: skip
        if self.lam_gate != "none" and self.mode != "speculative":
            fail(f"{prefix}.lam_gate", self.lam_gate,
                 f"applies to mode=speculative only (mode={self.mode!r}); set it to none")  # fmt: skip
        check_choice(f"{prefix}.guide_when", self.guide_when, GUIDE_WHEN.names())
        check_choice(f"{prefix}.topk_target", self.topk_target, TOPK_TARGETS.names())
        check_choice(f"{prefix}.prefix_schedule", self.prefix_schedule, LAM_SCHEDULES.names())
        check_choice(f"{prefix}.prefix_draw", self.prefix_draw, PREFIX_DRAWS.names())
        check_range(f"{prefix}.prefix_fraction", self.prefix_fraction, 0.0, 1.0)
        check_range(f"{prefix}.prefix_fraction_end", self.prefix_fraction_end, 0.0, 1.0)
        if self.prefix_fraction > 0 and self.mode != "speculative":
            fail(f"{prefix}.prefix_fraction", self.prefix_fraction,
                 f"applies to mode=speculative only (mode={self.mode!r} writes whole responses); set it to 0")  # fmt: skip
        if self.guide_when == "group_fails" and self.mode == "mix" and self.mix_num_samples == 0:
            fail(f"{prefix}.mix_num_samples", 0,
                 "guide_when=group_fails replaces the first mix_num_samples responses of a failing group: expected >= 1")  # fmt: skip
        if self.guide_when == "group_fails" and self.guided_samples == 0:
            fail(f"{prefix}.guided_samples", 0,
                 "guide_when=group_fails replaces the first guided_samples responses of a failing group: expected >= 1 (null: all n)")  # fmt: skip
        if self.lam_schedule_steps is not None:
            check_range(f"{prefix}.lam_schedule_steps", self.lam_schedule_steps, 1)
        check_sampling_fields(f"{prefix}.sampling_overrides", self.sampling_overrides, GUIDANCE_SAMPLING_FIELDS)  # fmt: skip
        if self.enable and not self.model_path:
            fail(
                f"{prefix}.model_path",
                self.model_path,
                "guidance is enabled, so give the guidance model's local folder or hub id",
            )


@dataclass
class RolloutConfig:
    """The draft vLLM engine (EasyR1's worker.rollout)."""

    name: str = "vllm"
    """Rollout engine."""
    n: int = 5
    """Responses sampled per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature (> 0); log-probs are of the processed distribution."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Top-k sampling (-1: off)."""
    seed: int = 1
    """Sampling seed."""
    dtype: str = "bfloat16"
    """Weights/activations dtype of the draft engine (VLLM_DTYPES; float32 on CPU)."""
    gpu_memory_utilization: float = 0.6
    """Share of GPU memory the draft engine may use."""
    tensor_parallel_size: int = 1
    """Tensor-parallel width of the draft engine (1 only: the weight sync and the sessions reach its model runner in-process)."""
    weight_sync_bucket_mb: float = 256.0
    """Weight sync streams the actor's weights to the replicas in buckets of at most this many MiB."""
    num_replicas: int | None = None
    """Draft engines (Ray actors), a step's prompts split over them by whole groups (None: auto = GPUs / tensor_parallel_size, 1 on CPU; with `n_gpus_per_node`, one per dedicated GPU)."""
    n_gpus_per_node: int = 0
    """GPUs per node of the draft engines' own, one engine on each, so that they generate while the actor trains (0: colocated, on the FSDP ranks' GPUs)."""
    enforce_eager: bool = False
    """Disable CUDA graphs."""
    free_cache_engine: bool = True
    """CUDA: the draft engine (and its colocated guidance engine) sleeps between generations, KV cache freed and weights offloaded to CPU (vLLM sleep mode, level 1); no effect on CPU."""
    sleep_level: int = 1
    """vLLM sleep level of `free_cache_engine` (1 only: level 2 discards the weights, which then come back garbled after a sync)."""
    enable_prefix_caching: bool = True
    """Share KV cache across requests with a common prefix (off by design on the draft with speculative guidance or multi-turn, whose sessions keep each sequence's KV cache themselves; on the guidance with speculative guidance)."""
    enable_chunked_prefill: bool = True
    """vLLM's enable_chunked_prefill for both engines: a prefill longer than max_num_batched_tokens is split over engine steps (vLLM 0.32's default for these models); False turns it off, which vLLM warns decoder models do not officially support."""
    max_num_batched_tokens: int = 8192
    """Token budget of one engine step."""
    max_num_seqs: int = 1024
    """Most sequences an engine runs at once (speculative guidance generates in waves of this)."""
    kv_block_size: int | None = None
    """KV-cache block size (None: engine default; CPU needs a multiple of 32)."""
    disable_tqdm: bool = True
    """False: vLLM's progress bar on the draft engine's whole-response generate calls (no guidance, validation, mix mode's draft share, λ = 0 prefill scoring); speculative rounds and the guidance engine show none."""
    val_override_config: dict[str, Any] = field(default_factory=dict)
    """Sampling fields that differ during validation: n, temperature (VAL_OVERRIDE_FIELDS; e.g. {temperature: 0, n: 1})."""
    offpolicy_guidance: OffPolicyGuidanceConfig = field(default_factory=OffPolicyGuidanceConfig)
    """The guidance engine and its mixing rule."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn, tool-using episodes (draft-only, or guided token by token in speculative mode)."""
    prompt_length: int = -1
    """auto: data.max_prompt_length."""
    response_length: int = -1
    """auto: data.max_response_length."""

    def validate(self, prefix: str) -> None:
        """Fail fast on bad values."""
        check_choice(f"{prefix}.name", self.name, ["vllm"])
        check_choice(f"{prefix}.dtype", self.dtype, VLLM_DTYPES, DTYPE_ALIASES)
        check_range(f"{prefix}.n", self.n, 1)
        check_range(f"{prefix}.temperature", self.temperature, 0.0, low_open=True)
        check_range(f"{prefix}.top_p", self.top_p, 0.0, 1.0, low_open=True)
        if self.top_k != -1 and self.top_k < 1:
            fail(f"{prefix}.top_k", self.top_k, "expected -1 (off) or a value >= 1")
        check_range(
            f"{prefix}.gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True
        )
        if self.tensor_parallel_size != 1:
            fail(f"{prefix}.tensor_parallel_size", self.tensor_parallel_size,
                 "expected 1: vLLM runs a wider draft engine through its multiprocess/Ray executor, where the weight sync "
                 "and the rewindable sessions cannot reach its model runner (more engines: worker.rollout.num_replicas)")  # fmt: skip
        if self.sleep_level != 1:
            fail(f"{prefix}.sleep_level", self.sleep_level,
                 "expected 1: level 2 discards the weights, and rollouts after a weight sync come back garbled "
                 "(vLLM #29341, verl #7904); level 1 offloads them to CPU")  # fmt: skip
        check_range(
            f"{prefix}.weight_sync_bucket_mb", self.weight_sync_bucket_mb, 0.0, low_open=True
        )
        if self.num_replicas is not None:
            check_range(f"{prefix}.num_replicas", self.num_replicas, 1)
        check_range(f"{prefix}.n_gpus_per_node", self.n_gpus_per_node, 0)
        check_range(f"{prefix}.max_num_seqs", self.max_num_seqs, 1)
        check_range(f"{prefix}.max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.kv_block_size is not None and (self.kv_block_size < 1 or self.kv_block_size % 16):
            fail(
                f"{prefix}.kv_block_size",
                self.kv_block_size,
                "expected a positive multiple of 16 (32 on CPU)",
            )
        check_sampling_fields(f"{prefix}.val_override_config", self.val_override_config,
                              VAL_OVERRIDE_FIELDS, greedy=True)  # fmt: skip
        self.offpolicy_guidance.validate(f"{prefix}.offpolicy_guidance", self.n)
        self.multi_turn.validate(f"{prefix}.multi_turn")
        guidance = self.offpolicy_guidance
        if self.multi_turn.enable and guidance.enable and guidance.mode != "speculative":
            fail(f"{prefix}.offpolicy_guidance.mode", guidance.mode,
                 "multi-turn rollouts are guided token by token only: expected speculative (mix would need "
                 f"the guidance to run whole tool-using episodes), or {prefix}.multi_turn.enable=false")  # fmt: skip
        if self.multi_turn.enable and guidance.enable and guidance.keep_topk:
            fail(f"{prefix}.offpolicy_guidance.keep_topk", True,
                 "multi-turn rollouts do not keep the guidance's top-K rows (the top-K forward KL is "
                 f"single-turn only); expected false, or {prefix}.multi_turn.enable=false")  # fmt: skip
        if self.multi_turn.enable and guidance.enable and guidance.guide_when != "always":
            fail(f"{prefix}.offpolicy_guidance.guide_when", guidance.guide_when,
                 f"multi-turn rollouts are guided in one stage for now: expected always, or {prefix}.multi_turn.enable=false")  # fmt: skip
        if self.multi_turn.enable and guidance.enable and guidance.prefix_fraction > 0:
            fail(f"{prefix}.offpolicy_guidance.prefix_fraction", guidance.prefix_fraction,
                 f"multi-turn rollouts take no teacher prefix for now: expected 0, or {prefix}.multi_turn.enable=false")  # fmt: skip
        shared = self.offpolicy_guidance.num_replicas
        if self.num_replicas is not None and shared is not None and shared > self.num_replicas:
            fail(f"{prefix}.offpolicy_guidance.num_replicas", shared,
                 f"expected at most worker.rollout.num_replicas = {self.num_replicas} (each serves draft replicas)")  # fmt: skip
