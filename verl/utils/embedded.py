"""The embedded default task: reversed-digit addition with a tiny draft and a stronger guidance.

Everything is built by the project's own code (no model hub): `a+b=` prompts whose answer is the
sum written least-significant digit first (`12+79=` -> `19`, since 91 reversed is 19), a
character-level tokenizer shared by both models, and two tiny Qwen2 models supervised-trained
for a few hundred steps: the guidance long enough to be good at the task, the draft briefly, so
it knows the answer format but is often wrong. DESIGN.md §6: with reversed digits a 4-layer
width-256 model passes ~86 % after 500 steps on two cores; in the usual order it stays near 6 %.

    python -m verl.utils.embedded [--task arithmetic3]   # builds once; later calls reuse it
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass

import torch

from verl.utils.tiny_lm import TinyLMSpec, build_char_tokenizer, build_tiny_qwen2, save_tiny_lm

EMBEDDED_SCHEME = "embedded://"
TASK_DIGITS = {"arithmetic": 2, "arithmetic3": 3}
"""Embedded tasks: reversed-digit addition of numbers with this many digits at most."""
TASKS = tuple(TASK_DIGITS)
CACHE_DIR = os.environ.get("VERL_EMBEDDED_CACHE", ".cache/embedded")
TEST_SIZE = 500
TRAIN_SIZE_3 = 40_000
"""Training pairs of `arithmetic3` (of its 10^6), drawn once with the split's seed."""


def arithmetic_answer(a: int, b: int) -> str:
    """The sum of a and b with its digits reversed (least significant first)."""
    return str(a + b)[::-1]


def arithmetic_split(split: str, seed: int = 0, digits: int = 2) -> list[dict[str, str]]:
    """Pairs a, b of at most `digits` digits; the first 500 are `test`, the rest `train`.

    2 digits: all 10^4 pairs, shuffled once. 3 digits (the harder task, answers of up to four
    digits): 500 + `TRAIN_SIZE_3` distinct pairs of the 10^6, drawn once. Rows:
    {"prompt": "a+b=", "answer": reversed digits of a+b}.
    """
    if split not in ("train", "test"):
        raise ValueError(f"embedded arithmetic split {split!r} is not valid; valid: train, test")
    top = 10**digits
    if digits == 2:
        pairs = [(a, b) for a in range(top) for b in range(top)]
        random.Random(seed).shuffle(pairs)
    else:
        codes = random.Random(seed).sample(range(top * top), TEST_SIZE + TRAIN_SIZE_3)
        pairs = [divmod(code, top) for code in codes]
    chosen = pairs[:TEST_SIZE] if split == "test" else pairs[TEST_SIZE:]
    return [{"prompt": f"{a}+{b}=", "answer": arithmetic_answer(a, b)} for a, b in chosen]


def load_embedded(spec: str) -> list[dict[str, str]]:
    """Rows of `embedded://<task>@<split>` (e.g. embedded://arithmetic@train)."""
    body = spec[len(EMBEDDED_SCHEME) :]
    task, _, split = body.partition("@")
    if task not in TASKS:
        raise ValueError(
            f"embedded task {task!r} in {spec!r} is not valid; valid: {', '.join(TASKS)}"
        )
    return arithmetic_split(split or "train", digits=TASK_DIGITS[task])


@dataclass
class SFTSpec:
    """The embedded pair: one tiny model supervised-trained once; the draft is an early snapshot."""

    model: TinyLMSpec
    """Shape of both models (same tokenizer, same shape)."""
    draft_steps: int
    """Optimizer step whose weights become the draft (before the loss plateau breaks: weak)."""
    guidance_steps: int
    """Optimizer steps of the guidance (after the plateau: strong)."""
    batch_size: int = 256
    """Prompts per step."""
    lr: float = 1e-3
    """Peak AdamW learning rate (linear warm-up over 20 steps, then constant)."""


PAIR = SFTSpec(TinyLMSpec(hidden_size=256, num_hidden_layers=4, vocab_size=128, seed=12),
               draft_steps=425, guidance_steps=525)  # fmt: skip
PAIR3 = SFTSpec(TinyLMSpec(hidden_size=256, num_hidden_layers=4, vocab_size=128, seed=12),
                draft_steps=600, guidance_steps=1200)  # fmt: skip
"""The harder task's pair (3-digit sums, answers of up to four digits). NOT CALIBRATED: with these
settings a supervised probe stayed at 0-1.2 % greedy test accuracy through 1,200 steps (38 s per
100 steps on 2 cores), so its steps are placeholders until a longer run or another model or
learning rate finds where the plateau breaks."""
PAIRS = {"arithmetic": PAIR, "arithmetic3": PAIR3}


def _encode(rows: list[dict[str, str]], tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, L) ids of prompt + answer + EOS, right-padded, and a mask of the answer + EOS tokens."""
    seqs, targets = [], []
    for row in rows:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        answer = tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id
        ]
        seqs.append(prompt + answer)
        targets.append([0] * len(prompt) + [1] * len(answer))
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, (s, t) in enumerate(zip(seqs, targets, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(t)] = torch.tensor(t, dtype=torch.bool)
    return ids, mask


@torch.no_grad()
def greedy_accuracy(model, rows: list[dict[str, str]], tokenizer) -> float:
    """Share of rows whose greedy answer (and EOS) is exactly right.

    Teacher-forced argmax equals greedy decoding here: greedy output matches the answer iff the
    argmax is right at every answer position given the right prefix.
    """
    ids, mask = _encode(rows, tokenizer)
    logits = model(ids).logits[:, :-1]
    correct = (logits.argmax(-1) == ids[:, 1:]) | ~mask[:, 1:]
    return correct.all(-1).float().mean().item()


def supervised_train(
    spec: SFTSpec, rows: list[dict[str, str]], tokenizer, log=print, snapshots: tuple[int, ...] = ()
):
    """Cross-entropy on the answer tokens (prompts are not predicted); yields (step, model) at
    each step of `snapshots` (default: `draft_steps` and `guidance_steps`), then stops."""
    snapshots = tuple(sorted(snapshots or (spec.draft_steps, spec.guidance_steps)))
    model = build_tiny_qwen2(spec.model, tokenizer)
    ids, mask = _encode(rows, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    gen = torch.Generator().manual_seed(spec.model.seed)
    for step in range(1, snapshots[-1] + 1):
        model.train()
        pick = torch.randint(0, ids.shape[0], (spec.batch_size,), generator=gen)
        batch, target = ids[pick], mask[pick]
        logits = model(batch).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[target[:, 1:]], batch[:, 1:][target[:, 1:]])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 50 == 0:
            log(f"  step {step}/{snapshots[-1]}  loss {loss.item():.3f}")
        if step in snapshots:
            model.eval()
            yield step, model


def _save(path: str, spec: SFTSpec, model, record: dict) -> None:
    """Write to `path.partial`, then rename: an interrupted build leaves nothing half-made."""
    tmp = path + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    save_tiny_lm(tmp, spec.model, model)
    with open(os.path.join(tmp, "embedded.json"), "w") as f:
        json.dump(record, f)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)


def task_dir(task: str, out: str = CACHE_DIR) -> str:
    """Cache folder of a task's models: `out` for arithmetic, `out/<task>` for the others."""
    return out if task == "arithmetic" else os.path.join(out, task)


def _cached(path: str, wanted: dict) -> dict | None:
    """The `embedded.json` record of `path` when it matches `wanted` (no task recorded: arithmetic)."""
    marker = os.path.join(path, "embedded.json")
    if not os.path.isfile(marker):
        return None
    with open(marker) as f:
        record = {"task": "arithmetic", **json.load(f)}
    return record if all(record.get(k) == v for k, v in wanted.items()) else None


def build_embedded(
    out: str | None = None, spec: SFTSpec | None = None, log=print, task: str = "arithmetic"
) -> dict[str, str]:
    """Build (once) a task's draft and guidance models under `out` (default `task_dir(task)`);
    returns their paths and accuracies. Both are reused when their records match the spec."""
    out, spec = out or task_dir(task), spec or PAIRS[task]
    paths = {name: os.path.join(out, name) for name in ("draft", "guidance")}
    wanted = {"spec": asdict(spec), "task": task}
    records = {name: _cached(path, wanted) for name, path in paths.items()}
    if all(records.values()):
        return {**paths, **{f"{n}_accuracy": records[n]["test_accuracy"] for n in paths}}
    os.makedirs(out, exist_ok=True)
    log(f"building the embedded {task} models: {spec.guidance_steps} supervised steps, once "
        "(a few minutes on 2 cores)...")  # fmt: skip
    start = time.perf_counter()
    tokenizer = build_char_tokenizer()
    digits = TASK_DIGITS[task]
    train, test = arithmetic_split("train", digits=digits), arithmetic_split("test", digits=digits)
    result = dict(paths)
    for step, model in supervised_train(spec, train, tokenizer, log):
        name = "draft" if step == spec.draft_steps else "guidance"
        accuracy = greedy_accuracy(model, test, tokenizer)
        _save(paths[name], spec, model, {**wanted, "step": step, "test_accuracy": accuracy})
        result[f"{name}_accuracy"] = accuracy
        log(
            f"  {name} (step {step}): test accuracy {accuracy:.1%} ({time.perf_counter() - start:.0f} s)"
        )
    return result


def build_snapshot(
    name: str, step: int, out: str | None = None, spec: SFTSpec | None = None, log=print,
    task: str = "arithmetic",
) -> dict[str, str | float]:  # fmt: skip
    """Build (once) the model of the task's supervised run at `step` as `out/name` (e.g. a
    weaker draft than the pair's); returns its path and greedy test accuracy."""
    out, spec = out or task_dir(task), spec or PAIRS[task]
    path = os.path.join(out, name)
    wanted = {"spec": asdict(spec), "task": task, "step": step}
    record = _cached(path, wanted)
    if record:
        return {"path": path, "accuracy": record["test_accuracy"]}
    log(f"building the embedded snapshot {name!r}: {step} supervised steps, once...")
    tokenizer = build_char_tokenizer()
    digits = TASK_DIGITS[task]
    train, test = arithmetic_split("train", digits=digits), arithmetic_split("test", digits=digits)
    for _, model in supervised_train(spec, train, tokenizer, log, snapshots=(step,)):
        accuracy = greedy_accuracy(model, test, tokenizer)
        _save(path, spec, model, {**wanted, "test_accuracy": accuracy})
    log(f"  {name} (step {step}): test accuracy {accuracy:.1%}")
    return {"path": path, "accuracy": accuracy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="arithmetic", choices=TASKS)
    parser.add_argument("--out", default=None, help="default: .cache/embedded[/<task>]")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(json.dumps(build_embedded(args.out, task=args.task), indent=1))


if __name__ == "__main__":
    main()
