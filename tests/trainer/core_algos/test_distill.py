"""On-policy distillation from the guidance: hand values of both modes and both estimators, and
Monte-Carlo checks that the sampled estimate and its gradient are those of KL(π ‖ q), for samples
from π and from the guided mixture q_λ with importance weights."""

from __future__ import annotations

import math

import pytest
import torch

from verl.trainer.core_algos.distill import (
    compute_distill_metrics,
    distill_advantages,
    distill_loss,
    distill_token_kl,
    distill_topk_forward_loss,
)
from verl.trainer.core_algos.guidance import LOG_PROB_FLOOR
from verl.trainer.core_algos.policy_loss import compute_policy_loss_ppo
from verl.utils import metric_names as M

D = torch.float64
LOG2 = math.log(2.0)


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=D)


# one response of four tokens and one of two (padding after): π_old(x) and q(x) per token
OLD = _t([[0.5, 0.25, 0.5, 0.8], [0.5, 0.5, 0.3, 0.3]]).log()
TEACHER = _t([[0.25, 0.5, 0.5, 0.4], [0.125, 0.9, 0.3, 0.3]]).log()
MASK = _t([[1, 1, 1, 1], [1, 1, 0, 0]])
MISSING = torch.tensor([[False, False, False, True], [False, False, False, False]])


def test_token_kl_hand_values_and_clamp():
    # k1 = log π - log q: log(0.5/0.25) = log 2, log(0.25/0.5) = -log 2, 0
    k1 = distill_token_kl(OLD[0, :3], TEACHER[0, :3], "k1")
    torch.testing.assert_close(k1, _t([LOG2, -LOG2, 0.0]))
    # k3 = q/π - 1 - log(q/π): 0.5 - 1 + log 2 = 0.193147; 2 - 1 - log 2 = 0.306853; 0
    k3 = distill_token_kl(OLD[0, :3], TEACHER[0, :3], "k3")
    torch.testing.assert_close(k3, _t([0.5 - 1 + LOG2, 1 - LOG2, 0.0]))
    # a teacher probability of exactly 0 (the floor) gives the clamped log-ratio 20, not 1e4
    zero = distill_token_kl(_t([math.log(0.5)]), _t([LOG_PROB_FLOOR]), "k1")
    torch.testing.assert_close(zero, _t([20.0]))


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        # β = 0.5, A_out = 1 on response 0, -1 on response 1; token 3 of response 0 is missing
        # k1 = [log 2, -log 2, 0, (missing)], [log 4, log(0.5/0.9), pad, pad]
        # A = A_out - β·k1: 1 - 0.34657, 1 + 0.34657, 1, 1 | -1 - 0.69315, -1 + 0.29389
        ("k1", [[1 - LOG2 / 2, 1 + LOG2 / 2, 1.0, 1.0], [-1 - LOG2, -1 - 0.5 * math.log(0.5 / 0.9), 0, 0]]),
        # k3 = [0.19315, 0.30685, 0, (missing)], [0.25 - 1 + log 4 = 0.63629, 1.8 - 1 - log 1.8 = 0.21221]
        ("k3", [[1 - 0.5 * (LOG2 - 0.5), 1 - 0.5 * (1 - LOG2), 1.0, 1.0],
                [-1 - 0.5 * (0.25 - 1 + 2 * LOG2), -1 - 0.5 * (0.8 - math.log(1.8)), 0, 0]]),
    ],
)  # fmt: skip
def test_reward_mode_hand_values(estimator, expected):
    outcome = _t([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, 0.0, 0.0]])
    advantages, term = distill_advantages(outcome, OLD, TEACHER, MASK, MISSING, 0.5, estimator)
    torch.testing.assert_close(advantages, _t(expected), rtol=0, atol=1e-12)
    torch.testing.assert_close(term, advantages - outcome, rtol=0, atol=1e-12)
    assert term[0, 3] == 0 and term[1, 2:].eq(0).all()  # missing and padding add nothing


@pytest.mark.parametrize(
    ("estimator", "value", "grad"),
    [
        # token 0: log π = log 0.5, log q = log 0.25, w = 1.5; token 1: missing (nothing).
        # k1 = log 2, d k1 / d log π = 1, so d/d log π of [k1 + sg(k1)·score] = 1 + log 2
        ("k1", 1.5 * LOG2, 1.5 * (1 + LOG2)),
        # k3 = 0.5 - 1 + log 2, d k3 / d log π = 1 - q/π = 0.5, total 0.5 + k3 = log 2
        ("k3", 1.5 * (LOG2 - 0.5), 1.5 * LOG2),
    ],
)
def test_loss_mode_hand_value_and_gradient(estimator, value, grad):
    log_probs = _t([[math.log(0.5), math.log(0.3)]]).requires_grad_(True)
    teacher = _t([[math.log(0.25), math.log(0.9)]])
    weights, mask, missing = _t([[1.5, 0.7]]), _t([[1, 1]]), torch.tensor([[False, True]])
    # token-mean over the response mask (2 tokens, the missing one counts in the normaliser)
    loss = distill_loss(log_probs, teacher, mask, missing, weights, estimator, "token-mean")
    assert loss.item() == pytest.approx(value / 2, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(log_probs.grad, _t([[grad / 2, 0.0]]), rtol=0, atol=1e-12)


def test_a_teacher_zero_is_a_constant_of_the_policy():
    """q = 0 (the floor): log q is clamped to log π - 20 with π detached, so k1 = 20 and the
    loss-mode gradient is pathwise 1 plus score 20 = 21 (not 20: q must not move with π_θ)."""
    log_probs = _t([[math.log(0.5)]]).requires_grad_(True)
    loss = distill_loss(log_probs, _t([[LOG_PROB_FLOOR]]), _t([[1.0]]), None, None, "k1")
    assert loss.item() == pytest.approx(20.0, abs=1e-12)
    loss.backward()
    assert log_probs.grad.item() == pytest.approx(21.0, abs=1e-12)


def test_topk_forward_hand_value_and_gradient():
    """Teacher top-3 q = [0.5, 0.25, unlisted (floor)] -> q̃ = [2/3, 1/3, 0] over the listed;
    π_θ at the same ids [0.4, 0.2, 0.1]: KL = 2/3·log((2/3)/0.4) + 1/3·log((1/3)/0.2)
    = (2/3 + 1/3)·log(5/3) = log(5/3); gradient wrt log π_θ = -q̃. A second, padded position
    adds nothing; token-mean over 1 valid token."""
    log_pi = _t([[[0.4, 0.2, 0.1], [0.3, 0.3, 0.3]]]).log().requires_grad_(True)
    teacher = _t([[[0.5, 0.25, 0.0], [0.5, 0.5, 0.0]]]).log().clamp(min=LOG_PROB_FLOOR)
    loss = distill_topk_forward_loss(log_pi, teacher, _t([[1, 0]]))
    assert loss.item() == pytest.approx(math.log(5 / 3), abs=1e-12)
    loss.backward()
    torch.testing.assert_close(
        log_pi.grad, _t([[[-2 / 3, -1 / 3, 0.0], [0.0, 0.0, 0.0]]]), rtol=0, atol=1e-12
    )
    # a missing position is left out (the normaliser keeps it): 0
    missing = torch.tensor([[True, False]])
    assert distill_topk_forward_loss(log_pi.detach(), teacher, _t([[1, 0]]), missing).item() == 0.0


def test_loss_mode_follows_the_aggregation_mode():
    log_probs = _t([[math.log(0.5), math.log(0.5)], [math.log(0.5), 0.0]])
    teacher = _t([[math.log(0.25), math.log(0.25)], [math.log(0.125), 0.0]])
    mask = _t([[1, 1], [1, 0]])
    # k1 = [log 2, log 2], [log 4, pad]: token-mean (4 log 2)/3; seq-mean-token-mean
    # (log 2 + 2 log 2)/2; seq-mean-token-sum-norm with horizon 2: (2 log 2 + 2 log 2)/2/2
    for mode, expected in (("token-mean", 4 * LOG2 / 3), ("seq-mean-token-mean", 1.5 * LOG2),
                           ("seq-mean-token-sum-norm", LOG2)):  # fmt: skip
        loss = distill_loss(log_probs, teacher, mask, None, None, "k1", mode)
        assert loss.item() == pytest.approx(expected, abs=1e-12), mode


def test_metrics_hand_values():
    weights = _t([[1.0, 2.0, 1.0, 1.0], [0.5, 1.0, 1.0, 1.0]])
    term = _t([[0.1, -0.2, 0.0, 0.0], [0.3, 0.0, 0.0, 0.0]])
    m = compute_distill_metrics(OLD, TEACHER, MASK, MISSING, weights, "k1", term)
    # scored: 5 tokens; w·k1 = log 2, -2 log 2, 0, 0.5 log 4, log(0.5/0.9) -> sum = log(0.5/0.9)
    assert m[M.DISTILL_REVERSE_KL] == pytest.approx(math.log(0.5 / 0.9) / 5, abs=1e-12)
    # log q over the scored tokens: log .25 + log .5 + log .5 + log .125 + log .9
    expected_q = (math.log(0.25) + 2 * math.log(0.5) + math.log(0.125) + math.log(0.9)) / 5
    assert m[M.DISTILL_TEACHER_LOG_PROB] == pytest.approx(expected_q, abs=1e-12)
    assert m[M.DISTILL_MISSING_FRAC] == pytest.approx(1 / 6)  # 1 of 6 valid tokens
    assert m[M.DISTILL_EXCLUDED_FRAC] == pytest.approx(1 / 6)  # the missing token only
    # |term| over the 5 scored tokens (the missing token's 0 is no value): (0.1 + 0.2 + 0.3)/5
    assert m[M.DISTILL_ADVANTAGE_ABS] == pytest.approx(0.6 / 5, abs=1e-12)


def test_metrics_leave_out_floor_and_unknown_tokens():
    # the batch above with two more valid tokens: response 0 gets a token the teacher gives
    # q = 0 exactly (the floor: k1 clamped to 20, term -β·20 = -2 at β = 0.1), response 1 one
    # whose π_old is NaN (its k and term are NaN); neither may move a distill/* mean
    nan = float("nan")
    old = _t([[0.5, 0.25, 0.5, 0.8, 0.5], [0.5, 0.5, nan, 0.3, 0.3]]).log()
    teacher = _t([[0.25, 0.5, 0.5, 0.4, 0.0], [0.125, 0.9, 0.7, 0.3, 0.3]]).log()
    # log 0 = -inf -> the floor, as the rollout hands it to the trainer
    teacher = teacher.clamp(min=LOG_PROB_FLOOR)
    mask = _t([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    missing = torch.tensor([[False, False, False, True, False], [False] * 5])
    weights = _t([[1.0, 2.0, 1.0, 1.0, 1.0], [0.5, 1.0, 1.0, 1.0, 1.0]])
    term = _t([[0.1, -0.2, 0.0, 0.0, -2.0], [0.3, 0.0, nan, 0.0, 0.0]])
    m = compute_distill_metrics(old, teacher, mask, missing, weights, "k1", term)
    # the same 5 known tokens as test_metrics_hand_values, hence the same three means
    assert m[M.DISTILL_REVERSE_KL] == pytest.approx(math.log(0.5 / 0.9) / 5, abs=1e-12)
    expected_q = (math.log(0.25) + 2 * math.log(0.5) + math.log(0.125) + math.log(0.9)) / 5
    assert m[M.DISTILL_TEACHER_LOG_PROB] == pytest.approx(expected_q, abs=1e-12)
    assert m[M.DISTILL_ADVANTAGE_ABS] == pytest.approx(0.6 / 5, abs=1e-12)
    # 8 valid tokens: 1 missing -> missing_frac 1/8; left out of the means: missing, q = 0, NaN
    assert m[M.DISTILL_MISSING_FRAC] == pytest.approx(1 / 8, abs=1e-12)
    assert m[M.DISTILL_EXCLUDED_FRAC] == pytest.approx(3 / 8, abs=1e-12)


# ------------------------------------------------------------------ Monte Carlo, small vocabulary
V, N, BATCHES = 6, 240_000, 60


def _policy_and_teacher():
    gen = torch.Generator().manual_seed(7)
    logits = (1.5 * torch.randn(V, generator=gen, dtype=D)).requires_grad_(True)
    teacher = torch.log_softmax(1.5 * torch.randn(V, generator=gen, dtype=D), -1)
    return logits, teacher


def _exact_kl(logits: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    log_pi = torch.log_softmax(logits, -1)
    return (log_pi.exp() * (log_pi - teacher)).sum()


def _samples(logits, teacher, lam: float):
    """N tokens from μ = (1-λ)π + λq, with w = π/μ (λ = 0: samples from π, w = 1)."""
    pi = torch.softmax(logits.detach(), -1)
    mu = (1 - lam) * pi + lam * teacher.exp()
    x = torch.multinomial(mu, N, replacement=True, generator=torch.Generator().manual_seed(11))
    return x, (pi[x] / mu[x])


@pytest.mark.parametrize("lam", [0.0, 0.5])
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_estimate_mean_is_the_reverse_kl(estimator, lam):
    """mean(w·k) over samples from μ equals KL(π ‖ q) within 4 standard errors."""
    logits, teacher = _policy_and_teacher()
    x, w = _samples(logits, teacher, lam)
    log_pi = torch.log_softmax(logits.detach(), -1)
    values = w * distill_token_kl(log_pi[x], teacher[x], estimator)
    se = values.std() / math.sqrt(N)
    exact = _exact_kl(logits.detach(), teacher).item()
    assert abs(values.mean().item() - exact) < 4 * se.item(), (values.mean().item(), exact)
    assert exact > 0.3  # the two distributions differ enough for the test to mean something


def _mean_gradient(logits, teacher, lam, loss_of) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard error (V,) of the gradient of `loss_of(log π(x), log q(x), w)` over
    BATCHES batches of N / BATCHES samples."""
    x, w = _samples(logits, teacher, lam)
    grads = []
    for xs, ws in zip(x.chunk(BATCHES), w.chunk(BATCHES), strict=True):
        log_pi = torch.log_softmax(logits, -1)
        (grad,) = torch.autograd.grad(
            loss_of(log_pi[xs][:, None], teacher[xs][:, None], ws[:, None]), logits
        )
        grads.append(grad)
    grads = torch.stack(grads)
    return grads.mean(0), grads.std(0) / math.sqrt(BATCHES)


def _loss_mode(estimator):
    def loss_of(log_pi, log_q, w):
        return distill_loss(
            log_pi, log_q, torch.ones_like(log_pi), None, w, estimator, "token-mean"
        )

    return loss_of


def _reward_mode(log_pi, log_q, w):
    """The PPO loss at θ = θ_old with A = -k1(π_old, q) (β = 1) and weights w."""
    advantages, _ = distill_advantages(torch.zeros_like(log_pi), log_pi.detach(), log_q, torch.ones_like(log_pi), None, 1.0, "k1")  # fmt: skip
    return compute_policy_loss_ppo(log_pi.detach(), log_pi, advantages, torch.ones_like(log_pi), importance_weights=w)[0]  # fmt: skip


@pytest.mark.parametrize("lam", [0.0, 0.5])
@pytest.mark.parametrize(
    "loss_of", [_loss_mode("k1"), _loss_mode("k3"), _reward_mode], ids=["loss-k1", "loss-k3", "reward-k1"]
)  # fmt: skip
def test_mean_gradient_is_the_reverse_kl_gradient(loss_of, lam):
    """Averaged over samples from μ with weights, the gradient of loss mode (k1, k3) and of
    reward mode (k1, through the PPO loss) equals ∇_z KL(π_z ‖ q) within 4 standard errors."""
    logits, teacher = _policy_and_teacher()
    mean, se = _mean_gradient(logits, teacher, lam, loss_of)
    (exact,) = torch.autograd.grad(_exact_kl(logits, teacher), logits)
    assert torch.all((mean - exact).abs() < 4 * se + 1e-9), (mean, exact, se)
    assert exact.abs().max() > 10 * se.max()  # the check has the power to see a wrong gradient


def test_pathwise_k3_alone_would_be_the_forward_kl_gradient():
    """Why loss mode adds the score-function term: differentiating k3 alone gives, on average,
    ∇ KL(q ‖ π), which this Monte Carlo check tells apart from ∇ KL(π ‖ q)."""
    logits, teacher = _policy_and_teacher()

    def pathwise(log_pi, log_q, w):
        return (w * distill_token_kl(log_pi, log_q, "k3")).mean()

    mean, se = _mean_gradient(logits, teacher, 0.0, pathwise)
    forward = (teacher.exp() * (teacher - torch.log_softmax(logits, -1))).sum()
    (forward_grad,) = torch.autograd.grad(forward, logits)
    (reverse_grad,) = torch.autograd.grad(_exact_kl(logits, teacher), logits)
    assert torch.all((mean - forward_grad).abs() < 4 * se + 1e-9)
    assert ((mean - reverse_grad).abs() > 4 * se).any()
