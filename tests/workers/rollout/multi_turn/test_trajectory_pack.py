"""Trajectories and `pack` (verl/workers/rollout/multi_turn/trajectory.py): hand-computed rows
at every turn boundary and every kind of cut, and a per-token loop against `pack` on random
batches."""

from __future__ import annotations

import random

import pytest
import torch

from verl.workers.rollout.multi_turn.trajectory import POLICY, TOOL, Trajectory, pack

PAD = 0


def episode_a() -> Trajectory:
    """Two turns and one tool delta: 3 + 2 + 2 = 7 response tokens."""
    t = Trajectory([1, 2])
    t.add_turn([10, 11, 12], lp=[-0.1, -0.2, -0.3], off=[0, 1, 0])
    t.add_tool([20, 21], ["ok"], [False])
    t.add_turn([13, 14], lp=[-0.4, -0.5], off=[0, 0])
    return t


def episode_b() -> Trajectory:
    """Two turns, a tool delta of 3 whose call timed out and was cut: 2 + 3 + 4 = 9 tokens."""
    t = Trajectory([3])
    t.add_turn([30, 31], lp=[-1.0, -2.0], off=[1, 1])
    t.add_tool([40, 41, 42], ["timeout"], [True])
    t.add_turn([32, 33, 34, 35], lp=[-3.0, -4.0, -5.0, -6.0], off=[0, 1, 0, 1])
    return t


def test_two_episodes_by_hand():
    out = pack([episode_a(), episode_b()], response_length=8, pad_id=PAD)
    assert out["responses"].tolist() == [[10, 11, 12, 20, 21, 13, 14, PAD],
                                         [30, 31, 40, 41, 42, 32, 33, 34]]  # fmt: skip
    assert out["response_mask"].tolist() == [[1, 1, 1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 1, 1, 1]]
    assert out["tool_mask"].tolist() == [[0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 0, 0, 0]]
    assert out["response_attention_mask"].tolist() == [[1] * 7 + [0], [1] * 8]
    assert out["turn_index"].tolist() == [[0, 0, 0, 0, 0, 1, 1, -1], [0, 0, 0, 0, 0, 1, 1, 1]]
    lp = [[-0.1, -0.2, -0.3, 0, 0, -0.4, -0.5, 0], [-1, -2, 0, 0, 0, -3, -4, -5]]
    torch.testing.assert_close(
        out["lp"], torch.tensor(lp, dtype=torch.float64), rtol=0, atol=0
    )  # slots as given (float64)
    assert out["off"].tolist() == [[0, 1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 1, 0]]
    assert out["truncated"].tolist() == [False, True]  # b: 9 tokens, budget 8, 35 dropped
    assert out["response_length"].tolist() == [7, 8]
    assert out["num_turns"].tolist() == [2, 2] and out["num_tool_calls"].tolist() == [1, 1]
    assert out["num_tool_errors"].tolist() == [0, 1] and out["num_tool_truncated"].tolist() == [
        0,
        1,
    ]
    assert out["response_mask"].dtype == torch.float32 and out["turn_index"].dtype == torch.long


@pytest.mark.parametrize(
    ("length", "responses", "mask", "turns", "truncated"),
    [(9, [30, 31, 40, 41, 42, 32, 33, 34, 35], [1, 1, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1, 1], False),
     (10, [30, 31, 40, 41, 42, 32, 33, 34, 35, PAD], [1, 1, 0, 0, 0, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1, 1, 1, 1, -1], False),
     (5, [30, 31, 40, 41, 42], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], True),  # cut at a boundary: turn 1 lost
     (3, [30, 31, 40], [1, 1, 0], [0, 0, 0], True),  # cut inside the tool delta
     (2, [30, 31], [1, 1], [0, 0], True),  # cut right after turn 0
     (1, [30], [1], [0], True)],  # cut inside turn 0
)  # fmt: skip
def test_every_cut_of_one_episode(length, responses, mask, turns, truncated):
    out = pack([episode_b()], response_length=length, pad_id=PAD)
    assert out["responses"][0].tolist() == responses and out["response_mask"][0].tolist() == mask
    assert out["turn_index"][0].tolist() == turns and out["truncated"].tolist() == [truncated]
    assert out["tool_mask"][0].tolist() == [1 - m if t >= 0 else 0 for m, t in zip(mask, turns)]
    assert out["num_turns"].tolist() == [2]  # counts are the episode's, past the cut too


def test_trajectory_records():
    t = episode_a()
    assert t.response_ids == [10, 11, 12, 20, 21, 13, 14]
    assert t.context_ids() == [1, 2, 10, 11, 12, 20, 21, 13, 14]
    assert [s.kind for s in t.segments] == [POLICY, TOOL, POLICY]
    assert (t.num_turns, t.num_tool_calls, t.num_tool_errors, t.tool_truncated) == (2, 1, 0, 0)
    with pytest.raises(ValueError, match="slot 'lp' has 1 values for 2 tokens"):
        t.add_turn([1, 2], lp=[0.0])
    with pytest.raises(ValueError, match="a tool delta must follow a policy turn"):
        Trajectory([1]).add_tool([5])


def test_slots_must_cover_every_policy_turn():
    t = Trajectory([1])
    t.add_turn([5], lp=[-1.0])
    t.add_tool([6])
    t.add_turn([7])
    with pytest.raises(ValueError, match="trajectory 0, segment 2: no slot 'lp'"):
        pack([t], 4, PAD)


def test_empty_batch_and_empty_episode():
    out = pack([], 4, PAD)
    assert out["responses"].shape == (0, 4) and out["num_turns"].shape == (0,)
    out = pack([Trajectory([1])], 3, PAD)
    assert out["responses"].tolist() == [[PAD] * 3] and out["turn_index"].tolist() == [[-1] * 3]
    assert out["truncated"].tolist() == [False] and out["num_turns"].tolist() == [0]


def random_trajectory(rng: random.Random) -> Trajectory:
    t = Trajectory([rng.randrange(1, 50) for _ in range(rng.randrange(1, 4))])
    for turn in range(rng.randrange(0, 5)):
        n = rng.randrange(0, 5)
        t.add_turn([rng.randrange(1, 99) for _ in range(n)],
                   lp=[-rng.random() for _ in range(n)], off=[rng.randrange(2) for _ in range(n)])  # fmt: skip
        if rng.random() < 0.7:
            statuses = rng.choices(["ok", "error", "timeout"], k=rng.randrange(1, 3))
            t.add_tool([100 + turn] * rng.randrange(0, 4), statuses, [rng.random() < 0.3])
    return t


def reference(trajectories: list[Trajectory], length: int) -> dict[str, list]:
    """Token by token, the same layout `pack` documents."""
    rows: dict[str, list] = {
        k: []
        for k in ("responses", "response_mask", "tool_mask", "turn_index", "lp", "off", "truncated")
    }
    for t in trajectories:
        row = {k: [] for k in rows if k != "truncated"}
        turn = -1
        for segment in t.segments:
            turn += segment.kind == POLICY
            for j, token in enumerate(segment.ids):
                policy = segment.kind == POLICY
                row["responses"].append(token)
                row["response_mask"].append(float(policy))
                row["tool_mask"].append(float(not policy))
                row["turn_index"].append(turn)
                for slot in ("lp", "off"):
                    row[slot].append(segment.slots[slot][j] if policy else 0.0)
        rows["truncated"].append(len(row["responses"]) > length)
        pads = {"responses": PAD, "turn_index": -1}
        for key, values in row.items():
            rows[key].append((values + [pads.get(key, 0.0)] * length)[:length])
    return rows  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
def test_pack_equals_a_per_token_loop(seed):
    rng = random.Random(seed)
    batch = [random_trajectory(rng) for _ in range(8)]
    length = rng.randrange(1, 16)
    out, expected = pack(batch, length, PAD), reference(batch, length)
    for key, values in expected.items():
        wanted = torch.tensor(values, dtype=out[key].dtype).reshape(out[key].shape)
        torch.testing.assert_close(out[key], wanted, rtol=0, atol=0, msg=key)
    assert out["num_tool_errors"].tolist() == [
        sum(s != "ok" for s in t.tool_statuses) for t in batch
    ]
