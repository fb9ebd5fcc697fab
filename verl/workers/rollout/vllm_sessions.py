"""Rewindable requests ("sessions") on one in-process vLLM engine, read as tensors.

Speculative guidance runs one session per sequence on each engine: every round a session is
resumed with its whole new token sequence and keeps the KV cache of the prefix it already
computed (rejected proposals are taken back), so a round costs about k + 1 new tokens per
sequence instead of the whole prefix. The rewind is `verl_patches.vllm_session_rewind`
(`patches/`); this module drives the engine core directly and reads log-probs as the engine's
own arrays, skipping vLLM's per-position Python conversion.

With `vllm_engine.py`, the only module that imports the session patch or touches vLLM's private
internals; the patch's request options reach other modules as functions (`scoring_params`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from verl_patches import vllm_session_rewind

from verl.utils.vision import ImagePrompt


@dataclass
class ChunkOutput:
    """What one session chunk produced."""

    token_ids: list[int] = field(default_factory=list)
    """Sampled tokens of the chunk."""
    logprob_ids: list[np.ndarray] = field(default_factory=list)
    """Per engine step that sampled for the chunk, (n, K+1) token ids: one row per sampled token,
    column 0 the token, then the top-K (`listed` joins them)."""
    logprobs: list[np.ndarray] = field(default_factory=list)
    """Log-probs matching `logprob_ids`, block for block."""
    prompt_logprobs: object | None = None
    """vLLM `LogprobsTensors` of the chunk's prompt: row t scores token t+1 (rows of the kept
    prefix are unset)."""
    finished: bool = False
    """The chunk stopped (its `max_tokens`, or a stop token)."""

    def listed(self) -> tuple[np.ndarray, np.ndarray]:
        """(len(token_ids), K+1) token ids and log-probs of the sampled tokens, in order."""
        return np.concatenate(self.logprob_ids), np.concatenate(self.logprobs)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(K+1,) token ids and log-probs of sampled token i."""
        if len(self.logprob_ids) == len(self.token_ids):  # one token per step (no spec decode)
            return self.logprob_ids[i][0], self.logprobs[i][0]
        ids, values = self.listed()
        return ids[i], values[i]


class SessionEngine:
    """Sessions on an in-process `vllm.LLM` built with `enable_prefix_caching=False`, whose live
    model runner and scheduler run the session patch (`vllm_session_rewind.check_engine`: the V1
    runner, async scheduling off).

    `run` adds one chunk per session (a new session starts from its tokens; an open one is
    rewound to them) and steps the engine until every chunk stopped; `add` and `step` do the
    same one engine step at a time, so chunks can join while others run. `close` frees sessions.
    `tokens_computed` counts every token the engine ran (prompt and decode).
    """

    def __init__(self, llm) -> None:
        vllm_session_rewind.apply()
        vllm_session_rewind.check_engine(llm)  # the live runner and scheduler run the patch
        self._engine = llm.llm_engine
        self._client = self._engine.engine_core
        core = self._client.engine_core
        if core.scheduler.cache_config.enable_prefix_caching:
            raise ValueError("SessionEngine needs an engine built with enable_prefix_caching=False")
        self._tasks = self._engine.get_supported_tasks()
        self._open: dict[str, object] = {}  # session id -> its first chunk's processed params
        self._running: dict[str, ChunkOutput] = {}  # session id -> its running chunk's output
        self._params: dict[tuple[str, int], object] = {}  # (session, max_tokens) -> params
        self._prompts: dict[str, list[int]] = {}  # session id -> its first chunk as run
        self._expected: dict[str, ImagePrompt] = {}  # sessions to open with images (`expect`)
        self._scheduler = core.scheduler
        self._idle = 0  # engine steps in a row without output
        self.tokens_computed = 0
        schedule = core.scheduler.schedule

        def counting_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            self.tokens_computed += out.total_num_scheduled_tokens
            return out

        core.scheduler.schedule = counting_schedule

    def capacity(self, max_tokens_per_session: int) -> int:
        """How many sessions of up to `max_tokens_per_session` tokens the KV cache holds at once."""
        scheduler = self._client.engine_core.scheduler
        cache = scheduler.cache_config
        per_session = -(-max_tokens_per_session // cache.block_size)
        # one block is vLLM's null block; a paused session also holds a request slot
        capacity = min((cache.num_gpu_blocks - 1) // per_session, scheduler.max_num_active_reqs)
        if capacity < 1:
            raise ValueError(
                f"the KV cache ({cache.num_gpu_blocks} blocks of {cache.block_size}) cannot hold one "
                f"sequence of {max_tokens_per_session} tokens; raise the engine's memory share"
            )
        return capacity

    def run(
        self,
        chunks: list[tuple[str, list[int], int, int | None]],
        new_params: Callable[[str, int], object],
    ) -> dict[str, ChunkOutput]:
        """Run one chunk per session and wait for all of them (`add`, then `step` until done).

        chunks: (session id, whole token sequence, max_tokens, recompute_from or None). A new
        session gets `new_params(session id, max_tokens)` (vLLM's SamplingParams); an open one
        keeps its first chunk's parameters with the new `max_tokens`.
        """
        return self._wait(self.add(chunks, new_params), [sid for sid, *_ in chunks])

    def _wait(self, outs: list[ChunkOutput], sids: list[str]) -> dict[str, ChunkOutput]:
        """Step the engine until the chunks `outs` of sessions `sids` stopped (other sessions'
        chunks advance in the same steps and fill in place)."""
        while not all(o.finished for o in outs):
            self.step()
        return dict(zip(sids, outs, strict=True))

    def lookup(self, requests: list[tuple[str, list[int], np.ndarray]]) -> np.ndarray:
        """Per open session (session id, tokens, ids (M,)): the log-probs of `ids` as the session's
        next token after `tokens`, under its own sampling settings (temperature, top-k, top-p:
        what vLLM's sampler reports as processed log-probs), stacked (R, M) float64.

        The session is rewound to `tokens` plus one placeholder token and recomputes its last
        token, whose row is then a prompt row read at `ids` (`vllm_session_rewind.GATHER_KEY`):
        O(M) out per row, whatever the vocabulary. The chunk samples one token after the
        placeholder, which is ignored; the next chunk rewinds past both. After a one-token prefix
        nothing would be kept (a rewind keeps at least one token): a one-chunk session of its own,
        closed after, scores that row instead.
        """
        if not requests:
            return np.zeros((0, 0))
        outs, scratch = [], []
        for sid, tokens, ids in requests:
            out, opened = self._lookup_chunk(sid, tokens, ids)
            outs.append(out)
            scratch += opened
        self._wait(outs, [sid for sid, *_ in requests])
        self.close(scratch)
        rows = [
            o.prompt_logprobs.logprobs[len(t) - 1, 1:].numpy()
            for o, (_, t, _) in zip(outs, requests, strict=True)
        ]
        return np.stack(rows).astype(np.float64)

    def _lookup_chunk(self, sid: str, tokens: list[int], ids) -> tuple[ChunkOutput, list[str]]:
        """Queue the chunk of `lookup` that scores `ids` after `tokens` in session `sid`: its
        output, and the scratch session it opened (after a one-token prefix) to close later."""
        rewind = len(tokens) > 1
        params = (
            self._rewind_params(sid, 1, len(tokens) - 1) if rewind else copy.copy(self._open[sid])
        )
        params.max_tokens, params.prompt_logprobs = 1, len(ids)
        params.extra_args = {**(params.extra_args or {}), vllm_session_rewind.PROCESS_KEY: True,
                             vllm_session_rewind.GATHER_KEY: [int(i) for i in ids]}  # fmt: skip
        chunk = [*tokens, int(ids[0])]
        if rewind:
            return self._add_one(sid, chunk, params)[0], []
        scratch = f"{sid}/lookup"
        return self.add([(scratch, chunk, 1, None)], lambda *_: params)[0], [scratch]

    def add(
        self,
        chunks: list[tuple[str, list[int], int, int | None]],
        new_params: Callable[[str, int], object],
    ) -> list[ChunkOutput]:
        """Queue one chunk per session (as in `run`); they join the engine's next step. Returns
        their outputs, which fill in place as the engine steps. A new session `expect`ed with
        images opens on its prompt's expanded tokens, like every later chunk."""
        from vllm.inputs import TokensPrompt

        for sid, tokens, max_tokens, recompute_from in chunks:
            if sid in self._running:
                raise RuntimeError(f"session {sid} already has a chunk running")
            if sid not in self._open:  # a new session: vLLM validates and completes the parameters
                opening = self._expected.pop(sid, None)
                # a copy: vLLM extends the request's token list in place as the session goes on
                prompt = TokensPrompt(prompt_token_ids=list(tokens) if opening is None else opening.engine_tokens(tokens))  # fmt: skip
                if opening is not None:
                    prompt["multi_modal_data"] = opening.data
                request = self._engine.input_processor.process_inputs(
                    sid, prompt, new_params(sid, max_tokens), supported_tasks=self._tasks, resumable=True,
                )  # fmt: skip
                if opening is not None and list(request.prompt_token_ids) != list(tokens):
                    raise ValueError(f"session {sid}: vLLM expanded the prompt's images to {len(request.prompt_token_ids)} tokens, the model's processor to {len(tokens)}; both must run one image processor with one pixel budget (data.min_pixels / data.max_pixels)")  # fmt: skip
                self._prompts[sid] = list(request.prompt_token_ids)
                self._open[sid] = request.sampling_params
                self._client.add_request(request)
                self._running[sid] = ChunkOutput()
            else:  # a rewind: the first chunk's settings with the new tokens and limits
                self._add_one(sid, tokens, self._rewind_params(sid, max_tokens, recompute_from))
        return [self._running[sid] for sid, *_ in chunks]

    def expect(self, openings: dict[str, ImagePrompt]) -> None:
        """Sessions to open with images (`ImagePrompt` by session id): each one's first chunk then
        gives the expanded prompt (and what follows), which the engine opens as one image pad
        per image plus the images, and checks that it expands them the same way. Kept until the
        session opens or `close`; a session already open (an episode's next turn) is left as it is."""
        self._expected.update({sid: im for sid, im in openings.items() if sid not in self._open})

    def _add_one(self, sid: str, tokens: list[int], params) -> list[ChunkOutput]:
        """Resume open session `sid` with `tokens` under `params` (a rewind); returns [its output]."""
        if sid in self._running:
            raise RuntimeError(f"session {sid} already has a chunk running")
        vllm_session_rewind.resume(self._scheduler, sid, tokens, params)
        self._running[sid] = ChunkOutput()
        return [self._running[sid]]

    def _rewind_params(self, sid: str, max_tokens: int, recompute_from: int | None):
        """The session's first sampling parameters with `max_tokens`, marked as a rewind. Without
        `recompute_from` they are kept per session and limit (the draft's rounds reuse a few)."""
        key = (sid, max_tokens)
        if recompute_from is None and key in self._params:
            return self._params[key]
        params = copy.copy(self._open[sid])  # shallow: only top-level fields change below
        params.max_tokens = max_tokens
        extra = {vllm_session_rewind.REPLACE_KEY: True}
        if recompute_from is not None:
            extra[vllm_session_rewind.RECOMPUTE_FROM_KEY] = int(recompute_from)
        params.extra_args = {**(params.extra_args or {}), **extra}
        if recompute_from is None:
            self._params[key] = params
        return params

    @property
    def busy(self) -> bool:
        """Some chunk is still running."""
        return bool(self._running)

    def step(self) -> dict[str, ChunkOutput]:
        """One engine step; returns the chunks that finished in it, by session id."""
        outputs = self._client.get_output().outputs
        self._idle = 0 if outputs else self._idle + 1
        if self._idle > 100:
            raise RuntimeError(
                f"vLLM made no progress on {len(self._running)} sessions (e.g. {min(self._running)}): "
                "more sessions than its KV cache holds? (see SessionEngine.capacity)"
            )
        finished = {}
        for out in outputs:
            result = self._running.get(out.request_id)
            if result is None:
                continue
            result.token_ids += out.new_token_ids
            if out.new_logprobs is not None:
                result.logprob_ids.append(out.new_logprobs.logprob_token_ids)
                result.logprobs.append(out.new_logprobs.logprobs)
            if out.new_prompt_logprobs_tensors is not None:
                result.prompt_logprobs = out.new_prompt_logprobs_tensors
            if out.finish_reason is not None:
                result.finished = True
                finished[out.request_id] = self._running.pop(out.request_id)
        return finished

    def prompt_ids(self, sid: str) -> list[int]:
        """Session `sid`'s first chunk as the engine runs it: its tokens, with each image pad
        expanded to one per merged patch for a session opened with images."""
        return self._prompts[sid]

    @property
    def session_ids(self) -> list[str]:
        """The open sessions."""
        return list(self._open)

    def close(self, session_ids=None) -> None:
        """Free sessions (all open ones by default) and their KV cache."""
        if session_ids is None:
            self._expected.clear()
        else:
            for sid in session_ids:
                self._expected.pop(sid, None)
        ids = sorted(self._open if session_ids is None else set(session_ids) & set(self._open))
        if ids:
            self._client.abort_requests(ids)
            for sid in ids:
                del self._open[sid]
                self._running.pop(sid, None)
                self._prompts.pop(sid, None)
            closed = set(ids)
            self._params = {key: p for key, p in self._params.items() if key[0] not in closed}


def scoring_params(max_tokens: int, num_logprobs: int, processing: dict, rows_from: int = 0):
    """SamplingParams of a scoring chunk: the prompt log-probs and the sampled tokens' log-probs,
    `num_logprobs` ids each, with every prompt row processed in the engine by `processing`
    (temperature, top_k, top_p) exactly as vLLM's sampler processes a sampled row (the session
    patch's `PROCESS_KEY`); the sampled rows are processed by the sampler itself when the engine
    reports processed log-probs. A new session's prompt rows before `rows_from` are not computed
    (`ROWS_FROM_KEY`: left unset, never to be read)."""
    from vllm.sampling_params import SamplingParams

    extra = {vllm_session_rewind.PROCESS_KEY: True}
    if rows_from:
        extra[vllm_session_rewind.ROWS_FROM_KEY] = int(rows_from)
    return SamplingParams(max_tokens=max_tokens, prompt_logprobs=num_logprobs, logprobs=num_logprobs,
                          detokenize=False, skip_clone=True, extra_args=extra, **processing)  # fmt: skip


def sampled_log_probs(completion) -> tuple[list[int], list[float]]:
    """Token ids of a vLLM completion and the log-prob reported for each (the sampled token is
    always listed; flat or per-position dict logprobs)."""
    tokens, logprobs = list(completion.token_ids), completion.logprobs
    values = []
    for pos, token in enumerate(tokens):
        if hasattr(logprobs, "start_indices"):  # FlatLogprobs: a constant number of Python objects
            start, end = logprobs.start_indices[pos], logprobs.end_indices[pos]
            ids, lps = logprobs.token_ids[start:end], logprobs.logprobs[start:end]
        else:
            ids, lps = list(logprobs[pos].keys()), [e.logprob for e in logprobs[pos].values()]
        values.append(lps[ids.index(token)])
    return tokens, values
