"""vLLM rollout: the draft engine, and with guidance a second engine driving speculative mixing.

The draft engine samples (and reports) processed log-probs (`logprobs_mode=processed_logprobs`);
the guidance engine scores the proposals with `prompt_logprobs`, which vLLM returns raw, so q is
processed here with the guidance's sampling settings (`detokenize=False` throughout: we work on
token ids). Scoring reads the prefix cache; see `_score` for when an entry is valid.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from verl.protocol import DataProto
from verl.trainer.core_algos.guidance import compute_behavior_log_probs, lam_at_step
from verl.workers.rollout.config import OffPolicyGuidanceConfig, RolloutConfig
from verl.workers.rollout.speculative import (
    GuidedSequence,
    RoundStats,
    process_log_probs,
    speculative_generate,
)

LOG_PROB_FLOOR = -1e4  # stands for log 0 in tensors handed to the trainer (never -inf)


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


def engine_memory_args(memory_share: float) -> dict:
    """GPU: `gpu_memory_utilization`. CPU: an explicit KV-cache size (the share of system memory),
    because vLLM's CPU worker otherwise charges the whole process (both engines) to each one."""
    if torch.cuda.is_available():
        return {"gpu_memory_utilization": memory_share}
    import psutil

    return {"kv_cache_memory_bytes": int(memory_share * psutil.virtual_memory().total)}


def _entries(logprobs, pos: int) -> tuple[list[int], list[float]]:
    """Token ids and log-probs listed at position `pos` of vLLM's logprobs (flat or per-position dicts)."""
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs: a constant number of Python objects
        start, end = logprobs.start_indices[pos], logprobs.end_indices[pos]
        return logprobs.token_ids[start:end], logprobs.logprobs[start:end]
    entries = logprobs[pos]
    return list(entries.keys()), [e.logprob for e in entries.values()]


def _logprob_of(logprobs, pos: int, token: int) -> float:
    """The log-prob vLLM reported for `token` at position `pos` (the sampled token is always listed)."""
    ids, values = _entries(logprobs, pos)
    return values[ids.index(token)]


def _dense(logprobs, pos: int, vocab: int) -> torch.Tensor:
    """The listed log-probs at `pos` as a dense (V,) row, -inf where a token is not listed."""
    ids, values = _entries(logprobs, pos)
    row = torch.full((vocab,), float("-inf"), dtype=torch.float64)
    ids_t = torch.tensor(ids, dtype=torch.long)
    if ids_t.numel() and (ids_t.min() < 0 or ids_t.max() >= vocab):
        raise RuntimeError(
            f"engine returned log-probs for token ids outside [0, {vocab}): {ids_t.min()}..{ids_t.max()}"
        )
    row[ids_t] = torch.tensor(values, dtype=torch.float64)
    return row


@dataclass
class _Engines:
    draft: object
    guidance: object | None
    vocab: int


class VLLMRollout:
    """Draft engine (+ guidance engine) producing EasyR1-layout DataProto batches."""

    def __init__(
        self, model_path: str, config: RolloutConfig, eos_token_id: int, pad_token_id: int
    ) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        guidance = config.offpolicy_guidance
        if guidance.enable:
            check_same_tokenizer(model_path, guidance.model_path)
        from transformers import AutoConfig
        from vllm import LLM

        self.config, self.eos_token_id, self.pad_token_id = config, eos_token_id, pad_token_id
        vocab = AutoConfig.from_pretrained(model_path).vocab_size
        if guidance.enable:
            vocab = max(vocab, AutoConfig.from_pretrained(guidance.model_path).vocab_size)
        max_len = (
            config.prompt_length + config.response_length + 1
        )  # scoring requests need one output slot
        common = dict(max_model_len=max_len, enable_prefix_caching=config.enable_prefix_caching, seed=config.seed,
                      max_num_batched_tokens=max(config.max_num_batched_tokens, max_len))  # fmt: skip
        if config.kv_block_size is not None:
            common["block_size"] = config.kv_block_size
        self.num_logprobs = min(guidance.logprobs, vocab) if guidance.enable else 1
        draft = LLM(model=model_path, dtype=config.dtype, tensor_parallel_size=config.tensor_parallel_size,
                    enforce_eager=config.enforce_eager, max_logprobs=max(self.num_logprobs, 1),
                    logprobs_mode="processed_logprobs", **engine_memory_args(config.gpu_memory_utilization), **common)  # fmt: skip
        engine = None
        if guidance.enable:
            engine = LLM(model=guidance.model_path, dtype=guidance.dtype, tensor_parallel_size=guidance.tensor_parallel_size,
                         enforce_eager=config.enforce_eager, max_logprobs=self.num_logprobs, logprobs_mode="raw_logprobs",
                         **engine_memory_args(guidance.gpu_memory_utilization), **common)  # fmt: skip
        self.engines = _Engines(draft, engine, vocab)

    # ------------------------------------------------------------------ weights
    def sync_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load new actor weights into the draft engine (in-process path of DESIGN.md §6)."""
        engine = self.engines.draft.llm_engine.engine_core.engine_core
        runner = engine.model_executor.driver_worker.worker.model_runner
        runner.reload_weights(weights_iterator=iter(state_dict.items()))
        self.engines.draft.reset_prefix_cache()

    # ------------------------------------------------------------------ sampling settings
    def _draft_params(self, max_tokens: int, logprobs: int, seed: int, **overrides):
        from vllm import SamplingParams

        cfg = self.config
        kwargs = dict(temperature=self._temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_tokens=max_tokens,
                      logprobs=logprobs, seed=seed, detokenize=False, ignore_eos=self._ignore_eos, flat_logprobs=True,
                      stop_token_ids=[] if self._ignore_eos else [self.eos_token_id])  # fmt: skip
        kwargs.update(overrides)
        return SamplingParams(**kwargs)

    def _guidance_processing(self) -> dict:
        cfg, over = self.config, self.config.offpolicy_guidance.sampling_overrides
        base = {"temperature": self._temperature, "top_k": cfg.top_k, "top_p": cfg.top_p}
        return {k: over.get(k, v) for k, v in base.items()}

    # ------------------------------------------------------------------ engine calls for the pure loop
    def _propose(self, prefixes: list[list[int]], budget: list[int], seeds: np.ndarray):
        params = [
            self._draft_params(b, self.num_logprobs, int(s))
            for b, s in zip(budget, seeds, strict=True)
        ]
        outputs = self.engines.draft.generate(
            [{"prompt_token_ids": p} for p in prefixes], params, use_tqdm=False
        )
        k = max(budget)
        proposals = torch.full((len(prefixes), k), -1, dtype=torch.long)
        tables = torch.full(
            (len(prefixes), k, self.engines.vocab), float("-inf"), dtype=torch.float64
        )
        num = torch.zeros(len(prefixes), dtype=torch.long)
        for b, out in enumerate(outputs):
            comp = out.outputs[0]
            num[b] = len(comp.token_ids)
            proposals[b, : num[b]] = torch.tensor(comp.token_ids)
            for j in range(len(comp.token_ids)):
                tables[b, j] = _dense(comp.logprobs, j, self.engines.vocab)
        return proposals, num, tables

    def _score(self, prefixes: list[list[int]], proposals: torch.Tensor, num: torch.Tensor):
        """Guidance log-prob tables at the proposal positions, reading the prefix cache safely.

        vLLM fills prompt log-prob row t only if position t-1 was computed in this request, so the
        first proposal (index len(prefix)) is valid only when the cache covers at most
        len(prefix) - 1 tokens. Requests whose cache reached further (a prefix ending exactly on
        a block boundary) are scored again without the cache.
        """
        from vllm import SamplingParams

        requests = [
            {"prompt_token_ids": p + proposals[b, : num[b]].tolist()}
            for b, p in enumerate(prefixes)
        ]
        cached = SamplingParams(max_tokens=1, prompt_logprobs=self.num_logprobs, detokenize=False,
                                skip_reading_prefix_cache=False, flat_logprobs=True)  # fmt: skip
        outputs = self.engines.guidance.generate(requests, cached, use_tqdm=False)
        redo = [
            b
            for b, out in enumerate(outputs)
            if (out.num_cached_tokens or 0) > len(prefixes[b]) - 1
        ]
        self._counters.submitted += sum(len(r["prompt_token_ids"]) for r in requests)
        self._counters.computed += sum(
            len(r["prompt_token_ids"]) - (o.num_cached_tokens or 0)
            for r, o in zip(requests, outputs, strict=True)
        )
        if redo:
            uncached = SamplingParams(
                max_tokens=1,
                prompt_logprobs=self.num_logprobs,
                detokenize=False,
                flat_logprobs=True,
            )
            again = self.engines.guidance.generate(
                [requests[b] for b in redo], uncached, use_tqdm=False
            )
            for b, out in zip(redo, again, strict=True):
                outputs[b] = out
                self._counters.computed += len(requests[b]["prompt_token_ids"])
            self._counters.rescored += len(redo)
        tables = torch.full(
            (len(prefixes), proposals.shape[1], self.engines.vocab),
            float("-inf"),
            dtype=torch.float64,
        )
        for b, out in enumerate(outputs):
            start = len(prefixes[b])
            for j in range(int(num[b])):
                tables[b, j] = _dense(out.prompt_logprobs, start + j, self.engines.vocab)
        valid = torch.arange(proposals.shape[1]) < num.unsqueeze(-1)
        self._counters.tail_mass.append((1.0 - tables.exp().sum(-1))[valid].clamp(min=0.0))
        processing = self._guidance_processing()
        if (
            processing["temperature"] == 1.0
            and processing["top_k"] in (-1, 0, None)
            and processing["top_p"] >= 1.0
        ):
            return tables  # raw = processed: exact for every listed token, even with top-K tables
        # with top-K tables the renormalisation over K tokens is approximate (tail mass reported)
        return process_log_probs(tables, **processing)

    # ------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample `n` responses per prompt; with guidance, speculative or mix mode. EasyR1 layout out."""
        guidance = self.config.offpolicy_guidance
        meta = prompts.meta_info
        n = meta.get("n", self.config.n)
        self._temperature = float(meta.get("temperature", self.config.temperature))
        self._ignore_eos = bool(meta.get("ignore_eos", False))
        self._max_tokens = min(
            int(meta.get("max_tokens", self.config.response_length)), self.config.response_length
        )
        prompt_ids = _unpad_prompts(prompts.batch["input_ids"], prompts.batch["attention_mask"])
        too_long = [len(p) for p in prompt_ids if len(p) > self.config.prompt_length]
        if too_long:
            raise ValueError(
                f"{len(too_long)} prompt(s) longer than worker.rollout.prompt_length={self.config.prompt_length} "
                f"(longest {max(too_long)} tokens); filter them in the dataset (data.filter_overlong_prompts)"
            )
        repeated = [ids for ids in prompt_ids for _ in range(n)]
        seed = int(meta.get("seed", self.config.seed)) + 7919 * int(meta.get("global_step", 0))
        rng = np.random.default_rng(seed)
        self._counters = _Counters()
        if not guidance.enable:
            seqs, stats, lam = self._draft_only(repeated, rng), None, 0.0
        else:
            lam = float(meta["lam"]) if "lam" in meta else lam_at_step(
                int(meta.get("global_step", 0)), int(meta.get("total_steps", 1) or 1),
                guidance.lam, guidance.lam_end, guidance.lam_schedule)  # fmt: skip
            if guidance.mode == "mix":
                seqs, stats = self._mix(repeated, n, rng), None
            else:
                gen = torch.Generator().manual_seed(seed)

                def propose(prefixes, budget):
                    return self._propose(prefixes, budget, rng.integers(0, 2**31, len(prefixes)))

                seqs, stats = speculative_generate(repeated, propose, self._score, lam, guidance.num_speculative_tokens,
                                                   self._max_tokens, None if self._ignore_eos else self.eos_token_id, gen)  # fmt: skip
        out = self._to_dataproto(repeated, seqs, lam, guidance)
        out.non_tensor_batch = {
            k: np.repeat(v, n, axis=0) for k, v in prompts.non_tensor_batch.items()
        }
        out.meta_info.update(self._counters.meta(stats, out, lam))
        return out

    def _draft_only(self, prompts: list[list[int]], rng: np.random.Generator):
        params = [
            self._draft_params(self._max_tokens, 1, int(s))
            for s in rng.integers(0, 2**31, len(prompts))
        ]
        outputs = self.engines.draft.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        seqs = []
        for out in outputs:
            comp = out.outputs[0]
            lps = [_logprob_of(comp.logprobs, j, t) for j, t in enumerate(comp.token_ids)]
            seqs.append(GuidedSequence(list(comp.token_ids), [False] * len(lps), lps, lps, True))
        return seqs

    def _mix(self, prompts: list[list[int]], n: int, rng: np.random.Generator):
        k = self.config.offpolicy_guidance.mix_num_samples
        from_guidance = [i % n < k for i in range(len(prompts))]
        seqs: list = [None] * len(prompts)
        for use_guidance, engine in ((False, self.engines.draft), (True, self.engines.guidance)):
            idx = [i for i, g in enumerate(from_guidance) if g == use_guidance]
            if not idx:
                continue
            processing = self._guidance_processing() if use_guidance else {}
            params = [self._draft_params(self._max_tokens, 1, int(s), **processing)
                      for s in rng.integers(0, 2**31, len(idx))]  # fmt: skip
            outputs = engine.generate(
                [{"prompt_token_ids": prompts[i]} for i in idx], params, use_tqdm=False
            )
            for i, out in zip(idx, outputs, strict=True):
                comp = out.outputs[0]
                lps = [_logprob_of(comp.logprobs, j, t) for j, t in enumerate(comp.token_ids)]
                seqs[i] = GuidedSequence(
                    list(comp.token_ids), [use_guidance] * len(lps), lps, lps, True
                )
        return seqs

    def _to_dataproto(
        self, prompts, seqs, lam: float, guidance: OffPolicyGuidanceConfig
    ) -> DataProto:
        p_len, r_len = self.config.prompt_length, self.config.response_length
        b = len(seqs)
        prompt_t = torch.full((b, p_len), self.pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros(b, p_len, dtype=torch.long)
        resp = torch.full((b, r_len), self.pad_token_id, dtype=torch.long)
        resp_mask = torch.zeros(b, r_len, dtype=torch.long)
        draft_lp = torch.zeros(b, r_len)
        guide_lp = torch.zeros(b, r_len)
        off = torch.zeros(b, r_len, dtype=torch.bool)
        for i, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
            prompt_t[i, p_len - len(p) :] = torch.tensor(p)
            prompt_mask[i, p_len - len(p) :] = 1
            n = len(s.tokens)
            resp[i, :n] = torch.tensor(s.tokens)
            resp_mask[i, :n] = 1
            draft_lp[i, :n] = torch.tensor(s.draft_log_probs).clamp(min=LOG_PROB_FLOOR)
            guide_lp[i, :n] = torch.tensor(s.guidance_log_probs).clamp(min=LOG_PROB_FLOOR)
            off[i, :n] = torch.tensor(s.offpolicy)
        attention = torch.cat([prompt_mask, resp_mask], dim=1)
        tensors = {
            "prompts": prompt_t,
            "responses": resp,
            "input_ids": torch.cat([prompt_t, resp], dim=1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0) * attention,
            "response_mask": resp_mask.float(),
            "rollout_log_probs": draft_lp * resp_mask,
        }
        if guidance.enable:
            missing = (guide_lp <= LOG_PROB_FLOOR) & resp_mask.bool() & ~off
            guide_filled = torch.where(missing, draft_lp, guide_lp) * resp_mask
            behavior = compute_behavior_log_probs(
                draft_lp, guide_filled, off, lam, guidance.mode, guidance.behavior
            )
            tensors.update(offpolicy_mask=off & resp_mask.bool(), guidance_log_probs=guide_filled,
                           guidance_missing_mask=missing, behavior_log_probs=behavior.clamp(min=LOG_PROB_FLOOR) * resp_mask)  # fmt: skip
        return DataProto.from_dict(tensors)


def _unpad_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    return [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask, strict=True)]


@dataclass
class _Counters:
    """Guidance work of one `generate_sequences` call, reported in meta_info."""

    computed: int = 0
    submitted: int = 0
    rescored: int = 0
    tail_mass: list[torch.Tensor] = field(default_factory=list)

    def meta(self, stats: RoundStats | None, out: DataProto, lam: float) -> dict:
        emitted = int(out.batch["response_mask"].sum())
        meta = {"lam": lam, "emitted_tokens": emitted, "guidance_tokens_computed": self.computed,
                "guidance_tokens_submitted": self.submitted, "guidance_rescored_requests": self.rescored}  # fmt: skip
        if stats is not None:
            meta.update(accept_rate=stats.accept_rate, rounds=stats.rounds,
                        guidance_tokens_per_emitted=self.computed / max(emitted, 1))  # fmt: skip
        if self.tail_mass:
            meta["topk_tail_mass"] = float(torch.cat(self.tail_mass).mean())
        return meta
