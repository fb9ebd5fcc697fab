"""The multi-turn benchmark's pure parts: the per-turn prefill counter and its prompts."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scripts import load

B = load("bench_multi_turn")


def test_prefill_counter_records_prompt_and_computed_tokens_per_call():
    outputs = [
        SimpleNamespace(prompt_token_ids=list(range(40)), num_cached_tokens=32),
        SimpleNamespace(prompt_token_ids=list(range(6)), num_cached_tokens=None),
    ]
    engine = SimpleNamespace(generate=lambda requests, *args, **kwargs: outputs[: len(requests)])
    counter = B.PrefillCounter(engine)
    assert engine.generate(["a", "b"], None, use_tqdm=False) == outputs  # passed through
    engine.generate(["a"])
    # 40 prompt tokens, 32 served by the prefix cache: 8 computed; None (nothing cached): 6 of 6
    assert counter.calls == [[(40, 8), (6, 6)], [(40, 8)]]


def test_the_recipe_is_the_tool_task_s():
    cfg = B.rollout_config(n=4, response_length=51, multi_turn=True, guidance="g", block=32)
    mt, g = cfg.multi_turn, cfg.offpolicy_guidance
    assert (mt.enable, mt.tools, mt.tool_call_format, mt.max_turns) == (
        True,
        ["lookup"],
        "embedded",
        4,
    )
    assert (g.enable, g.lam, cfg.kv_block_size, cfg.n) == (True, 0.5, 32, 4)
    assert not B.rollout_config(4, 25, False, None).offpolicy_guidance.enable
