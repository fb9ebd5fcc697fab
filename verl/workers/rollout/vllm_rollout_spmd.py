"""vLLM rollout: the draft engine, and with guidance a second engine driving speculative mixing.

The draft engine samples (and reports) processed log-probs (`logprobs_mode=processed_logprobs`);
the guidance engine scores the proposals with `prompt_logprobs`, which vLLM returns raw, so q is
processed here with the guidance's sampling settings (`detokenize=False` throughout: we work on
token ids). In speculative mode every sequence has a rewindable session on each engine
(`vllm_sessions.py`): a round computes only the new tokens, not the whole prefix.
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
from verl.workers.rollout.vllm_sessions import SessionEngine, dense_rows

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


@dataclass
class _Engines:
    draft: object
    guidance: object | None
    vocab: int


@dataclass
class _Sessions:
    draft: SessionEngine
    guidance: SessionEngine


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
        # speculative guidance runs rewindable sessions (patches/vllm_session_rewind.py), which keep
        # each sequence's KV cache themselves and must not share blocks through the prefix cache
        self.speculative = guidance.enable and guidance.mode == "speculative"
        prefix_caching = config.enable_prefix_caching and not self.speculative
        common = dict(max_model_len=max_len, enable_prefix_caching=prefix_caching, seed=config.seed,
                      max_num_batched_tokens=max(config.max_num_batched_tokens, max_len), max_num_seqs=config.max_num_seqs)  # fmt: skip
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
        self.sessions = (
            _Sessions(SessionEngine(draft), SessionEngine(engine)) if self.speculative else None
        )
        self._call = 0

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
                      stop_token_ids=[] if self._ignore_eos else [self.eos_token_id], skip_clone=True)  # fmt: skip
        kwargs.update(overrides)
        return SamplingParams(**kwargs)

    def _guidance_processing(self) -> dict:
        cfg, over = self.config, self.config.offpolicy_guidance.sampling_overrides
        base = {"temperature": self._temperature, "top_k": cfg.top_k, "top_p": cfg.top_p}
        return {k: over.get(k, v) for k, v in base.items()}

    # ------------------------------------------------------------------ engine calls for the pure loop
    def _propose(self, ids: list[int], prefixes: list[list[int]], budget: list[int]):
        """Up to budget[b] draft tokens per sequence from its draft session, with dense p tables."""
        chunks = [(f"d{self._call}-{i}", prefix, b, None) for i, prefix, b in zip(ids, prefixes, budget, strict=True)]  # fmt: skip
        seed_of = dict(zip((c[0] for c in chunks), (int(self._seeds[i]) for i in ids), strict=True))
        results = self.sessions.draft.run(
            chunks, lambda sid, m: self._draft_params(m, self.num_logprobs, seed_of[sid])
        )
        outs = [results[sid] for sid, *_ in chunks]
        num = torch.tensor([len(o.token_ids) for o in outs], dtype=torch.long)
        rows = dense_rows(torch.from_numpy(np.concatenate([np.stack(o.logprob_ids) for o in outs])),
                          torch.from_numpy(np.concatenate([np.stack(o.logprobs) for o in outs])), self.engines.vocab)  # fmt: skip
        valid = torch.arange(max(budget)) < num.unsqueeze(-1)
        proposals = torch.full(valid.shape, -1, dtype=torch.long)
        proposals[valid] = torch.tensor([t for o in outs for t in o.token_ids], dtype=torch.long)
        tables = torch.full((*valid.shape, self.engines.vocab), float("-inf"), dtype=torch.float64)
        tables[valid] = rows
        return proposals, num, tables

    def _score(
        self, ids: list[int], prefixes: list[list[int]], proposals: torch.Tensor, num: torch.Tensor
    ):
        """Guidance log-prob tables (B, k, V) at the proposal positions, from the guidance sessions.

        Row t of vLLM's prompt log-probs scores token t+1, so the proposals of a prefix of length
        L are rows L-1 .. L+n-2; the session recomputes from position L-1 on (`recompute_from`).
        """
        from vllm import SamplingParams

        def new_params(sid: str, max_tokens: int):
            return SamplingParams(max_tokens=max_tokens, prompt_logprobs=self.num_logprobs,
                                  detokenize=False, skip_clone=True)  # fmt: skip

        chunks = [(f"g{self._call}-{i}", prefix + proposals[row, : num[row]].tolist(), 1, len(prefix) - 1)
                  for row, (i, prefix) in enumerate(zip(ids, prefixes, strict=True))]  # fmt: skip
        before = self.sessions.guidance.tokens_computed
        results = self.sessions.guidance.run(chunks, new_params)
        self._counters.computed += self.sessions.guidance.tokens_computed - before
        self._counters.submitted += sum(len(tokens) for _, tokens, *_ in chunks)
        picked = [(results[sid].prompt_logprobs, len(prefixes[row]) - 1, int(num[row]))
                  for row, (sid, *_) in enumerate(chunks)]  # fmt: skip
        rows = dense_rows(torch.cat([lp.logprob_token_ids[f : f + n] for lp, f, n in picked]),
                          torch.cat([lp.logprobs[f : f + n] for lp, f, n in picked]), self.engines.vocab)  # fmt: skip
        valid = torch.arange(proposals.shape[1]) < num.unsqueeze(-1)
        tables = torch.full((*valid.shape, self.engines.vocab), float("-inf"), dtype=torch.float64)
        tables[valid] = rows
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
        if not guidance.enable or not meta.get(
            "guidance", True
        ):  # e.g. validation: the draft alone
            seqs, stats, lam = self._draft_only(repeated, rng), None, 0.0
        else:
            lam = float(meta["lam"]) if "lam" in meta else lam_at_step(
                int(meta.get("global_step", 0)), int(meta.get("total_steps", 1) or 1),
                guidance.lam, guidance.lam_end, guidance.lam_schedule)  # fmt: skip
            if guidance.mode == "mix":
                seqs, stats = self._mix(repeated, n, rng), None
            else:
                seqs, stats = self._speculative(
                    repeated, lam, rng, torch.Generator().manual_seed(seed)
                )
        out = self._to_dataproto(repeated, seqs, lam, guidance)
        out.non_tensor_batch = {
            k: np.repeat(v, n, axis=0) for k, v in prompts.non_tensor_batch.items()
        }
        out.meta_info.update(self._counters.meta(stats, out, lam))
        return out

    def _speculative(self, prompts: list[list[int]], lam: float, rng: np.random.Generator, gen):
        """Speculative guidance in waves of sequences whose sessions fit both KV caches at once
        (a session keeps its KV blocks from its first round to its last)."""
        guidance = self.config.offpolicy_guidance
        longest = max(map(len, prompts)) + self._max_tokens + 1
        wave = min(self.sessions.draft.capacity(longest), self.sessions.guidance.capacity(longest))
        seqs, stats = [], RoundStats()
        for start in range(0, len(prompts), wave):
            self._call += 1  # session ids are unique per wave
            self._seeds = rng.integers(0, 2**31, min(wave, len(prompts) - start))
            try:
                part, part_stats = speculative_generate(prompts[start : start + wave], self._propose, self._score, lam,
                                                        guidance.num_speculative_tokens, self._max_tokens,
                                                        None if self._ignore_eos else self.eos_token_id, gen)  # fmt: skip
            finally:
                self.sessions.draft.close()
                self.sessions.guidance.close()
            seqs.extend(part)
            stats.add(part_stats)
        return seqs, stats

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
    tail_mass: list[torch.Tensor] = field(default_factory=list)

    def meta(self, stats: RoundStats | None, out: DataProto, lam: float) -> dict:
        emitted = int(out.batch["response_mask"].sum())
        meta = {"lam": lam, "emitted_tokens": emitted, "guidance_tokens_computed": self.computed,
                "guidance_tokens_submitted": self.submitted}  # fmt: skip
        if stats is not None:
            meta.update(accept_rate=stats.accept_rate, rounds=stats.rounds, proposed_tokens=stats.proposed,
                        guidance_tokens_per_emitted=self.computed / max(emitted, 1))  # fmt: skip
        if self.tail_mass:
            meta["topk_tail_mass"] = float(torch.cat(self.tail_mass).mean())
        return meta
