"""The `toolchain` task's turn-loop figures: build it once (`embedded.build_embedded`), then print
each model's exact canonical accuracy, its turn-loop accuracy and the guidance's dependence on
the tool, as JSON (benchmarks/README.md records them).

    python -m verl.tasks.toolchain_report
"""

from __future__ import annotations

import json
import os

import torch

from verl.tasks.embedded import build_embedded, sampled_accuracy
from verl.tasks.embedded_tools import (
    evaluate_episodes,
    tool_dependence,
    toolchain_encode,
    toolchain_split,
)
from verl.tasks.tiny_lm import build_char_tokenizer


def main() -> None:
    """Build `toolchain` once (`embedded.build_embedded`), then print each model's exact canonical
    accuracy, its turn-loop accuracy and the guidance's dependence on the tool, as JSON."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    built, tokenizer = build_embedded(task="toolchain"), build_char_tokenizer()
    test, report = toolchain_split("test"), {"build": built}
    for name in ("draft", "guidance"):
        model = AutoModelForCausalLM.from_pretrained(built[name]).eval()
        report[name] = {"canonical_exact": sampled_accuracy(model, test, tokenizer, encode=toolchain_encode),
                        **evaluate_episodes(model, test, tokenizer)}  # fmt: skip
        if name == "guidance":
            report[name].update(tool_dependence(model, test, tokenizer))
        print(json.dumps({name: report[name]}, indent=1), flush=True)


if __name__ == "__main__":
    main()
