"""The embedded tool task `toolchain`: a multi-turn task whose answer needs the `lookup` tool.

A prompt `k07>3=` names a start key of the built-in `lookup` tool's table (k00..k99 -> (37 n +
11) mod 100, `multi_turn.tools`) and a number of lookups, 1-3, never a value. The policy looks
the key up with a call in the `embedded` format, one call per turn (the turn stops at `]`), the
environment appends the result (`=70\\n`, the plain delta of `multi_turn.deltas`), and each next
key is the previous value, two digits (`k70`; 1 -> `k01`). After the last result the policy
writes the last value as two digits, and EOS:

    prompt    k07>3=
    response  [lookup:k07] =70\\n [lookup:k70] =1\\n [lookup:k01] =48\\n 48<EOS>
              policy       tool   policy       tool  policy       tool   policy

Each key but the first comes from a tool result, so an episode of n lookups needs n calls made
one after the other. The table is affine, so a value's last digit follows from its key's
((7 x the key's last digit + 1) mod 10) and a model can learn that part from its own calls;
the first digit needs the result (`tool_dependence` measures both).
Policy turns are at most 4 (`TOOLCHAIN_MAX_TURNS`: three calls and the answer) and a response at
most 51 tokens, tool tokens included (`TOOLCHAIN_RESPONSE_LENGTH`).

Supervised data are whole transcripts (`toolchain_transcript`) whose loss mask keeps the policy
tokens only (`toolchain_encode`), as RL's response_mask does. `sample_episodes` runs the real
turn loop (`MultiTurnRuntime`: parsing, tools, deltas) with a Hugging Face model sampling token
by token, and `evaluate_episodes` scores its episodes with the `toolchain` reward: a Monte-Carlo
estimate of the expected accuracy with its standard error, beside the exact probability of the
canonical episode (`embedded.sampled_accuracy` over these transcripts: a lower bound).
`tool_dependence` measures whether the answers need the tool: the same loop with the tool
answering nothing, or answering from another table.

    python -m verl.tasks.toolchain_report   # builds toolchain once, then prints its turn-loop figures
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from verl.workers.reward.function import toolchain_reward
from verl.workers.rollout.multi_turn import MultiTurnConfig, MultiTurnRuntime, Trajectory
from verl.workers.rollout.multi_turn.deltas import PLAIN_RESULT_CLOSE, PLAIN_RESULT_OPEN
from verl.workers.rollout.multi_turn.parsing import get_format
from verl.workers.rollout.multi_turn.tools import LOOKUP_TABLE, describe_tool, lookup

TOOLCHAIN_TOOLS = ("lookup",)
"""The tools its episodes load (`worker.rollout.multi_turn.tools`)."""
TOOLCHAIN_FORMAT = "embedded"
"""Its tool-call format (`worker.rollout.multi_turn.tool_call_format`)."""
TOOLCHAIN_DEPTHS = (1, 2, 3)
"""Lookups per episode."""
TOOLCHAIN_MAX_TURNS = max(TOOLCHAIN_DEPTHS) + 1
"""Policy turns per episode at most (`multi_turn.max_turns`): one per lookup and the answer."""
TOOLCHAIN_PROMPT_LENGTH = len("k07>3=")
"""Prompt length in tokens."""
TOOLCHAIN_RESPONSE_LENGTH = max(TOOLCHAIN_DEPTHS) * (len("[lookup:k07]") + len("=70\n")) + 3
"""Longest canonical response in tokens, tool tokens and EOS included: 51."""
TOOLCHAIN_TEST_STARTS = frozenset(random.Random(0).sample(range(100), 20))
"""Held-out start keys, 20 drawn once (with every depth: 60 test prompts; the chains from the
other 80 are `train`, 240): no training prompt starts from one of them."""
POLICY, TOOL = "policy", "tool"


def toolchain_prompt(start: int, depth: int) -> str:
    """`k07>3=`: start at key `start`, `depth` lookups."""
    return f"k{start:02d}>{depth}="


def toolchain_parse(prompt: str) -> tuple[int, int]:
    """(start key number, depth) of a prompt (`k07>3=` -> (7, 3))."""
    key, _, depth = prompt.removesuffix("=").partition(">")
    return int(key.removeprefix("k")), int(depth)


def toolchain_values(start: int, depth: int, table: Callable[[str], str] = lookup) -> list[str]:
    """The `depth` values of the chain from key `start`, as `table` (the tool) returns them; each
    next key is the previous value as two digits."""
    values, key = [], start
    for _ in range(depth):
        values.append(table(f"k{key:02d}"))
        key = int(values[-1])
    return values


def toolchain_row(start: int, depth: int, table: Callable[[str], str] = lookup) -> dict[str, str]:
    """The row of a chain: its prompt and the answer, the last value as two digits."""
    last = int(toolchain_values(start, depth, table)[-1])
    return {"prompt": toolchain_prompt(start, depth), "answer": f"{last:02d}"}


def toolchain_split(split: str) -> list[dict[str, str]]:
    """`test`: the chains of every depth from the `TOOLCHAIN_TEST_STARTS` keys (60 rows), in key
    order; `train`: those from the other 80 keys (240 rows)."""
    if split not in ("train", "test"):
        raise ValueError(f"embedded split {split!r} is not valid; valid: train, test")
    held_out = split == "test"
    return [toolchain_row(start, depth) for start in range(100) for depth in TOOLCHAIN_DEPTHS
            if (start in TOOLCHAIN_TEST_STARTS) == held_out]  # fmt: skip


def toolchain_transcript(
    prompt: str, table: Callable[[str], str] = lookup
) -> list[tuple[str, str]]:
    """The canonical episode of `prompt` after the prompt, as (kind, text) segments: per lookup a
    policy call and the tool's delta (`table`'s value), then the answer (EOS not included)."""
    start, depth = toolchain_parse(prompt)
    call_format, segments, key = get_format(TOOLCHAIN_FORMAT), [], start
    for value in toolchain_values(start, depth, table):
        segments.append((POLICY, call_format.render_call("lookup", [f"k{key:02d}"])))
        segments.append((TOOL, PLAIN_RESULT_OPEN + value + PLAIN_RESULT_CLOSE))
        key = int(value)
    return [*segments, (POLICY, f"{key:02d}")]


def _token_table(texts: set[str], tokenizer) -> dict[str, list[int]]:
    """Text -> its ids, tokenized in one batch (transcripts repeat a few hundred segments)."""
    ordered = sorted(texts)
    return dict(
        zip(ordered, tokenizer(ordered, add_special_tokens=False)["input_ids"], strict=True)
    )


def transcript_ids(
    prompt: str, tokenizer, table: dict[str, list[int]] | None = None
) -> tuple[list[int], list[int], list[bool]]:
    """(prompt ids, canonical response ids with EOS, policy-token mask of the response); `table`
    (`_token_table`) holds the ids of its texts when given."""
    segments = toolchain_transcript(prompt)
    table = table or _token_table({prompt, *(text for _, text in segments)}, tokenizer)
    response, policy = [], []
    for kind, text in segments:
        response += table[text]
        policy += [kind == POLICY] * len(table[text])
    return table[prompt], [*response, tokenizer.eos_token_id], [*policy, True]


def toolchain_encode(
    rows: Sequence[dict[str, str]], tokenizer
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, L) ids of prompt + canonical response + EOS, right-padded, and the mask of the policy
    tokens (calls, answer, EOS): the supervised loss and `sampled_accuracy` read only those."""
    transcripts = {row["prompt"]: toolchain_transcript(row["prompt"]) for row in rows}
    texts = {text for segments in transcripts.values() for _, text in segments}
    table = _token_table(texts | set(transcripts), tokenizer)
    seqs, masks = [], []
    for row in rows:
        prompt, response, policy = transcript_ids(row["prompt"], tokenizer, table)
        seqs.append(prompt + response)
        masks.append([False] * len(prompt) + policy)
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, (seq, policy) in enumerate(zip(seqs, masks, strict=True)):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(policy)] = torch.tensor(policy)
    return ids, mask


def toolchain_runtime(tokenizer, tool: Callable[[str], str] | None = None) -> MultiTurnRuntime:
    """The runtime of its episodes (`lookup`, embedded format, 4 turns, plain deltas); `tool`
    replaces the lookup function (the same name and description: `tool_dependence`)."""
    config = MultiTurnConfig(enable=True, tools=list(TOOLCHAIN_TOOLS), max_turns=TOOLCHAIN_MAX_TURNS,
                             tool_call_format=TOOLCHAIN_FORMAT)  # fmt: skip
    runtime = MultiTurnRuntime(config, tokenizer, use_chat_template=False)
    if tool is not None:
        runtime.tools["lookup"] = describe_tool(tool, "lookup")
    return runtime


@torch.no_grad()
def _next_tokens(model, contexts: list[list[int]], pad_id: int, temperature: float,
                 generator: torch.Generator) -> list[int]:  # fmt: skip
    """One token sampled at `temperature` after each context (right-padded, one forward)."""
    lengths = torch.tensor([len(c) for c in contexts])
    ids = torch.full((len(contexts), int(lengths.max())), pad_id, dtype=torch.long)
    for i, context in enumerate(contexts):
        ids[i, : len(context)] = torch.tensor(context)
    attention = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
    logits = model(input_ids=ids, attention_mask=attention).logits
    last = logits[torch.arange(len(contexts)), lengths - 1].float() / temperature
    return torch.multinomial(last.softmax(-1), 1, generator=generator).squeeze(-1).tolist()


def _turn_end(turn: list[int], used: int, limit: int, tokenizer, stops: list[str]) -> str | None:
    """Why a turn whose last token was just sampled ends (`runtime.FINISH_REASONS`), or None."""
    if turn[-1] == tokenizer.eos_token_id:
        return "eos"
    if any(tokenizer.decode(turn).endswith(stop) for stop in stops):
        return "tool_call"
    return "length" if used >= limit else None


def sample_episodes(
    model, prompts: Sequence[str], tokenizer, runtime: MultiTurnRuntime,
    response_length: int = TOOLCHAIN_RESPONSE_LENGTH, temperature: float = 1.0, seed: int = 0,
) -> list[Trajectory]:  # fmt: skip
    """One episode per prompt, sampled by `model` (`model(input_ids=, attention_mask=).logits`)
    at `temperature` through the real turn loop: a turn ends at a stop string, EOS or the
    response budget; `runtime.step` answers it; a delta that does not fit ends the episode."""
    generator = torch.Generator().manual_seed(seed)
    episodes = [Trajectory(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    contexts = [list(t.prompt_ids) for t in episodes]
    turns: list[list[int]] = [[] for _ in prompts]
    used, done = [0] * len(prompts), [0] * len(prompts)
    active = list(range(len(prompts)))
    while active:
        tokens = _next_tokens(model, [contexts[i] for i in active], tokenizer.pad_token_id,
                              temperature, generator)  # fmt: skip
        ended = []
        for i, token in zip(active, tokens, strict=True):
            turns[i].append(token)
            contexts[i].append(token)
            used[i] += 1
            reason = _turn_end(turns[i], used[i], response_length, tokenizer, runtime.stop_strings)
            if reason is not None:
                ended.append((i, reason))
                done[i] += 1
        texts = [tokenizer.decode(turns[i], skip_special_tokens=True) for i, _ in ended]
        outcomes = runtime.step(texts, [r for _, r in ended], [done[i] for i, _ in ended])
        for (i, _), outcome in zip(ended, outcomes, strict=True):
            episodes[i].add_turn(turns[i])
            turns[i] = []
            fits = outcome.continues and used[i] + len(outcome.delta.ids) <= response_length
            if fits:
                outcome.append_to(episodes[i])
                contexts[i] += outcome.delta.ids
                used[i] += len(outcome.delta.ids)
            else:
                active.remove(i)
    return episodes


def evaluate_episodes(
    model, rows: Sequence[dict[str, str]], tokenizer, runtime: MultiTurnRuntime | None = None,
    samples: int = 16, batch_size: int = 480, seed: int = 0,
) -> dict[str, float]:  # fmt: skip
    """Monte-Carlo expected accuracy at T = 1 over `rows` (`samples` episodes each, the
    `toolchain` reward against each row's answer) and its standard error for this fixed set of
    prompts (sqrt(Σ_p s_p² / k) / P, s_p² the unbiased variance of the k rewards of prompt p);
    also the share of episodes that are the canonical one, that are right without any call, the
    mean calls, and the accuracy by depth."""
    runtime = runtime or toolchain_runtime(tokenizer)
    prompts = [row["prompt"] for row in rows for _ in range(samples)]
    episodes: list[Trajectory] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        episodes += sample_episodes(model, chunk, tokenizer, runtime, seed=seed + start)
    rewards = torch.zeros(len(rows), samples)
    canonical = no_call = 0
    for n, episode in enumerate(episodes):
        row = rows[n // samples]
        text = tokenizer.decode(episode.response_ids, skip_special_tokens=True)
        score = toolchain_reward({"response": text, "ground_truth": row["answer"]})["overall"]
        rewards[n // samples, n % samples] = score
        canonical += episode.response_ids == transcript_ids(row["prompt"], tokenizer)[1]
        no_call += score > 0 and episode.num_tool_calls == 0
    per_prompt = rewards.var(1, unbiased=True) if samples > 1 else torch.zeros(len(rows))
    depths = torch.tensor([toolchain_parse(row["prompt"])[1] for row in rows])
    return {
        "accuracy": rewards.mean().item(),
        "stderr": (per_prompt.sum() / samples).sqrt().item() / len(rows),
        "episodes": len(episodes),
        "canonical_share": canonical / len(episodes),
        "right_without_call": no_call / len(episodes),
        "mean_tool_calls": sum(e.num_tool_calls for e in episodes) / len(episodes),
        **{
            f"accuracy_depth_{d}": rewards[depths == d].mean().item()
            for d in sorted(set(depths.tolist()))
        },
    }


def empty_lookup(key: str) -> str:
    """The lookup tool disabled: every call returns an empty result (`=\\n`).

    Args:
        key: the key, k00 to k99.
    """
    return ""


SHUFFLED_TABLE = dict(zip(LOOKUP_TABLE, random.Random(1).sample(list(LOOKUP_TABLE.values()), 100),
                          strict=True))  # fmt: skip
"""Another table over the same keys and values (a fixed permutation): `tool_dependence`."""


def shuffled_lookup(key: str) -> str:
    """The lookup tool answering from `SHUFFLED_TABLE` instead of the task's table.

    Args:
        key: the key, k00 to k99.
    """
    return SHUFFLED_TABLE[key.strip()]


def tool_dependence(model, rows: Sequence[dict[str, str]], tokenizer, samples: int = 8,
                    seed: int = 0) -> dict[str, float]:  # fmt: skip
    """Whether `model`'s answers come from the tool (chance: 1 %). `disabled`: the lookup tool
    returns nothing, accuracy against the true answers. `shuffled`: it answers from another
    table; accuracy against the true answers (high only if the model knows the table) and
    against the other table's answers (high when it reads the results)."""
    disabled = evaluate_episodes(model, rows, tokenizer, toolchain_runtime(tokenizer, empty_lookup),
                                 samples, seed=seed)  # fmt: skip
    runtime = toolchain_runtime(tokenizer, shuffled_lookup)
    true = evaluate_episodes(model, rows, tokenizer, runtime, samples, seed=seed)
    other = [toolchain_row(*toolchain_parse(r["prompt"]), shuffled_lookup) for r in rows]
    follows = evaluate_episodes(model, other, tokenizer, runtime, samples, seed=seed)
    return {"disabled_accuracy": disabled["accuracy"], "disabled_stderr": disabled["stderr"],
            "shuffled_true_accuracy": true["accuracy"], "shuffled_true_stderr": true["stderr"],
            "shuffled_follows_accuracy": follows["accuracy"],
            "shuffled_follows_stderr": follows["stderr"]}  # fmt: skip
