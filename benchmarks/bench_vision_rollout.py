"""Guided rollout cost vs draft-only with images, as ratios measured in one run (2-core CPU).

A tiny Qwen2.5-VL pair built here (`verl.tasks.tiny_vlm`: the draft 128 wide, the guidance 256
wide, one tokenizer and image processor) generates the same responses (`ignore_eos`) for
prompts of a picture to count: draft-only, and with speculative guidance (λ = 0.5, k = 4). The
same pair then does the same on text prompts of the same lengths (the expanded image prompts
with every image token replaced by a letter, no images): the guided/draft-only ratio with images
beside the text ratio says what the images add to guidance's cost. Timed in turns, medians of
--repeats, with the threads of `bench_guided_rollout.timed` (the guidance in its own process).

Usage:
    python benchmarks/bench_vision_rollout.py
    python benchmarks/bench_vision_rollout.py --prompts 16 --response 32 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch

from benchmarks.bench_guided_rollout import bootstrap_ratio, timed
from verl.protocol import DataProto
from verl.workers.rollout.config import RolloutConfig
from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout


def image_batch(draft: str, root: str, count: int) -> DataProto:
    """`count` counting prompts with their pictures, collated as the trainer does."""
    from transformers import AutoTokenizer

    from verl.tasks.tiny_vlm import write_count_data
    from verl.utils.dataset import ImageSettings, PromptEncoder, RLDataset, collate

    data = write_count_data(f"{root}/data", count, seed=0)
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(draft), 128)
    dataset = RLDataset(data, encoder, "prompt", "answer", images=ImageSettings(draft, image_dir=f"{root}/data"))  # fmt: skip
    items = [dataset[i] for i in range(count)]
    return DataProto.from_single_dict(collate(items, 128, 0), meta_info={"ignore_eos": True, "lam": 0.5})  # fmt: skip


def text_twin(batch: DataProto, image_token_id: int, letter: int) -> DataProto:
    """The batch's expanded prompts with every image pad replaced by `letter`, without images."""
    ids = batch.batch["input_ids"].clone()
    ids[ids == image_token_id] = letter
    return DataProto.from_dict({"input_ids": ids, "attention_mask": batch.batch["attention_mask"]},
                               meta_info=dict(batch.meta_info))  # fmt: skip


def rollout(draft: str, guidance: str | None, response: int, tok) -> VLLMRollout:
    cfg = RolloutConfig(n=1, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.03, seed=0,
                        prompt_length=128, response_length=response)  # fmt: skip
    g = cfg.offpolicy_guidance
    g.enable, g.model_path, g.dtype, g.gpu_memory_utilization = (
        bool(guidance),
        guidance,
        "float32",
        0.03,
    )
    g.num_speculative_tokens, g.lam = 4, 0.5
    return VLLMRollout(draft, cfg, tok.eos_token_id, tok.pad_token_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--response", type=int, default=32, help="new tokens per response")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from verl.tasks.tiny_vlm import TinyVLMSpec, save_tiny_vlm
    from verl.utils.vision import load_processor

    with tempfile.TemporaryDirectory(prefix="bench_vision_") as root:
        draft = save_tiny_vlm(f"{root}/draft", TinyVLMSpec(seed=0))
        guide = save_tiny_vlm(f"{root}/guidance", TinyVLMSpec(hidden_size=256, seed=1))
        tok = AutoTokenizer.from_pretrained(draft)
        images = image_batch(draft, root, args.prompts)
        text = text_twin(
            images, load_processor(draft).image_token_id, tok.convert_tokens_to_ids("a")
        )
        engines = {"draft-only": rollout(draft, None, args.response, tok),
                   "guided": rollout(draft, guide, args.response, tok)}  # fmt: skip
        batches = {"images": images, "text": text}
        settings = [(e, b) for b in batches for e in engines]
        times = {s: [] for s in settings}
        meta = {}
        for repeat in range(args.repeats + 1):  # the first: warm-up
            for engine, kind in settings:
                seconds, out = timed(engines[engine], batches[kind])
                assert int(out.batch["response_mask"].sum()) == args.prompts * args.response
                if repeat:
                    times[engine, kind].append(seconds)
                    meta[engine, kind] = out.meta_info
        for engine in engines.values():
            engine.shutdown()
    width = int(images.batch["attention_mask"].sum(-1).float().mean())
    print(f"torch {torch.__version__}, tiny Qwen2.5-VL pair (128 / 256 wide), {args.prompts} prompts "
          f"(one picture, {width} prompt tokens on average), {args.response} new tokens, λ=0.5, k=4, "
          f"{os.cpu_count()} cores")  # fmt: skip
    for (engine, kind), t in times.items():
        m = meta[engine, kind]
        extra = f"  accept {m['accept_rate']:.2f}" if "accept_rate" in m else ""
        print(f"{engine:10s} {kind:6s} median {statistics.median(t):6.2f} s  ({', '.join(f'{x:.2f}' for x in t)}){extra}")  # fmt: skip
    print("\n=== summary (ratios from one run) ===")
    for kind in batches:
        guided, alone = times["guided", kind], times["draft-only", kind]
        low, high, share = bootstrap_ratio(guided, alone)
        ratio = statistics.median(guided) / statistics.median(alone)
        print(f"{kind}: guided / draft-only wall time {ratio:.2f}x (95 % bootstrap interval {low:.2f}-{high:.2f}, "
              f"<= 2.0 in {share:.0%} of resamples)")  # fmt: skip
    for engine in engines:
        ratio = statistics.median(times[engine, "images"]) / statistics.median(
            times[engine, "text"]
        )
        print(f"{engine}: with images / text of the same lengths {ratio:.2f}x")


if __name__ == "__main__":
    main()
