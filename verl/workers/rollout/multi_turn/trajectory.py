"""A multi-turn episode as segments of tokens, and the batch tensors it packs into.

A `Trajectory` is the prompt's ids and, after them, segments in order: a policy turn (the ids
exactly as sampled, with per-token slots such as the rollout's log-probs, the behavior log-probs
μ and the provenance mask) and, after a turn that called tools, the tool delta (`deltas.py`).
`pack` lays a batch of them out in the rollout's (B, T) layout, right-padded.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

POLICY, TOOL = "policy", "tool"
SEGMENT_KINDS = (POLICY, TOOL)
"""A segment's kind: sampled by the policy (trained on), or appended tool output (context only)."""


@dataclass
class Segment:
    """Consecutive tokens of one kind."""

    ids: list[int]
    """Token ids, as sampled (policy) or as rendered (tool)."""
    kind: str
    """One of SEGMENT_KINDS."""
    slots: dict[str, list[float]] = field(default_factory=dict)
    """Policy segments: name -> one value per token (log-probs, μ, provenance, ...)."""


@dataclass
class Trajectory:
    """One episode: prompt ids, then policy turns and tool deltas, and its tool outcomes."""

    prompt_ids: list[int]
    """The prompt's ids (before the first policy turn)."""
    segments: list[Segment] = field(default_factory=list)
    """The response: policy turns and tool deltas, in order."""
    tool_statuses: list[str] = field(default_factory=list)
    """Status of every tool call run for this episode (`tools.TOOL_STATUSES`)."""
    tool_truncated: int = 0
    """Tool results cut to `max_tool_response_length` (results only: `TurnOutcome.append_to`
    does not count a cut error text)."""

    def add_turn(self, ids: Sequence[int], **slots: Sequence[float]) -> None:
        """Append a policy turn; each slot has one value per token."""
        for name, values in slots.items():
            if len(values) != len(ids):
                raise ValueError(f"slot {name!r} has {len(values)} values for {len(ids)} tokens")
        self.segments.append(
            Segment(list(ids), POLICY, {k: [float(v) for v in vs] for k, vs in slots.items()})
        )

    def add_tool(self, ids: Sequence[int], statuses: Iterable[str] = (),
                 truncated: Iterable[bool] = ()) -> None:  # fmt: skip
        """Append the tool delta answering the last policy turn, with its calls' statuses and
        which texts count as truncated."""
        if not self.segments or self.segments[-1].kind != POLICY:
            raise ValueError("a tool delta must follow a policy turn")
        self.segments.append(Segment(list(ids), TOOL))
        self.tool_statuses.extend(statuses)
        self.tool_truncated += sum(bool(t) for t in truncated)

    @property
    def response_ids(self) -> list[int]:
        """Every token after the prompt, in order."""
        return [token for segment in self.segments for token in segment.ids]

    def context_ids(self) -> list[int]:
        """Prompt and response: what the engines' sessions hold."""
        return [*self.prompt_ids, *self.response_ids]

    @property
    def num_turns(self) -> int:
        """Policy turns."""
        return sum(segment.kind == POLICY for segment in self.segments)

    @property
    def num_tool_calls(self) -> int:
        """Tool calls run."""
        return len(self.tool_statuses)

    @property
    def num_tool_errors(self) -> int:
        """Tool calls whose status is not `ok`."""
        return sum(status != "ok" for status in self.tool_statuses)


def retokenized_tokens(tokenizer, trajectory: Trajectory, limit: int | None = None) -> int:
    """A diagnostic of what token-in/token-out avoids: how many of the episode's first `limit`
    response tokens (None: all) a text round trip would change, i.e. tokens of the response not
    in the matching blocks (`difflib`) between the episode's ids (prompt and response) and
    `tokenizer(decode(prompt + response))`. An agent loop that keeps the
    conversation as text and re-tokenizes it trains on those changed tokens instead of the
    sampled ones (a sampled "1","2" re-encoded as "12", a tool result merged with what follows).
    Training never uses the re-encoded ids. One episode of `retokenized_counts`."""
    return retokenized_counts(tokenizer, [trajectory], limit)[0]


def retokenized_counts(
    tokenizer, trajectories: Sequence[Trajectory], limit: int | None = None
) -> list[int]:
    """`retokenized_tokens` of each episode, decoded and encoded as one batch (the matching
    blocks are only searched where the round trip changed something)."""
    from difflib import SequenceMatcher

    sequences = [[*t.prompt_ids, *t.response_ids[:limit]] for t in trajectories]
    if not sequences:
        return []
    texts = tokenizer.batch_decode(sequences, skip_special_tokens=False)
    counts = []
    for t, sequence, again in zip(trajectories, sequences,
                                  tokenizer(texts, add_special_tokens=False)["input_ids"], strict=True):  # fmt: skip
        if again == sequence:
            counts.append(0)
            continue
        n = len(t.prompt_ids)
        blocks = SequenceMatcher(None, sequence, again, autojunk=False).get_matching_blocks()
        kept = sum(max(0, a + size - max(a, n)) for a, _, size in blocks)  # matched response tokens
        counts.append(len(sequence) - n - kept)
    return counts


def _slot_names(trajectories: Sequence[Trajectory]) -> list[str]:
    """The slot names of the batch; ValueError when a policy segment lacks one of them."""
    names = sorted(
        {n for t in trajectories for s in t.segments if s.kind == POLICY for n in s.slots}
    )
    for i, trajectory in enumerate(trajectories):
        for j, segment in enumerate(trajectory.segments):
            missing = set(names) - set(segment.slots) if segment.kind == POLICY else set()
            if missing:
                raise ValueError(f"trajectory {i}, segment {j}: no slot {sorted(missing)[0]!r}")
    return names


def _row(trajectory: Trajectory, names: list[str]) -> dict[str, list]:
    """One trajectory's per-token values, unpadded and uncut: ids, policy (bool), turn, slots."""
    row: dict[str, list] = {k: [] for k in ("ids", "policy", "turn", *names)}
    turn = -1
    for segment in trajectory.segments:
        if segment.kind not in SEGMENT_KINDS:
            raise ValueError(
                f"segment kind {segment.kind!r} is not valid; valid: {', '.join(SEGMENT_KINDS)}"
            )
        n, policy = len(segment.ids), segment.kind == POLICY
        turn += policy
        if turn < 0:
            raise ValueError("a trajectory's first segment must be a policy turn")
        row["ids"] += segment.ids
        row["policy"] += [policy] * n
        row["turn"] += [turn] * n
        for name in names:
            row[name] += segment.slots[name] if policy else [0.0] * n
    return row


def pack(
    trajectories: Sequence[Trajectory], response_length: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """The batch's response tensors, right-padded / cut to T = `response_length`.

    Per token (B, T): `responses` (long, `pad_id` on padding); `response_mask` (float32, 1 on
    policy tokens: the only ones any loss, advantage or token metric reads); `tool_mask`
    (float32, 1 on tool tokens); `response_attention_mask` (long, 1 on every kept token: tool
    tokens are context); `turn_index` (long, k on policy turn k, 0-based, and on the tool delta
    answering it, -1 on padding); one float64 tensor per slot name (the slot's value at each
    policy token as given, 0 on tool tokens and padding).
    Per episode (B,): `truncated` (bool, the budget cut the response), `response_length` (kept
    tokens), `num_turns`, `num_tool_calls`, `num_tool_errors`, `num_tool_truncated` (long, of the
    whole episode, also past a cut).
    """
    names = _slot_names(trajectories)
    b, t = len(trajectories), response_length
    rows = [_row(trajectory, names) for trajectory in trajectories]

    def padded(key: str, fill, dtype: torch.dtype) -> torch.Tensor:
        values = [row[key][:t] + [fill] * (t - min(len(row[key]), t)) for row in rows]
        return torch.tensor(values, dtype=dtype).reshape(b, t)

    lengths = torch.tensor([len(row["ids"]) for row in rows], dtype=torch.long)
    kept = torch.arange(t) < lengths.clamp(max=t)[:, None]
    policy = padded("policy", False, torch.bool)
    out = {
        "responses": padded("ids", pad_id, torch.long),
        "response_mask": policy.float(),
        "tool_mask": (kept & ~policy).float(),
        "response_attention_mask": kept.long(),
        "turn_index": padded("turn", -1, torch.long),
        **{name: padded(name, 0.0, torch.float64) for name in names},
        "truncated": lengths > t,
        "response_length": lengths.clamp(max=t),
    }
    counts = {"num_turns": "num_turns", "num_tool_calls": "num_tool_calls",
              "num_tool_errors": "num_tool_errors",
              "num_tool_truncated": "tool_truncated"}  # fmt: skip
    for key, attribute in counts.items():
        out[key] = torch.tensor([getattr(tr, attribute) for tr in trajectories], dtype=torch.long)
    return out
