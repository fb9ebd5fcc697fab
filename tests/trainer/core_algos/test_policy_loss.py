"""Policy losses and aggregation: hand-worked examples (torchtune style) and properties."""

from __future__ import annotations

import math

import pytest
import torch

from verl.trainer.core_algos.policy_loss import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    PolicyLossConfig,
    agg_loss,
    cppo_keep_mask,
    dppo_tv_keep_mask,
    get_policy_loss_fn,
    luffy_shaping,
    policy_loss_kwargs,
)
from verl.utils import metric_names as M

D = torch.float64


def t(values):
    return torch.tensor(values, dtype=D)


def logt(values):
    return torch.tensor(values, dtype=D).log()


# ------------------------------------------------------------------------------------------ agg


def test_agg_modes_hand_values():
    loss = t([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0]])
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0]])
    # token-mean: (1+2+3+4)/4 = 2.5
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(2.5, abs=1e-12)
    # seq-mean-token-mean: mean(6/3, 4/1) = (2+4)/2 = 3
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0, abs=1e-12)
    # seq-mean-token-sum-norm, H = T = 4: mean(6/4, 4/4) = (1.5+1)/2 = 1.25
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(1.25, abs=1e-12)
    # H = 10: mean(0.6, 0.4) = 0.5
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", horizon=10).item() == pytest.approx(
        0.5, abs=1e-12
    )


@pytest.mark.parametrize("mode", LOSS_AGG_MODES.names())
def test_agg_gradient_accumulation_equals_full_batch(mode):
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=gen, dtype=D)
    mask = (torch.arange(5) < torch.tensor([5, 3, 1, 4, 2, 5]).unsqueeze(-1)).to(D)
    full = agg_loss(loss, mask, mode)
    n_tok, n_seq = mask.sum(), (mask.sum(-1) > 0).sum()
    parts = [
        agg_loss(
            loss[i : i + 2], mask[i : i + 2], mode, global_num_tokens=n_tok, global_num_seqs=n_seq
        )
        for i in range(0, 6, 2)
    ]
    torch.testing.assert_close(sum(parts), full, rtol=0, atol=1e-12)


def test_agg_unknown_mode_lists_registry():
    with pytest.raises(ValueError) as err:
        agg_loss(t([[1.0]]), t([[1.0]]), "sum-of-everything")
    for name in LOSS_AGG_MODES.names():
        assert name in str(err.value)


# ------------------------------------------------------------------------------------------ ppo


def _ppo_example():
    # token:        0      1      2      3
    # π_old:       0.5    0.5    0.2    0.5
    # π_θ:         0.75   0.25   0.8    0.5     -> r = 1.5, 0.5, 4.0, 1.0
    # A:           +1     -1     -1     +2
    old = logt([[0.5, 0.5, 0.2, 0.5]])
    new = logt([[0.75, 0.25, 0.8, 0.5]]).requires_grad_(True)
    adv = t([[1.0, -1.0, -1.0, 2.0]])
    mask = t([[1, 1, 1, 1]])
    return old, new, adv, mask


def test_ppo_hand_values_and_gradient():
    old, new, adv, mask = _ppo_example()
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_dual=3.0)
    loss, metrics = get_policy_loss_fn("ppo")(old, new, adv, mask, config=cfg)
    # token 0: max(-1.5, -1.28) = -1.28 (clipped high)
    # token 1: max(0.5, -(-1)·clip(0.5, 0.8, 1.28)=0.8) = 0.8 (clipped low)
    # token 2: max(4.0, 1.28) = 4.0 -> dual cap -A·c = 3.0 -> 3.0
    # token 3: -2·1 = -2
    # token-mean: (-1.28 + 0.8 + 3 - 2)/4 = 0.52/4 = 0.13
    assert loss.item() == pytest.approx(0.13, abs=1e-12)
    assert metrics[M.ACTOR_PG_CLIPFRAC] == pytest.approx(0.5)  # tokens 0 and 1
    assert metrics[M.ACTOR_PG_CLIPFRAC_LOWER] == pytest.approx(0.25)  # token 2 (dual clip)
    # ppo_kl = mean(log π_old - log π_θ) = -(log 1.5 + log 0.5 + log 4 + 0)/4 = -log(3)/4
    assert metrics[M.ACTOR_PPO_KL] == pytest.approx(-math.log(3) / 4, abs=1e-12)
    assert metrics[M.ACTOR_PG_LOSS] == pytest.approx(0.13, abs=1e-12)
    loss.backward()
    # only token 3 is unclipped: d(-A·r)/d log π = -A·r = -2, /4 tokens = -0.5
    torch.testing.assert_close(new.grad, t([[0.0, 0.0, 0.0, -0.5]]), rtol=0, atol=1e-12)


def test_ppo_importance_weights_scale_each_token():
    old, new, adv, mask = _ppo_example()
    w = t([[0.5, 1.0, 2.0, 1.5]])
    loss, _ = get_policy_loss_fn("ppo")(old, new, adv, mask, importance_weights=w)
    # (0.5·-1.28 + 1·0.8 + 2·3 + 1.5·-2)/4 = (-0.64 + 0.8 + 6 - 3)/4 = 3.16/4 = 0.79
    assert loss.item() == pytest.approx(0.79, abs=1e-12)
    loss.backward()
    # token 3: -A·r·w = -2·1·1.5 = -3, /4 = -0.75
    torch.testing.assert_close(new.grad, t([[0.0, 0.0, 0.0, -0.75]]), rtol=0, atol=1e-12)


def _plain_clipped_ppo(old, new, adv, mask, eps_low, eps_high):
    """Textbook PPO-clip, written independently: -mean(min(rA, clip(r)A))."""
    ratio = torch.exp(new - old)
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)
    return -(surrogate * mask).sum() / mask.sum()


@pytest.mark.parametrize("seed", range(5))
def test_decoupled_with_behavior_equal_old_and_unit_weights_is_plain_ppo(seed):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 6, generator=gen, dtype=D) * 3
    new = (old + 0.3 * torch.randn(4, 6, generator=gen, dtype=D)).requires_grad_(True)
    adv = torch.randn(4, 6, generator=gen, dtype=D)
    mask = (torch.arange(6) < torch.tensor([6, 2, 4, 5]).unsqueeze(-1)).to(D)
    cfg = PolicyLossConfig(clip_ratio_dual=1e9)  # dual clip off: textbook PPO has none
    loss, _ = get_policy_loss_fn("ppo")(
        old,
        new,
        adv,
        mask,
        config=cfg,
        behavior_log_probs=old.clone(),
        importance_weights=torch.ones_like(old),
    )
    (grad,) = torch.autograd.grad(loss, new)
    new2 = new.detach().clone().requires_grad_(True)
    ref = _plain_clipped_ppo(old, new2, adv, mask, cfg.clip_ratio_low, cfg.clip_ratio_high)
    (grad_ref,) = torch.autograd.grad(ref, new2)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, grad_ref, rtol=0, atol=1e-12)


def test_importance_not_detached_differentiates_through_weight():
    # one token: π_old = 0.5, π_θ = 0.5 (r = 1), μ = 0.25, A = 1
    old, new, beh = logt([[0.5]]), logt([[0.5]]).requires_grad_(True), logt([[0.25]])
    adv, mask = t([[1.0]]), t([[1.0]])
    live = PolicyLossConfig(importance_detach=False, importance_clamp_max=3.0)
    loss, _ = get_policy_loss_fn("ppo")(old, new, adv, mask, config=live, behavior_log_probs=beh)
    # w = π_θ/μ = 2 (inside [0, 3]); loss = -A·r·w = -2
    assert loss.item() == pytest.approx(-2.0, abs=1e-12)
    loss.backward()
    # d(-r·w)/d log π_θ = -(r·w + r·w) = -4: both factors depend on π_θ
    assert new.grad.item() == pytest.approx(-4.0, abs=1e-12)
    new2 = logt([[0.5]]).requires_grad_(True)
    const, _ = get_policy_loss_fn("ppo")(
        old, new2, adv, mask, behavior_log_probs=beh, importance_weights=t([[2.0]])
    )
    const.backward()
    assert const.item() == pytest.approx(-2.0, abs=1e-12)
    assert new2.grad.item() == pytest.approx(-2.0, abs=1e-12)  # constant weight: -r·w


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_padding_contributes_nothing(name):
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(3, 5, generator=gen, dtype=D)
    new = (old + 0.2 * torch.randn(3, 5, generator=gen, dtype=D)).requires_grad_(True)
    adv = torch.randn(3, 5, generator=gen, dtype=D)
    mask = t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    cfg = PolicyLossConfig(luffy_shaping=True, opsm_delta=0.1)
    off = t([[0, 1, 0, 1, 1], [0, 0, 1, 0, 0], [1, 0, 0, 0, 0]])
    loss, _ = get_policy_loss_fn(name)(
        old, new, adv, mask, config=cfg, behavior_log_probs=old - 0.05, offpolicy_mask=off
    )
    (grad,) = torch.autograd.grad(loss, new)
    # garbage in the padding changes nothing, and padding gets exactly zero gradient
    garbage = mask == 0
    new_g = torch.where(garbage, torch.full_like(old, -0.001), new.detach()).requires_grad_(True)
    adv_g = torch.where(garbage, torch.full_like(adv, 1e6), adv)
    old_g = torch.where(garbage, torch.full_like(old, -30.0), old)
    loss_g, _ = get_policy_loss_fn(name)(
        old_g, new_g, adv_g, mask, config=cfg, behavior_log_probs=old_g - 0.05, offpolicy_mask=off
    )
    (grad_g,) = torch.autograd.grad(loss_g, new_g)
    torch.testing.assert_close(loss_g, loss, rtol=0, atol=1e-12)
    assert torch.all(grad_g[garbage] == 0)
    torch.testing.assert_close(grad_g[~garbage], grad[~garbage], rtol=0, atol=1e-12)


def test_every_loss_accepts_the_shared_keywords():
    import inspect

    for name in POLICY_LOSSES.names():
        params = inspect.signature(get_policy_loss_fn(name)).parameters
        assert all(k in params for k in policy_loss_kwargs()), name


def test_unknown_loss_lists_registry():
    with pytest.raises(ValueError) as err:
        get_policy_loss_fn("reinforce_with_vibes")
    assert "valid: " + ", ".join(POLICY_LOSSES.names()) in str(err.value)


# ------------------------------------------------------------------------------------------ luffy


def test_luffy_shaping_value_and_gradient_on_guidance_tokens_only():
    # token 0 draft, token 1 guidance; π_θ = 0.5 on both, π_old = 0.5 (r = 1), A = 1, γ = 0.1
    old = logt([[0.5, 0.5]])
    new = logt([[0.5, 0.5]]).requires_grad_(True)
    adv, mask, off = t([[1.0, 1.0]]), t([[1, 1]]), t([[0, 1]])
    cfg = PolicyLossConfig(luffy_shaping=True, luffy_gamma=0.1)
    loss, metrics = get_policy_loss_fn("ppo")(old, new, adv, mask, config=cfg, offpolicy_mask=off)
    # token 0: -A·r = -1; token 1: -A·π/(π+γ) = -0.5/0.6 = -0.833333...; mean = -0.9166667
    assert loss.item() == pytest.approx((-1.0 - 0.5 / 0.6) / 2, abs=1e-12)
    assert metrics[M.ACTOR_LUFFY_TOKEN_FRAC] == pytest.approx(0.5)
    loss.backward()
    # token 1: d/dlogπ [-π/(π+γ)] = -γπ/(π+γ)² = -0.1·0.5/0.36 = -0.138889, /2 tokens
    torch.testing.assert_close(new.grad, t([[-0.5, -0.1 * 0.5 / 0.36 / 2]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(luffy_shaping(logt([[0.5]]), t([[2.0]]), 0.1), t([[-2 * 0.5 / 0.6]]))


# ------------------------------------------------------------------------------------------ dppo


def _dppo_example():
    # token:    0     1     2     3     4
    # μ:       0.5   0.5   0.5   0.5   0.1
    # π_θ:     0.7   0.6   0.2   0.2   0.9
    # A:       +1    +1    +1    -1    -1
    # |π-μ|:   0.2   0.1   0.3   0.3   0.8
    # toward μ: no    no    yes   no    yes      (A·(π-μ) ≤ 0)
    # keep (δ = 0.15): no, yes(TV ≤ δ), yes(toward), no, yes(toward)
    mu = logt([[0.5, 0.5, 0.5, 0.5, 0.1]])
    new = logt([[0.7, 0.6, 0.2, 0.2, 0.9]]).requires_grad_(True)
    adv = t([[1.0, 1.0, 1.0, -1.0, -1.0]])
    mask = t([[1, 1, 1, 1, 1]])
    return mu, new, adv, mask


def test_dppo_tv_hand_values_and_gradient():
    mu, new, adv, mask = _dppo_example()
    cfg = PolicyLossConfig(tv_delta=0.15, is_ratio_cap=5.0)
    keep = dppo_tv_keep_mask(new.detach(), mu, adv, 0.15)
    assert keep.tolist() == [[False, True, True, False, True]]
    loss, metrics = get_policy_loss_fn("dppo_tv")(
        mu.clone(), new, adv, mask, config=cfg, behavior_log_probs=mu
    )
    # kept values -A·min(π/μ, 5): token1 -1.2, token2 -0.4, token4 +min(9, 5) = +5
    # token-mean: (0 - 1.2 - 0.4 + 0 + 5)/5 = 3.4/5 = 0.68
    assert loss.item() == pytest.approx(0.68, abs=1e-12)
    assert metrics[M.ACTOR_PG_CLIPFRAC] == pytest.approx(0.4)  # 2 of 5 masked
    assert metrics[M.ACTOR_PG_CLIPFRAC_LOWER] == pytest.approx(0.2)  # ratio 9 > cap 5
    loss.backward()
    # gradient -A·min(r, cap)·∇log π / 5: [0, -0.24, -0.08, 0, +1.0]
    torch.testing.assert_close(new.grad, t([[0.0, -0.24, -0.08, 0.0, 1.0]]), rtol=0, atol=1e-12)


def test_dppo_anchors_at_behavior_not_old():
    mu, new, adv, mask = _dppo_example()
    cfg = PolicyLossConfig(tv_delta=0.15, is_ratio_cap=5.0)
    with_mu, _ = get_policy_loss_fn("dppo_tv")(
        mu + 1.0, new, adv, mask, config=cfg, behavior_log_probs=mu
    )
    ref, _ = get_policy_loss_fn("dppo_tv")(
        mu, new, adv, mask, config=cfg
    )  # no behavior: anchor = old
    # π_old is only used for the ppo_kl metric once μ is given
    torch.testing.assert_close(with_mu, ref, rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------------ cppo


def test_cppo_mask_hand_worked():
    # One response of 3 valid tokens (+1 padding), all A > 0 with π > μ (moving away from μ).
    # D = |π-μ| = [0.12, 0.10, 0.05]; w_t = 0.8 + 0.2·(3-t)/2 = [1.0, 0.9, 0.8]
    # P90(D) with linear interpolation: sorted [0.05, 0.10, 0.12], pos 0.9·2 = 1.8 -> 0.10+0.8·0.02 = 0.116
    # budget δ_b = clamp(0.116, 0.02, 0.04) = 0.04; δ = 0.15
    # t=1: Z = 0.12,  S0 = 0,    W0 = 0   -> c = min(.15, .15)                  = 0.15  keep
    # t=2: Z = 0.09,  S1 = 0.12, W1 = 1.0 -> c = min(.15, .15 + .04 - .12)      = 0.07  drop
    # t=3: Z = 0.04,  S2 = 0.21, W2 = 1.9 -> c = min(.15, .15 + .076 - .21)     = 0.016 drop
    mu = logt([[0.30, 0.30, 0.30, 0.5]])
    pi = logt([[0.42, 0.40, 0.35, 0.9]])
    adv = t([[1.0, 1.0, 1.0, 1.0]])
    mask = t([[1, 1, 1, 0]])
    keep = cppo_keep_mask(pi, mu, adv, mask, delta=0.15, w_min=0.8, budget=0.02, quantile=0.9)
    assert keep[0, :3].tolist() == [True, False, False]
    # DPPO keeps all three (every D ≤ 0.15): the prefix budget is what drops tokens 2 and 3
    assert dppo_tv_keep_mask(pi, mu, adv, 0.15)[0, :3].tolist() == [True, True, True]
    # the same drifted tokens with A < 0 move π back toward μ: always kept
    keep_neg = cppo_keep_mask(pi, mu, -adv, mask, delta=0.15, w_min=0.8, budget=0.02, quantile=0.9)
    assert keep_neg[0, :3].tolist() == [True, True, True]


def test_cppo_small_drift_stays_inside_budget_floor():
    # D = [0.01, 0.01]: P90 = 0.01 -> budget clamp(0.01, 0.02, 0.04) = 0.02; w = [1.0, 0.8]
    # t=2: Z = 0.008, S1 = 0.01, W1 = 1 -> c = min(.15, .15 + .02 - .01 = .16) = .15 -> keep
    mu, pi = logt([[0.5, 0.5]]), logt([[0.51, 0.51]])
    keep = cppo_keep_mask(pi, mu, t([[1.0, 1.0]]), t([[1, 1]]), delta=0.15, w_min=0.8, budget=0.02)
    assert keep.tolist() == [[True, True]]


@pytest.mark.parametrize("seed", range(5))
def test_cppo_and_dppo_keep_every_token_moving_back_toward_mu(seed):
    gen = torch.Generator().manual_seed(seed)
    mu = torch.rand(8, 16, generator=gen, dtype=D).clamp(min=1e-3).log()
    pi = torch.rand(8, 16, generator=gen, dtype=D).clamp(min=1e-3).log()
    adv = torch.randn(8, 16, generator=gen, dtype=D)
    mask = (torch.arange(16) < torch.randint(1, 17, (8, 1), generator=gen)).to(D)
    toward = adv * (pi - mu) <= 0
    keep_c = cppo_keep_mask(pi, mu, adv, mask, delta=0.05, w_min=0.5, budget=0.001)
    keep_d = dppo_tv_keep_mask(pi, mu, adv, 0.05)
    assert torch.all(keep_c[toward]) and torch.all(keep_d[toward])
    # and the tight budget does bite somewhere on tokens moving away
    assert not torch.all(keep_c[~toward & mask.bool()])


@pytest.mark.parametrize("seed", range(3))
def test_cppo_without_position_weight_or_budget_is_dppo(seed):
    gen = torch.Generator().manual_seed(seed)
    mu = torch.rand(6, 10, generator=gen, dtype=D).clamp(min=1e-3).log()
    new = torch.rand(6, 10, generator=gen, dtype=D).clamp(min=1e-3).log().requires_grad_(True)
    adv = torch.randn(6, 10, generator=gen, dtype=D)
    mask = (torch.arange(10) < torch.randint(1, 11, (6, 1), generator=gen)).to(D)
    loose = PolicyLossConfig(cppo_w_min=1.0, cppo_budget=1e9, tv_delta=0.2)
    l_c, _ = get_policy_loss_fn("cppo")(mu, new, adv, mask, config=loose, behavior_log_probs=mu)
    l_d, _ = get_policy_loss_fn("dppo_tv")(mu, new, adv, mask, config=loose, behavior_log_probs=mu)
    torch.testing.assert_close(l_c, l_d, rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------------ opsm


def test_opsm_in_loss_drops_negative_drifted_sequences_without_renormalising():
    # three one-token responses, π_old = π_θ = 0.5 (r = 1):
    # seq 0: A = -1, μ = 0.5·e^0.3 -> mean log(μ/π_θ) = 0.3 > δ = 0.2 -> dropped
    # seq 1: A = +1, drift 0.5 -> kept (A ≥ 0 is never dropped)
    # seq 2: A = -1, drift 0.1 -> kept
    old = logt([[0.5], [0.5], [0.5]])
    new = old.clone().requires_grad_(True)
    beh = old + t([[0.3], [0.5], [0.1]])
    adv = t([[-1.0], [1.0], [-1.0]])
    mask = t([[1], [1], [1]])
    cfg = PolicyLossConfig(opsm_delta=0.2)
    loss, metrics = get_policy_loss_fn("ppo")(
        old, new, adv, mask, config=cfg, behavior_log_probs=beh
    )
    # per-token -A·r = [1, -1, 1]; seq 0 masked; normaliser stays 3 tokens: (0 - 1 + 1)/3 = 0
    assert loss.item() == pytest.approx(0.0, abs=1e-12)
    assert metrics[M.ACTOR_OPSM_MASKED_SEQ_FRAC] == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(new.grad, t([[0.0], [-1 / 3], [1 / 3]]), rtol=0, atol=1e-12)


def test_rollout_mask_drops_tokens_in_every_loss():
    old = logt([[0.5, 0.5]])
    adv, mask, keep = t([[1.0, 1.0]]), t([[1, 1]]), t([[1, 0]])
    for name in POLICY_LOSSES.names():
        new = logt([[0.5, 0.5]]).requires_grad_(True)
        loss, _ = get_policy_loss_fn(name)(old, new, adv, mask, rollout_mask=keep)
        (grad,) = torch.autograd.grad(loss, new)
        # token 1 is dropped: no gradient, and it still counts in the token-mean normaliser
        assert grad[0, 1].item() == 0.0 and grad[0, 0].item() == pytest.approx(-0.5, abs=1e-12), (
            name
        )
