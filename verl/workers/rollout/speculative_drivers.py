"""Drivers of speculative guidance over whole generations: `speculative_generate`, the
synchronous loop (propose, score, verify, round after round), and `overlapped_generate`, which
interleaves several batches' rounds so the draft engine steps while the guidance scores
(`DraftStepper` and `AsyncScorer` are what it needs of the two engines). Pure: no vLLM.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from verl.workers.rollout.log_prob_tables import ListedRows, TopK
from verl.workers.rollout.speculative_batch import GuidedSequence, RoundStats, SpeculativeBatch
from verl.workers.rollout.speculative_verify import BonusRows

ProposeFn = Callable[
    [list[int], list[list[int]], list[int]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]
ScoreFn = Callable[[list[int], list[list[int]], torch.Tensor, torch.Tensor], torch.Tensor]


def speculative_generate(
    prompts: list[list[int]],
    propose: ProposeFn,
    score: ScoreFn,
    lam: float,
    num_speculative_tokens: int,
    max_new_tokens: int,
    eos_token_id: int | None,
    generator: torch.Generator | None = None,
) -> tuple[list[GuidedSequence], RoundStats]:
    """Generate responses whose tokens follow q_λ, round by round, for a batch of prompts.

    `propose(ids, prefixes, n)` returns (proposals (B, k) with -1 padding, num_proposed (B,),
    draft log-prob tables (B, k, V) or `TopK`): up to n[b] draft tokens per prefix, stopping
    after EOS. `score(ids, prefixes, proposals, num_proposed)` returns the guidance tables
    (B, k, V) or `TopK` at the same positions. Both get only the still-active sequences, with
    `ids` their indices in `prompts` (engines keep per-sequence state). Stops at EOS or
    `max_new_tokens`.
    """
    batch = SpeculativeBatch(
        prompts, lam, num_speculative_tokens, max_new_tokens, eos_token_id, generator
    )
    while not batch.done:
        ids, prefixes, budget = batch.next_round()
        proposals, num, draft_tables = propose(ids, prefixes, budget)
        batch.apply(proposals, num, draft_tables, score(ids, prefixes, proposals, num))
    return batch.seqs, batch.stats


class DraftStepper(Protocol):
    """The draft engine one step at a time: rounds of several batches may run in the same step."""

    def start(
        self,
        key: int,
        ids: list[int],
        prefixes: list[list[int]],
        budget: list[int],
        lookahead: list[bool],
    ) -> None:
        """Begin batch `key`'s proposals (up to budget[b] tokens per prefix), and where
        lookahead[b] one token more, drafted after the round is returned (may be ignored)."""

    @property
    def busy(self) -> bool:
        """Some round is still proposing or drafting its lookahead."""

    def step(
        self,
    ) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | TopK | ListedRows]]:
        """One engine step; returns (key, proposals, num_proposed, draft tables) of the rounds
        whose proposals all finished in it (shapes as `ProposeFn`'s)."""

    def drafting(self, key: int) -> bool:
        """Round `key` was returned and its lookahead tokens are still being drafted."""

    def lookahead(self, key: int) -> tuple[np.ndarray, ListedRows] | None:
        """Round `key`'s lookahead once drafted, as `BonusRows`' (has, draft); None if none."""

    def probe(self, ids: list[int], prefixes: list[list[int]], tokens: np.ndarray) -> np.ndarray:
        """The draft's processed log p of `tokens` (R, M) as the next token after each prefix of
        sequences `ids` (R): (R, M), for tokens its listed rows do not give."""


class AsyncScorer(Protocol):
    """The guidance engine working on its own: answers come back in submission order."""

    def submit(
        self, ids: list[int], prefixes: list[list[int]], proposals: torch.Tensor, num: torch.Tensor
    ) -> None:
        """Start scoring a round's proposals; returns at once."""

    def ready(self) -> bool:
        """The oldest submitted round's tables can be collected without waiting."""

    def collect(self) -> torch.Tensor | TopK | ListedRows | tuple[ListedRows, ListedRows]:
        """The guidance tables (B, k, V), `TopK` or `ListedRows` of the oldest submitted round
        (waits if needed), or `ListedRows` paired with the rows one position past each
        sequence's last proposal (`BonusRows.guidance`)."""


class Refill(Protocol):
    """Sequences that end and start again while the batches run (the turns of episodes that
    advance on their own): told which rows ended, it resumes some later
    (`SpeculativeBatch.resume`)."""

    def ended(self, key: int, batch: SpeculativeBatch, rows: list[int]) -> None:
        """Rows of batch `key` ended in the round just verified."""

    @property
    def waiting(self) -> bool:
        """Some ended sequence may still be resumed."""

    def resumed(self, wait: bool) -> list[int]:
        """The batches in which sequences were resumed since the last call; with `wait`, blocks
        until some ended sequence was resumed or will not be."""


def overlapped_generate(
    batches: list[SpeculativeBatch],
    draft: DraftStepper,
    guidance: AsyncScorer,
    stagger: int,
    refill: Refill | None = None,
) -> None:
    """Run several batches so the engines overlap: while the guidance scores one batch's round,
    the draft keeps stepping the rounds of the others (and that round's lookahead tokens), and
    never waits while it has work.

    Batch g starts after g * `stagger` draft steps, so the batches' rounds fall out of phase and
    a draft step usually holds more than one batch. Each batch still runs its rounds in order
    with its own generator, so its tokens are exactly those it gets alone with the same engines
    and follow q_λ as with `speculative_generate` (plus bonus tokens, see `SpeculativeBatch`).
    With `refill`, the rows that end in a round are handed to it, and a sequence it resumes joins
    its batch's next round (a batch that had ended starts again); the run ends once nothing is
    left to resume.
    """
    pending = deque(range(len(batches)))  # not started yet
    rounds: dict[int, tuple[list[int], list[list[int]]]] = {}  # the open rounds
    in_flight: deque = deque()
    steps = 0

    def start(key: int) -> None:
        ids, prefixes, budget = batches[key].next_round()
        rounds[key] = (ids, prefixes)
        draft.start(key, ids, prefixes, budget, batches[key].lookahead)

    def verifiable() -> bool:  # the oldest round's answer is in (or nothing else can happen)
        if draft.drafting(in_flight[0][0]):
            return False
        return guidance.ready() or not (draft.busy or pending)

    while pending or draft.busy or in_flight or (refill is not None and refill.waiting):
        while pending and (steps >= pending[0] * stagger or not draft.busy):
            key = pending.popleft()
            if not batches[key].done:
                start(key)
        if draft.busy:
            steps += 1
            for key, proposals, num, draft_tables in draft.step():
                guidance.submit(*rounds[key], proposals, num)
                in_flight.append((key, proposals, num, draft_tables))
        # verify what the guidance answered; wait for it only when the draft has nothing to do
        while in_flight and verifiable():
            key, proposals, num, draft_tables = in_flight.popleft()
            tables, following = _split_answer(guidance.collect())
            extra = draft.lookahead(key)
            bonus = None if extra is None or following is None else BonusRows(*extra, following)
            batches[key].apply(proposals, num, draft_tables, tables, bonus, draft.probe)
            del rounds[key]
            if refill is not None and batches[key].ended:
                refill.ended(key, batches[key], batches[key].ended)
            if not batches[key].done:
                start(key)
        if refill is not None:
            idle = not (draft.busy or in_flight or pending)
            for key in refill.resumed(wait=idle and refill.waiting):
                if key not in rounds and key not in pending:
                    start(key)


def _split_answer(answer) -> tuple:
    """(tables, rows past the proposals or None) from `AsyncScorer.collect`'s answer."""
    return answer if isinstance(answer, tuple) else (answer, None)
