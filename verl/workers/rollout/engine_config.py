"""The rollout's vLLM engines as arguments, from the config: the draft's and the guidance's
`vllm.LLM` keyword arguments (`engine_args`), their memory shares (`engine_memory_args`), whether
they sleep between generations (`sleeps`), and the check that both share one tokenizer
(`check_same_tokenizer`, before any engine starts). Building them is `vllm_engine.build_llm`'s.
"""

from __future__ import annotations

import os

import torch

from verl.workers.rollout.config import RolloutConfig
from verl.workers.rollout.vllm_engine import ENGINE_KEY

_KEY = "worker.rollout"


def check_same_tokenizer(draft_path: str, guidance_path: str) -> None:
    """Refuse a guidance model whose tokenizer differs from the draft's (before any engine starts)."""
    from transformers import AutoTokenizer

    for path in (draft_path, guidance_path):
        if not path or not os.path.isdir(path):
            raise FileNotFoundError(
                f"model path {path!r} is not a local folder with a model and tokenizer"
            )
    a, b = AutoTokenizer.from_pretrained(draft_path), AutoTokenizer.from_pretrained(guidance_path)
    specials = ("eos_token_id", "pad_token_id", "bos_token_id")
    if a.get_vocab() != b.get_vocab() or any(getattr(a, s) != getattr(b, s) for s in specials):
        raise ValueError(
            f"draft tokenizer ({draft_path}) and guidance tokenizer ({guidance_path}) differ; "
            "speculative guidance needs the same vocabulary and special tokens"
        )


def engine_memory_args(memory_share: float, key: str, vocab_rows: int | None = None) -> dict:
    """An engine's memory share (`gpu_memory_utilization`) and its `ENGINE_KEY` entry: the config
    key the share comes from and the ids it may give probability (`vocab_rows`, None: all).
    `vllm_engine.build_llm` turns the share into an explicit KV budget in the process that builds
    the engine (CPU: that share of system memory; CUDA: share x device memory - weights - reserve)."""
    return {"gpu_memory_utilization": memory_share,
            ENGINE_KEY: {"memory_key": key, "vocab_rows": vocab_rows}}  # fmt: skip


def guidance_engine_args(
    config: RolloutConfig, num_logprobs: int, common: dict, vocab_rows: int | None = None
) -> dict:
    """`vllm.LLM` arguments of the guidance engine: its own model, dtype, width, memory share and
    `enforce_eager` (the rollout's when unset), plus the arguments both engines share; with
    `vocab_rows`, the ids past the draft's embedding rows get probability 0 in it."""
    guidance = config.offpolicy_guidance
    eager = config.enforce_eager if guidance.enforce_eager is None else guidance.enforce_eager
    return dict(model=guidance.model_path, dtype=guidance.dtype, tensor_parallel_size=guidance.tensor_parallel_size,
                enforce_eager=eager, max_logprobs=num_logprobs,
                # scoring rows are processed in the engine (the session patch), samples by vLLM's sampler
                logprobs_mode="processed_logprobs",
                **engine_memory_args(guidance.gpu_memory_utilization, f"{_KEY}.offpolicy_guidance.gpu_memory_utilization",
                                     vocab_rows), **common)  # fmt: skip


def sleeps(config: RolloutConfig) -> bool:
    """The engines sleep between generations: `free_cache_engine` on a CUDA machine."""
    return config.free_cache_engine and torch.cuda.is_available()


def engine_args(model_path: str, config: RolloutConfig) -> tuple[dict, dict | None, int]:
    """`vllm.LLM` arguments of the draft engine and of the guidance engine (None without
    guidance), and the number of log-probs a guidance row lists (K, capped by the vocabulary).

    Both engines run vLLM's V1 runner without async scheduling (`vllm_engine.build_llm`). With
    guidance, the ids past either model's embedding rows get probability 0 in the engine that has
    them (e.g. a 152,064-row guidance for a 151,936-row draft): neither engine ever samples,
    scores or lists an id the other cannot embed."""
    from transformers import AutoConfig

    guidance = config.offpolicy_guidance
    draft_rows = AutoConfig.from_pretrained(model_path).get_text_config().vocab_size
    guide_rows = draft_rows
    if guidance.enable:
        guide_rows = AutoConfig.from_pretrained(guidance.model_path).get_text_config().vocab_size
    vocab = min(draft_rows, guide_rows)  # the ids both engines embed
    max_len = config.prompt_length + config.response_length + 1  # scoring needs one output slot
    # speculative guidance runs rewindable sessions (patches/vllm_session_rewind.py), which keep
    # each sequence's KV cache themselves and must not share blocks through the prefix cache
    speculative = guidance.enable and guidance.mode == "speculative"
    common = dict(max_model_len=max_len, enable_prefix_caching=config.enable_prefix_caching and not speculative,
                  seed=config.seed, max_num_batched_tokens=max(config.max_num_batched_tokens, max_len),
                  max_num_seqs=config.max_num_seqs, async_scheduling=False,
                  enable_chunked_prefill=config.enable_chunked_prefill)  # fmt: skip
    if config.kv_block_size is not None:
        common["block_size"] = config.kv_block_size
    if sleeps(config):
        common["enable_sleep_mode"] = True
    num_logprobs = min(guidance.logprobs, vocab) if guidance.enable else 1
    draft = dict(model=model_path, dtype=config.dtype, tensor_parallel_size=config.tensor_parallel_size,
                 enforce_eager=config.enforce_eager, max_logprobs=max(num_logprobs, 1),
                 logprobs_mode="processed_logprobs", **common,
                 **engine_memory_args(config.gpu_memory_utilization, f"{_KEY}.gpu_memory_utilization",
                                      vocab if draft_rows > vocab else None))  # fmt: skip
    if config.multi_turn.enable:  # draft-only episodes keep a session from turn to turn too
        draft["enable_prefix_caching"] = False
    teacher = None
    if guidance.enable:
        teacher = guidance_engine_args(
            config, num_logprobs, common, vocab if guide_rows > vocab else None
        )
    return draft, teacher, num_logprobs
