"""Shared by the end-to-end trainer tests: a tiny draft / guidance pair and a reward file."""

from __future__ import annotations

import pytest

REWARD = """
def digit_share(reward_input):
    text = reward_input["response"]
    return {"overall": sum(c.isdigit() for c in text) / max(len(text), 1)}
"""


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """Built once a session and only read (runs write under their own run folders)."""
    from verl.tasks.tiny_lm import TinyLMSpec, save_tiny_lm

    root = tmp_path_factory.mktemp("e2e")
    draft = save_tiny_lm(
        str(root / "draft"), TinyLMSpec(hidden_size=64, num_hidden_layers=1, vocab_size=128, seed=1)
    )
    guide = save_tiny_lm(str(root / "guidance"), TinyLMSpec(hidden_size=128, num_hidden_layers=1, vocab_size=128, seed=2))  # fmt: skip
    (root / "reward.py").write_text(REWARD)
    return {"draft": draft, "guidance": guide, "reward": f"{root / 'reward.py'}:digit_share"}
