"""The tokens appended after a policy turn that called tools: the tool messages as a *delta*.

Token-in/token-out: a trajectory is the prompt's ids, each policy turn's ids as sampled and one
delta per answered turn; history is never re-rendered. A delta is rendered on a fixed dummy
history, never on the real one:

    H = [user "Hi.", assistant A]          (A: a sentinel text)
    R1 = render(H + tool messages, add_generation_prompt=True)
    delta = R1 after the end of A          (then tokenized on its own)

It starts with what the template writes after an assistant's content (ChatML: `<|im_end|>\\n`),
then the tool messages, then the generation prompt of the next assistant turn (ChatML:
`<|im_start|>assistant\\n`), so the policy continues as the assistant. A turn that stopped at a
stop string (the embedded format's `]`) lacks its end-of-turn token, so the delta closes it; a
turn that ended at EOS (hermes) already holds it as its last sampled token (`after_eos`): where
the template's close starts with the tokenizer's EOS token, the delta starts after it (ChatML:
`\\n<|im_start|>tool\\n...`), so the sampled `<|im_end|>` is the turn's close. The whole delta is
tool output (response_mask 0). `prefix_preserving` records whether render(H) is a prefix of R1:
only then does the concatenated trajectory equal the template's rendering of the conversation.

All of a turn's results are rendered together, as consecutive tool messages in call order, so
a template that groups them renders them as it does in a conversation: Qwen2.5's and Qwen3's
put consecutive tool messages in one user turn:

    <|im_start|>user\\n<tool_response>\\n{a}\\n</tool_response>\\n<tool_response>\\n{b}
    \\n</tool_response><|im_end|>\\n                                   (one line, cut here)

A template that refuses the role `tool`, or renders nothing of its content, gets role `user`
with the text wrapped in `<tool_response>...</tool_response>` (`ToolDelta.role` says which).
SmolLM2-135M-Instruct's ChatML template renders any role, so its delta after a turn ended at
`<|im_end|>` is `\\n<|im_start|>tool\\n{text}<|im_end|>\\n<|im_start|>assistant\\n`.

Without a chat template (the embedded task's plain prompts) the delta is `=` + text + `\\n` per
result (`PLAIN_RESULT_OPEN`, `PLAIN_RESULT_CLOSE`), the text limited to printable ASCII on one
line (the char-level tokenizer silently drops other characters).

Each tool text (a result or an error text) is cut to `max_tokens` tokens (as tokenized alone)
before rendering; a cut text is flagged (`ToolDelta.truncated`; the runtime counts the cut results
only, not the cut error texts).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

ASSISTANT_SENTINEL = "ASSISTANTTURNSENTINEL"
"""Content of the dummy history's assistant turn: the delta starts where it ends."""
TOOL_SENTINEL = "TOOLRESULTSENTINEL"
"""Content of the probing tool message: a template that drops it gets role `user` instead."""
DUMMY_HISTORY = ({"role": "user", "content": "Hi."},
                 {"role": "assistant", "content": ASSISTANT_SENTINEL})  # fmt: skip
"""The fixed history every delta is rendered after."""
USER_WRAPPER = ("<tool_response>\n", "\n</tool_response>")
"""Around a tool text sent as role `user` (templates without a tool role)."""
PLAIN_RESULT_OPEN, PLAIN_RESULT_CLOSE = "=", "\n"
"""Around each tool text without a chat template: `[lookup:k07]` then `=70\\n`."""


@dataclass(frozen=True)
class ToolDelta:
    """The ids appended after a turn and how they were made."""

    ids: list[int]
    """Token ids of the delta (tool output: response_mask 0)."""
    truncated: list[bool]
    """Per tool text: cut to `max_tokens`."""
    role: str
    """Role the tool texts were rendered as: tool, user (template without a tool role) or plain."""
    prefix_preserving: bool
    """render(dummy history) is a prefix of the rendering with the tool messages (always true for
    plain deltas)."""


def _render(tokenizer, messages: Sequence[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=generation_prompt
    )


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@functools.lru_cache(maxsize=16)
def tool_role(tokenizer) -> str:
    """`tool` when the chat template renders a tool message's content, else `user` (read once
    per tokenizer)."""
    try:
        probe = [*DUMMY_HISTORY, {"role": "tool", "content": TOOL_SENTINEL}]
        return "tool" if TOOL_SENTINEL in _render(tokenizer, probe, True) else "user"
    except Exception:  # jinja's raise_exception for an unknown role
        return "user"


def _tool_message(role: str, text: str) -> dict[str, str]:
    if role == "user":
        text = USER_WRAPPER[0] + text + USER_WRAPPER[1]
    return {"role": role, "content": text}


def truncate_text(tokenizer, text: str, max_tokens: int | None) -> tuple[str, bool]:
    """(text cut to its first `max_tokens` tokens, whether it was cut); None: no limit."""
    if max_tokens is None:
        return text, False
    ids = _encode(tokenizer, text)
    if len(ids) <= max_tokens:
        return text, False
    return tokenizer.decode(ids[:max_tokens]), True


def plain_text(text: str) -> str:
    """`text` on one line of printable ASCII: line breaks and tabs become spaces, any other
    character outside ' '..'~' becomes '?'."""
    text = text.replace("\r", " ").replace("\n", " ").replace("\t", " ")
    return "".join(c if " " <= c <= "~" else "?" for c in text)


@functools.lru_cache(maxsize=16)
def _frame(tokenizer) -> tuple[str, str]:
    """The dummy history as the chat template renders it, and its generation prompt (read once
    per tokenizer)."""
    history = _render(tokenizer, DUMMY_HISTORY, False)
    return history, _render(tokenizer, DUMMY_HISTORY, True)[len(history) :]


def chat_delta_text(tokenizer, tool_texts: Sequence[str], role: str) -> tuple[str, bool]:
    """(delta text, prefix-preserving) of tool messages in the chat template (module docstring);
    ValueError when the template does not end it with its generation prompt."""
    history, generation_prompt = _frame(tokenizer)
    messages = [*DUMMY_HISTORY, *(_tool_message(role, t) for t in tool_texts)]
    full = _render(tokenizer, messages, True)
    end = full.index(ASSISTANT_SENTINEL) + len(ASSISTANT_SENTINEL)
    delta = full[end:]
    if not delta.endswith(generation_prompt):
        raise ValueError(
            f"the chat template's tool message {delta!r} does not end with its generation prompt "
            f"{generation_prompt!r}"
        )
    return delta, full.startswith(history)


def tool_delta_ids(
    tokenizer,
    tool_texts: Sequence[str],
    max_tokens: int | None = None,
    use_chat_template: bool | None = None,
    after_eos: bool = False,
) -> ToolDelta:
    """The delta appended after a turn whose calls returned `tool_texts` (in call order).

    `use_chat_template`: render through the tokenizer's chat template (None: when it has one);
    False gives the plain format. Each text keeps at most `max_tokens` tokens. `after_eos`: the
    turn's last token is the tokenizer's EOS; a chat delta that starts with the EOS token's text
    starts after it (the plain format has no close and is unchanged).
    """
    if use_chat_template is None:
        use_chat_template = bool(getattr(tokenizer, "chat_template", None))
    cut = [truncate_text(tokenizer, t if use_chat_template else plain_text(t), max_tokens)
           for t in tool_texts]  # fmt: skip
    texts, truncated = [t for t, _ in cut], [flag for _, flag in cut]
    if not use_chat_template:
        delta = "".join(PLAIN_RESULT_OPEN + t + PLAIN_RESULT_CLOSE for t in texts)
        return ToolDelta(_encode(tokenizer, delta), truncated, "plain", True)
    role = tool_role(tokenizer)
    delta, preserving = chat_delta_text(tokenizer, texts, role)
    eos = getattr(tokenizer, "eos_token", None)
    if after_eos and eos and delta.startswith(eos):
        delta = delta[len(eos) :]
    return ToolDelta(_encode(tokenizer, delta), truncated, role, preserving)


def retokenization_mismatch(
    tokenizer, trajectory_ids: Sequence[int], messages: Sequence[dict]
) -> float:
    """Share of the trajectory's positions whose token differs from the template's rendering of
    `messages` re-tokenized (a diagnostic only; training uses the trajectory's own ids).

    mismatch = #{i < N : i ≥ M or rendered[i] ≠ trajectory[i]} / N, N = len(trajectory), M =
    len(rendered). The rendering's tail past N is not counted: a template closes the final turn
    with text the policy did not sample (ChatML: the newline after the last `<|im_end|>`).
    Causes: a policy turn sampled as a non-canonical tokenization of its text, or a template
    that is not prefix-preserving. 0.0 for an empty trajectory.
    """
    if not trajectory_ids:
        return 0.0
    rendered = _encode(tokenizer, _render(tokenizer, messages, False))
    differ = sum(
        i >= len(rendered) or rendered[i] != token for i, token in enumerate(trajectory_ids)
    )
    return differ / len(trajectory_ids)
