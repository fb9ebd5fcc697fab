"""The pure speculative algorithm: emitted tokens follow q_λ exactly (statistical tests, fixed seeds)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from speculative_helpers import P1, Q1, D, chi2_counts_pvalue

from verl.trainer.core_algos.guidance import mixture_log_probs
from verl.workers.rollout.speculative import (
    ListedRows,
    SpeculativeBatch,
    TopK,
    overlapped_generate,
    speculative_generate,
    verify_proposals,
)


@pytest.mark.parametrize("lam", [0.0, 0.3, 0.5, 1.0])
def test_single_step_emits_q_lambda(lam):
    n = 40_000
    gen = torch.Generator().manual_seed(int(lam * 100) + 1)
    proposals = torch.multinomial(P1, n, replacement=True, generator=gen).unsqueeze(-1)
    result = verify_proposals(
        proposals,
        torch.ones(n, dtype=torch.long),
        P1.log().expand(n, 1, 5),
        Q1.log().expand(n, 1, 5),
        lam,
        gen,
    )
    assert torch.all(result.num_emitted == 1)
    counts = torch.bincount(result.tokens[:, 0], minlength=5).to(D)
    target = (1 - lam) * P1 + lam * Q1
    assert chi2_counts_pvalue(counts, target) > 1e-3
    # provenance: λ = 0 never emits a guidance token; the off-policy share is TV(q_λ, p) = λ·TV(q, p)
    tv = 0.5 * (target - P1).abs().sum().item()
    share = result.offpolicy.double().mean().item()
    assert share == pytest.approx(tv, abs=4 * math.sqrt(max(tv * (1 - tv), 1e-12) / n) + 1e-12)
    if lam == 0.0:
        assert not result.offpolicy.any()
    # recorded log-probs are those of the emitted tokens
    torch.testing.assert_close(result.draft_log_probs[:, 0], P1.log()[result.tokens[:, 0]])
    torch.testing.assert_close(result.guidance_log_probs[:, 0], Q1.log()[result.tokens[:, 0]])


def test_offpolicy_marks_exactly_the_residual_token():
    # proposal token 0 has q = 0 and λ = 1: always rejected; the residual max(0, q - p) has
    # support only where q > p, i.e. tokens 2, 3, 4
    n = 2000
    p = torch.tensor([0.6, 0.3, 0.1, 0.0, 0.0], dtype=D)
    q = torch.tensor([0.0, 0.2, 0.3, 0.25, 0.25], dtype=D)
    proposals = torch.tensor([[0, 1]]).expand(n, 2)
    result = verify_proposals(
        proposals, torch.full((n,), 2), p.log().expand(n, 2, 5), q.log().expand(n, 2, 5), 1.0
    )
    assert torch.all(result.num_accepted == 0) and torch.all(result.num_emitted == 1)
    assert torch.all(result.offpolicy[:, 0]) and not result.offpolicy[:, 1].any()
    assert set(result.tokens[:, 0].tolist()) <= {2, 3, 4}
    assert torch.all(result.tokens[:, 1] == -1)  # the second proposal is dropped
    # a proposal the guidance likes at least as much (q/p >= 1) is always accepted, never marked
    good = verify_proposals(torch.tensor([[2, 3]]).expand(n, 2), torch.full((n,), 2),
                            p.clamp(min=1e-9).log().expand(n, 2, 5), q.log().expand(n, 2, 5), 0.7)  # fmt: skip
    assert torch.all(good.num_accepted == 2) and not good.offpolicy.any()


@pytest.mark.parametrize("lam", [0.5, 1.0])
def test_topk_guidance_lists_emit_the_truncated_target(lam):
    """A guidance that lists only its top-2 of V = 6: the emitted token follows the documented
    target t = (1-λ)p + λq̃, q̃ = q renormalised over the listed set S (chi-square), with
    log q̃ and TV(t, q_λ) = λ(1 - Q_S) recorded per token."""
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], dtype=D)
    q = torch.tensor([0.05, 0.1, 0.2, 0.3, 0.05, 0.3], dtype=D)
    n = 40_000
    x = torch.multinomial(p, n, replacement=True, generator=torch.Generator().manual_seed(5))
    # S = {3, 5} (top-2 of q), Q_S = 0.6: q̃ = [0, 0, 0, 0.5, 0, 0.5]
    guide = TopK(
        torch.tensor([3, 5]).expand(n, 1, 2), q.log()[torch.tensor([3, 5])].expand(n, 1, 2)
    )
    out = verify_proposals(x.unsqueeze(-1), torch.ones(n, dtype=torch.long), p.log().expand(n, 1, 6),
                           guide, lam, torch.Generator().manual_seed(9))  # fmt: skip
    q_t = torch.tensor([0, 0, 0, 0.5, 0, 0.5], dtype=D)
    target = (1 - lam) * p + lam * q_t
    counts = torch.bincount(out.tokens[:, 0], minlength=6).to(D)
    assert chi2_counts_pvalue(counts, target) > 1e-3
    y = out.tokens[:, 0]
    torch.testing.assert_close(out.target_log_probs[:, 0], q_t.log()[y])
    torch.testing.assert_close(out.draft_log_probs[:, 0], p.log()[y])
    torch.testing.assert_close(out.target_tv[:, 0], torch.full((n,), lam * 0.4, dtype=D))
    # a draft list that does not give p on S cannot draw the residual: refused
    partial = TopK(x.view(n, 1, 1), p.log()[x].view(n, 1, 1))
    with pytest.raises(ValueError, match="does not give p"):
        verify_proposals(x.unsqueeze(-1), torch.ones(n, dtype=torch.long), partial, guide, lam,
                         torch.Generator().manual_seed(9))  # fmt: skip


# ---------------------------------------------------------------------------------------- loop

V = 3
P_CHAIN = torch.tensor(
    [[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.3, 0.3, 0.4]], dtype=D
)  # p(next | prev)
Q_CHAIN = torch.tensor([[0.1, 0.2, 0.7], [0.6, 0.1, 0.3], [0.25, 0.5, 0.25]], dtype=D)


def toy_engines(gen: torch.Generator):
    """Vectorised toy draft / guidance 'models': Markov chains over V tokens."""

    def propose(ids, prefixes, budget):
        k = max(budget)
        last = torch.tensor([p[-1] for p in prefixes])
        proposals = torch.full((len(prefixes), k), -1, dtype=torch.long)
        tables = torch.zeros(len(prefixes), k, V, dtype=D)
        for j in range(k):
            tables[:, j] = P_CHAIN[last].log()
            nxt = torch.multinomial(P_CHAIN[last], 1, generator=gen).squeeze(-1)
            proposals[:, j] = nxt
            last = nxt
        num = torch.tensor(budget)
        proposals[torch.arange(k) >= num.unsqueeze(-1)] = -1
        return proposals, num, tables

    def score(ids, prefixes, proposals, num):
        prev = torch.cat(
            [torch.tensor([[p[-1]] for p in prefixes]), proposals[:, :-1].clamp(min=0)], dim=1
        )
        return Q_CHAIN[prev].log()

    return propose, score


def chain_prob(seq, lam, start=0, q=Q_CHAIN):
    """Probability of `seq` under the chain (1-λ)·P + λ·q (q: Q_CHAIN, or a truncated q̃)."""
    prob, prev = 1.0, start
    mix = (1 - lam) * P_CHAIN + lam * q
    for tok in seq:
        prob *= mix[prev, tok].item()
        prev = tok
    return prob


def chain_pvalue(seqs: list, lam: float, length: int, q: torch.Tensor = Q_CHAIN) -> float:
    """Chi-square p-value of `length`-token sequences from token 0 against the chain mixture
    (1-λ)·P + λ·q."""
    outcomes = list(itertools.product(range(V), repeat=length))
    index = {o: i for i, o in enumerate(outcomes)}
    counts = torch.zeros(len(outcomes), dtype=D)
    for s in seqs:
        counts[index[tuple(s.tokens)]] += 1
    probs = torch.tensor([chain_prob(o, lam, q=q) for o in outcomes], dtype=D)
    return chi2_counts_pvalue(counts, probs)


@pytest.mark.parametrize(("lam", "k"), [(0.5, 1), (0.5, 2), (0.5, 4), (1.0, 3), (0.0, 2), (0.8, 3)])
def test_generated_sequences_follow_q_lambda(lam, k):
    n, length = 30_000, 3
    gen = torch.Generator().manual_seed(k * 10 + int(lam * 10))
    propose, score = toy_engines(gen)
    seqs, stats = speculative_generate([[0]] * n, propose, score, lam, k, length, None, gen)
    assert chain_pvalue(seqs, lam, length) > 1e-3
    assert stats.emitted == n * length
    if lam == 0.0:
        assert stats.accept_rate == 1.0 and not any(any(s.offpolicy) for s in seqs)
        # every proposal accepted, no bonus tokens here: k = 2 tokens a round, then the last 1
        # (budget 1), so 2 rounds per sequence: sequence_rounds 2n over `rounds` batch rounds 2
        assert (stats.sequence_rounds, stats.rounds) == (2 * n, 2)
    # every token's recorded log-probs are the chains' values, and the exact behavior is log q_λ
    s = seqs[0]
    prevs = [0, *s.tokens[:-1]]
    for tok, prev, lp, lq in zip(
        s.tokens, prevs, s.draft_log_probs, s.guidance_log_probs, strict=True
    ):
        assert lp == pytest.approx(math.log(P_CHAIN[prev, tok]))
        assert lq == pytest.approx(math.log(Q_CHAIN[prev, tok]))
    behavior = mixture_log_probs(
        torch.tensor(s.draft_log_probs, dtype=D),
        torch.tensor(s.guidance_log_probs, dtype=D),
        None,
        lam,
    )
    expected = [
        math.log(chain_prob([t], lam, start=p)) for t, p in zip(s.tokens, prevs, strict=True)
    ]
    torch.testing.assert_close(behavior, torch.tensor(expected, dtype=D))


def test_eos_ends_a_sequence_and_lengths_follow_q_lambda():
    # token 2 is EOS: sequences are 1..3 tokens long, probability of each from the chain
    n, lam, eos = 30_000, 0.5, 2
    gen = torch.Generator().manual_seed(7)
    base_propose, score = toy_engines(gen)

    def propose(ids, prefixes, budget):  # the draft stops after proposing EOS, like vLLM
        proposals, num, tables = base_propose(ids, prefixes, budget)
        for b in range(len(prefixes)):
            hits = (proposals[b, : num[b]] == eos).nonzero()
            if hits.numel():
                num[b] = int(hits[0]) + 1
                proposals[b, num[b] :] = -1
        return proposals, num, tables

    seqs, _ = speculative_generate([[0]] * n, propose, score, lam, 3, 3, eos, gen)
    outcomes = [o for length in (1, 2, 3) for o in itertools.product(range(V), repeat=length)
                if (eos not in o[:-1]) and (len(o) == 3 or o[-1] == eos)]  # fmt: skip
    index = {o: i for i, o in enumerate(outcomes)}
    counts = torch.zeros(len(outcomes), dtype=D)
    for s in seqs:
        counts[index[tuple(s.tokens)]] += 1
    probs = torch.tensor([chain_prob(o, lam) for o in outcomes], dtype=D)
    assert probs.sum().item() == pytest.approx(1.0)
    assert chi2_counts_pvalue(counts, probs) > 1e-3


def stop_after_pair(tokens: list[int]) -> int | None:
    """A two-token "stop string": the response ends right after its first 1 followed by 2."""
    for j in range(1, len(tokens)):
        if tokens[j - 1] == 1 and tokens[j] == 2:
            return j + 1
    return None


def test_a_stop_rule_and_per_sequence_limits_keep_sequences_exact():
    """A stop rule (the multi-turn modes' stop strings) cuts a round where a response first ends
    with the pair (1, 2), which may straddle two rounds (k = 2); half the sequences may have 3
    tokens, half 4. Every outcome's frequency is its probability under the chain mixture with
    that stopping time: sum over complete outcomes = 1, chi-square against the counts."""
    n, lam, k = 40_000, 0.5, 2
    gen = torch.Generator().manual_seed(17)
    propose, score = toy_engines(gen)
    limits = [3 if i % 2 else 4 for i in range(n)]
    batch = SpeculativeBatch([[0]] * n, lam, k, limits, None, gen,
                             stop=lambda r, tokens: stop_after_pair(tokens))  # fmt: skip
    while not batch.done:
        ids, prefixes, budget = batch.next_round()
        proposals, num, tables = propose(ids, prefixes, budget)
        batch.apply(proposals, num, tables, score(ids, prefixes, proposals, num))
    for limit in (3, 4):
        seqs = batch.seqs[0::2] if limit == 4 else batch.seqs[1::2]
        outcomes = [o for m in range(2, limit + 1) for o in itertools.product(range(V), repeat=m)
                    if stop_after_pair(list(o)) in (m, None) and (stop_after_pair(list(o)) == m or m == limit)]  # fmt: skip
        index = {o: i for i, o in enumerate(outcomes)}
        counts = torch.zeros(len(outcomes), dtype=D)
        for s in seqs:
            counts[index[tuple(s.tokens)]] += 1
            assert s.stopped == (stop_after_pair(s.tokens) == len(s.tokens))
            assert len(s.offpolicy) == len(s.draft_log_probs) == len(s.lam) == len(s.tokens)
        probs = torch.tensor([chain_prob(o, lam) for o in outcomes], dtype=D)
        assert probs.sum().item() == pytest.approx(1.0)  # the outcomes are all the possible ones
        assert chi2_counts_pvalue(counts, probs) > 1e-3
    assert any(s.stopped for s in batch.seqs) and not all(s.stopped for s in batch.seqs)


def test_engines_get_the_index_of_each_active_sequence():
    """propose/score receive `ids`: the positions in `prompts` of the sequences still running, so
    engines can keep per-sequence state (vLLM sessions). Prompts here are distinct."""
    gen = torch.Generator().manual_seed(3)
    base_propose, base_score = toy_engines(gen)
    prompts = [[0], [1, 2], [2, 2, 1], [1]]
    seen: list[list[int]] = []
    eos = 2

    def propose(ids, prefixes, budget):
        seen.append(list(ids))
        for i, prefix in zip(ids, prefixes, strict=True):
            assert prefix[: len(prompts[i])] == prompts[i]
        proposals, num, tables = base_propose(ids, prefixes, budget)
        for row in range(len(ids)):  # stop proposing after EOS, like vLLM
            hits = (proposals[row, : num[row]] == eos).nonzero()
            if hits.numel():
                num[row] = int(hits[0]) + 1
                proposals[row, num[row] :] = -1
        return proposals, num, tables

    def score(ids, prefixes, proposals, num):
        assert list(ids) == seen[-1]
        return base_score(ids, prefixes, proposals, num)

    seqs, _ = speculative_generate(prompts, propose, score, 0.5, 2, 6, eos, gen)
    assert seen[0] == [0, 1, 2, 3]
    for before, after in itertools.pairwise(seen):  # finished sequences drop out, order is kept
        assert set(after) <= set(before) and after == sorted(after)
    for i, s in enumerate(seqs):  # every sequence ended at EOS or at the length limit
        assert s.finished
        assert (s.tokens[-1] == eos) or len(s.tokens) == 6, i


class ToyStepper:
    """Draft engine at step granularity: a round's proposals (from its group's toy chain) are
    ready after as many steps as its longest budget; records which groups shared each step."""

    def __init__(self, engines, group_of):
        self.engines, self.group_of = engines, group_of
        self.running: dict[int, list] = {}
        self.shared: list[tuple[int, ...]] = []

    def start(self, key, ids, prefixes, budget, lookahead):
        assert key == self.group_of[ids[0]] and key not in self.running
        assert not any(lookahead)  # the batches here run without bonus tokens
        self.running[key] = [max(budget), self.engines[key][0](ids, prefixes, budget)]

    @property
    def busy(self):
        return bool(self.running)

    def drafting(self, key):
        return False

    def lookahead(self, key):
        return None

    def probe(self, ids, prefixes, tokens):
        raise AssertionError("dense draft tables give p everywhere: nothing to probe")

    def step(self):
        self.shared.append(tuple(sorted(self.running)))
        done = []
        for key in list(self.running):
            self.running[key][0] -= 1
            if self.running[key][0] == 0:
                done.append((key, *self.running.pop(key)[1]))
        return done


class ToyScorer:
    """Guidance answering in order; `ready()` says no every other time (the driver must cope)."""

    def __init__(self, engines, group_of):
        self.engines, self.group_of, self.queue, self.polls = engines, group_of, [], 0

    def submit(self, ids, prefixes, proposals, num):
        self.queue.append(self.engines[self.group_of[ids[0]]][1](ids, prefixes, proposals, num))

    def ready(self):
        self.polls += 1
        return bool(self.queue) and self.polls % 2 == 0

    def collect(self):
        return self.queue.pop(0)


@pytest.mark.parametrize("stagger", [1, 2, 5])
def test_overlapped_batches_equal_each_batch_alone(stagger):
    """Batches whose rounds overlap across the two engines give exactly the tokens each batch
    gives alone (speculative_generate) with the same engines and generators: the overlap changes
    when work happens, never what is sampled. Later batches start `stagger` draft steps apart."""
    prompts = [[0], [1, 2], [2, 2, 1], [1], [0, 1], [2], [1, 1]]
    groups = [[0, 3, 6], [1, 4], [2, 5]]
    group_of = {i: n for n, g in enumerate(groups) for i in g}

    def make():  # per group: toy engines and a batch, each with its own generator
        engines = [toy_engines(torch.Generator().manual_seed(11 + n)) for n in range(len(groups))]
        batches = [SpeculativeBatch([prompts[i] for i in g], 0.5, 3, 7, None, torch.Generator().manual_seed(20 + n), ids=g)
                   for n, g in enumerate(groups)]  # fmt: skip
        return engines, batches

    engines, alone = make()
    for n, batch in enumerate(alone):
        seqs, stats = speculative_generate(
            batch.prompts, engines[n][0], engines[n][1], 0.5, 3, 7, None, batch.generator
        )
        batch.seqs, batch.stats = seqs, stats  # fmt: skip
    engines, together = make()
    draft, scorer = ToyStepper(engines, group_of), ToyScorer(engines, group_of)
    overlapped_generate(together, draft, scorer, stagger)
    assert not draft.running and not scorer.queue
    for one, two in zip(alone, together, strict=True):
        assert [s.tokens for s in one.seqs] == [s.tokens for s in two.seqs]
        assert [s.offpolicy for s in one.seqs] == [s.offpolicy for s in two.seqs]
        assert [s.guidance_log_probs for s in one.seqs] == [s.guidance_log_probs for s in two.seqs]
        assert one.stats == two.stats and one.stats.rounds > 1
        assert all(s.finished for s in two.seqs)
    # batch 1 joined at step `stagger` (unless batch 0's first round ended sooner), and some
    # draft steps carried rounds of two batches at once
    first_step_of_1 = next(i for i, keys in enumerate(draft.shared) if 1 in keys)
    assert first_step_of_1 == min(stagger, 3)
    assert any(len(keys) >= 2 for keys in draft.shared)


def test_overlapped_generate_follows_q_lambda():
    """Distribution check through the overlapped driver: 3-token sequences of 2 x 10,000 prompts
    follow the chain mixture q_λ (chi-square), as with the synchronous loop."""
    n, lam, length = 10_000, 0.5, 3
    engines = [toy_engines(torch.Generator().manual_seed(31 + g)) for g in range(2)]
    group_of = {i: i // n for i in range(2 * n)}
    batches = [SpeculativeBatch([[0]] * n, lam, 2, length, None, torch.Generator().manual_seed(41 + g),
                                ids=list(range(g * n, (g + 1) * n))) for g in range(2)]  # fmt: skip
    overlapped_generate(batches, ToyStepper(engines, group_of), ToyScorer(engines, group_of), 1)
    assert chain_pvalue([s for b in batches for s in b.seqs], lam, length) > 1e-3


def chain_rows(
    table: torch.Tensor, prev: np.ndarray, tokens: np.ndarray, top: int | None = None
) -> ListedRows:
    """Rows of a chain at states `prev` (N,): column 0 the token, then every token of V, or with
    `top` only the `top` most likely (ties in id order), as an engine's top-K."""
    order = np.tile(np.arange(V), (len(prev), 1))
    if top is not None:
        order = np.argsort(-table.numpy()[prev], axis=-1, kind="stable")[:, :top]
    ids = np.concatenate([tokens[:, None], order], axis=1)
    return ListedRows(ids, np.log(table.numpy()[prev[:, None], ids]))


def truncated_chain(table: torch.Tensor, top: int) -> torch.Tensor:
    """q̃: each row of `table` renormalised over its `top` most likely tokens (as `chain_rows`)."""
    keep = torch.zeros_like(table, dtype=torch.bool)
    keep.scatter_(
        -1, torch.from_numpy(np.argsort(-table.numpy(), -1, kind="stable")[:, :top]), True
    )
    kept = torch.where(keep, table, 0.0)
    return kept / kept.sum(-1, keepdim=True)


class ListedChainStepper:
    """The chain draft as a `DraftStepper` with flat rows and lookahead tokens: a round's
    proposals come after max(budget) steps, its lookahead one step later. Every round draws
    k + 1 tokens per sequence from its batch's generator, used or not, so what is drawn never
    depends on timing. Rows list all of V, or with `top` the proposal and the top `top`; `probe`
    answers from the chain and records (ids, prefixes, tokens) of each call."""

    def __init__(self, seeds: dict[int, int], top: int | None = None):
        self.gens = {key: np.random.default_rng(seed) for key, seed in seeds.items()}
        self.running: dict[int, list] = {}
        self.top, self.calls = top, []

    def start(self, key, ids, prefixes, budget, lookahead):
        gen, k = self.gens[key], max(budget)
        states, last = [], np.array([p[-1] for p in prefixes])
        for _ in range(k + 1):  # inverse CDF of the chain's row at each sequence's last token
            states.append(last)
            u = gen.random(len(last))
            last = (P_CHAIN.numpy()[last].cumsum(-1) <= u[:, None]).sum(-1).clip(max=V - 1)
        states.append(last)
        drawn = np.stack(states[1:], axis=1)  # (B, k + 1) tokens
        prev = np.stack(states[:-1], axis=1)
        num = torch.tensor(budget)
        used = np.arange(k) < np.array(budget)[:, None]
        rows = chain_rows(P_CHAIN, prev[:, :k][used], drawn[:, :k][used], self.top)
        proposals = torch.from_numpy(np.where(used, drawn[:, :k], -1))
        has = np.array(lookahead)
        at = np.array(budget)[has]
        extra = (
            (has, chain_rows(P_CHAIN, prev[has, at], drawn[has, at], self.top))
            if has.any()
            else None
        )
        self.running[key] = [k, (proposals, num, rows), extra, 1 if has.any() else 0]

    @property
    def busy(self):
        return any(r[0] > 0 or r[3] > 0 for r in self.running.values())

    def step(self):
        done = []
        for key, r in self.running.items():
            if r[0] > 0:
                r[0] -= 1
                if r[0] == 0:
                    done.append((key, *r[1]))
            elif r[3] > 0:
                r[3] -= 1
        return done

    def drafting(self, key):
        return self.running[key][3] > 0

    def lookahead(self, key):
        return self.running.pop(key)[2]

    def probe(self, ids, prefixes, tokens):
        self.calls.append((list(ids), [list(p) for p in prefixes], tokens.copy()))
        return np.log(P_CHAIN.numpy()[np.array([p[-1] for p in prefixes])[:, None], tokens])


class ListedChainScorer(ToyScorer):
    """The chain guidance with flat rows (all of V, or the proposal and the top `top`), and one
    row past each sequence's last proposal (column 0 its most likely token)."""

    def __init__(self, top: int | None = None):
        super().__init__(None, None)
        self.top = top

    def submit(self, ids, prefixes, proposals, num):
        num_np = num.numpy()
        last = np.array([p[-1] for p in prefixes])
        prev = np.concatenate([last[:, None], proposals[:, :-1].clamp(min=0).numpy()], axis=1)
        used = np.arange(proposals.shape[1]) < num_np[:, None]
        rows = chain_rows(Q_CHAIN, prev[used], proposals.numpy()[used], self.top)
        end = proposals.numpy()[np.arange(len(num_np)), num_np - 1]
        following = chain_rows(Q_CHAIN, end, Q_CHAIN.numpy()[end].argmax(-1), self.top)
        self.queue.append((rows, following))


def run_bonus_batches(
    lam: float,
    k: int,
    n: int,
    length: int,
    stagger: int,
    draft_top=None,
    guide_top=None,
    target: str = "renormalize",
):
    """Two batches of n prompts [0] with bonus tokens through `overlapped_generate`; returns
    the batches and the draft stepper (its probe calls)."""
    batches = [SpeculativeBatch([[0]] * n, lam, k, length, None, torch.Generator().manual_seed(41 + g),
                                ids=list(range(g * n, (g + 1) * n)), bonus=True, target=target) for g in range(2)]  # fmt: skip
    stepper, scorer = ListedChainStepper({0: 51, 1: 52}, draft_top), ListedChainScorer(guide_top)
    overlapped_generate(batches, stepper, scorer, stagger)
    assert not stepper.running and not scorer.queue
    return batches, stepper


@pytest.mark.parametrize(("lam", "k"), [(0.5, 1), (0.5, 2), (0.0, 2), (1.0, 1), (0.8, 2)])
def test_bonus_tokens_follow_q_lambda(lam, k):
    """With the draft's lookahead tokens, fully accepted rounds emit a bonus token, and 3-token
    sequences of 2 x 10,000 prompts still follow the chain mixture q_λ (chi-square); every
    token's recorded log-probs are the chains' values, and λ = 0 never emits a guidance token."""
    n, length = 10_000, 3
    batches, stepper = run_bonus_batches(lam, k, n, length, 1)
    assert not stepper.calls  # rows list all of V: the probe is never needed
    assert chain_pvalue([s for b in batches for s in b.seqs], lam, length) > 1e-3
    stats = [b.stats for b in batches]
    assert all(st.bonus > 0 for st in stats)  # each batch emitted bonus tokens
    assert sum(st.emitted for st in stats) == 2 * n * length
    seqs = [s for b in batches for s in b.seqs]
    if lam == 0.0:
        assert not any(any(s.offpolicy) for s in seqs)
    tokens = np.array([s.tokens for s in seqs])
    prevs = np.concatenate([np.zeros((len(seqs), 1), dtype=int), tokens[:, :-1]], axis=1)
    np.testing.assert_allclose(
        np.array([s.draft_log_probs for s in seqs]), np.log(P_CHAIN.numpy()[prevs, tokens])
    )
    np.testing.assert_allclose(
        np.array([s.guidance_log_probs for s in seqs]), np.log(Q_CHAIN.numpy()[prevs, tokens])
    )


@pytest.mark.parametrize(("lam", "k"), [(0.5, 2), (0.8, 1)])
def test_partial_lists_with_probe_follow_the_truncated_chain(lam, k):
    """Draft rows listing the proposal and its top-1, guidance rows its top-2 of V = 3, with
    bonus tokens, through `overlapped_generate`: 3-token sequences of 2 x 10,000 prompts follow
    the chain (1-λ)·P + λ·Q̃ (Q̃ = Q renormalised over each row's top-2), not q_λ (chi-square).
    The draft's p on S comes from `DraftStepper.probe`, which each call asks at the prefix the
    token is drawn after (prompt + emitted + proposals before it), for tokens drawn there."""
    n, length = 10_000, 3
    q_t = truncated_chain(Q_CHAIN, 2)  # rows: [0, 2/9, 7/9], [2/3, 0, 1/3], [1/3, 2/3, 0]
    torch.testing.assert_close(
        q_t, torch.tensor([[0, 2 / 9, 7 / 9], [2 / 3, 0, 1 / 3], [1 / 3, 2 / 3, 0]], dtype=D)
    )
    batches, stepper = run_bonus_batches(lam, k, n, length, 1, draft_top=1, guide_top=2)
    seqs = [s for b in batches for s in b.seqs]
    assert chain_pvalue(seqs, lam, length, q=q_t) > 1e-3
    assert chain_pvalue(seqs, lam, length) < 1e-6  # q_λ itself is not what is sampled
    assert all(b.stats.bonus > 0 for b in batches)
    # every probe call: each prefix is a prefix of its sequence, the token that followed it is
    # one of the tokens asked (a residual over S, or the bonus y)
    assert stepper.calls
    for ids, prefixes, tokens in stepper.calls:
        for i, prefix, asked in zip(ids, prefixes, tokens, strict=True):
            full = [0, *seqs[i].tokens]
            assert len(prefix) < len(full) and full[: len(prefix)] == prefix
            assert full[len(prefix)] in asked.tolist()
    # recorded values: log p and log q̃ exact, log q the chain's where reported (NaN only for a
    # bonus lookahead outside S), TV λ(1 - Q_S); behavior log((1-λ)p + λq̃) is the chain's
    tokens = np.array([s.tokens for s in seqs])
    prevs = np.concatenate([np.zeros((len(seqs), 1), dtype=int), tokens[:, :-1]], axis=1)
    field = lambda name: np.array([getattr(s, name) for s in seqs])  # noqa: E731
    np.testing.assert_allclose(
        field("draft_log_probs"), np.log(P_CHAIN.numpy()[prevs, tokens]), rtol=1e-12
    )
    with np.errstate(divide="ignore"):
        log_q_t = np.log(q_t.numpy()[prevs, tokens])
    np.testing.assert_allclose(field("target_log_probs"), log_q_t, rtol=1e-12)
    log_q = field("guidance_log_probs")
    reported = ~np.isnan(log_q)
    assert np.isneginf(log_q_t[~reported]).all() and not field("offpolicy")[~reported].any()
    np.testing.assert_allclose(
        log_q[reported], np.log(Q_CHAIN.numpy()[prevs, tokens])[reported], rtol=1e-12
    )
    mass = np.array([0.9, 0.9, 0.75])  # Q_S of each state's top-2
    np.testing.assert_allclose(field("target_tv"), lam * (1 - mass[prevs]), rtol=1e-12)
    behavior = np.logaddexp(math.log1p(-lam) + field("draft_log_probs"), math.log(lam) + log_q_t)
    mix = ((1 - lam) * P_CHAIN + lam * q_t).numpy()
    np.testing.assert_allclose(behavior, np.log(mix[prevs, tokens]), rtol=0, atol=1e-12)


def test_bonus_tokens_do_not_depend_on_timing():
    """The same batches with bonus tokens, their rounds overlapping differently (stagger 1 or
    3), emit the same tokens, provenance and counters: bonus tokens change what is drawn only
    through the batches' own generators."""
    (one, _), (two, _) = run_bonus_batches(0.5, 2, 50, 7, 1), run_bonus_batches(0.5, 2, 50, 7, 3)
    for a, b in zip(one, two, strict=True):
        assert [s.tokens for s in a.seqs] == [s.tokens for s in b.seqs]
        assert [s.offpolicy for s in a.seqs] == [s.offpolicy for s in b.seqs]
        assert a.stats == b.stats and a.stats.bonus > 0 and a.stats.rounds > 2


def draft_tail_chain(lam: float, top: int) -> torch.Tensor:
    """t = (1 - λQ_S)·P + λ·Q·1_S per state, S the `top` most likely tokens of Q's row."""
    keep = truncated_chain(Q_CHAIN, top) > 0
    listed = torch.where(keep, Q_CHAIN, 0.0)
    mass = listed.sum(-1, keepdim=True)
    return (1 - lam * mass) * P_CHAIN + lam * listed


@pytest.mark.parametrize(("lam", "k"), [(0.5, 1), (1.0, 2), (0.8, 3)])
def test_draft_tail_target_gives_the_unlisted_mass_to_the_draft(lam, k):
    """Guidance rows listing their top 2 only, target `draft_tail`: 3-token sequences of 2 x 10,000
    prompts follow t = (1 - λQ_S)·P + λ·Q·1_S (chi-square), not the renormalised (1-λ)P + λQ̃.
    Each token records λ'_t = λ·Q_S of its state (and λ_t = λ as set), the bound λ·(1 - Q_S) as its distance, and the
    behavior log((1-λ')p + λ'q̃) is log t of the chain.
    By hand, state 0: Q = [0.1, 0.2, 0.7], S = {2, 1}, Q_S = 0.9; at λ = 0.5
    t = 0.55·[0.6, 0.3, 0.1] + 0.5·[0, 0.2, 0.7] = [0.33, 0.265, 0.405]."""
    torch.testing.assert_close(
        draft_tail_chain(0.5, 2)[0], torch.tensor([0.33, 0.265, 0.405], dtype=D)
    )
    n, length = 10_000, 3
    batches, _ = run_bonus_batches(
        lam, k, n, length, 1, draft_top=1, guide_top=2, target="draft_tail"
    )
    seqs = [s for b in batches for s in b.seqs]
    target = draft_tail_chain(lam, 2)
    outcomes = list(itertools.product(range(V), repeat=length))
    counts = torch.zeros(len(outcomes), dtype=D)
    for s in seqs:
        counts[outcomes.index(tuple(s.tokens))] += 1

    def pvalue(chain: torch.Tensor) -> float:
        probs = torch.ones(len(outcomes), dtype=D)
        for i, o in enumerate(outcomes):
            prev = 0
            for tok in o:
                probs[i] *= chain[prev, tok]
                prev = tok
        if counts[probs == 0].sum() > 0:  # an outcome impossible under `chain` was drawn
            return 0.0
        return chi2_counts_pvalue(counts, probs)

    assert pvalue(target) > 1e-3
    assert pvalue((1 - lam) * P_CHAIN + lam * truncated_chain(Q_CHAIN, 2)) < 1e-6
    tokens = np.array([s.tokens for s in seqs])
    prevs = np.concatenate([np.zeros((len(seqs), 1), dtype=int), tokens[:, :-1]], axis=1)
    mass = np.array([0.9, 0.9, 0.75])  # Q_S of each state's top 2
    lam_t = np.array([s.lam for s in seqs])
    np.testing.assert_allclose(lam_t, lam * mass[prevs], rtol=1e-12)
    # λ_t as set stays λ on every token (proposal, residual and bonus): at λ = 0.5 in state 0 the
    # target's weight is 0.5·0.9 = 0.45 while guidance/lambda_mean reads 0.5
    assert np.array([s.strength for s in seqs]).tolist() == np.full(lam_t.shape, lam).tolist()
    np.testing.assert_allclose(
        np.array([s.target_tv for s in seqs]), lam * (1 - mass[prevs]), rtol=1e-12
    )
    behavior = mixture_log_probs(torch.tensor([s.draft_log_probs for s in seqs], dtype=D),
                                 torch.tensor([s.target_log_probs for s in seqs], dtype=D),
                                 None, torch.from_numpy(lam_t))  # fmt: skip
    np.testing.assert_allclose(
        behavior.numpy(), np.log(target.numpy()[prevs, tokens]), rtol=0, atol=1e-12
    )


class ResumeOnce:
    """A `Refill` that resumes every sequence once after it ended, as an episode's next turn: its
    prompt the old one, its tokens and a delta token 0, at most 2 tokens, its own generator; and
    only when the driver waits (as tool calls that return while the engines are idle)."""

    def __init__(self) -> None:
        self.ended_ids: list[int] = []
        self.first: dict[int, object] = {}  # id -> the sequence it ended its first turn with
        self.queue: list[tuple[int, SpeculativeBatch, int]] = []

    def ended(self, key, batch, rows):
        for row in rows:
            self.ended_ids.append(batch.ids[row])
            if batch.ids[row] not in self.first:
                self.queue.append((key, batch, row))

    @property
    def waiting(self):
        return bool(self.queue)

    def resumed(self, wait):
        if not wait:
            return []
        for _, batch, row in self.queue:
            prompt = [*batch.prompts[row], *batch.seqs[row].tokens, 0]
            draws = torch.Generator().manual_seed(100 + batch.ids[row])
            self.first[batch.ids[row]] = batch.resume(row, prompt, 2, draws)
        keys = sorted({key for key, _, _ in self.queue})
        self.queue.clear()
        return keys


def test_overlapped_generate_resumes_ended_sequences_in_their_batches():
    """With a `Refill`, every sequence of two batches ends its first turn (3 tokens), is resumed
    once after a delta token 0 (its batch had ended and starts again) and ends its second turn (2
    tokens); each second turn continues from the delta: its first token's draft log-prob is the
    chain's row of token 0. Nothing is left running."""
    n, k = 3, 2
    batches = [SpeculativeBatch([[0]] * n, 0.5, k, 3, None,
                                [torch.Generator().manual_seed(10 * g + r) for r in range(n)],
                                ids=list(range(g * n, (g + 1) * n)), bonus=True) for g in range(2)]  # fmt: skip
    stepper, scorer, refill = ListedChainStepper({0: 51, 1: 52}), ListedChainScorer(), ResumeOnce()
    overlapped_generate(batches, stepper, scorer, 1, refill)
    assert not stepper.running and not scorer.queue and not refill.waiting
    assert sorted(refill.ended_ids) == sorted(2 * list(range(2 * n)))
    for batch in batches:
        assert batch.done
        for row, seq in enumerate(batch.seqs):
            first = refill.first[batch.ids[row]]
            assert len(first.tokens) == 3 and len(seq.tokens) == 2
            assert batch.prompts[row] == [0, *first.tokens, 0]
            chain = np.log(P_CHAIN.numpy()[[0, seq.tokens[0]], seq.tokens])
            np.testing.assert_allclose(seq.draft_log_probs, chain)


def test_resume_refuses_a_sequence_that_has_not_ended():
    batch = SpeculativeBatch([[0], [1]], 0.5, 2, 3, None, [torch.Generator(), torch.Generator()])
    with pytest.raises(ValueError, match="sequence 1 has not ended"):
        batch.resume(1, [1, 2], 2)


def test_each_sequence_reads_its_generators_stream_round_after_round():
    """Uniforms drawn `UNIFORM_ROUNDS` rounds at a time are the stream of one `torch.rand(k + 1)`
    per round from each sequence's generator: across block boundaries (40 rounds > 2 blocks),
    while another row sits out some rounds (it reads on where it stopped), and from the start of
    a new generator after `resume`."""
    from verl.workers.rollout.speculative_batch import UNIFORM_ROUNDS

    k, rounds = 2, 40
    assert rounds > 2 * UNIFORM_ROUNDS
    batch = SpeculativeBatch([[0], [1]], 0.5, k, 10**6, None,
                             [torch.Generator().manual_seed(s) for s in (3, 4)])  # fmt: skip
    refs = [torch.Generator().manual_seed(s) for s in (3, 4)]
    for i in range(rounds):
        batch.seqs[1].finished = 10 <= i < 15  # row 1 sits out rounds 10-14
        _, prefixes, _ = batch.next_round()
        got = batch._uniforms(len(prefixes))
        rows = [0] if batch.seqs[1].finished else [0, 1]
        expected = torch.stack([torch.rand(k + 1, generator=refs[r], dtype=torch.float64) for r in rows])  # fmt: skip
        assert torch.equal(got, expected), i
    batch.seqs[1].finished = True
    batch.resume(1, [1, 5], 3, torch.Generator().manual_seed(9))
    batch.next_round()
    fresh = torch.rand(k + 1, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    assert torch.equal(batch._uniforms(2)[1], fresh)
