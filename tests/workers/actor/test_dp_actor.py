"""The actor's math on one process (no distributed): log-probs, Σπ², entropy and the update."""

from __future__ import annotations

import copy

import pytest
import torch

from verl.protocol import DataProto
from verl.tasks.synthetic import synthetic_rl_batch
from verl.tasks.tiny_lm import TinyLMSpec, build_tiny_qwen2
from verl.trainer.core_algos.policy_loss import LOSS_AGG_MODES, PolicyLossConfig
from verl.utils import metric_names as M
from verl.workers.actor.config import ActorConfig
from verl.workers.actor.dp_actor import DataParallelPPOActor

P, T, V = 6, 5, 128


@pytest.fixture(scope="module")
def model():
    return build_tiny_qwen2(
        TinyLMSpec(hidden_size=128, num_hidden_layers=2, vocab_size=V, seed=0)
    ).float()


@pytest.fixture(scope="module")
def batch():
    data = synthetic_rl_batch(8, P, T, vocab_size=100, seed=1, group_size=4)
    data.meta_info["temperature"] = 0.7
    return data


def reference_stats(model, data: DataProto, temperature: float) -> dict[str, torch.Tensor]:
    """Plain HF forward, one unpadded sequence at a time: log π, entropy, Σπ² of each response token."""
    out = {k: torch.zeros(len(data), T) for k in ("log_probs", "entropy", "sum_pi_squared")}
    with torch.no_grad():
        for i in range(len(data)):
            keep = data.batch["attention_mask"][i].bool()
            ids = data.batch["input_ids"][i][keep].unsqueeze(0)
            n_resp = int(data.batch["response_mask"][i].sum())
            logits = model(input_ids=ids, use_cache=False).logits[0].double() / temperature
            pred = logits[-n_resp - 1 : -1]
            logp = torch.log_softmax(pred, -1)
            probs = logp.exp()
            out["log_probs"][i, :n_resp] = (
                logp.gather(-1, ids[0, -n_resp:].unsqueeze(-1)).squeeze(-1).float()
            )
            out["entropy"][i, :n_resp] = -(probs * logp).sum(-1).float()
            out["sum_pi_squared"][i, :n_resp] = (probs**2).sum(-1).float()
    return out


def make_actor(model, **overrides) -> DataParallelPPOActor:
    settings = dict(micro_batch_size_per_device_for_experience=3, micro_batch_size_per_device_for_update=2,
                    global_batch_size=8, calculate_sum_pi_squared=True)  # fmt: skip
    cfg = ActorConfig(**{**settings, **overrides})
    return DataParallelPPOActor(cfg, model)


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("dynamic", [False, True])
def test_log_probs_entropy_and_sum_pi_squared_match_plain_hf_forward(
    model, batch, padding_free, dynamic
):
    actor = make_actor(
        model, padding_free=padding_free, dynamic_batching=dynamic, max_token_len_per_device=25
    )
    out = actor.compute_log_prob(batch, calculate_entropy=True)
    ref = reference_stats(model, batch, 0.7)
    mask = batch.batch["response_mask"].bool()
    for key in ("old_log_probs", "entropy", "sum_pi_squared"):
        got = out.batch[key]
        want = ref["log_probs" if key == "old_log_probs" else key]
        assert torch.all(got[~mask] == 0), key  # padding is exactly zero
        torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=1e-5, msg=key)


def test_padded_and_padding_free_paths_agree(model, batch):
    a = make_actor(model, padding_free=True).compute_log_prob(batch).batch["old_log_probs"]
    b = make_actor(model, padding_free=False).compute_log_prob(batch).batch["old_log_probs"]
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_packed_rows_hold_at_most_the_token_budget(model, batch):
    """Padding-free under sdpa: the sequences bin-packed into rows of at most the budget (a longer
    sequence alone), tails padded with positions restarting at 0; the picks point at the tokens
    that predict each valid response token, in row-major order."""
    actor = make_actor(model)
    micro = dict(batch.batch.items())
    keep = micro["attention_mask"].bool()
    lengths = keep.sum(-1).tolist()
    actor.packed_row_tokens = max(lengths) + 1
    kwargs, pick = actor._model_inputs(micro)
    ids, pos = kwargs["input_ids"], kwargs["position_ids"]
    assert ids.shape[0] > 2 and ids.shape[1] <= max(lengths) + 1
    flat_ids, flat_pos = ids.flatten(), pos.flatten()
    mask = micro["response_mask"].bool()
    assert flat_ids[pick + 1].tolist() == micro["responses"][mask].tolist()  # the next token
    assert (flat_pos[pick + 1] - flat_pos[pick]).eq(1).all()  # within one sequence
    # every valid token once (the synthetic batch's tokens are >= 1); the rest is tail padding
    assert sorted(flat_ids[flat_ids.ne(0)].tolist()) == sorted(micro["input_ids"][keep].tolist())
    # the rule under sdpa: max(longest, min(hidden_size, 4 x longest)) = min(128, 4·10) = 40
    # here (lengths 7, 9, 5, 8, 4, 6, 10, 7: 56 tokens, the longest 10)
    actor.packed_row_tokens = None
    assert max(lengths) == 10 and actor._packed_row_budget(lengths) == 40
    rows = actor._model_inputs(micro)[0]["input_ids"]
    assert rows.shape == (2, 28)  # 56 tokens in 2 rows of at most 40: 7+4+10+7 and 9+5+8+6
    assert actor._packed_row_budget([40, 3]) == 128  # 4·40 > hidden_size: capped at 128
    assert actor._packed_row_budget([200, 3]) == 200  # a longer sequence sits alone


@pytest.mark.parametrize("budget", [1, 12, 25])
def test_packed_rows_give_plain_hf_log_probs_entropy_and_sum_pi_squared(model, batch, budget):
    actor = make_actor(model)
    actor.packed_row_tokens = budget  # 1: one sequence per row
    out = actor.compute_log_prob(batch, calculate_entropy=True)
    ref = reference_stats(model, batch, 0.7)
    mask = batch.batch["response_mask"].bool()
    for key in ("old_log_probs", "entropy", "sum_pi_squared"):
        want = ref["log_probs" if key == "old_log_probs" else key]
        torch.testing.assert_close(out.batch[key][mask], want[mask], rtol=0, atol=1e-5, msg=key)
    chunked = make_actor(model, sum_pi_squared_checkpointing=True, sum_pi_squared_chunk_size=4)
    chunked.packed_row_tokens = budget
    again = chunked.compute_log_prob(batch, calculate_entropy=True)
    for key in ("old_log_probs", "entropy", "sum_pi_squared"):
        torch.testing.assert_close(again.batch[key], out.batch[key], rtol=0, atol=1e-6, msg=key)


def _update_batch(model, batch, seed=0):
    data = copy.deepcopy(batch)
    out = make_actor(model).compute_log_prob(data)
    data.batch["old_log_probs"] = out.batch["old_log_probs"]
    gen = torch.Generator().manual_seed(seed)
    data.batch["advantages"] = (
        torch.randn(len(data), 1, generator=gen).expand(-1, T) * data.batch["response_mask"]
    )
    return data


def _step(model, data, lr=0.5, **overrides):
    clone = copy.deepcopy(model)
    actor = make_actor(clone, **overrides)
    actor.actor_optimizer = torch.optim.SGD(clone.parameters(), lr=lr)
    metrics = actor.update_policy(data)
    return clone, metrics


def _max_param_diff(a, b) -> float:
    return max(
        (p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def test_update_with_behavior_equal_old_and_unit_weights_is_plain_ppo(model, batch):
    data = _update_batch(model, batch)
    plain, _ = _step(model, data)
    guided_data = copy.deepcopy(data)
    guided_data.batch["behavior_log_probs"] = data.batch["old_log_probs"].clone()
    guided_data.batch["importance_weights"] = torch.ones_like(data.batch["old_log_probs"])
    guided, _ = _step(model, guided_data)
    assert _max_param_diff(plain, guided) == 0.0
    # and plain PPO itself equals one SGD step on the textbook clipped objective over the batch
    manual = copy.deepcopy(model)
    logits = manual(input_ids=data.batch["input_ids"], attention_mask=data.batch["attention_mask"],
                    position_ids=data.batch["position_ids"], use_cache=False).logits[:, P - 1 : -1] / 0.7  # fmt: skip
    logp = (
        torch.log_softmax(logits.float(), -1)
        .gather(-1, data.batch["responses"].unsqueeze(-1))
        .squeeze(-1)
    )
    ratio = torch.exp(logp - data.batch["old_log_probs"])
    adv, mask = data.batch["advantages"], data.batch["response_mask"]
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - 0.2, 1 + 0.28) * adv)
    loss = -(surrogate * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(manual.parameters(), 1.0)
    with torch.no_grad():
        for p in manual.parameters():
            p -= 0.5 * p.grad
    assert _max_param_diff(plain, manual) < 1e-6
    assert _max_param_diff(plain, model) > 1e-4  # the update did move the parameters


@pytest.mark.parametrize("mode", LOSS_AGG_MODES.names())
def test_gradient_accumulation_equals_single_batch_update(model, batch, mode):
    data = _update_batch(model, batch, seed=3)
    loss = PolicyLossConfig(loss_agg_mode=mode)
    accumulated, m_acc = _step(
        model, data, policy_loss=loss, micro_batch_size_per_device_for_update=2
    )
    single, m_one = _step(model, data, policy_loss=loss, micro_batch_size_per_device_for_update=8)
    assert _max_param_diff(accumulated, single) < 1e-6
    assert m_acc[M.ACTOR_PG_LOSS][0] == pytest.approx(m_one[M.ACTOR_PG_LOSS][0], abs=1e-6)
    assert m_acc[M.ACTOR_GRAD_NORM][0] == pytest.approx(m_one[M.ACTOR_GRAD_NORM][0], rel=1e-5)


def test_update_over_packed_rows_equals_one_packed_row(model, batch):
    """Packed rows of at most 12 tokens in one forward: the same step and metrics as one packed
    row per micro-batch."""
    data = _update_batch(model, batch, seed=5)
    one_row, m_one = _step(model, data, micro_batch_size_per_device_for_update=8)
    clone = copy.deepcopy(model)
    actor = make_actor(clone, micro_batch_size_per_device_for_update=8)
    actor.actor_optimizer = torch.optim.SGD(clone.parameters(), lr=0.5)
    actor.packed_row_tokens = 12
    m_rows = actor.update_policy(data)
    assert _max_param_diff(clone, one_row) < 1e-6 and _max_param_diff(clone, model) > 1e-4
    for key in (M.ACTOR_PG_LOSS, M.ACTOR_PG_CLIPFRAC, M.ACTOR_PPO_KL):
        assert m_rows[key] == pytest.approx(m_one[key], abs=1e-6), key
    assert m_rows[M.ACTOR_GRAD_NORM][0] == pytest.approx(m_one[M.ACTOR_GRAD_NORM][0], rel=1e-5)


def test_non_finite_gradient_skips_the_step(model, batch):
    data = _update_batch(model, batch)
    data.batch["advantages"] = data.batch["advantages"].clone()
    data.batch["advantages"][0, 0] = float("nan")
    stepped, metrics = _step(model, data)
    assert _max_param_diff(stepped, model) == 0.0
    assert metrics[M.ACTOR_SKIPPED_STEPS] == [1.0]


def test_update_reports_the_actor_metrics(model, batch):
    data = _update_batch(model, batch)
    data.batch["ref_log_probs"] = data.batch["old_log_probs"] - 0.1
    _, metrics = _step(
        model, data, entropy_coeff=0.01, use_kl_loss=True, kl_coef=0.1, kl_penalty="k3"
    )
    for key in (M.ACTOR_PG_LOSS, M.ACTOR_PPO_KL, M.ACTOR_PG_CLIPFRAC, M.ACTOR_GRAD_NORM, M.ACTOR_LR,
                M.ACTOR_ENTROPY, M.ACTOR_KL_LOSS):  # fmt: skip
        assert key in metrics and all(torch.isfinite(torch.tensor(metrics[key]))), key
    # first mini-batch step is on-policy: ratio 1, so ppo_kl is 0 and pg_loss = -mean(A)
    assert metrics[M.ACTOR_PPO_KL][0] == pytest.approx(0.0, abs=1e-6)
    mask = data.batch["response_mask"]
    expected = -(data.batch["advantages"] * mask).sum() / mask.sum()
    assert metrics[M.ACTOR_PG_LOSS][0] == pytest.approx(expected.item(), abs=1e-5)


@pytest.mark.parametrize("padding_free", [True, False])
def test_sum_pi_squared_checkpointing_gives_the_same_statistics(model, batch, padding_free):
    base = make_actor(model, padding_free=padding_free).compute_log_prob(
        batch, calculate_entropy=True
    )
    chunked = make_actor(
        model,
        padding_free=padding_free,
        sum_pi_squared_checkpointing=True,
        sum_pi_squared_chunk_size=4,
    )
    out = chunked.compute_log_prob(batch, calculate_entropy=True)
    for key in ("old_log_probs", "entropy", "sum_pi_squared"):
        torch.testing.assert_close(out.batch[key], base.batch[key], rtol=0, atol=1e-6, msg=key)


def test_balanced_partition_hand_example():
    from verl.workers.actor.dp_actor import balanced_partition

    # lengths 9, 2, 7, 3, 5 (Σ = 26), budget 13 -> k = ceil(26/13) = 2
    # longest first into the lightest bin: 9 -> A(9), 7 -> B(7), 5 -> B(12), 3 -> A(12), 2 -> A would be 14 > 13
    # -> k = 3: 9 -> A, 7 -> B, 5 -> C, 3 -> C(8), 2 -> B(9): loads 9, 9, 8
    parts = balanced_partition([9, 2, 7, 3, 5], budget=13)
    assert sorted(map(sorted, parts)) == [[0], [1, 2], [3, 4]]
    # a row longer than the budget gets a micro-batch of its own
    assert sorted(map(sorted, balanced_partition([20, 1, 1], budget=10))) == [[0], [1, 2]]


@pytest.mark.parametrize("seed", range(5))
def test_balanced_partition_properties(seed):
    from verl.workers.actor.dp_actor import balanced_partition

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (37,), generator=gen).tolist()
    parts = balanced_partition(lengths, budget=60)
    assert sorted(i for p in parts for i in p) == list(range(37))  # every row exactly once
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) <= 60
    assert len(parts) >= -(-sum(lengths) // 60)  # never fewer than the lower bound


def test_dynamic_batching_update_equals_fixed_micro_batches(model, batch):
    data = _update_batch(model, batch, seed=4)
    dynamic, _ = _step(model, data, dynamic_batching=True, max_token_len_per_device=30)
    fixed, _ = _step(model, data, micro_batch_size_per_device_for_update=8)
    assert _max_param_diff(dynamic, fixed) < 1e-6


def test_the_update_checks_the_engine_log_probs_on_its_first_mini_batch(model, batch):
    """`algorithm.proximal=rollout`: no π_old forward runs, so the update's first forward (before
    any optimizer step, where π_θ is π_old) gives mismatch/*: the same values as
    compute_mismatch_metrics against a separate compute_log_prob over the first mini-batch's rows,
    and none on the later mini-batches; without the mask key no mismatch/* at all."""
    from verl.trainer.core_algos.kl import compute_mismatch_metrics
    from verl.workers.actor.dp_actor import MISMATCH_MASK_KEY

    data = _update_batch(model, batch, seed=7)
    gen = torch.Generator().manual_seed(11)  # an engine off by a little: |noise| ≤ 0.05 nats
    mask = data.batch["response_mask"]
    noise = (torch.rand(mask.shape, generator=gen) - 0.5) * 0.1 * mask
    data.batch["rollout_log_probs"] = data.batch["old_log_probs"] + noise
    data.batch[MISMATCH_MASK_KEY] = mask.float()
    data.batch[MISMATCH_MASK_KEY][0] = 0.0  # a stale response: left out of the check
    data.meta_info["mismatch_forced_threshold"] = -0.01
    _, metrics = _step(model, data, global_batch_size=4)  # 2 mini-batches of 4 rows
    first = slice(0, 4)
    want = compute_mismatch_metrics(data.batch["rollout_log_probs"][first], data.batch["old_log_probs"][first],
                                    data.batch[MISMATCH_MASK_KEY][first], None, -0.01)  # fmt: skip
    assert want[M.MISMATCH_KL_V2] > 1e-5  # the noise shows (½·E[u²], u ~ U(-0.05, 0.05): ~4e-4)
    for key, value in want.items():
        assert metrics[key] == [pytest.approx(value, rel=1e-4, abs=1e-9)], key
    plain = copy.deepcopy(data)
    del plain.batch[MISMATCH_MASK_KEY]
    _, none = _step(model, plain, global_batch_size=4)
    assert not any(k.startswith("mismatch/") for k in none)
