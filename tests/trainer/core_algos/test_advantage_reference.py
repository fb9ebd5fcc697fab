"""Advantage estimators vs deliberately naive loop references, and properties over seeds.

The references are per group / per position Python loops over lists, an implementation
independent of the vectorized registry functions; float64, tolerance 1e-10.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from verl.trainer.core_algos.advantage import get_adv_estimator_fn

F64 = torch.float64
OTB_EPS = 1e-8  # default otb_epsilon
GRPO_EPS = 1e-6  # default GRPO epsilon
CANONICAL = [
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
]
PAD_P, PAD_S = 0.1, 0.9


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


# --------------------------------------------------------------------------------------------
# loop references (independent, deliberately naive)
# --------------------------------------------------------------------------------------------


def _groups(index) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = defaultdict(list)
    for i, uid in enumerate(index):
        groups[str(uid)].append(i)
    return groups


def _scores(rewards: list, mask: list) -> list[float]:
    return [sum(r * m for r, m in zip(rr, mm)) for rr, mm in zip(rewards, mask)]


def ref_grpo(rewards, mask, index, eps=GRPO_EPS, norm=True) -> torch.Tensor:
    r, m = rewards.tolist(), mask.tolist()
    scores = _scores(r, m)
    adv = [[0.0] * len(row) for row in m]
    for members in _groups(index).values():
        n = len(members)
        mean = sum(scores[i] for i in members) / n
        std = math.sqrt(sum((scores[i] - mean) ** 2 for i in members) / (n - 1)) if n > 1 else 0
        for i in members:
            if n == 1:
                a = scores[i]
            elif norm:
                a = (scores[i] - mean) / (std + eps)
            else:
                a = scores[i] - mean
            for t, valid in enumerate(m[i]):
                adv[i][t] = a if valid else 0.0
    return _t(adv)


def ref_rloo(rewards, mask, index) -> torch.Tensor:
    r, m = rewards.tolist(), mask.tolist()
    scores = _scores(r, m)
    adv = [[0.0] * len(row) for row in m]
    for members in _groups(index).values():
        for i in members:
            others = [scores[j] for j in members if j != i]
            a = scores[i] - sum(others) / len(others) if others else scores[i]
            for t, valid in enumerate(m[i]):
                adv[i][t] = a if valid else 0.0
    return _t(adv)


def ref_reinforce_pp(rewards, mask, gamma) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded batches only: G_t = Σ_{j≥t, valid} γ^{j-t} r_j, whitened over valid tokens."""
    r, m = rewards.tolist(), mask.tolist()
    ret = [[0.0] * len(row) for row in m]
    for i, row in enumerate(m):
        for t in range(len(row)):
            if row[t]:
                ret[i][t] = sum(gamma ** (j - t) * r[i][j] for j in range(t, len(row)) if m[i][j])
    valid = [ret[i][t] for i, row in enumerate(m) for t in range(len(row)) if row[t]]
    mean = sum(valid) / len(valid)
    var = sum((v - mean) ** 2 for v in valid) / (len(valid) - 1) if len(valid) > 1 else 0.0
    adv = [
        [(ret[i][t] - mean) / math.sqrt(var + 1e-8) if m[i][t] else 0.0 for t in range(len(row))]
        for i, row in enumerate(m)
    ]
    return _t(adv), _t(ret)


def ref_otb(
    rewards,
    mask,
    index,
    old_lp,
    spi2,
    weights=None,
    eps=OTB_EPS,
    zero_tail=True,
    compact=False,
) -> tuple[torch.Tensor, torch.Tensor]:
    r, m = rewards.tolist(), mask.tolist()
    lp, s = old_lp.tolist(), spi2.tolist()
    w = weights.tolist() if weights is not None else None
    B, T = len(m), len(m[0])
    G = [[sum(r[i][j] * m[i][j] for j in range(t, T)) for t in range(T)] for i in range(B)]
    W = [[0.0] * T for _ in range(B)]
    token_at: list[dict[int, int]] = []  # per row: position -> column of that valid token
    pos_of: list[dict[int, int]] = []  # per row: column -> position
    for i in range(B):
        acc, rank = 0.0, 0
        token_at.append({})
        pos_of.append({})
        for t in range(T):
            if m[i][t]:
                e = 1.0 - 2.0 * math.exp(lp[i][t]) + s[i][t]
                if w is not None:
                    e *= w[i][t] ** 2
                acc += e
                pos = rank if compact else t
                token_at[i][pos] = t
                pos_of[i][t] = pos
                rank += 1
            W[i][t] = acc
    adv = [[0.0] * T for _ in range(B)]
    for members in _groups(index).values():
        for i in members:
            for t, pos in pos_of[i].items():
                alive = [(k, token_at[k][pos]) for k in members if pos in token_at[k]]
                if len(alive) == 1 and (zero_tail or len(members) == 1):
                    baseline = 0.0
                else:
                    num = sum(G[k][c] * W[k][c] for k, c in alive)
                    den = sum(W[k][c] for k, c in alive)
                    baseline = num / (den + eps)
                adv[i][t] = G[i][t] - baseline
    return _t(adv), _t(G)


def _random_batch(seed: int, holes: bool = False, B: int = 12, T: int = 7, groups: int = 3):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).to(F64)
    if holes:
        hole = torch.rand(B, T, generator=gen) < 0.35
        hole[:, 0] = False  # at least one model token per response
        mask = mask * (~hole).to(F64)
    rewards = torch.randn(B, T, generator=gen, dtype=F64)  # also on padding: must be ignored
    logits = torch.randn(B, T, 6, generator=gen, dtype=F64) * 1.5
    probs = torch.softmax(logits, dim=-1)
    tokens = torch.randint(0, 6, (B, T, 1), generator=gen)
    old_lp = probs.gather(-1, tokens).squeeze(-1).log()
    spi2 = probs.pow(2).sum(-1)
    weights = torch.rand(B, T, generator=gen, dtype=F64) * 1.5 + 0.25
    gid = torch.randint(0, groups, (B,), generator=gen).tolist()
    uids = [f"uid-{g}" for g in gid]
    uids[-1] = "uid-solo"  # always one group of size 1 next to the larger groups
    index = np.array(uids, dtype=object)
    return dict(
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        old_log_probs=old_lp,
        sum_pi_squared=spi2,
        rollout_is_weights=weights,
    )


SEEDS = [0, 1, 2, 3, 4]


# --------------------------------------------------------------------------------------------
# properties over random seeds
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", CANONICAL)
@pytest.mark.parametrize("holes", [False, True])
def test_padding_gets_exactly_zero_advantage(name, seed, holes):
    batch = _random_batch(seed, holes=holes)
    # every estimator is called with the same full keyword set (extra ones are ignored)
    adv, ret = get_adv_estimator_fn(name)(**batch, gamma=0.9)
    mask = batch["response_mask"]
    assert adv.shape == mask.shape and ret.shape == mask.shape
    assert adv.dtype == F64
    assert torch.all(adv[mask == 0] == 0)
    assert torch.isfinite(adv).all()
    assert (adv[mask == 1] != 0).any()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", CANONICAL)
def test_returns_are_zero_after_the_last_valid_token(name, seed):
    batch = _random_batch(seed, holes=False)
    _, ret = get_adv_estimator_fn(name)(**batch, gamma=0.9)
    assert torch.all(ret[batch["response_mask"] == 0] == 0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
@pytest.mark.parametrize("zero_tail", [True, False])
def test_otb_with_groups_of_one_returns_exactly_the_returns(name, seed, zero_tail):
    batch = _random_batch(seed, holes=name.startswith("tir"))
    batch["index"] = np.array([f"solo-{i}" for i in range(12)], dtype=object)
    adv, ret = get_adv_estimator_fn(name)(**batch, otb_handle_zero_tail=zero_tail)
    mask = batch["response_mask"]
    assert torch.equal(adv, ret * mask)
    _, ref_ret = ref_otb(
        batch["token_level_rewards"],
        mask,
        batch["index"],
        batch["old_log_probs"],
        batch["sum_pi_squared"],
    )
    torch.testing.assert_close(adv, ref_ret * mask, atol=1e-12, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_loop_reference(seed, norm):
    batch = _random_batch(seed)
    adv, ret = get_adv_estimator_fn("grpo")(**batch, norm_adv_by_std_in_grpo=norm)
    expected = ref_grpo(
        batch["token_level_rewards"], batch["response_mask"], batch["index"], norm=norm
    )
    torch.testing.assert_close(adv, expected, atol=1e-10, rtol=0)
    torch.testing.assert_close(ret, expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_matches_loop_reference(seed):
    batch = _random_batch(seed)
    adv, _ = get_adv_estimator_fn("rloo")(**batch)
    expected = ref_rloo(batch["token_level_rewards"], batch["response_mask"], batch["index"])
    torch.testing.assert_close(adv, expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_loop_reference(seed, gamma):
    batch = _random_batch(seed)
    adv, ret = get_adv_estimator_fn("reinforce_plus_plus")(**batch, gamma=gamma)
    ref_adv, ref_ret = ref_reinforce_pp(batch["token_level_rewards"], batch["response_mask"], gamma)
    torch.testing.assert_close(ret, ref_ret, atol=1e-10, rtol=0)
    torch.testing.assert_close(adv, ref_adv, atol=1e-10, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("use_weights", [False, True])
def test_otb_family_matches_loop_reference(seed, name, zero_tail, use_weights):
    compact = name.startswith("tir")
    batch = _random_batch(seed, holes=compact)
    if not use_weights:
        batch["rollout_is_weights"] = None
    adv, ret = get_adv_estimator_fn(name)(**batch, otb_handle_zero_tail=zero_tail)
    ref_adv, ref_ret = ref_otb(
        batch["token_level_rewards"],
        batch["response_mask"],
        batch["index"],
        batch["old_log_probs"],
        batch["sum_pi_squared"],
        weights=batch["rollout_is_weights"],
        zero_tail=zero_tail,
        compact=compact,
    )
    torch.testing.assert_close(adv, ref_adv, atol=1e-10, rtol=0)
    mask = batch["response_mask"]
    torch.testing.assert_close(ret * mask, ref_ret * mask, atol=1e-10, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_tir_otb_on_holes_matches_loop_reference_but_not_plain_reference(seed):
    # on masks with holes the two pooling rules are genuinely different
    batch = _random_batch(seed, holes=True)
    args = (
        batch["token_level_rewards"],
        batch["response_mask"],
        batch["index"],
        batch["old_log_probs"],
        batch["sum_pi_squared"],
    )
    tir, _ = get_adv_estimator_fn("tir_otb")(**batch)
    plain, _ = get_adv_estimator_fn("otb")(**batch)
    torch.testing.assert_close(
        tir,
        ref_otb(*args, weights=batch["rollout_is_weights"], compact=True)[0],
        atol=1e-10,
        rtol=0,
    )
    torch.testing.assert_close(
        plain,
        ref_otb(*args, weights=batch["rollout_is_weights"], compact=False)[0],
        atol=1e-10,
        rtol=0,
    )
    assert (tir - plain).abs().max().item() > 1e-6


def test_random_batches_cover_singletons_and_multi_member_groups():
    # sanity check of the generator: the seeds exercise both group sizes 1 and > 1
    sizes = set()
    for seed in SEEDS:
        idx = _random_batch(seed)["index"]
        sizes.update(len(v) for v in _groups(idx).values())
    assert 1 in sizes
    assert any(s > 1 for s in sizes)
