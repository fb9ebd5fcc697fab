"""The rollout's door to vLLM's engine: building engines the same way on every platform, checking
what was built, and the few operations on a live engine that reach past `vllm.LLM`'s public API.

With `vllm_sessions.py`, the only module that imports the session patch or touches vLLM's private
internals (engine core, model runner, sleep state); everything else calls `build_llm`,
`reload_weights`, `close_llm`, `shutdown_core`, `is_sleeping`, `vocab_size` and `RequestStream`
(requests added while the engine steps). tests/workers/rollout/test_vllm_door.py parses every
module and fails when another one reaches in (docs/design.md#the-vllm-door-and-the-patch).

vLLM 0.32 picks several things by platform that the rollout depends on: it builds
Model Runner V2 wherever Triton is usable (the session patch changes the V1 runner), turns async
scheduling on on CUDA (a rewound session could meet a stale queued step), and sizes a KV cache
on CUDA from the device's free memory while it profiles (two engines starting at once on one GPU
each count the other's allocations: vLLM issues #55827, #56830). `build_llm` makes each of these
explicit: the V1 runner pinned (`VLLM_USE_V2_MODEL_RUNNER=0`), `async_scheduling=False` (set by
`engine_args`), an explicit KV budget from the config (`kv_cache_bytes`), and then checks the
live engine (`vllm_session_rewind.check_engine`), failing at start-up in one line. Callers start
the engines of one GPU one after the other. `device_lock` serialises sleep/wake on one GPU across
processes (vLLM #36753).
"""

from __future__ import annotations

import fcntl
import gc
import json
import os
import tempfile
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from verl_patches import qwen_vl_images, vllm_session_rewind

from verl.utils.config_checks import fail
from verl.utils.vision import processor_class, vision_token_ids
from verl.workers.rollout.vllm_logging import quiet_partial_reload

ENGINE_KEY = "verl_engine"
"""A private entry of an engine's keyword arguments that `build_llm` takes out before vLLM sees
them: {"memory_key": the config key of its memory share, "vocab_rows": ids it may give
probability (None: all)}. It travels with the arguments to whichever process builds the engine."""

GiB = 2**30
ACTIVATION_RESERVE_BYTES = 1 * GiB
"""CUDA: memory an engine needs besides its weights, its KV cache and the sampler's rows: the
CUDA context's non-torch share, the forward's activations at `max_num_batched_tokens`, CUDA
graphs and the prompt log-prob chunks (`PROMPT_LOGPROB_CHUNK_BYTES`, 256 MiB). An estimate."""

SAMPLER_COPIES = 3
"""fp32 (max_num_seqs, vocabulary) tensors the sampler holds at once (logits, log-probs, the
processed copy): part of an engine's reserve besides its KV cache."""


def pin_v1_model_runner() -> None:
    """Make vLLM build its V1 model runner, which the session patch changes (vLLM 0.32 builds
    Model Runner V2 wherever Triton is usable). Refuses, in one line, an environment that asks
    for V2. Takes effect for engines built after it in this process (vLLM caches its environment
    once an engine started; `vllm_session_rewind.check_engine` checks what was built)."""
    value = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if value not in (None, "", "0"):
        raise RuntimeError(
            f"VLLM_USE_V2_MODEL_RUNNER={value!r} is not supported: the rollout's session patch "
            "changes vLLM's V1 model runner; unset it or set it to 0"
        )
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def eager_sampler_ranks() -> None:
    """For engines built with `enforce_eager`: vLLM's sampler counts each logprob token's rank with
    a torch.compile'd helper (`batched_count_greater_than`), compiled by inductor on an engine
    process's first log-probs (3 s on 2 CPU cores, every engine process). Replaced by the function
    it wraps, plain torch: the same integers, no compile, as `enforce_eager` promises. The sampler
    module is shared, so this holds for every engine of the process built afterwards."""
    from vllm.v1.sample import sampler

    compiled = sampler.batched_count_greater_than
    sampler.batched_count_greater_than = getattr(compiled, "__wrapped__", compiled)


def weight_bytes(model: str, dtype: str) -> int:
    """Bytes of a model's parameters in `dtype` ("auto": the checkpoint's), counted on the meta
    device from its config (nothing is loaded; tied weights count once)."""
    from transformers import AutoConfig

    from verl.utils.model_path import auto_model_class

    config = AutoConfig.from_pretrained(model)
    if dtype == "auto":
        dtype = str(getattr(config, "torch_dtype", None) or "float32").removeprefix("torch.")
    with torch.device("meta"):
        module = auto_model_class(config).from_config(config)
    count = sum(p.numel() for p in module.parameters())
    return count * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def architectures(model: str) -> list[str]:
    """The `architectures` of a local checkpoint's config.json ([] where it has none)."""
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return list(json.load(f).get("architectures") or [])


def reserve_bytes(vocab: int, max_num_seqs: int) -> int:
    """CUDA: an engine's memory besides weights and KV cache (`ACTIVATION_RESERVE_BYTES` plus the
    sampler's fp32 rows of a full batch)."""
    return ACTIVATION_RESERVE_BYTES + SAMPLER_COPIES * max_num_seqs * vocab * 4


def kv_cache_bytes(share: float, total: int, weights: int, reserve: int, key: str) -> int:
    """The KV budget of an engine allowed `share` of a device of `total` bytes: share x total
    minus its weights and its reserve. A share that leaves nothing is refused in one line
    naming `key` and the smallest share that works."""
    budget = int(share * total) - weights - reserve
    if budget <= 0:
        need = (weights + reserve) / total
        fail(key, share, f"{share} x {total / GiB:.1f} GiB leaves no KV cache after the weights "
                         f"({weights / GiB:.2f} GiB) and the reserve ({reserve / GiB:.2f} GiB); "
                         f"expected more than {need:.3f}")  # fmt: skip
    return budget


def memory_args(kwargs: dict, memory_key: str) -> dict:
    """vLLM's memory arguments for an engine whose `gpu_memory_utilization` is its share, in the
    process that builds it. An explicit `kv_cache_memory_bytes` is kept. CPU: that share of the
    system memory as the KV cache (vLLM's CPU worker otherwise charges the whole process, both
    engines, to each). CUDA: share x the device's memory minus the weights and the reserve
    (`kv_cache_bytes`), so an engine never sizes its cache from what another one left free, with
    `gpu_memory_utilization` kept (vLLM checks at start that this share is free)."""
    share = kwargs.get("gpu_memory_utilization")
    if kwargs.get("kv_cache_memory_bytes") is not None or share is None:
        return {}
    if not torch.cuda.is_available():
        import psutil

        return {"gpu_memory_utilization": None,
                "kv_cache_memory_bytes": int(share * psutil.virtual_memory().total)}  # fmt: skip
    from transformers import AutoConfig

    total = torch.cuda.mem_get_info()[1]
    weights = weight_bytes(kwargs["model"], kwargs.get("dtype", "auto"))
    vocab = AutoConfig.from_pretrained(kwargs["model"]).get_text_config().vocab_size
    reserve = reserve_bytes(vocab, kwargs.get("max_num_seqs") or 1024)
    budget = kv_cache_bytes(share, total, weights, reserve, memory_key)
    print(f"KV cache budget of {kwargs['model']}: {budget / GiB:.2f} GiB = {memory_key} {share} x "
          f"{total / GiB:.1f} GiB - weights {weights / GiB:.2f} GiB - reserve {reserve / GiB:.2f} GiB",
          flush=True)  # fmt: skip
    return {"kv_cache_memory_bytes": budget}


def build_llm(kwargs: dict):
    """A `vllm.LLM` from `kwargs` (its `ENGINE_KEY` entry taken out): the V1 runner pinned, an
    explicit KV budget (`memory_args`), the session patch applied and checked on the live engine
    (`vllm_session_rewind.check_engine`), and the ids past `vocab_rows` restricted to
    probability 0. Returns (llm, facts: runner class, KV budget in bytes, vocab rows)."""
    kwargs = dict(kwargs)
    extra = kwargs.pop(ENGINE_KEY, None) or {}
    kwargs.update(memory_args(kwargs, extra.get("memory_key", "gpu_memory_utilization")))
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    pin_v1_model_runner()
    with collector_paused():
        vllm_session_rewind.apply()
        if qwen_vl_images.ARCHITECTURE in architectures(kwargs["model"]):
            qwen_vl_images.apply(processor_class())  # images without torchvision (a no-op with it)
        if kwargs.get("enforce_eager"):
            eager_sampler_ranks()
        from vllm import LLM

        llm = LLM(**kwargs)
    _LIVE.add(llm)
    runner = vllm_session_rewind.check_engine(llm)
    rows = extra.get("vocab_rows")
    banned = vision_token_ids(kwargs["model"])  # a vision-language model never emits these
    if rows is not None or banned:
        vllm_session_rewind.restrict_vocab(llm, rows, banned)
    facts = {"runner": runner, "kv_cache_bytes": kwargs.get("kv_cache_memory_bytes"),
             "vocab_rows": rows}  # fmt: skip
    print(f"vLLM engine of {kwargs['model']} built: model runner class {runner}, KV cache "
          f"{facts['kv_cache_bytes']} bytes, vocab rows {rows or 'all'}", flush=True)  # fmt: skip
    return llm, facts


@contextmanager
def collector_paused() -> Iterator[None]:
    """Build an engine without Python's cyclic collector in the way. vLLM imports most of itself
    and builds the model here, and the collector's automatic passes, plus the explicit ones its
    loader makes, each walk the whole heap (torch, transformers: millions of objects), about 2 s
    of a tiny engine's 13 s build on one core. The heap as it stands is frozen first (the
    explicit passes then walk only what the build makes) and the automatic passes paused; vLLM
    freezes its own objects once the engine is up, as it does on every platform."""
    enabled = gc.isenabled()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_LIVE: weakref.WeakSet = weakref.WeakSet()
"""The in-process engines `build_llm` built and `close_llm` has not closed."""


def close_llm(llm) -> None:
    """Shut an in-process engine down so that its memory is returned: vLLM freezes what it
    allocates at start-up (`gc.freeze`), so dropping the last reference to the `vllm.LLM` leaves
    its weights and KV cache allocated for the life of the process (0.5 GB per tiny engine on CPU
    at a 0.02 share). The last engine of the process gets its engine core's whole shutdown, which
    also tears down vLLM's process-wide distributed state; while another one still runs here, only
    its worker is shut down and its objects unfrozen (that state is shared: destroying it breaks
    the other engine's next call). The caller then drops its references. Closing twice is a no-op."""
    _LIVE.discard(llm)
    client = llm.llm_engine.engine_core
    if not len(_LIVE):
        client.shutdown()
    elif client._finalizer.detach() is not None:  # (the finalizer would run the whole shutdown)
        client.engine_core.model_executor.shutdown()
    gc.unfreeze()
    gc.collect()


def shutdown_core(llm) -> None:
    """Shut an in-process engine's core down (its worker, and vLLM's process-wide distributed
    state), without `close_llm`'s collection passes: for a process that exits right after."""
    _LIVE.discard(llm)
    llm.llm_engine.engine_core.shutdown()


class RequestStream:
    """Requests on an in-process `vllm.LLM` that join while the engine runs (continuous batching
    under the caller's control): `add` queues requests as `generate` does (`LLM.enqueue`: the same
    prompt processing, only final outputs reported), `step` runs one engine step and returns the
    requests that finished in it. A `with` block aborts what is still running when it is left
    (after an error), so the engine's next `generate` meets no stray request."""

    def __init__(self, llm) -> None:
        self._llm = llm
        self._running: set[str] = set()

    def add(self, prompts: list[dict], params: list) -> list[str]:
        """Queue one request per prompt (`{"prompt_token_ids": ...}`) with its `SamplingParams`;
        they join the next step. Returns their request ids, in order."""
        internal = self._llm.enqueue(prompts, params, use_tqdm=False)
        # vLLM suffixes the ids it hands out; outputs carry the request's own (external) id
        states = self._llm.llm_engine.output_processor.request_states
        ids = [states[i].external_req_id for i in internal]
        self._running.update(ids)
        return ids

    @property
    def busy(self) -> bool:
        """Some request added here has not finished."""
        return bool(self._running)

    def step(self) -> list:
        """One engine step; the `RequestOutput`s of this stream's requests that finished in it."""
        engine = self._llm.llm_engine
        finished = [o for o in engine.step() if o.finished and o.request_id in self._running]
        for output in finished:
            self._running.discard(output.request_id)
        if self._running and not engine.has_unfinished_requests():
            raise RuntimeError(
                f"vLLM lost {len(self._running)} requests (e.g. {min(self._running)})"
            )
        return finished

    def interrupt(self) -> list:
        """Abort every request of this stream, between two steps, and return each one's output so
        far: a `RequestOutput` whose completion holds the tokens and sampled log-probs of the
        steps that ended (none for a request still waiting), with `finish_reason` "abort" (AReaL's
        interruptible generation: a weight sync need not wait for the requests to end). The
        offline engine reports final outputs only, so they are made from vLLM's output processor,
        which holds what each request sampled so far; a step still in flight on an asynchronous
        scheduler is dropped with the request (its tokens were never reported)."""
        from vllm.v1.engine import FinishReason

        processor = self._llm.llm_engine.output_processor
        running = sorted(self._running)
        outputs = [
            processor.request_states[internal].make_request_output(
                [], None, FinishReason.ABORT, None
            )
            for external in running
            for internal in processor.external_req_ids.get(external, [])
        ]
        self._llm.llm_engine.abort_request(running, internal=False)
        self._running.clear()
        return outputs

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc) -> None:
        if self._running:
            self._llm.llm_engine.abort_request(sorted(self._running), internal=False)
            self._running.clear()


def reload_weights(
    llm,
    weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    partial: bool = False,
) -> None:
    """Load new weights into an in-process engine's live model, in place: a state dict or a
    stream of (name, tensor) pairs consumed once, in order (vLLM's model runner `reload_weights`,
    tensor_parallel_size=1), then drop the prefix cache and the encoder cache (a vision-language
    model's image embeddings, kept per image: the next step would reuse those the old vision
    tower computed, and vLLM's scheduler and runner disagree about them after a reload) computed
    with the old weights. `partial`:
    some layers are not sent (a LoRA sync); vLLM keeps them and its lines saying so are dropped.
    A layer must be sent whole (verl/utils/lora.py, `sync_sources`)."""
    runner = vllm_session_rewind.live_runner(llm)
    with quiet_partial_reload() if partial else nullcontext():
        runner.reload_weights(
            weights_iterator=iter(weights.items() if isinstance(weights, dict) else weights)
        )
    llm.reset_prefix_cache()
    llm.llm_engine.reset_encoder_cache()


def is_sleeping(llm) -> bool:
    """Whether the engine itself reports sleep-mode memory still offloaded (vLLM's own state, not
    what the caller asked for: a wake-up call may return with a tag still asleep)."""
    return bool(llm.llm_engine.is_sleeping())


def vocab_size(llm) -> int:
    """The number of ids the engine's model scores (its embedding rows, padding included)."""
    return llm.llm_engine.model_config.get_vocab_size()


def device_key() -> str | None:
    """This process's GPU as the same name in every process that sees it (its UUID), or None
    without CUDA."""
    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


@contextmanager
def device_lock(key: str | None = None) -> Iterator[None]:
    """Hold this GPU's lock (an exclusive `flock` on a file named by `key`, default the device's
    UUID) for a sleep or wake-up: engines on one GPU never sleep or wake at the same time, in
    whichever processes they run (vLLM #36753). Nothing to hold without CUDA and no `key`."""
    key = key if key is not None else device_key()
    if key is None:
        yield
        return
    path = os.path.join(tempfile.gettempdir(), f"verl-gpu-{key}.lock")
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
