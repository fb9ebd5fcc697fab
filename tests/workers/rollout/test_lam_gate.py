"""Per-position λ_t (offpolicy_guidance.lam_gate, guided_samples): hand values and chi-square
tests that the emitted tokens follow (1-λ_t)·p + λ_t·q with λ_t = λ·scale·min(1, H(p_t)/τ)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from speculative_helpers import chi2_counts_pvalue
from test_speculative import P_CHAIN, Q_CHAIN, ListedChainScorer, ListedChainStepper, V

from verl.trainer.core_algos.guidance import (
    LAM_GATES,
    compute_gate_metrics,
    entropy_threshold,
    gate_entropy,
    mixture_log_probs,
    unguided_entropies,
)
from verl.utils import metric_names as M
from verl.workers.rollout.log_prob_tables import listed_entropy
from verl.workers.rollout.speculative import (
    ListedRows,
    SpeculativeBatch,
    draw_bonus,
    overlapped_generate,
    verify_listed,
)

D = torch.float64
LN = math.log


def test_listed_entropy_hand_values():
    # listed p = [0.5, 0.25], tail R = 0.25 as one atom:
    #   H = 0.5·ln 2 + 0.25·ln 4 + 0.25·ln 4 = 0.5·0.693147 + 2·0.25·1.386294 = 1.039721
    # (the entropy of [0.5, 0.25, 0.25]: exact when the tail is one token)
    got = listed_entropy(np.log([[0.5, 0.25]]))
    np.testing.assert_allclose(got, [0.5 * LN(2) + 0.5 * LN(4)], rtol=0, atol=1e-12)
    # a full row: no tail; a cut token (-inf) adds 0; one certain token: H = 0
    with np.errstate(divide="ignore"):
        full = np.log([[0.6, 0.3, 0.1], [1.0, 0.0, 0.0]])
    expected = -(0.6 * LN(0.6) + 0.3 * LN(0.3) + 0.1 * LN(0.1))  # 0.897946
    np.testing.assert_allclose(listed_entropy(full), [expected, 0.0], rtol=0, atol=1e-12)
    # ListedRows.entropy reads the top-K columns, never column 0 (the sampled token)
    rows = ListedRows(
        np.array([[7, 0, 1], [0, 0, 1]]), np.log([[0.05, 0.5, 0.25], [0.5, 0.5, 0.25]])
    )
    np.testing.assert_allclose(rows.entropy(), [0.5 * LN(2) + 0.5 * LN(4)] * 2, rtol=0, atol=1e-12)


def test_gates_hand_values_and_threshold():
    h = np.array([0.0, 0.75, 1.5, 3.0])
    # min(1, H/1.5) = [0, 0.5, 1, 1]
    np.testing.assert_array_equal(gate_entropy(h, 1.5), [0.0, 0.5, 1.0, 1.0])
    np.testing.assert_array_equal(LAM_GATES.get("none")(h, 1.5), [1.0] * 4)
    with pytest.raises(ValueError, match="threshold"):
        gate_entropy(h, 0.0)
    # P95 of 0, 1, ..., 100 is 95 (linear interpolation), above the floor 1.5
    assert entropy_threshold(np.arange(101.0), 1.5, 95) == pytest.approx(95.0)
    # P95 of 0.0, 0.1, ..., 1.0 is 0.95 < floor: the floor
    assert entropy_threshold(np.linspace(0, 1, 11), 1.5, 95) == 1.5
    assert entropy_threshold(np.arange(101.0), 1.5, None) == 1.5  # no percentile: τ fixed
    assert entropy_threshold(np.zeros(0), 2.0, 95) == 2.0  # nothing measured yet


def _full_rows(ids_col0: list[int], probs: list[list[float]]) -> ListedRows:
    """Rows listing every token of V = 3 (column 0 the given token)."""
    p = np.array(probs)
    ids = np.array([[t, 0, 1, 2] for t in ids_col0])
    return ListedRows(ids, np.log(np.concatenate([p[np.arange(len(p)), ids_col0][:, None], p], 1)))


def test_verify_listed_per_row_lambda_hand_values():
    # one sequence, proposals x1 = x2 = 0; p = [0.5, 0.3, 0.2], q = [0.2, 0.3, 0.5] at both
    # λ_t = [0.5, 1.0]: ratio_1 = 0.5 + 0.5·0.2/0.5 = 0.7 (u 0.6: accept),
    #                   ratio_2 = 0.0 + 1.0·0.2/0.5 = 0.4 (u 0.5: reject)
    # residual ∝ max(0, q - p) = [0, 0, 0.3]: token 2, from the guidance
    p, q = [[0.5, 0.3, 0.2]] * 2, [[0.2, 0.3, 0.5]] * 2
    draft, guide = _full_rows([0, 0], p), _full_rows([0, 0], q)
    u = torch.tensor([[0.6, 0.5, 0.3]], dtype=D)
    out = verify_listed(torch.tensor([2]), draft, guide, np.array([0.5, 1.0]), u)
    assert out.tokens.tolist() == [[0, 2]] and out.offpolicy.tolist() == [[False, True]]
    np.testing.assert_allclose(out.lam.numpy(), [[0.5, 1.0]])
    np.testing.assert_allclose(out.target_tv.numpy(), [[0.0, 0.0]], atol=1e-12)
    # the same round at a constant λ = 0.5 accepts both (ratio_2 = 0.7 > 0.5)
    same = verify_listed(torch.tensor([2]), draft, guide, 0.5, u)
    assert same.tokens.tolist() == [[0, 0]] and same.lam.tolist() == [[0.5, 0.5]]


def test_draw_bonus_per_row_lambda_hand_values():
    # lookahead x = 0 in both rows, p = [0.5, 0.3, 0.2], q = [0.2, 0.3, 0.5] over S = all of V
    # (Q_S = 1, q̃ = q); u = 0.5 in both; a = min(1, (1-λ) + λ·q(0)/p(0)) = 1 - 0.6·λ:
    # row 0: λ = 0.2, a = 0.88 > u: x = 0 kept
    # row 1: λ = 0.9, a = 0.46 <= u: rejected, (0.5 - 0.46)/0.54 = 0.074 draws the residual
    #   max(0, q - p) = [0, 0, 0.3]: token 2, off-policy
    draft = _full_rows([0, 0], [[0.5, 0.3, 0.2]] * 2)
    guide = _full_rows([2, 2], [[0.2, 0.3, 0.5]] * 2)
    out = draw_bonus(draft, guide, np.array([0.2, 0.9]), np.array([0.5, 0.5]))
    assert out["tokens"].tolist() == [0, 2] and out["offpolicy"].tolist() == [False, True]
    np.testing.assert_allclose(out["lam"], [0.2, 0.9])
    # the residual's p and q are its own: p(2) = 0.2, q(2) = 0.5
    np.testing.assert_allclose(out["log_p"], np.log([0.5, 0.2]), rtol=1e-12)
    np.testing.assert_allclose(out["log_q"], np.log([0.2, 0.5]), rtol=1e-12)


def test_mixture_log_probs_per_token_lambda_hand_values():
    # p = 0.5, q = 0.1: λ_t = 0 -> 0.5; 0.5 -> 0.3; 1 -> 0.1
    p, q = torch.full((1, 3), LN(0.5)), torch.full((1, 3), LN(0.1))
    got = mixture_log_probs(p, q, None, torch.tensor([[0.0, 0.5, 1.0]]))
    torch.testing.assert_close(got, torch.tensor([[LN(0.5), LN(0.3), LN(0.1)]]), rtol=0, atol=1e-6)
    # a constant λ as a tensor equals the float path
    scalar = mixture_log_probs(p, q, None, 0.25)
    torch.testing.assert_close(mixture_log_probs(p, q, None, torch.full((1, 3), 0.25)), scalar)
    with pytest.raises(ValueError, match="lam"):
        mixture_log_probs(p, q, None, torch.tensor([[0.0, 1.5, 1.0]]))


def test_gate_metrics_and_unguided_entropies_hand_values():
    # 2 responses x 3 tokens, the second padded after 2; response 0 guided, λ = 0.8, τ = 1.0
    lam_t = torch.tensor([[0.8, 0.4, 0.2], [0.0, 0.0, 0.0]])
    h = torch.tensor([[1.5, 0.5, 0.25], [0.3, 0.7, float("nan")]])
    guided, mask = torch.tensor([True, False]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    # λ'_t of a draft_tail target, λ_t·Q_S with Q_S = 0.5, 1, 0.5 on response 0
    target = torch.tensor([[0.4, 0.4, 0.1], [0.0, 0.0, 0.0]])
    m = compute_gate_metrics(lam_t, h, guided, mask, 0.8, 1.0, target)
    # λ mean over 5 tokens: (0.8 + 0.4 + 0.2 + 0 + 0) / 5 = 0.28
    assert m[M.GUIDANCE_LAMBDA_MEAN] == pytest.approx(0.28)
    # λ' mean over the same 5: (0.4 + 0.4 + 0.1 + 0 + 0) / 5 = 0.18; the gate still reads λ_t
    assert m[M.GUIDANCE_TARGET_LAMBDA_MEAN] == pytest.approx(0.18)
    # H mean over 5 tokens: (1.5 + 0.5 + 0.25 + 0.3 + 0.7) / 5 = 0.65
    assert m[M.GUIDANCE_DRAFT_ENTROPY_MEAN] == pytest.approx(0.65)
    # guided tokens: gate mean (0.8 + 0.4 + 0.2) / 3 / 0.8 = 0.583333; open (H ≥ 1): 1 of 3
    assert m[M.GUIDANCE_GATE_MEAN] == pytest.approx(1.4 / 3 / 0.8)
    assert m[M.GUIDANCE_GATE_OPEN_FRAC] == pytest.approx(1 / 3)
    assert m[M.GUIDANCE_ENTROPY_THRESHOLD] == 1.0
    ungated = compute_gate_metrics(lam_t, h, guided, mask, 0.8, None)
    assert set(ungated) == {M.GUIDANCE_LAMBDA_MEAN, M.GUIDANCE_DRAFT_ENTROPY_MEAN}
    # the percentile's sample: the unguided response's known tokens; all guided: every token
    np.testing.assert_allclose(unguided_entropies(h, guided, mask), [0.3, 0.7], rtol=1e-6)
    everyone = unguided_entropies(h, torch.tensor([True, True]), mask)
    np.testing.assert_allclose(everyone, [1.5, 0.5, 0.25, 0.3, 0.7], rtol=1e-6)


ENTROPY = np.array([listed_entropy(np.log(row)) for row in P_CHAIN.numpy()])
"""H(p) of the draft chain's rows: 0.897946, 1.029653, 1.088900."""


def gated_chain(lam: float, tau: float) -> torch.Tensor:
    """The chain the gated rollout samples: row s = (1-λ_s)·P[s] + λ_s·Q[s], λ_s = λ·min(1, H_s/τ)."""
    lam_s = torch.from_numpy(lam * np.minimum(1.0, ENTROPY / tau)).unsqueeze(-1)
    return (1 - lam_s) * P_CHAIN + lam_s * Q_CHAIN


def chain_pvalue(seqs, chain: torch.Tensor, length: int) -> float:
    """Chi-square p-value of `length`-token sequences from state 0 against `chain`."""
    return positional_pvalue(seqs, [chain] * length)


@pytest.mark.parametrize(("lam", "tau", "k"), [(1.0, 2.0, 2), (0.8, 1.0, 1)])
def test_gated_guided_subset_follows_the_gated_chain(lam, tau, k):
    """Two batches of 10,000 prompts through `overlapped_generate` with bonus tokens, the entropy
    gate and half of each batch unguided: guided sequences follow the chain with
    λ_s = λ·min(1, H(P[s])/τ) (chi-square), not the ungated q_λ; unguided ones follow P and
    never hold a guidance token; every token records λ_t and H_t of its state; the behavior
    log-probs from λ_t are the gated chain's."""
    n, length = 10_000, 3
    gate = lambda h: gate_entropy(h, tau)  # noqa: E731
    scale = [1.0, 0.0] * (n // 2)
    batches = [SpeculativeBatch([[0]] * n, lam, k, length, None, torch.Generator().manual_seed(61 + g),
                                ids=list(range(g * n, (g + 1) * n)), bonus=True, lam_scale=scale, gate=gate)
               for g in range(2)]  # fmt: skip
    overlapped_generate(batches, ListedChainStepper({0: 71, 1: 72}), ListedChainScorer(), 1)
    seqs = [s for b in batches for s in b.seqs]
    guided, unguided = seqs[0::2], seqs[1::2]
    target = gated_chain(lam, tau)
    assert chain_pvalue(guided, target, length) > 1e-3
    assert chain_pvalue(guided, (1 - lam) * P_CHAIN + lam * Q_CHAIN, length) < 1e-6
    assert chain_pvalue(unguided, P_CHAIN, length) > 1e-3
    assert not any(any(s.offpolicy) for s in unguided)
    assert all(b.stats.bonus > 0 for b in batches)
    tokens = np.array([s.tokens for s in seqs])
    prevs = np.concatenate([np.zeros((len(seqs), 1), dtype=int), tokens[:, :-1]], axis=1)
    lam_s = lam * np.minimum(1.0, ENTROPY / tau)
    expected_lam = lam_s[prevs] * np.array([1.0, 0.0] * n)[:, None]
    np.testing.assert_allclose(np.array([s.lam for s in seqs]), expected_lam, rtol=0, atol=1e-12)
    np.testing.assert_allclose(
        np.array([s.draft_entropy for s in seqs]), ENTROPY[prevs], atol=1e-12
    )
    behavior = mixture_log_probs(
        torch.tensor([s.draft_log_probs for s in seqs], dtype=D),
        torch.tensor([s.target_log_probs for s in seqs], dtype=D),
        None,
        torch.from_numpy(expected_lam),
    )
    mix = (1 - expected_lam) * P_CHAIN.numpy()[prevs, tokens] + expected_lam * Q_CHAIN.numpy()[
        prevs, tokens
    ]
    np.testing.assert_allclose(behavior.numpy(), np.log(mix), rtol=0, atol=1e-12)


def test_without_gate_or_subset_the_round_lambda_stays_a_float():
    """No gate and every sequence guided: the round's λ is the float itself (the path every
    earlier test exercises), recorded per token."""
    batch = SpeculativeBatch([[0]] * 4, 0.5, 2, 3, None, torch.Generator().manual_seed(3))
    batch.next_round()
    assert batch._lam(np.zeros(3), np.array([0, 1, 2]), np.zeros(3, dtype=int)) == 0.5
    gated = SpeculativeBatch([[0]] * 4, 0.5, 2, 3, None, lam_scale=[1, 0, 1, 1])
    gated.next_round()
    np.testing.assert_array_equal(
        gated._lam(np.zeros(3), np.array([0, 1, 2]), np.zeros(3, dtype=int)), [0.5, 0.0, 0.5]
    )


def positional_pvalue(seqs, chains: list[torch.Tensor]) -> float:
    """Chi-square p-value of sequences from state 0 whose token t follows `chains[t]`."""
    length = len(chains)
    counts = np.zeros(V**length)
    for s in seqs:
        counts[int(np.ravel_multi_index(s.tokens, (V,) * length))] += 1
    probs = np.ones(V**length)
    for index in range(V**length):
        prev = 0
        for t, tok in enumerate(np.unravel_index(index, (V,) * length)):
            probs[index] *= chains[t][prev, tok].item()
            prev = tok
    return chi2_counts_pvalue(torch.from_numpy(counts), torch.from_numpy(probs))


@pytest.mark.parametrize("k", [1, 2])
def test_teacher_prefix_follows_q_then_the_mixture(k):
    """24,000 prompts through `overlapped_generate` with bonus tokens, λ = 0.4, in four kinds:
    guided with prefixes j = 0, 1, 3 and unguided. Token t of a guided sequence follows Q where
    t < j and (1-λ)·P + λ·Q after (chi-square per kind); the unguided follow P; every token
    records λ_t (1 inside the prefix), and the behavior log-probs from λ_t are the chain's."""
    lam, n, length = 0.4, 24_000, 3
    mix = (1 - lam) * P_CHAIN + lam * Q_CHAIN
    kinds = [(1.0, 0), (1.0, 1), (1.0, 3), (0.0, 0)]  # (λ scale, prefix j)
    scale = [kinds[i % 4][0] for i in range(n)]
    prefix = [kinds[i % 4][1] for i in range(n)]
    half = n // 2
    batches = [SpeculativeBatch([[0]] * half, lam, k, length, None, torch.Generator().manual_seed(81 + g),
                                ids=list(range(g * half, (g + 1) * half)), bonus=True,
                                lam_scale=scale[g * half:(g + 1) * half], prefix=prefix[g * half:(g + 1) * half])
               for g in range(2)]  # fmt: skip
    overlapped_generate(batches, ListedChainStepper({0: 91, 1: 92}), ListedChainScorer(), 1)
    seqs = [s for b in batches for s in b.seqs]
    by_kind = [seqs[i::4] for i in range(4)]
    assert positional_pvalue(by_kind[0], [mix] * 3) > 1e-3
    assert positional_pvalue(by_kind[1], [Q_CHAIN, mix, mix]) > 1e-3
    assert positional_pvalue(by_kind[1], [mix] * 3) < 1e-6  # the prefix changed the first token
    assert positional_pvalue(by_kind[2], [Q_CHAIN] * 3) > 1e-3
    assert positional_pvalue(by_kind[3], [P_CHAIN] * 3) > 1e-3
    assert not any(any(s.offpolicy) for s in by_kind[3])
    expected_lam = np.array([[1.0 if t < j else lam * c for t in range(length)] for c, j in kinds])
    got = np.array([s.lam for s in seqs])
    np.testing.assert_allclose(got, np.tile(expected_lam, (n // 4, 1)), rtol=0, atol=1e-12)
    tokens = np.array([s.tokens for s in seqs])
    prevs = np.concatenate([np.zeros((n, 1), dtype=int), tokens[:, :-1]], axis=1)
    behavior = mixture_log_probs(torch.tensor([s.draft_log_probs for s in seqs], dtype=D),
                                 torch.tensor([s.target_log_probs for s in seqs], dtype=D),
                                 None, torch.from_numpy(got))  # fmt: skip
    chain = (1 - got) * P_CHAIN.numpy()[prevs, tokens] + got * Q_CHAIN.numpy()[prevs, tokens]
    np.testing.assert_allclose(behavior.numpy(), np.log(chain), rtol=0, atol=1e-12)
