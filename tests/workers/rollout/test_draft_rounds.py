"""The draft side of a round on plain arrays: chunk outputs, proposal tables, lookahead rows."""

from __future__ import annotations

import numpy as np
import torch

from verl.workers.rollout.speculative_mode import _DraftRounds, _Round, draft_tables
from verl.workers.rollout.vllm_sessions import ChunkOutput

K1 = 3  # columns of a listed row: the sampled token, then a top-2


def chunk(tokens: list[int], per_step: int = 1) -> ChunkOutput:
    """A chunk that sampled `tokens`, `per_step` of them per engine step; token t's row lists
    (t, t + 100, t + 200) with log-probs (-t, -t - 0.5, -t - 0.25)."""
    out = ChunkOutput(token_ids=list(tokens))
    for at in range(0, len(tokens), per_step):
        block = np.array(tokens[at : at + per_step])
        out.logprob_ids.append(np.stack([block, block + 100, block + 200], axis=1))
        out.logprobs.append(np.stack([-block, -block - 0.5, -block - 0.25], axis=1).astype(float))
    return out


def test_listed_and_row_read_blocks_of_any_size():
    for per_step in (1, 2, 3):
        out = chunk([5, 6, 7], per_step)
        ids, values = out.listed()
        assert ids.tolist() == [[5, 105, 205], [6, 106, 206], [7, 107, 207]]
        assert values[:, 0].tolist() == [-5, -6, -7]
        row_ids, row_values = out.row(1)
        assert row_ids.tolist() == [6, 106, 206] and row_values.tolist() == [-6, -6.5, -6.25]


def test_draft_tables_keep_each_chunks_budget_and_leave_its_lookahead():
    # budget 3, 1, 2: chunk 0 drafted a lookahead token (4 tokens), chunk 1 stopped at 1 token,
    # chunk 2 ended early (EOS after 1 of its 2 proposals)
    outs = [chunk([1, 2, 3, 4]), chunk([11], per_step=1), chunk([21])]
    proposals, num, rows = draft_tables(outs, [3, 1, 2])
    assert proposals.tolist() == [[1, 2, 3], [11, -1, -1], [21, -1, -1]]
    assert num.tolist() == [3, 1, 1] and proposals.dtype == torch.long
    assert rows.ids[:, 0].tolist() == [1, 2, 3, 11, 21]  # one row per proposal, in order
    assert rows.log_probs[:, 2].tolist() == [-1.25, -2.25, -3.25, -11.25, -21.25]


def test_lookahead_rows_are_the_tokens_past_each_budget():
    rounds = _DraftRounds(sessions=None, prefix="d", new_params=None)
    rounds.rounds[0] = _Round(
        [2, 2, 1], [chunk([1, 2, 3]), chunk([4, 5]), chunk([6, 7], per_step=2)]
    )
    has, rows = rounds.lookahead(0)
    assert has.tolist() == [True, False, True]
    assert rows.ids[:, 0].tolist() == [3, 7] and rows.log_probs[:, 1].tolist() == [-3.5, -7.5]
    rounds.rounds[1] = _Round([2], [chunk([1, 2])])
    assert rounds.lookahead(1) is None and not rounds.rounds


class IdleSessions:
    """Sessions with no chunk running: stepping them is an error."""

    busy = False

    def step(self):
        raise AssertionError("stepped an idle engine")


def test_a_round_that_finished_during_a_probe_is_still_returned():
    """A draft lookup (`probe`) steps the engine, and other rounds' chunks may finish in those
    steps: with no chunk left running, the round is still reported busy and returned by the
    next `step`, without stepping the engine (else the rollout would stop with it unverified)."""
    draft = _DraftRounds(IdleSessions(), "d-", lambda i, m: None)
    finished = chunk([1, 2])
    finished.finished = True
    draft.rounds[7] = _Round([2], [finished])
    assert draft.busy
    (key, proposals, num, _), *rest = draft.step()
    assert key == 7 and proposals.tolist() == [[1, 2]] and num.tolist() == [2] and not rest
    assert not draft.busy and draft.step() == []
