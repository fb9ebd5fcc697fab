"""vLLM rollout: the draft engine, and with guidance a second engine driving speculative mixing.

Both engines report processed log-probs (`logprobs_mode=processed_logprobs`); the guidance scores
the proposals with `prompt_logprobs`, which the session patch processes inside the engine with
the guidance's sampling settings exactly as vLLM's sampler does (`detokenize=False` throughout:
we work on token ids). Where a rejected position needs the draft's p at guidance tokens its own
top-K does not list, the draft engine looks them up (`SessionEngine.lookup`). In speculative mode every sequence has a rewindable session on each engine
(`vllm_sessions.py`): a round computes only the new tokens, not the whole prefix. The guidance
engine runs in its own process (`guidance_server.py`) and scores one group of sequences while
the draft steps the others' proposals (`speculative.overlapped_generate`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from verl_patches import vllm_session_rewind

from verl.protocol import DataProto
from verl.trainer.core_algos.guidance import (
    LAM_GATES,
    LOG_PROB_FLOOR,
    guidance_tensors,
)
from verl.workers.rollout.config import OffPolicyGuidanceConfig, RolloutConfig
from verl.workers.rollout.guidance_server import GuidanceChannel, GuidanceClient, GuidanceProcess
from verl.workers.rollout.speculative import (
    GuidedSequence,
    ListedRows,
    RoundStats,
    SpeculativeBatch,
    overlapped_generate,
)
from verl.workers.rollout.vllm_engine import ENGINE_KEY, build_llm, device_lock
from verl.workers.rollout.vllm_logging import drop_harmless_vllm_records
from verl.workers.rollout.vllm_sessions import SessionEngine, sampled_log_probs

WAKE_ORDER = ("weights", "kv_cache")
"""Sleep-mode memory in the order it wakes: a KV cache never wakes before its weights."""
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


@dataclass
class _Engines:
    draft: object
    guidance: GuidanceChannel | None


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
    draft_rows = AutoConfig.from_pretrained(model_path).vocab_size
    guide_rows = draft_rows
    if guidance.enable:
        guide_rows = AutoConfig.from_pretrained(guidance.model_path).vocab_size
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
    teacher = None
    if guidance.enable:
        teacher = guidance_engine_args(
            config, num_logprobs, common, vocab if guide_rows > vocab else None
        )
    return draft, teacher, num_logprobs


class VLLMRollout:
    """Draft engine (+ a connection to the guidance engine) producing EasyR1-layout batches.

    `own_guidance`: start the guidance engine as a child process here (used on its own); else
    the guidance is a service reached after `connect_guidance` (the trainer's `RolloutGroup`)."""

    def __init__(
        self,
        model_path: str,
        config: RolloutConfig,
        eos_token_id: int,
        pad_token_id: int,
        own_guidance: bool = True,
    ) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        drop_harmless_vllm_records()
        guidance = config.offpolicy_guidance
        if guidance.enable:
            check_same_tokenizer(model_path, guidance.model_path)
        self.config, self.eos_token_id, self.pad_token_id = config, eos_token_id, pad_token_id
        self.speculative = guidance.enable and guidance.mode == "speculative"
        draft_args, guidance_args, self.num_logprobs = engine_args(model_path, config)
        engine = None
        if guidance_args is not None and own_guidance:  # its process imports vLLM meanwhile
            engine = GuidanceProcess(env=split_cpu_threads())
        elif guidance_args is not None:
            split_cpu_threads()  # this engine's share of the cores (the service has the rest)
        try:  # one engine after the other: neither sizes memory while the other allocates
            draft, self.draft_facts = build_llm(draft_args)
            self.guidance_facts = None
            if engine is not None:
                engine.start(guidance_args)
                self.guidance_facts = engine.wait_ready()
        except BaseException:
            if engine is not None:
                engine.shutdown()
            raise
        self.engines = _Engines(draft, engine)
        self.draft_sessions = SessionEngine(draft) if self.speculative else None
        self._call = 0
        self.sleep_mode = sleeps(config)
        self._awake = {"weights", "kv_cache"}  # the draft engine's memory that is resident

    def sleep(self) -> None:
        """`free_cache_engine` on CUDA: free the KV cache and offload the weights to CPU, here and
        in the guidance engine (which sleeps once every replica it serves sleeps)."""
        if not self.sleep_mode or not self._awake:
            return
        with device_lock():  # one sleep or wake at a time on this GPU (the guidance's included)
            self.engines.draft.sleep(level=self.config.sleep_level)
        self._awake = set()
        if self.engines.guidance is not None:  # after the draft's, under its own lock
            self.engines.guidance.call("sleep")

    def wake_up(self, tags: tuple[str, ...] = WAKE_ORDER) -> None:
        """Make the draft engine's `tags` memory resident again (weights before a weight sync,
        everything before generating), one tag at a time in `WAKE_ORDER` (a KV cache wakes its
        weights first) under the GPU's lock; the guidance wakes after the draft's KV cache."""
        unknown = set(tags) - set(WAKE_ORDER)
        if unknown:
            raise ValueError(
                f"unknown sleep-mode tags {sorted(unknown)}; valid: {', '.join(WAKE_ORDER)}"
            )
        wanted = {"weights", *tags} if "kv_cache" in tags else set(tags)
        missing = [t for t in WAKE_ORDER if t in wanted and t not in self._awake]
        for tag in missing:
            with device_lock():
                self.engines.draft.wake_up(tags=[tag])
            self._awake.add(tag)
        if "kv_cache" in missing and self.engines.guidance is not None:
            self.engines.guidance.call("wake_up")

    def _check_awake(self) -> None:
        """Refuse to generate unless the draft engine is fully awake, by this object's record and
        by the engine's own state (after waking only the weights, vLLM #44395: an illegal memory
        access on CUDA)."""
        asleep = [t for t in WAKE_ORDER if t not in self._awake]
        if not asleep and self.sleep_mode and self.engines.draft.llm_engine.is_sleeping():
            asleep = ["(the engine reports it is sleeping)"]
        if asleep:
            raise RuntimeError(
                f"the draft engine is not awake to generate: {', '.join(asleep)} still asleep; "
                "wake_up() every tag (weights, then kv_cache) before generate_sequences"
            )

    def connect_guidance(self, address: tuple, authkey: bytes, name: str) -> None:
        """Use the `GuidanceService` at `address` from now on (a restarted one included)."""
        if self.engines.guidance is not None:
            self.engines.guidance.shutdown()
        self.engines.guidance = GuidanceClient(address, authkey, name)

    def shutdown(self) -> None:
        """Stop the guidance engine's process, or close the connection to the service (the draft
        engine goes with this object)."""
        if self.engines.guidance is not None:
            self.engines.guidance.shutdown()

    # ------------------------------------------------------------------ weights
    def sync_weights(
        self, weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> None:
        """Load new actor weights into the draft engine (in-process path of DESIGN.md §6), from a
        state dict or a stream of (name, tensor) pairs consumed once, in order."""
        self.wake_up(("weights",))
        runner = vllm_session_rewind.live_runner(self.engines.draft)
        runner.reload_weights(
            weights_iterator=iter(weights.items() if isinstance(weights, dict) else weights)
        )
        self.engines.draft.reset_prefix_cache()

    # ------------------------------------------------------------------ sampling settings
    def _draft_params(self, max_tokens: int, logprobs: int, seed: int, **overrides):
        from vllm import SamplingParams

        return SamplingParams(**self._sampling_kwargs(max_tokens, logprobs, seed, **overrides))

    def _sampling_kwargs(self, max_tokens: int, logprobs: int, seed: int, **overrides) -> dict:
        """SamplingParams fields of a rollout request (the guidance process builds its own)."""
        cfg = self.config
        kwargs = dict(temperature=self._temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_tokens=max_tokens,
                      logprobs=logprobs, seed=seed, detokenize=False, ignore_eos=self._ignore_eos, flat_logprobs=True,
                      stop_token_ids=[] if self._ignore_eos else [self.eos_token_id], skip_clone=True)  # fmt: skip
        kwargs.update(overrides)
        return kwargs

    def _guidance_processing(self) -> dict:
        cfg, over = self.config, self.config.offpolicy_guidance.sampling_overrides
        base = {"temperature": self._temperature, "top_k": cfg.top_k, "top_p": cfg.top_p}
        return {k: over.get(k, v) for k, v in base.items()}

    # ------------------------------------------------------------------ engine calls for the pure loop
    def _submit_score(
        self, ids: list[int], prefixes: list[list[int]], proposals: torch.Tensor, num: torch.Tensor
    ) -> None:
        """Ask the guidance process for its log-prob tables at the proposal positions (no wait).

        Row t of vLLM's prompt log-probs scores token t+1, so the proposals of a prefix of length
        L are rows L-1 .. L+n-2; the session recomputes from position L-1 on (`recompute_from`).
        """
        chunks = [(f"g{self._call}-{i}", prefix + proposals[row, : num[row]].tolist(), 1, len(prefix) - 1)
                  for row, (i, prefix) in enumerate(zip(ids, prefixes, strict=True))]  # fmt: skip
        rows = [(len(prefix) - 1, int(n)) for prefix, n in zip(prefixes, num, strict=True)]
        self.engines.guidance.submit(
            "score", chunks, rows, self.num_logprobs, self._guidance_processing()
        )
        self._counters.submitted += sum(len(tokens) for _, tokens, *_ in chunks)
        self._in_flight += 1

    def _collect_score(self) -> tuple[ListedRows, ListedRows]:
        """The guidance's listed log-probs of the oldest round submitted, one row per proposal,
        and one row per sequence one position past its last proposal (for a bonus token), both
        processed like the draft's."""
        self._in_flight -= 1
        (ids, values), (next_ids, next_values), computed = self.engines.guidance.result()
        self._counters.computed += computed
        tables = ListedRows(ids, values)
        self._counters.tail_mass.append(tables.tail_mass())  # after processing: 1 - Q_S
        return tables, ListedRows(next_ids, next_values)

    # ------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample `n` responses per prompt; with guidance, speculative or mix mode. EasyR1 layout out."""
        self.wake_up()
        self._check_awake()
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
        step_seed = int(meta.get("seed", self.config.seed)) + 7919 * int(meta.get("global_step", 0))
        seeds = sequence_seeds(step_seed, int(meta.get("first_row", 0)), len(prompt_ids), n)
        self._counters = _Counters()
        guided = np.zeros(len(repeated), dtype=bool)  # the responses sampled with λ > 0
        if not guidance.enable or not meta.get(
            "guidance", True
        ):  # e.g. validation: the draft alone
            seqs, stats, lam = self._draft_only(repeated, seeds[:, 0]), None, 0.0
        else:
            # the step's λ as the trainer scheduled it (`ray_trainer.step_guidance`); a caller
            # outside the trainer (a test, a benchmark) that sends none gets the configured `lam`
            lam = float(meta.get("lam", guidance.lam))
            subset = n if guidance.guided_samples is None else guidance.guided_samples
            if guidance.mode == "mix":
                seqs, stats = self._mix(repeated, n, seeds[:, 0]), None
            elif (lam == 0.0 or subset == 0) and guidance.teacher_scoring == "prefill":
                seqs, stats = self._teacher_only_prefill(repeated, seeds[:, 0]), None  # scores only
            else:  # the first `subset` responses of each prompt guided, the others λ_t = 0
                guided = (np.arange(len(repeated)) % n < subset) & (lam > 0.0)
                tau = float(meta.get("entropy_threshold", guidance.entropy_threshold))
                seqs, stats = self._speculative(repeated, lam, seeds, guided, self._gate(tau))
        out = self._to_dataproto(repeated, seqs, lam, guidance, guided)
        out.non_tensor_batch = {
            k: np.repeat(v, n, axis=0) for k, v in prompts.non_tensor_batch.items()
        }
        out.meta_info.update(self._counters.meta(stats, out, lam, seqs))
        return out

    def _gate(self, tau: float) -> Callable[[np.ndarray], np.ndarray] | None:
        """The per-position gate of λ (`lam_gate`) with threshold τ; None: λ_t = λ."""
        name = self.config.offpolicy_guidance.lam_gate
        if name == "none":
            return None
        gate = LAM_GATES.get(name)
        return lambda entropy: gate(entropy, tau)

    def _speculative(
        self,
        prompts: list[list[int]],
        lam: float,
        seeds: np.ndarray,
        guided: np.ndarray,
        gate: Callable[[np.ndarray], np.ndarray] | None,
    ):
        """Speculative guidance in waves of sequences whose sessions fit both KV caches at once
        (a session keeps its KV blocks from its first round to its last). A wave is split into
        `pipeline_groups` groups whose rounds interleave across the two engines. Sequences not
        `guided` (B,) sample the draft alone (λ_t = 0); `gate` maps draft entropies to λ_t / λ."""
        guidance = self.config.offpolicy_guidance
        longest = max(map(len, prompts)) + self._max_tokens + 1
        wave = min(
            self.draft_sessions.capacity(longest), self.engines.guidance.call("capacity", longest)
        )
        eos = None if self._ignore_eos else self.eos_token_id
        seqs, stats = [], RoundStats()
        for start in range(0, len(prompts), wave):
            self._call += 1  # session ids are unique per wave
            part, part_seeds = prompts[start : start + wave], seeds[start : start + wave]
            scale = guided[start : start + wave].astype(np.float64)
            gens = [torch.Generator().manual_seed(int(s)) for s in part_seeds[:, 1]]
            self._in_flight = 0  # scoring rounds submitted and not yet collected
            groups = np.array_split(np.arange(len(part)), min(guidance.pipeline_groups, len(part)))
            batches = [SpeculativeBatch([part[i] for i in g], lam, guidance.num_speculative_tokens, self._max_tokens, eos,
                                        [gens[i] for i in g], ids=g.tolist(), bonus=guidance.bonus_token,
                                        lam_scale=scale[g].tolist(), gate=gate) for g in groups]  # fmt: skip
            draft = _DraftRounds(self.draft_sessions, f"d{self._call}-",
                                 lambda i, m, s=part_seeds[:, 0]: self._draft_params(m, self.num_logprobs, int(s[i])))  # fmt: skip
            scorer = _Scorer(self._submit_score, self.engines.guidance.ready, self._collect_score)
            stagger = -(-guidance.num_speculative_tokens // len(batches))  # spread over one round
            try:
                overlapped_generate(batches, draft, scorer, stagger)
            except BaseException:
                self._abandon_wave()
                raise
            self.draft_sessions.close()
            self.engines.guidance.call("close")
            self._counters.lookups += draft.lookups
            for batch in batches:
                seqs.extend(batch.seqs)
                stats.add(batch.stats)
        return seqs, stats

    def _abandon_wave(self) -> None:
        """After an error: collect the guidance answers still in flight and free every session, so
        the engines stay usable (best effort: the error being raised is the one that matters)."""
        self.draft_sessions.close()
        try:
            while self._in_flight:
                self._in_flight -= 1
                self.engines.guidance.result()
            self.engines.guidance.call("close")
        except RuntimeError:
            pass

    def _teacher_only_prefill(self, prompts: list[list[int]], seeds) -> list[GuidedSequence]:
        """λ = 0 by prefill: the draft samples whole responses, then the guidance scores each in
        one prefill; on CPU each engine has every core while it works (the other idles)."""
        with self._cores_to("draft"):
            seqs = self._draft_only(prompts, seeds)
        with self._cores_to("guidance"):
            self._teacher_prefill(prompts, seqs)
        return seqs

    @contextmanager
    def _cores_to(self, engine: str):
        """CPU only: every core to `engine` ("draft" or "guidance") while the other idles, then
        the usual split back (`split_cpu_threads`)."""
        if torch.cuda.is_available():
            yield
            return
        cores = rollout_cores()
        if engine == "draft":
            torch._C.set_num_threads(cores)
        else:
            self.engines.guidance.call("threads", cores)
        try:
            yield
        finally:
            share = int(split_cpu_threads()["OMP_NUM_THREADS"])
            if engine == "guidance":
                self.engines.guidance.call("threads", share)

    def _teacher_prefill(self, prompts: list[list[int]], seqs: list[GuidedSequence]) -> None:
        """Score whole sampled sequences on the guidance engine, one prefill each (in waves its
        KV cache holds), and set their `guidance_log_probs` to its processed log q of every
        response token (column 0 of a prompt log-prob row is the scored token itself)."""
        longest = max(len(p) + len(s.tokens) for p, s in zip(prompts, seqs, strict=True)) + 1
        wave = self.engines.guidance.call("capacity", longest)
        for start in range(0, len(seqs), wave):
            self._call += 1
            part = range(start, min(start + wave, len(seqs)))
            chunks = [(f"t{self._call}-{i}", prompts[i] + seqs[i].tokens, 1, None) for i in part]
            rows = [(len(prompts[i]) - 1, len(seqs[i].tokens)) for i in part]
            (ids, values), _, computed = self.engines.guidance.call(
                "score", chunks, rows, self.num_logprobs, self._guidance_processing()
            )
            self.engines.guidance.call("close")
            self._counters.computed += computed
            processed = ListedRows(ids, values)  # processed in the engine
            self._counters.tail_mass.append(processed.tail_mass())
            ends = np.cumsum([count for _, count in rows])[:-1]
            for i, values_i in zip(
                part, np.split(processed.log_probs[:, 0].astype(np.float64), ends), strict=True
            ):
                seqs[i].guidance_log_probs = values_i.tolist()
            if self.config.offpolicy_guidance.keep_topk:  # the rows, for a top-K forward KL
                ids_k, values_k = processed.topk()
                for i, a, b in zip(
                    part, np.split(ids_k, ends), np.split(values_k, ends), strict=True
                ):
                    seqs[i].guidance_topk = (a, b)

    def _draft_only(self, prompts: list[list[int]], seeds) -> list[GuidedSequence]:
        """Whole responses from the draft engine, one seed per prompt."""
        params = [self._draft_params(self._max_tokens, 1, int(s)) for s in seeds]
        outputs = self.engines.draft.generate(
            [{"prompt_token_ids": p} for p in prompts],
            params,
            use_tqdm=not self.config.disable_tqdm,
        )
        return [_whole_response(*sampled_log_probs(out.outputs[0]), False) for out in outputs]

    def _mix(self, prompts: list[list[int]], n: int, seeds: np.ndarray):
        """The first `mix_num_samples` of each prompt's n samples from the guidance (its process
        samples them while the draft engine samples the rest here), the others from the draft."""
        k = self.config.offpolicy_guidance.mix_num_samples
        rows = {g: [i for i in range(len(prompts)) if (i % n < k) == g] for g in (True, False)}
        seqs: list = [None] * len(prompts)
        if rows[True]:
            params = [self._sampling_kwargs(self._max_tokens, 1, int(seeds[i]), **self._guidance_processing())
                      for i in rows[True]]  # fmt: skip
            self.engines.guidance.submit("generate", [prompts[i] for i in rows[True]], params)
        if rows[False]:
            draft = self._draft_only([prompts[i] for i in rows[False]], seeds[rows[False]])
            for i, seq in zip(rows[False], draft, strict=True):
                seqs[i] = seq
        if rows[True]:
            for i, (tokens, lps) in zip(rows[True], self.engines.guidance.result(), strict=True):
                seqs[i] = _whole_response(tokens, lps, True)
        return seqs

    def _to_dataproto(
        self, prompts, seqs, lam: float, guidance: OffPolicyGuidanceConfig, guided: np.ndarray
    ) -> DataProto:
        p_len, r_len = self.config.prompt_length, self.config.response_length
        b = len(seqs)
        prompt_t = torch.full((b, p_len), self.pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros(b, p_len, dtype=torch.long)
        resp = torch.full((b, r_len), self.pad_token_id, dtype=torch.long)
        resp_mask = torch.zeros(b, r_len, dtype=torch.long)
        draft_lp = torch.zeros(b, r_len)
        guide_lp = torch.zeros(b, r_len)  # -inf: q = 0 after processing; NaN: not reported
        target_lp = torch.zeros(b, r_len)  # log q̃ of the sampled target (speculative rounds)
        lam_t = torch.full((b, r_len), lam, dtype=torch.float64)  # λ_t (speculative rounds)
        entropy = torch.full((b, r_len), float("nan"))  # the draft's H_t (speculative rounds)
        off = torch.zeros(b, r_len, dtype=torch.bool)
        for i, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
            prompt_t[i, p_len - len(p) :] = torch.tensor(p)
            prompt_mask[i, p_len - len(p) :] = 1
            n = len(s.tokens)
            resp[i, :n] = torch.tensor(s.tokens)
            resp_mask[i, :n] = 1
            draft_lp[i, :n] = torch.tensor(s.draft_log_probs).clamp(min=LOG_PROB_FLOOR)
            guide_lp[i, :n] = torch.tensor(s.guidance_log_probs)
            target_lp[i, :n] = torch.tensor(
                s.target_log_probs if s.target_log_probs else s.guidance_log_probs
            )
            off[i, :n] = torch.tensor(s.offpolicy)
            if s.lam:
                lam_t[i, :n] = torch.tensor(s.lam, dtype=torch.float64)
                entropy[i, :n] = torch.tensor(s.draft_entropy)
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
        if guidance.enable and guidance.keep_topk:
            tensors.update(_topk_tensors(seqs, r_len, self.num_logprobs))
        if guidance.enable:
            per_token = any(s.lam for s in seqs) and (lam_t != lam).any()  # a gate or a subset
            tensors.update(guidance_tensors(draft_lp, guide_lp, off, resp_mask, lam_t if per_token else lam,
                                            guidance.mode, guidance.behavior, target_lp))  # fmt: skip
            tensors.update(guidance_lam=(lam_t * resp_mask).float(), draft_entropy=entropy,
                           guided_responses=torch.from_numpy(guided))  # fmt: skip
        return DataProto.from_dict(tensors)


@dataclass
class _Scorer:
    """The guidance process as `speculative.AsyncScorer`."""

    submit: Callable
    ready: Callable[[], bool]
    collect: Callable[[], tuple[ListedRows, ListedRows]]


@dataclass
class _Round:
    budget: list[int]
    outs: list  # the sessions' chunk outputs, filled in place as the engine steps
    returned: bool = False  # its proposals were handed out (its lookahead may still run)


class _DraftRounds:
    """The draft engine's sessions as `speculative.DraftStepper`: rounds of several batches
    share engine steps; a round is returned once all its sequences finished proposing, and its
    lookahead tokens (a chunk's one token past the budget) are drafted in the steps after."""

    def __init__(self, sessions: SessionEngine, prefix: str, new_params: Callable) -> None:
        self.sessions, self.prefix, self.new_params = sessions, prefix, new_params
        self.rounds: dict[int, _Round] = {}
        self.lookups = 0  # draft rows looked up (`probe`)

    def start(
        self,
        key: int,
        ids: list[int],
        prefixes: list[list[int]],
        budget: list[int],
        lookahead: list[bool],
    ) -> None:
        sids = [f"{self.prefix}{i}" for i in ids]
        index = dict(zip(sids, ids, strict=True))
        chunks = [(sid, prefix, b + extra, None)
                  for sid, prefix, b, extra in zip(sids, prefixes, budget, lookahead, strict=True)]  # fmt: skip
        outs = self.sessions.add(chunks, lambda sid, m: self.new_params(index[sid], m))
        self.rounds[key] = _Round(list(budget), outs)

    @property
    def busy(self) -> bool:
        """A chunk is running, or a round finished proposing and was not returned yet (it may have
        finished in the engine steps of a `probe`, when no chunk is left to step)."""
        return self.sessions.busy or any(
            not r.returned and self._proposed(r) for r in self.rounds.values()
        )

    @staticmethod
    def _proposed(r: _Round) -> bool:
        return all(
            o.finished or len(o.token_ids) >= b for o, b in zip(r.outs, r.budget, strict=True)
        )

    def step(self) -> list[tuple[int, torch.Tensor, torch.Tensor, ListedRows]]:
        if self.sessions.busy:
            self.sessions.step()
        done = []
        for key, r in self.rounds.items():
            if not r.returned and self._proposed(r):
                r.returned = True
                done.append((key, *draft_tables(r.outs, r.budget)))
        return done

    def drafting(self, key: int) -> bool:
        return not all(o.finished for o in self.rounds[key].outs)

    def probe(self, ids: list[int], prefixes: list[list[int]], tokens: np.ndarray) -> np.ndarray:
        """The draft's processed log p of `tokens` (R, M) after each prefix, from its engine."""
        sids = [f"{self.prefix}{i}" for i in ids]
        self.lookups += len(sids)
        return self.sessions.lookup(list(zip(sids, prefixes, tokens, strict=True)))

    def lookahead(self, key: int) -> tuple[np.ndarray, ListedRows] | None:
        r = self.rounds.pop(key)
        has = np.array([len(o.token_ids) > b for o, b in zip(r.outs, r.budget, strict=True)])
        if not has.any():
            return None
        extra = [o.row(b) for o, b, h in zip(r.outs, r.budget, has, strict=True) if h]
        return has, ListedRows(np.stack([i for i, _ in extra]), np.stack([v for _, v in extra]))


def draft_tables(outs: list, budget: list[int]) -> tuple[torch.Tensor, torch.Tensor, ListedRows]:
    """Proposals (B, k) with -1 padding, their number (B,) and the draft's listed log-probs, one
    row per proposal (sampled token, then the top-K, processed), from the sessions' chunks (the
    first budget[b] tokens of each: a chunk may run on to draft a lookahead token)."""
    have = np.array([len(o.token_ids) for o in outs])  # sampled tokens: one listed row each
    ids = np.concatenate([block for o in outs for block in o.logprob_ids])
    values = np.concatenate([block for o in outs for block in o.logprobs])
    start = np.cumsum(have) - have  # each chunk's first row
    num = np.minimum(have, budget)
    seq = np.repeat(np.arange(len(outs)), num)
    at = np.arange(len(seq)) - np.repeat(np.cumsum(num) - num, num)  # position within the chunk
    rows = ListedRows(ids[start[seq] + at], values[start[seq] + at])
    proposals = np.full((len(outs), max(budget)), -1, dtype=np.int64)
    proposals[seq, at] = rows.ids[:, 0]
    return torch.from_numpy(proposals), torch.from_numpy(num), rows


def sequence_seeds(step_seed: int, first_row: int, rows: int, n: int) -> np.ndarray:
    """(rows * n, 2) seeds of each sequence, row-major by prompt: its sampling seed for the
    engine and its speculative acceptance draws. A function of the step's seed and the prompt's
    row in the whole batch alone (`first_row` + r), so a sequence gets the same seeds whichever
    replica, wave or group generates it."""
    if rows == 0:
        return np.zeros((0, 2), dtype=np.int64)
    return np.concatenate(
        [
            np.random.default_rng([step_seed, first_row + r]).integers(0, 2**31, (n, 2))
            for r in range(rows)
        ]
    )


def rollout_cores() -> int:
    """CPU cores this replica's engines may use: its share when several replicas share the
    machine (`VERL_ROLLOUT_CORES`, set by `RolloutWorker`), else every core it may run on."""
    return int(os.environ.get("VERL_ROLLOUT_CORES", 0)) or len(os.sched_getaffinity(0))


def split_cpu_threads() -> dict[str, str]:
    """CPU only: give the draft (this process) and the guidance process half the cores each, so
    the two engines never oversubscribe the machine while they overlap. Returns the guidance
    process's environment additions (its OMP_NUM_THREADS); nothing on a GPU machine."""
    if torch.cuda.is_available():
        return {}
    cores = rollout_cores()
    guidance = max(1, cores // 2)
    # torch._C's setter: vLLM replaces torch.set_num_threads by a no-op once an engine started here
    torch._C.set_num_threads(max(1, cores - guidance))
    return {"OMP_NUM_THREADS": str(guidance)}


def _whole_response(
    tokens: list[int], log_probs: list[float], from_guidance: bool
) -> GuidedSequence:
    """A response sampled whole by one engine. The other engine never scored it: a draft
    response's q is not reported (NaN, `guidance_missing_mask`); a guidance response's p is not
    either, and its own log-probs stand in for `rollout_log_probs` (mix mode's behavior is the
    emitting engine's, so neither enters μ; see README_guidance.md)."""
    unscored = [float("nan")] * len(tokens)
    return GuidedSequence(tokens, [from_guidance] * len(tokens), log_probs,
                          log_probs if from_guidance else unscored, True)  # fmt: skip


def _topk_tensors(seqs: list[GuidedSequence], width: int, k: int) -> dict[str, torch.Tensor]:
    """`guidance_topk_ids` (B, T, K) and `guidance_topk_log_probs` (B, T, K) from the rows the
    sequences kept; padding and sequences without rows read id 0 and the floor."""
    ids = torch.zeros(len(seqs), width, k, dtype=torch.long)
    values = torch.full((len(seqs), width, k), LOG_PROB_FLOOR)
    for i, seq in enumerate(seqs):
        if seq.guidance_topk is not None:
            n = len(seq.guidance_topk[0])
            ids[i, :n] = torch.from_numpy(seq.guidance_topk[0])
            values[i, :n] = torch.from_numpy(seq.guidance_topk[1]).float().clamp(min=LOG_PROB_FLOOR)
    return {"guidance_topk_ids": ids, "guidance_topk_log_probs": values}


def _unpad_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    return [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask, strict=True)]


@dataclass
class _Counters:
    """Guidance work of one `generate_sequences` call, reported in meta_info."""

    computed: int = 0
    submitted: int = 0
    tail_mass: list[np.ndarray] = field(default_factory=list)
    lookups: int = 0  # draft rows looked up at guidance tokens its top-K did not list

    def meta(self, stats: RoundStats | None, out: DataProto, lam: float, seqs: list) -> dict:
        emitted = int(out.batch["response_mask"].sum())
        meta = {"lam": lam, "emitted_tokens": emitted, "guidance_tokens_computed": self.computed,
                "guidance_tokens_submitted": self.submitted, "draft_lookups": self.lookups}  # fmt: skip
        if stats is not None:  # speculative rounds ran: TV(target, q_λ) per emitted token
            tv = [t for s in seqs for t in s.target_tv]
            meta["target_tv"] = float(np.mean(tv)) if tv else 0.0
            meta.update(accept_rate=stats.accept_rate, rounds=stats.rounds, proposed_tokens=stats.proposed,
                        accepted_tokens=stats.accepted, bonus_tokens=stats.bonus,
                        guidance_tokens_per_emitted=self.computed / max(emitted, 1))  # fmt: skip
        if self.tail_mass:
            rows = np.concatenate(self.tail_mass)
            meta.update(topk_tail_mass=float(rows.mean()), topk_rows=len(rows))
        return meta
