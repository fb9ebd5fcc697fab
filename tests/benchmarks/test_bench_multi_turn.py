"""The multi-turn benchmark's pure parts: the step counter, the recipe and the comparisons."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scripts import load

B = load("bench_multi_turn")


def test_step_counter_counts_both_loops_steps_and_restores_them(monkeypatch):
    """Two request-stream steps and one session step counted (3), each answer passed through, and
    the classes' own `step` back once the block is left."""
    monkeypatch.setattr(B.RequestStream, "step", lambda self: "request step")
    monkeypatch.setattr(B.SessionEngine, "step", lambda self: "session step")
    with B.StepCounter() as counter:
        assert B.RequestStream.step(None) == "request step"
        B.RequestStream.step(None)
        assert B.SessionEngine.step(None) == "session step"
    assert counter.steps == 3
    B.RequestStream.step(None)
    assert counter.steps == 3


def test_the_recipe_is_the_tool_task_s():
    cfg = B.rollout_config(n=4, response_length=51, multi_turn=True, guidance="g")
    mt, g = cfg.multi_turn, cfg.offpolicy_guidance
    assert (mt.enable, mt.tools, mt.tool_call_format, mt.max_turns) == (
        True,
        ["lookup"],
        "embedded",
        4,
    )
    assert (g.enable, g.lam, cfg.n) == (True, 0.5, 4)
    assert not B.rollout_config(4, 25, False, None).offpolicy_guidance.enable


def test_same_episodes_compares_tokens_masks_and_log_probs():
    import torch

    from verl.protocol import DataProto

    def rollout(log_prob: float) -> DataProto:
        tensors = {"responses": torch.tensor([[5, 6, 7]]), "response_mask": torch.tensor([[1.0, 0.0, 1.0]]),
                   "tool_mask": torch.tensor([[0.0, 1.0, 0.0]]), "multiturn_num_turns": torch.tensor([2]),
                   "rollout_log_probs": torch.tensor([[-0.5, 0.0, log_prob]])}  # fmt: skip
        return DataProto.from_dict(tensors)

    assert B.same_episodes(rollout(-1.0), rollout(-1.0)) == (True, 0.0)
    same, gap = B.same_episodes(rollout(-1.0), rollout(-1.25))
    assert same and gap == 0.25
    other = rollout(-1.0)
    other.batch["responses"][0, 1] = 9
    assert not B.same_episodes(rollout(-1.0), other)[0]


def test_turn_steps_by_hand():
    """Episode 0: turns of 2 and 1 policy tokens; episode 1: turns of 1, 3 and 1. A barrier
    loop's calls take 2 + 3 + 1 = 6 steps; the longest episode has 5 policy tokens."""
    import torch

    from verl.protocol import DataProto

    # turn 0, its tool delta, turn 1, its tool delta, turn 2, padding (-1)
    turn = torch.tensor([[0, 0, 0, 1, 1, -1, -1, -1, -1, -1],
                         [0, 0, 1, 1, 1, 1, 1, 2, -1, -1]])  # fmt: skip
    policy = torch.tensor([[1, 1, 0, 1, 0, 0, 0, 0, 0, 0],
                           [1, 0, 1, 1, 1, 0, 0, 1, 0, 0]])  # fmt: skip
    out = DataProto.from_dict({"turn_index": turn, "response_mask": policy.float()})
    assert B.turn_steps(out) == (6, 5)
