"""The embedded tasks: tiny draft / guidance pairs and their data, built by the project's own code.

Everything is built here (no model hub): the prompts, a character-level tokenizer shared by both
models, and one tiny Qwen2 supervised-trained once per task, whose snapshots become the pair:
each model is the snapshot whose held-out accuracy is nearest a stated target among the
evaluations up to `PICK_WINDOW` steps after the run first reaches it (`SFTSpec.targets`), never a
fixed step number, so every machine builds models of the same strength (within
`TARGET_TOLERANCE` wherever its curve passes that near; else the build warns) even where float
rounding moves the curve.

- `arithmetic` (the demo's): `a+b=` with the sum's digits reversed (`12+79=` -> `19`, since 91
  reversed is 19); responses of 1-3 digits. With reversed digits a 4-layer
  width-256 model passes ~86 % after 500 steps on two cores; in the usual order it stays near 6 %.
- `runsum` (the evidence's, long horizon): 20 digits and their running sums modulo 10
  (`7394=` -> `7093`): a response is 20 steps, each adding the next digit to the previous step's
  sum, and the reward reads the final digit only (with the response's length as its format), so
  one wrong step fails it: the error carries into every later sum. Its models are smaller (2
  layers, width 128) and measured by their expected accuracy when sampling at temperature 1,
  the rollout's, since a response of 20 steps sampled at T = 1 fails far more often than the
  greedy one.
- `toolchain` (multi-turn, needs its tool; `verl/tasks/embedded_tools.py`): `k07>3=` asks for
  3 lookups in the `lookup` tool's table from key k07, each next key the previous value
  (`[lookup:k07]`, answered `=70\n`, then `[lookup:k70]`...), then the last value (`48`).
  Trained on whole transcripts, the loss on the policy's tokens only; measured like `runsum`,
  sampled at T = 1 (the canonical episode's exact probability).
- `count` (vision, `verl/tasks/embedded_vision.py`): a 56 x 56 picture and `count=`; the answer
  is the number of squares in it, 1-9. Its models are tiny Qwen2.5-VLs (`tiny_vlm`; a vision
  tower of 2 blocks, a language model of 2 layers, width 128), measured sampled at T = 1.

    python -m verl.tasks.embedded [--task runsum] [--report]   # builds once; later calls reuse it
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from verl.tasks.embedded_tools import (
    TOOLCHAIN_FORMAT,
    TOOLCHAIN_MAX_TURNS,
    TOOLCHAIN_PROMPT_LENGTH,
    TOOLCHAIN_RESPONSE_LENGTH,
    TOOLCHAIN_TOOLS,
    toolchain_encode,
    toolchain_split,
)
from verl.tasks.embedded_vision import (
    COUNT_PROMPT_LENGTH,
    COUNT_RESPONSE_LENGTH,
    count_encode,
    count_split,
)
from verl.tasks.tiny_lm import TinyLMSpec, build_char_tokenizer, build_tiny_qwen2, save_tiny_lm
from verl.tasks.tiny_vlm import TinyVLMSpec, build_processor, build_tiny_qwen2_5_vl, save_tiny_vlm
from verl.utils.dataset import register_row_source

EMBEDDED_SCHEME = "embedded://"
CACHE_DIR = os.environ.get("VERL_EMBEDDED_CACHE", ".cache/embedded")
TEST_SIZE = 500
RUNSUM_TERMS = 20
"""Digits per `runsum` prompt: the steps of a response."""
RUNSUM_TRAIN_SIZE = 40_000
"""Training prompts of `runsum` (of 10^24), drawn once after the test prompts."""


def arithmetic_answer(a: int, b: int) -> str:
    """The sum of a and b with its digits reversed (least significant first)."""
    return str(a + b)[::-1]


def arithmetic_split(split: str, seed: int = 0) -> list[dict[str, str]]:
    """All 10^4 pairs a, b < 100, shuffled once; the first 500 are `test`, the rest `train`.
    Rows: {"prompt": "a+b=", "answer": reversed digits of a+b}."""
    _check_split(split)
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(seed).shuffle(pairs)
    chosen = pairs[:TEST_SIZE] if split == "test" else pairs[TEST_SIZE:]
    return [{"prompt": f"{a}+{b}=", "answer": arithmetic_answer(a, b)} for a, b in chosen]


def runsum_row(digits: list[int]) -> dict[str, str]:
    """The `runsum` row of `digits` (each 0-9): the prompt is the digits and "=", the answer
    their running sums modulo 10, one digit per step, whose last digit is the final answer.
    [7, 3, 9, 4] -> prompt "7394=", answer "7098" (7, 10, 19, 23 mod 10)."""
    total, sums = 0, []
    for digit in digits:
        total = (total + digit) % 10
        sums.append(str(total))
    return {"prompt": "".join(map(str, digits)) + "=", "answer": "".join(sums)}


def runsum_split(split: str, seed: int = 0, terms: int = RUNSUM_TERMS) -> list[dict[str, str]]:
    """`TEST_SIZE` test rows, then `RUNSUM_TRAIN_SIZE` train rows of `terms` random digits,
    drawn once from `seed` (a train prompt equal to a test prompt is dropped)."""
    _check_split(split)
    rng = random.Random(seed)
    rows = [runsum_row([rng.randrange(10) for _ in range(terms)])
            for _ in range(TEST_SIZE + RUNSUM_TRAIN_SIZE)]  # fmt: skip
    test = rows[:TEST_SIZE]
    if split == "test":
        return test
    seen = {r["prompt"] for r in test}
    return [r for r in rows[TEST_SIZE:] if r["prompt"] not in seen]


def _check_split(split: str) -> None:
    if split not in ("train", "test"):
        raise ValueError(f"embedded split {split!r} is not valid; valid: train, test")


@dataclass
class SFTSpec:
    """One supervised run of a tiny model; its snapshots at the accuracy targets are the pair."""

    model: TinyLMSpec | TinyVLMSpec
    """Shape of the model, a tiny Qwen2 or Qwen2.5-VL (every snapshot shares it and the tokenizer)."""
    targets: dict[str, float]
    """Snapshot name -> held-out accuracy it is chosen nearest (`pick_snapshot`, `target_decided`)."""
    max_steps: int
    """Optimizer steps at most; a target not fixed by then takes its nearest snapshot (one never
    reached is logged)."""
    eval_every: int = 10
    """Steps between held-out evaluations while the model scores below `DENSE_FROM` of its lowest
    open target; every step after (the candidates of `pick_snapshot`, `PICK_WINDOW` past a crossing)."""
    batch_size: int = 256
    """Prompts per step."""
    lr: float = 1e-3
    """Peak AdamW learning rate (linear warm-up over 20 steps, then constant)."""


@dataclass(frozen=True)
class EmbeddedTask:
    """An embedded task: its rows, its reward, its lengths and its pair."""

    rows: Callable[[str], list[dict[str, str]]]
    """split ("train" / "test") -> rows with a prompt and its answer."""
    reward: str
    """Built-in reward function (`verl.workers.reward.function`)."""
    max_prompt_length: int
    """Longest prompt in tokens."""
    max_response_length: int
    """Longest right answer in tokens, EOS included."""
    pair: SFTSpec
    """The supervised run whose snapshots are its models."""
    measure: str = "greedy"
    """Held-out accuracy its targets are stated in: greedy (`greedy_accuracy`) or sampled at
    temperature 1 (`sampled_accuracy`)."""
    encode: Callable | None = None
    """(rows, tokenizer) -> (ids, mask of the tokens trained on and measured[, per-row image
    inputs]) of its supervised sequences (`_encoded`); None: prompt + answer + EOS (`_encode`)."""
    tools: tuple[str, ...] = ()
    """Multi-turn tasks: the tools its episodes load (`worker.rollout.multi_turn.tools`); () for a
    single-turn task."""
    tool_call_format: str = "embedded"
    """Multi-turn tasks: `worker.rollout.multi_turn.tool_call_format`."""
    max_turns: int = 1
    """Policy turns per episode (`worker.rollout.multi_turn.max_turns`); 1: single-turn."""


MODEL = TinyLMSpec(hidden_size=256, num_hidden_layers=4, vocab_size=128, seed=12)
SMALL = TinyLMSpec(hidden_size=128, num_hidden_layers=2, vocab_size=128, seed=12)
VISION = TinyVLMSpec(hidden_size=128, num_hidden_layers=2, seed=0)
TASKS: dict[str, EmbeddedTask] = {
    "arithmetic": EmbeddedTask(arithmetic_split, "arithmetic", 8, 4,
                               SFTSpec(MODEL, {"weak": 0.15, "draft": 0.36, "guidance": 0.97}, max_steps=1500)),
    "runsum": EmbeddedTask(runsum_split, "runsum", RUNSUM_TERMS + 1, RUNSUM_TERMS + 1,
                           SFTSpec(SMALL, {"hard": 0.03, "draft": 0.15, "guidance": 0.95}, max_steps=4000, batch_size=128), "sampled"),
    "count": EmbeddedTask(count_split, "count", COUNT_PROMPT_LENGTH, COUNT_RESPONSE_LENGTH,
                          SFTSpec(VISION, {"draft": 0.15, "guidance": 0.95}, max_steps=600, batch_size=64), "sampled",
                          count_encode),
    "toolchain": EmbeddedTask(toolchain_split, "toolchain", TOOLCHAIN_PROMPT_LENGTH, TOOLCHAIN_RESPONSE_LENGTH,
                              SFTSpec(SMALL, {"draft": 0.15, "guidance": 0.95}, max_steps=4000, batch_size=128),
                              "sampled", toolchain_encode, TOOLCHAIN_TOOLS, TOOLCHAIN_FORMAT, TOOLCHAIN_MAX_TURNS),
}  # fmt: skip
"""Embedded task name -> its definition. Targets: `arithmetic` weak 15 %, draft (the demo's)
36 %, guidance 97 % (greedy); `runsum` draft 15 % (a student that gets most steps right and the
whole answer seldom), hard 3 % (a student whose groups of 8 mostly all fail: the regime where
GRPO learns nothing from a prompt), guidance 95 % (sampled at T = 1); `toolchain` the same, over the canonical
episode's policy tokens (its response length counts the tool tokens: 51; 4 turns at most);
`count` (tiny Qwen2.5-VL, squares in a picture) draft 15 % (chance is 1 in 9) and guidance 95 %,
sampled at T = 1."""


@register_row_source(EMBEDDED_SCHEME)
def load_embedded(spec: str) -> list[dict[str, str]]:
    """Rows of `embedded://<task>@<split>` (e.g. embedded://arithmetic@train)."""
    body = spec[len(EMBEDDED_SCHEME) :]
    task, _, split = body.partition("@")
    if task not in TASKS:
        raise ValueError(
            f"embedded task {task!r} in {spec!r} is not valid; valid: {', '.join(TASKS)}"
        )
    return TASKS[task].rows(split or "train")


def embedded_task(train_files: str) -> str | None:
    """The embedded task a `data.train_files` value names (None: not an embedded dataset)."""
    if not train_files.startswith(EMBEDDED_SCHEME):
        return None
    task = train_files[len(EMBEDDED_SCHEME) :].partition("@")[0]
    return task if task in TASKS else None


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


def _encoded(encode, rows: list[dict], tokenizer) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """`encode`'s (ids, mask) or (ids, mask, inputs), as (ids, mask, inputs): inputs ({} for
    text) are the rows' image inputs, each (N, ...) (`embedded_vision.count_encode`)."""
    ids, mask, *inputs = encode(rows, tokenizer)
    return ids, mask, inputs[0] if inputs else {}


def _logits(model, ids: torch.Tensor, inputs: dict) -> torch.Tensor:
    """(N, L, V) logits of the rows `ids` with their image inputs (`_encoded`): a VLM takes
    `pixel_values` as every row's patches in one (N·patches, D) tensor."""
    extra = {k: v.flatten(0, 1) if k == "pixel_values" else v for k, v in inputs.items()}
    return model(input_ids=ids, **extra).logits


def _pick(inputs: dict, rows: torch.Tensor) -> dict:
    """The image inputs of the chosen `rows` (each input is (N, ...))."""
    return {k: v[rows] for k, v in inputs.items()}


@torch.no_grad()
def sampled_accuracy(
    model, rows: list[dict[str, str]], tokenizer, temperature: float = 1.0, encode=_encode
) -> float:
    """Expected share of rows whose answer (and EOS), sampled at `temperature`, is exactly right:
    the mean over rows of Π_t p_T(answer token t | the right prefix), computed exactly from one
    teacher-forced forward (no sampling noise; smooth in the weights, unlike greedy accuracy).
    `encode` (`EmbeddedTask.encode`) gives the sequences and the tokens the product runs over
    (`toolchain`: the canonical episode's policy tokens, its tool tokens given)."""
    return sampled_row_accuracy(model, rows, tokenizer, temperature, encode).mean().item()


@torch.no_grad()
def sampled_row_accuracy(
    model, rows: list[dict[str, str]], tokenizer, temperature: float = 1.0, encode=_encode
) -> torch.Tensor:
    """(R,) each row's probability of its exact answer sampled at `temperature` (`sampled_accuracy`
    is their mean)."""
    ids, mask, inputs = _encoded(encode, rows, tokenizer)
    log_probs = (_logits(model, ids, inputs)[:, :-1].float() / temperature).log_softmax(-1)
    picked = log_probs.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) * mask[:, 1:]
    return picked.sum(-1).exp()


def all_fail_share(row_accuracy: torch.Tensor, n: int) -> float:
    """Expected share of groups of n independent samples that all fail: mean over rows of
    (1 - a_r)^n, a_r a row's success probability (R,). The groups GRPO learns nothing from."""
    return ((1.0 - row_accuracy.double()) ** n).mean().item()


@torch.no_grad()
def greedy_accuracy(model, rows: list[dict[str, str]], tokenizer, encode=_encode) -> float:
    """Share of rows whose greedy answer (and EOS) is exactly right (for `runsum`: every step
    right, which its final-answer reward reads up to errors that cancel).

    Teacher-forced argmax equals greedy decoding here: greedy output matches the answer iff the
    argmax is right at every answer position given the right prefix.
    """
    ids, mask, inputs = _encoded(encode, rows, tokenizer)
    logits = _logits(model, ids, inputs)[:, :-1]
    correct = (logits.argmax(-1) == ids[:, 1:]) | ~mask[:, 1:]
    return correct.all(-1).float().mean().item()


def load_snapshot(path: str) -> tuple[torch.nn.Module, object]:
    """A built model folder as (the model in eval mode, float32; what its task encodes with: the
    char tokenizer, or a VLM's processor)."""
    import transformers

    if os.path.isfile(os.path.join(path, "preprocessor_config.json")):
        from verl.utils.vision import load_processor

        model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
            path, dtype=torch.float32
        )
        return model.eval(), load_processor(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval(), build_char_tokenizer()


MEASURES = {"greedy": greedy_accuracy, "sampled": sampled_accuracy}
"""How a task's held-out accuracy is measured (`EmbeddedTask.measure`)."""


TARGET_TOLERANCE = 0.05
"""How far (absolute accuracy) a chosen snapshot may land from its target before the build warns.
Near a target the run evaluates every step, and greedy accuracy moves by a median of 5 points, at
most 20, between neighbouring steps in arithmetic's 25-50 % band (2-4 points for runsum, sampled,
near 15 %): the two evaluations around the first crossing can both miss by more (an Intel Xeon
built its draft at 30.4 % of 36 % so), which is why the pick looks over `PICK_WINDOW` more."""

PICK_WINDOW = 20
"""Evaluations that follow a target's first crossing before the run may fix its snapshot
(`target_decided`); near the targets the run evaluates every step, so these are 20 steps."""


DENSE_FROM = 0.01
"""The share of its lowest open target from which a supervised run evaluates every step. A tenth
was too late for runsum's 3 % student: its sampled accuracy grows about 1.5x a step there, from
0.3 % at one sparse evaluation to 15.7 % at the next (10 steps), so the nearest snapshot was the
0.3 % one; evaluated every step, the steps between land within about 0.6 points of 3 %."""


def _within(accuracy: float, target: float) -> bool:
    """Whether `accuracy` lies within `TARGET_TOLERANCE` of `target` (the bound included)."""
    return abs(accuracy - target) <= TARGET_TOLERANCE + 1e-12


def _nearness(evaluation: tuple[int, float], target: float) -> tuple[float, bool, int]:
    """Sort key of a (step, accuracy) evaluation for `target`: its distance, then ties broken
    toward the first crossing (at or above the target before below it; the earliest of those at
    or above, the latest of those below)."""
    step, accuracy = evaluation
    below = accuracy < target
    return abs(accuracy - target), below, -step if below else step


def pick_snapshot(curve: list[tuple[int, float]], target: float) -> tuple[int, float]:
    """The (step, accuracy) evaluation of `curve` nearest `target` (ties: `_nearness`)."""
    return min(curve, key=lambda evaluation: _nearness(evaluation, target))


def target_decided(
    curve: list[tuple[int, float]], target: float, window: int = PICK_WINDOW
) -> bool:
    """Whether a run whose evaluations so far are `curve` fixes `target`'s snapshot now: `window`
    evaluations have followed the first that reaches it, and either the nearest so far lies
    within `TARGET_TOLERANCE` or the last `window` all lie above that band (the curve has left
    it upward; training on would not come back). A run that ends decides every open target."""
    first = next((i for i, (_, acc) in enumerate(curve) if acc >= target), None)
    if first is None or len(curve) - 1 - first < window:
        return False
    if _within(pick_snapshot(curve, target)[1], target):
        return True
    return all(acc > target and not _within(acc, target) for _, acc in curve[-window:])


def off_target(accuracy: float, target: float) -> str:
    """A warning when a chosen snapshot's accuracy lies more than `TARGET_TOLERANCE` from its
    target (the figures the README reports then do not hold for this build), else ''."""
    if _within(accuracy, target):
        return ""
    return (f"warning: {accuracy:.1%} is {100 * abs(accuracy - target):.1f} points from the target {target:.0%} "
            f"(tolerance {TARGET_TOLERANCE:.0%}): no evaluation of the supervised curve came nearer on this "
            "machine, so runs from this model may differ from the README's figures")  # fmt: skip


def decision_point(curve: list[tuple[int, float]], target: float, window: int = PICK_WINDOW) -> int:
    """How many evaluations of a whole recorded `curve` the run had made when it fixed `target`
    (`target_decided`); all of them when it never did (the run ended)."""
    decided = (n for n in range(1, len(curve) + 1) if target_decided(curve[:n], target, window))
    return next(decided, len(curve))


def pick_snapshots(
    curve: list[tuple[int, float]], targets: dict[str, float], window: int = PICK_WINDOW
) -> dict[str, tuple[int, float]]:
    """The rule of `supervised_snapshots` replayed over a whole curve of (step, accuracy)
    evaluations, in order: each target takes the evaluation nearest it among those made by the
    time the run fixes it (`decision_point`)."""
    return {name: pick_snapshot(curve[: decision_point(curve, target, window)], target)
            for name, target in targets.items()}  # fmt: skip


def supervised_snapshots(
    spec: SFTSpec,
    train: list[dict[str, str]],
    test: list[dict[str, str]],
    tokenizer,
    log=print,
    curve: list[tuple[int, float]] | None = None,
    measure: str = "greedy",
    encode=_encode,
) -> Iterator[tuple[str, int, float, torch.nn.Module]]:
    """Cross-entropy on the tokens `encode` marks (the response: prompts and tool results are not
    predicted), evaluated on `test` every `eval_every` steps; yields (name, step, accuracy, model)
    for each target as soon as the run fixes it (`_decide`), and stops when every target is fixed
    (or at `max_steps`, where the targets still open take their nearest snapshot). Every
    evaluation is appended to `curve`."""
    model = _build_model(spec.model, tokenizer)
    ids, mask, inputs = _encoded(encode, train, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    gen = torch.Generator().manual_seed(spec.model.seed)
    pending = dict(sorted(spec.targets.items(), key=lambda item: item[1]))
    previous, kept = None, {}
    curve = [] if curve is None else curve
    for step in range(spec.max_steps + 1):
        if step:
            model.train()
            pick = torch.randint(0, ids.shape[0], (spec.batch_size,), generator=gen)
            batch, target = ids[pick], mask[pick]
            logits = _logits(model, batch, _pick(inputs, pick))[:, :-1]
            loss = torch.nn.functional.cross_entropy(
                logits[target[:, 1:]], batch[:, 1:][target[:, 1:]]
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
        # every step once the run scores `DENSE_FROM` of its lowest open target (it may climb fast)
        sparse = previous is None or previous[1] < DENSE_FROM * min(pending.values())
        if sparse and step % spec.eval_every and step != spec.max_steps:
            continue
        model.eval()
        current = (step, MEASURES[measure](model, test, tokenizer, encode=encode))
        curve.append(current)
        if step % 50 == 0:
            log(f"  step {step}/{spec.max_steps}  held-out accuracy {current[1]:.1%}")
        yield from _decide(pending, curve, model, kept, step == spec.max_steps, log)
        if not pending:
            return
        previous = current


def _decide(
    pending: dict[str, float],
    curve: list[tuple[int, float]],
    model: torch.nn.Module,
    kept: dict[int, torch.nn.Module],
    last: bool,
    log=print,
) -> Iterator[tuple[str, int, float, torch.nn.Module]]:
    """After an evaluation of `model` (the last of `curve`): keep a copy of it in `kept` (step ->
    snapshot) while it is an open target's nearest (`pick_snapshot`), yield (name, step, accuracy,
    snapshot) for each target of `pending` the run fixes now (`target_decided`; all at its `last`
    evaluation) and remove it, then drop the copies no open target needs."""
    step = curve[-1][0]
    nearest = {name: pick_snapshot(curve, goal) for name, goal in pending.items()}
    if any(chosen == step for chosen, _ in nearest.values()):
        kept[step] = copy.deepcopy(model)
    for name, goal in list(pending.items()):
        if last or target_decided(curve, goal):
            if max(acc for _, acc in curve) < goal:
                log(f"  {name}: the run ends at {curve[-1][1]:.1%}, below its target {goal:.0%}")
            chosen, accuracy = nearest.pop(name)
            yield name, chosen, accuracy, kept[chosen]
            del pending[name]
    for stale in set(kept) - {chosen for chosen, _ in nearest.values()}:
        del kept[stale]


def _tokenizer(model: TinyLMSpec | TinyVLMSpec):
    """What a spec's supervised sequences are encoded with: the char tokenizer, or for a VLM the
    processor (its tokenizer with the vision tokens, and its image processor)."""
    return build_processor(model) if isinstance(model, TinyVLMSpec) else build_char_tokenizer()


def _build_model(model: TinyLMSpec | TinyVLMSpec, tokenizer) -> torch.nn.Module:
    """A randomly initialised tiny Qwen2 or Qwen2.5-VL of `model` (`_tokenizer`'s `tokenizer`)."""
    if isinstance(model, TinyVLMSpec):
        return build_tiny_qwen2_5_vl(model, tokenizer.tokenizer)
    return build_tiny_qwen2(model, tokenizer)


def _save(path: str, spec: SFTSpec, model, record: dict) -> None:
    """Write to `path.partial`, then rename: an interrupted build leaves nothing half-made."""
    tmp = path + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(spec.model, TinyVLMSpec):
        save_tiny_vlm(tmp, spec.model, model)
    else:
        save_tiny_lm(tmp, spec.model, model)
    with open(os.path.join(tmp, "embedded.json"), "w") as f:
        json.dump(record, f)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)


def task_dir(task: str, out: str = CACHE_DIR) -> str:
    """Cache folder of a task's models: `out` for arithmetic, `out/<task>` for the others."""
    return out if task == "arithmetic" else os.path.join(out, task)


def _cached(path: str, wanted: dict) -> dict | None:
    """The `embedded.json` record of `path` when it matches `wanted`."""
    marker = os.path.join(path, "embedded.json")
    if not os.path.isfile(marker):
        return None
    with open(marker) as f:
        record = json.load(f)
    return record if all(record.get(k) == v for k, v in wanted.items()) else None


def build_embedded(
    out: str | None = None, spec: SFTSpec | None = None, log=print, task: str = "arithmetic"
) -> dict[str, str | float]:
    """Build (once) a task's models under `out` (default `task_dir(task)`), one folder per target
    of its pair (`draft`, `guidance`, ...); returns their paths and held-out accuracies
    (`<name>_accuracy`). Reused when every record matches the spec."""
    out, spec = out or task_dir(task), spec or TASKS[task].pair
    paths = {name: os.path.join(out, name) for name in spec.targets}
    wanted = {"spec": asdict(spec), "task": task, "measure": TASKS[task].measure}
    records = {name: _cached(path, wanted) for name, path in paths.items()}
    if all(records.values()):
        return {**paths, **{f"{n}_accuracy": records[n]["test_accuracy"] for n in paths}}
    os.makedirs(out, exist_ok=True)
    targets = ", ".join(f"{n} {t:.0%}" for n, t in spec.targets.items())
    log(f"building the embedded {task} models ({TASKS[task].measure} held-out accuracy targets: {targets}), once; "
        "a few minutes on 2 cores...")  # fmt: skip
    start = time.perf_counter()
    tokenizer = _tokenizer(spec.model)
    rows, encode = TASKS[task].rows, TASKS[task].encode or _encode
    result: dict[str, str | float] = dict(paths)
    curve: list[tuple[int, float]] = []
    for name, step, accuracy, model in supervised_snapshots(
        spec, rows("train"), rows("test"), tokenizer, log, curve, TASKS[task].measure, encode
    ):
        record = {**wanted, "step": step, "test_accuracy": accuracy, "target": spec.targets[name],
                  "curve": list(curve)}  # fmt: skip
        _save(paths[name], spec, model, record)
        result[f"{name}_accuracy"] = accuracy
        log(f"  {name}: step {step}, held-out accuracy {accuracy:.1%} (target {spec.targets[name]:.0%}, "
            f"{time.perf_counter() - start:.0f} s)")  # fmt: skip
        if warning := off_target(accuracy, spec.targets[name]):
            log(f"  {name}: {warning}")
    return result


def snapshot_report(path: str, task: str, n: int = 8) -> dict[str, float | dict[str, float]]:
    """A built model's held-out figures: greedy and sampled (T = 1) accuracy, the expected share
    of groups of `n` samples that all fail (`all_fail_share`), and, for a task of at most 10
    distinct answers, the sampled accuracy per answer."""
    model, tokenizer = load_snapshot(path)
    rows, encode = TASKS[task].rows("test"), TASKS[task].encode or _encode
    sampled = sampled_row_accuracy(model, rows, tokenizer, encode=encode)
    report = {"greedy": greedy_accuracy(model, rows, tokenizer, encode),
              "sampled": sampled.mean().item(), f"all_fail_{n}": all_fail_share(sampled, n)}  # fmt: skip
    answers = sorted({row["answer"] for row in rows})
    if len(answers) <= 10:
        report["sampled_by_answer"] = {
            a: sampled[[row["answer"] == a for row in rows]].mean().item() for a in answers
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="arithmetic", choices=list(TASKS))
    parser.add_argument("--out", default=None, help="default: .cache/embedded[/<task>]")
    parser.add_argument("--report", action="store_true",
                        help="then print each model's held-out figures (snapshot_report)")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    built = build_embedded(args.out, task=args.task)
    print(json.dumps(built, indent=1))
    if args.report:
        folders = {name: built[name] for name in TASKS[args.task].pair.targets}
        print(
            json.dumps(
                {name: snapshot_report(str(path), args.task) for name, path in folders.items()},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
