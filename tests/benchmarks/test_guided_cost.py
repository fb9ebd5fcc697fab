"""The guided rollout's cost model (benchmarks/guided_cost.py): hand-computed values, and E[N]
against a simulation of the rounds."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scripts import load

C = load("guided_cost")


def test_tokens_per_round_by_hand():
    # α = 0.5, k = 4, bonus: 1 + .5 + .25 + .125 + .0625 = 1.9375
    assert C.tokens_per_round(0.5, 4) == pytest.approx(1.9375, abs=1e-12)
    # no bonus: accepted .5 + .25 + .125 + .0625 = .9375, plus a residual unless all 4 passed
    # (1 - .0625 = .9375): 1.875
    assert C.tokens_per_round(0.5, 4, bonus=False) == pytest.approx(1.875, abs=1e-12)
    # every proposal accepted: k + 1 with the bonus token, k without; none: the residual alone
    assert C.tokens_per_round(1.0, 4) == 5.0 and C.tokens_per_round(1.0, 4, bonus=False) == 4.0
    assert C.tokens_per_round(0.0, 4) == 1.0 and C.tokens_per_round(0.0, 4, bonus=False) == 1.0
    with pytest.raises(ValueError, match=r"alpha=1\.5"):
        C.tokens_per_round(1.5, 4)


@pytest.mark.parametrize("alpha,k,bonus", [(0.556, 4, True), (0.8, 6, False), (0.3, 2, True)])
def test_tokens_per_round_matches_simulated_rounds(alpha, k, bonus):
    """Rounds of i.i.d. acceptances: the mean tokens emitted is within 4 standard errors of E[N]
    (200,000 rounds: the standard error is under 0.004 tokens)."""
    rng = np.random.default_rng(0)
    accepted = (rng.random((200_000, k)) < alpha).cumprod(axis=1).sum(axis=1)
    emitted = accepted + np.where(accepted < k, 1, int(bonus))
    se = emitted.std() / np.sqrt(len(emitted))
    assert abs(emitted.mean() - C.tokens_per_round(alpha, k, bonus)) < 4 * se


def test_effective_alpha_inverts_tokens_per_round():
    # 1.9375 tokens a round at k = 4 with bonus tokens is α = 0.5 (first test); 5 is every one
    assert C.effective_alpha(1.9375, 4) == pytest.approx(0.5, abs=1e-12)
    assert C.effective_alpha(5.0, 4) == 1.0 and C.effective_alpha(1.0, 4) == pytest.approx(
        0.0, abs=1e-12
    )
    assert C.effective_alpha(C.tokens_per_round(0.81, 6, False), 6, False) == pytest.approx(
        0.81, abs=1e-12
    )


def test_measured_tokens_per_round():
    # 100 emitted tokens in 40 sequence-rounds: 2.5 a round; no round yet: nan
    assert C.measured_tokens_per_round(100, 40) == 2.5
    assert C.measured_tokens_per_round(0, 0) != C.measured_tokens_per_round(0, 0)


def test_verify_seconds_interpolate_and_extrapolate():
    guidance = C.Engine(prefill=0.0, verify={2: 0.010, 5: 0.016})
    # slope (0.016 - 0.010) / 3 = 0.002 s per position
    assert guidance.verify_s(3) == pytest.approx(0.012, abs=1e-12)
    assert guidance.verify_s(9) == pytest.approx(0.016 + 4 * 0.002, abs=1e-12)  # 0.024
    assert guidance.verify_s(1) == pytest.approx(0.008, abs=1e-12)
    assert C.Engine(prefill=0.0, verify={5: 0.02}).verify_s(9) == 0.02  # one point: flat


def parts() -> object:
    return C.Parts(
        draft_split=C.Engine(prefill=0.05, step=0.002),
        draft_full=C.Engine(prefill=0.04, step=0.0015),
        guidance_split=C.Engine(prefill=0.03, verify={5: 0.012}),
        guidance_full=C.Engine(prefill=0.02, verify={5: 0.007}),
        lookup_per_rejection=0.004,
        length=64,
        groups={
            2: (C.Engine(prefill=0.0, step=0.0018), C.Engine(prefill=0.0, verify={5: 0.008})),
            4: (C.Engine(prefill=0.0, step=0.0017), C.Engine(prefill=0.0, verify={5: 0.006})),
        },
    )


def test_round_and_rollout_seconds_by_hand():
    p = parts()
    # α = 0.5, k = 4, bonus: rejections per round 1 - .5^4 = .9375, lookups .9375 · 0.004 = 0.00375
    # sequential: D = 5 · 0.0015 + 0.00375 = 0.01125, V = 0.007: 0.01825
    assert C.round_seconds(p, 0.5, 4, True, "sequential") == pytest.approx(0.01825, abs=1e-12)
    # overlapped, one group: D = 5 · 0.002 + 0.00375 = 0.01375, V = 0.012,
    # chain 4 · 0.002 + max(0.002, 0.012) + 0.00375 = 0.02375: the chain
    assert C.round_seconds(p, 0.5, 4, True, "overlapped") == pytest.approx(0.02375, abs=1e-12)
    # two groups: 2 · 0.008 = 0.016 of guidance; chain 4 · 0.0018 + 0.008 + 0.00375 = 0.01895
    assert C.round_seconds(p, 0.5, 4, True, "overlapped", 2) == pytest.approx(0.01895, abs=1e-12)
    # four groups: 4 · 0.006 = 0.024 of guidance; chain 4 · 0.0017 + 0.006 + 0.00375 = 0.01655
    assert C.round_seconds(p, 0.5, 4, True, "overlapped", 4) == pytest.approx(0.024, abs=1e-12)
    # no bonus token, two groups: D = 4 · 0.002 + 0.00375 = 0.01175; chain 4 · 0.0018 + 0.008
    # + 0.00375 = 0.01895 (the lookahead step is gone, the call was longer anyway)
    assert C.round_seconds(p, 0.5, 4, False, "overlapped", 2) == pytest.approx(0.01895, abs=1e-12)
    # a call shorter than a step: the lookahead step bounds the chain, 4 · 0.0018 + 0.0018 + 0.00375
    quick = C.Parts(p.draft_split, p.draft_full, p.guidance_split, p.guidance_full, 0.004, 64,
                    {2: (C.Engine(0.0, step=0.0018), C.Engine(0.0, verify={5: 0.001}))})  # fmt: skip
    assert C.round_seconds(quick, 0.5, 4, True, "overlapped", 2) == pytest.approx(
        0.01375, abs=1e-12
    )
    # (there D = 0.01375 too: 5 · 0.002 + 0.00375; the chain 0.01275 is below it)
    # rollout: 64 / 1.9375 = 33.0323 rounds; two groups, the prefills at once max(0.05, 0.03)
    # + 33.0323 · 0.01895 = 0.05 + 0.625961 = 0.675961
    assert C.guided_seconds(p, 0.5, 4, True, "overlapped", 2) == pytest.approx(0.675961, abs=1e-6)
    # sequential: 0.04 + 0.02 + 33.0323 · 0.01825 = 0.662839
    assert C.guided_seconds(p, 0.5, 4, True, "sequential") == pytest.approx(0.662839, abs=1e-6)
    # draft-only: 0.04 + 63 · 0.0015 = 0.1345
    assert C.draft_only_seconds(p.draft_full, 64) == pytest.approx(0.1345, abs=1e-12)
    with pytest.raises(ValueError, match="'both'"):
        C.round_seconds(p, 0.5, 4, True, "both")
    with pytest.raises(ValueError, match=r"groups=8: timed for \[1, 2, 4\]"):
        C.round_seconds(p, 0.5, 4, True, "overlapped", 8)


def test_floor_is_the_cheapest_schedule_k_and_groups():
    p = parts()
    seconds, k, schedule, groups = C.floor(p, 0.5, True)
    every = [C.guided_seconds(p, 0.5, j, True, "sequential") for j in range(1, 13)]
    every += [
        C.guided_seconds(p, 0.5, j, True, "overlapped", g) for j in range(1, 13) for g in (1, 2, 4)
    ]
    assert seconds == min(every)
    assert seconds == C.guided_seconds(p, 0.5, k, True, schedule, groups)
    # α = 0.5: E[N] = 2 - .5^k. Sequential at k = 1: (1 + 1) · 0.0015 + .5 · 0.004 + 0.007 = 0.012
    # a round, 64 / 1.5 = 42.667 rounds: 0.04 + 0.02 + 0.512 = 0.572. k = 2 gives 0.0145 · 36.571
    # + 0.06 = 0.5903; overlapped pays at least 0.016 a round (two groups' calls 2 · 0.008, one
    # group's chain 0.002 + 0.012 + 0.002) and 0.05 of prefills: 0.7327 at k = 1
    assert (seconds, k, schedule, groups) == (pytest.approx(0.572, abs=1e-9), 1, "sequential", 1)
    # a slower guidance with every core (0.02 a call) makes two groups the floor: at k = 3,
    # D = 4 · 0.002 + .875 · 0.004 = 0.0115, calls 2 · 0.008 = 0.016, chain 3 · 0.0018 + 0.008
    # + 0.0035 = 0.0169; 64 / 1.875 = 34.133 rounds: 0.05 + 34.133 · 0.0169 = 0.626853 (k = 2:
    # 0.05 + 36.571 · 0.016 = 0.63514; k = 4: 0.05 + 33.032 · 0.01895 = 0.67596)
    slow = C.Parts(p.draft_split, p.draft_full, p.guidance_split,
                   C.Engine(prefill=0.02, verify={5: 0.02}), 0.004, 64, p.groups)  # fmt: skip
    seconds, k, schedule, groups = C.floor(slow, 0.5, True)
    assert (seconds, k, schedule, groups) == (pytest.approx(0.626853, abs=1e-6), 3, "overlapped", 2)


def test_perfect_overlap_floor_is_the_looser_bound():
    p = parts()
    # overlapped as max(D, V), V = 0.012: k = 3, D = 4 · 0.002 + .875 · 0.004 = 0.0115 < V,
    # 0.05 + 64 / 1.875 · 0.012 = 0.4596; k = 2: 0.05 + 36.571 · 0.012 = 0.48886; k = 4: D = 0.01375,
    # 0.05 + 33.0323 · 0.01375 = 0.504194. Below the refined floor's 0.572 (sequential, k = 1)
    assert C.perfect_overlap_floor(p, 0.5, True) == (
        pytest.approx(0.4596, abs=1e-9),
        3,
        "overlapped",
    )
    assert C.floor(p, 0.5, True)[0] == pytest.approx(0.572, abs=1e-9)
    # at k = 1: D = 2 · 0.002 + .5 · 0.004 = 0.006 against V = 0.012: 0.05 + 42.667 · 0.012 = 0.562
    one = C.perfect_overlap_floor(p, 0.5, True, ks=range(1, 2))
    assert one == (pytest.approx(0.562, abs=1e-9), 1, "overlapped")  # below sequential's 0.572


def test_median_engine_takes_each_field_on_its_own():
    timings = [
        C.Engine(prefill=0.03, step=0.004, verify={2: 0.010, 3: 0.012}),
        C.Engine(prefill=0.01, step=0.006, verify={2: 0.009, 3: 0.020}),
        C.Engine(prefill=0.02, step=0.005, verify={2: 0.030, 3: 0.011, 5: 0.5}),
    ]
    # prefill median of (.03, .01, .02) = .02; step of (.004, .006, .005) = .005; m = 2: median
    # of (.010, .009, .030) = .010; m = 3: of (.012, .020, .011) = .012; m = 5 timed once: left out
    assert C.median_engine(timings) == C.Engine(
        prefill=0.02, step=0.005, verify={2: 0.010, 3: 0.012}
    )


def test_round_survival_by_hand():
    # L = 3, k = 1, α = .5, bonus: round 1 gives 1 token (.5, rejected: the residual) or 2 (.5,
    # accepted plus the bonus: 3 left > k); from 1 token, 1 or 2 again (2 left > k), so after
    # round 2: 2 tokens w.p. .25 and 3 w.p. .75 (from 2: 1 left, no bonus, always 1 token).
    # p_r = P(still generating at round r): 1, 1, .25; their sum 2.25 = E[rounds] = 2·.75 + 3·.25
    assert C.round_survival(0.5, 1, True, 3) == pytest.approx([1.0, 1.0, 0.25], abs=1e-12)
    # without the bonus token a round of k = 1 always gives one token: three rounds
    assert C.round_survival(0.5, 1, False, 3) == pytest.approx([1.0, 1.0, 1.0], abs=1e-12)
    # every proposal accepted, k = 2: 3 tokens a round while 3 < left, then what is left
    assert C.round_survival(1.0, 2, True, 6).tolist() == [1.0, 1.0]
    assert C.round_survival(1.0, 2, True, 5).tolist() == [1.0, 1.0]
    assert C.round_survival(0.0, 4, True, 4).tolist() == [1.0] * 4  # the residual alone, 1 a round
    with pytest.raises(ValueError, match=r"alpha=1\.5"):
        C.round_survival(1.5, 2, True, 8)


def test_round_survival_matches_simulated_sequences():
    """20,000 sequences of i.i.d. acceptances (α = .7, k = 3, L = 20, bonus): the share still
    generating at each round is within 4 standard errors (at most .0036) of p_r."""
    rng = np.random.default_rng(1)
    alpha, k, length, n = 0.7, 3, 20, 20_000
    rounds = np.zeros(n, dtype=int)
    for i in range(n):
        t = 0
        while t < length:
            left = length - t
            budget = min(k, left)
            accepted = int((rng.random(budget) < alpha).cumprod().sum())
            t += accepted + 1 if accepted < budget else budget + int(left > k)
            rounds[i] += 1
    p = C.round_survival(alpha, k, True, length)
    share = np.array([(rounds >= r).mean() for r in range(1, len(p) + 1)])
    se = np.sqrt(p * (1 - p) / n)
    assert (np.abs(share - p) <= 4 * se + 1e-12).all()
    assert (rounds <= len(p)).all()


def test_active_per_round_by_hand():
    # p = 1, 1, .25 (above) for two sequences: the batch runs round 3 w.p. 1 - .75² = .4375,
    # holding 2 · .25 / .4375 = 1.142857 sequences on average then
    rounds = C.active_per_round(0.5, 1, True, 3, 2)
    assert rounds == [(1.0, 2.0), (1.0, 2.0), (pytest.approx(0.4375), pytest.approx(8 / 7))]


def test_parts_at_fewer_sequences_by_hand():
    p = C.Parts(**{**parts().__dict__, "batch": 64})
    # timed at 16 (G = 4: step .0017, call .006), 32 (G = 2: .0018, .008) and 64 (.002, .012);
    # at 48: step .0018 + 16 · .0002 / 32 = .0019, call .008 + 16 · .004 / 32 = .010
    at = p.at(48)
    assert at.draft_split.step == pytest.approx(0.0019, abs=1e-12)
    assert at.guidance_split.verify == {5: pytest.approx(0.010, abs=1e-12)}
    # one of 2 groups, 24: .0017 + 8 · .0001 / 16 = .00175 and .006 + 8 · .002 / 16 = .007; one
    # of 4, 12, below the sizes timed, along the first segment: .0017 - 4 · .0001 / 16 = .001675
    assert at.groups[2][0].step == pytest.approx(0.00175, abs=1e-12)
    assert at.groups[2][1].verify[5] == pytest.approx(0.007, abs=1e-12)
    assert at.groups[4][0].step == pytest.approx(0.001675, abs=1e-12)
    assert at.groups[4][1].verify[5] == pytest.approx(0.0055, abs=1e-12)
    # every core, scaled as the split ones: .0015 · .0019 / .002 and .007 · .010 / .012
    assert at.draft_full.step == pytest.approx(0.001425, abs=1e-12)
    assert at.guidance_full.verify[5] == pytest.approx(0.007 * 10 / 12, abs=1e-12)
    assert p.at(64).draft_split.step == pytest.approx(0.002, abs=1e-12)  # the size timed
    with pytest.raises(ValueError, match="batch size"):
        parts().at(32)


def test_guided_seconds_until_the_slowest_sequence_by_hand():
    # B = 2, L = 3, k = 1, α = .5, bonus: rounds (1, 2), (1, 2), (.4375, 8/7) (above). Timed at
    # 2 sequences (step .002, call .006) and at 1 (G = 2: .001, .004): at n, .001·n and
    # .004 + .002·(n - 1)
    p = C.Parts(
        draft_split=C.Engine(prefill=0.01, step=0.002),
        draft_full=C.Engine(prefill=0.008, step=0.0015),
        guidance_split=C.Engine(prefill=0.02, verify={2: 0.006}),
        guidance_full=C.Engine(prefill=0.009, verify={2: 0.005}),
        lookup_per_rejection=0.0,
        length=3,
        groups={2: (C.Engine(prefill=0.0, step=0.001), C.Engine(prefill=0.0, verify={2: 0.004}))},
        batch=2,
    )
    # overlapped, one group, n = 2: D = 2 · .002, calls .006, chain .002 + .006 = .008;
    # n = 8/7: chain .0011429 + .0042857 = .0054286. max(.01, .02) + 2 · .008 + .4375 · .0054286
    assert C.guided_seconds(p, 0.5, 1, True, "overlapped", 1, slowest=True) == pytest.approx(
        0.038375, abs=1e-9
    )
    # the mean rounds, 3 / 1.5 = 2, at .008: .036, below
    assert C.guided_seconds(p, 0.5, 1, True, "overlapped", 1) == pytest.approx(0.036, abs=1e-12)
    # sequential, every core: n = 2: 2 · .0015 + .005 = .008; n = 8/7: 2 · .0015 · (8/7 · .001)
    # / .002 + .005 · .0042857 / .006 = .0017143 + .0035714 = .0052857; .017 + .016 + .0023125
    assert C.guided_seconds(p, 0.5, 1, True, "sequential", slowest=True) == pytest.approx(
        0.0353125, abs=1e-9
    )


def test_the_slowest_sequence_floor_is_above_the_mean_rounds_floor():
    p = C.Parts(**{**parts().__dict__, "batch": 64})
    assert C.floor(p, 0.5, True, slowest=True)[0] > C.floor(p, 0.5, True)[0]
    # one sequence alone still pays the rounds past the mean: E[rounds] >= L / E[N]
    one = C.Parts(**{**parts().__dict__, "batch": 1, "groups": {}})
    assert C.guided_seconds(one, 0.5, 4, True, "sequential", slowest=True) > C.guided_seconds(
        one, 0.5, 4, True, "sequential"
    )
