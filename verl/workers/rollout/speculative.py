"""Speculative guidance, the pure algorithm (docs/design.md#guidance-math): emitted tokens follow q_λ exactly.

Notation: p the draft's processed next-token distribution, q the guidance's, λ in [0, 1],
q_λ = (1-λ)·p + λ·q. One round for a batch of sequences:
  1. the draft proposes up to k tokens x_1..x_n ~ p (with the tables p(·) at each position);
  2. the guidance gives q(·) at the same positions;
  3. x_i is accepted with probability min(1, q_λ(x_i)/p(x_i)) = min(1, (1-λ) + λ·q(x_i)/p(x_i));
  4. at the first rejection a token y ~ r(y) ∝ max(0, q(y) - p(y)) is emitted instead, marked
     off-policy, and the remaining proposals are dropped.
  5. after a fully accepted round, a bonus token of q_λ when the draft already drafted one token
     x ~ p past its proposals (while the guidance scored them) and the guidance reports q there:
     x verified as in 3, else the residual of 4, marked off-policy (`draw_bonus`).
This is speculative sampling with target q_λ and proposal p, so every emitted token is an exact
sample of q_λ given its prefix (Leviathan et al., https://arxiv.org/abs/2211.17192); the bonus
is that paper's extra token, with the draft's lookahead as one more proposal.

This module imports neither vLLM nor torch.distributed: it works on token ids and log-prob
tables (dense (B, k, V), or the engines' top-K lists as `TopK`), so it is tested exactly on
CPU with toy models. The engine driver feeds it the engines' lists as flat `ListedRows`, which
`verify_listed` verifies in numpy with the same decisions as `verify_proposals` on a `TopK`.

The algorithm lives in three modules, re-exported here for callers: `speculative_verify` (one
round: `verify_proposals`, `verify_listed`, `draw_bonus`), `speculative_batch` (a batch advanced
round by round: `SpeculativeBatch`, `GuidedSequence`, `RoundStats`) and `speculative_drivers`
(whole generations: `speculative_generate`, `overlapped_generate` and the engine protocols).
"""

from __future__ import annotations

from verl.workers.rollout.log_prob_tables import (
    NEG_INF,
    ListedRows,
    TopK,
    as_topk,
    listed_entropy,
    process_log_probs,
)
from verl.workers.rollout.speculative_batch import GuidedSequence, RoundStats, SpeculativeBatch
from verl.workers.rollout.speculative_drivers import (
    AsyncScorer,
    DraftStepper,
    ProposeFn,
    Refill,
    ScoreFn,
    overlapped_generate,
    speculative_generate,
)
from verl.workers.rollout.speculative_verify import (
    BonusRows,
    DraftProbe,
    VerifyResult,
    draw_bonus,
    verify_listed,
    verify_proposals,
)

__all__ = [
    "NEG_INF",
    "AsyncScorer",
    "BonusRows",
    "DraftProbe",
    "DraftStepper",
    "GuidedSequence",
    "ListedRows",
    "ProposeFn",
    "Refill",
    "RoundStats",
    "ScoreFn",
    "SpeculativeBatch",
    "TopK",
    "VerifyResult",
    "as_topk",
    "draw_bonus",
    "listed_entropy",
    "overlapped_generate",
    "process_log_probs",
    "speculative_generate",
    "verify_listed",
    "verify_proposals",
]
