"""Tool deltas (verl/workers/rollout/multi_turn/deltas.py) on the real SmolLM2 chat template
(ChatML, any role rendered as is), on templates without a tool role or not prefix-preserving, and
without a template (the embedded task's plain format); the retokenization diagnostic."""

from __future__ import annotations

import pytest

from verl.tasks.real_model import chat_prompt_ids
from verl.tasks.tiny_lm import build_char_tokenizer
from verl.workers.rollout.multi_turn.deltas import (
    plain_text,
    retokenization_mismatch,
    tool_delta_ids,
    tool_role,
)
from verl.workers.rollout.multi_turn.parsing import get_format

CHATML_DELTA = "<|im_end|>\n<|im_start|>tool\n70<|im_end|>\n<|im_start|>assistant\n"
"""SmolLM2's delta after a turn stopped at </tool_call> whose call returned "70": the assistant's
end of turn, the tool message, the next assistant turn's generation prompt."""


@pytest.fixture(scope="module")
def smol(real_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_pair.guidance)


def char_tokenizer(template: str | None):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


def text_of(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_smollm2_renders_role_tool_and_its_delta_closes_the_turn(smol):
    assert tool_role(smol) == "tool"
    delta = tool_delta_ids(smol, ["70"])
    assert text_of(smol, delta.ids) == CHATML_DELTA
    assert smol.convert_ids_to_tokens(delta.ids) == [
        "<|im_end|>", "Ċ", "<|im_start|>", "tool", "Ċ", "7", "0", "<|im_end|>", "Ċ",
        "<|im_start|>", "ass", "istant", "Ċ"]  # fmt: skip
    assert (delta.role, delta.prefix_preserving, delta.truncated) == ("tool", True, [False])
    two = tool_delta_ids(smol, ["70", "error: unknown tool 'x'; tools: lookup"])
    assert text_of(smol, two.ids) == (
        "<|im_end|>\n<|im_start|>tool\n70<|im_end|>\n"
        "<|im_start|>tool\nerror: unknown tool 'x'; tools: lookup<|im_end|>\n<|im_start|>assistant\n"
    )


def conversation(smol, final_ids: list[int], final_text: str):
    """(trajectory ids, messages) of: user question, a lookup call, its result, a final answer."""
    call = get_format("hermes").render_call("lookup", {"key": "k07"})
    turn = smol(call, add_special_tokens=False)["input_ids"]  # as sampled: the text's own tokens
    ids = [*chat_prompt_ids(smol, "What is k07?"), *turn, *tool_delta_ids(smol, ["70"]).ids,
           *final_ids, smol.eos_token_id]  # fmt: skip
    messages = [{"role": "user", "content": "What is k07?"}, {"role": "assistant", "content": call},
                {"role": "tool", "content": "70"}, {"role": "assistant", "content": final_text}]  # fmt: skip
    return ids, messages


def test_concatenated_turns_equal_the_templates_rendering(smol):
    final = smol("It is 70.", add_special_tokens=False)["input_ids"]
    ids, messages = conversation(smol, final, "It is 70.")
    rendered = smol.apply_chat_template(messages, tokenize=False)
    # ChatML ends a rendered conversation with "\n" after the last <|im_end|>; the policy's final
    # turn stops at <|im_end|> (its EOS): that newline is the only difference
    assert text_of(smol, ids) + "\n" == rendered
    assert ids == smol(rendered, add_special_tokens=False)["input_ids"][:-1]
    assert retokenization_mismatch(smol, ids, messages) == 0.0


def test_a_non_canonical_tokenization_shows_in_the_mismatch(smol):
    """The final turn sampled "hello" as five one-letter tokens; the rendering has one token."""
    letters = [smol(c, add_special_tokens=False)["input_ids"][0] for c in "hello"]
    assert len(letters) == 5 and smol("hello", add_special_tokens=False)["input_ids"] == [28120]
    ids, messages = conversation(smol, letters, "hello")
    # the last 6 positions: h e l l o <|im_end|> against hello <|im_end|> \n (then nothing): all
    # 6 differ, every earlier position agrees
    assert retokenization_mismatch(smol, ids, messages) == pytest.approx(6 / len(ids))
    assert retokenization_mismatch(smol, [], messages) == 0.0


def test_long_tool_results_are_cut_to_max_tokens(smol):
    text = "one two three four five six"
    assert smol.convert_ids_to_tokens(smol(text, add_special_tokens=False)["input_ids"])[:3] == [
        "one", "Ġtwo", "Ġthree"]  # fmt: skip
    delta = tool_delta_ids(smol, [text, "70"], max_tokens=3)
    assert delta.truncated == [True, False]
    assert text_of(smol, delta.ids) == (
        "<|im_end|>\n<|im_start|>tool\none two three<|im_end|>\n"
        "<|im_start|>tool\n70<|im_end|>\n<|im_start|>assistant\n"
    )


CHATML_BODY = "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
GEN_PROMPT = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
RAISING = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
           "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}" + CHATML_BODY
           + "{% endfor %}" + GEN_PROMPT)  # fmt: skip
DROPPING = ("{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant'] %}"
            + CHATML_BODY + "{% endif %}{% endfor %}" + GEN_PROMPT)  # fmt: skip
MARKS_LAST = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
              "{% if loop.last and m['role'] == 'assistant' %}{{ ' (final)' }}{% endif %}"
              "{{ '<|im_end|>\n' }}{% endfor %}" + GEN_PROMPT)  # fmt: skip
NO_PROMPT_AFTER_TOOL = ("{% for m in messages %}" + CHATML_BODY + "{% endfor %}"
                        "{% if add_generation_prompt and messages[-1]['role'] != 'tool' %}"
                        "{{ '<|im_start|>assistant\n' }}{% endif %}")  # fmt: skip


@pytest.mark.parametrize("template", [RAISING, DROPPING], ids=["raises", "drops"])
def test_a_template_without_a_tool_role_gets_a_wrapped_user_message(template):
    tokenizer = char_tokenizer(template)
    assert tool_role(tokenizer) == "user"
    delta = tool_delta_ids(tokenizer, ["70"])
    assert (delta.role, delta.prefix_preserving) == ("user", True)
    assert text_of(tokenizer, delta.ids) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n70\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_a_template_that_is_not_prefix_preserving_still_gives_the_tool_part():
    """render(H) ends "...SENTINEL (final)<|im_end|>\\n": not a prefix of the rendering with the
    tool message, whose assistant turn is no longer last; the delta is cut after the sentinel."""
    tokenizer = char_tokenizer(MARKS_LAST)
    delta = tool_delta_ids(tokenizer, ["70"])
    assert (delta.role, delta.prefix_preserving) == ("tool", False)
    assert text_of(tokenizer, delta.ids) == CHATML_DELTA


def test_a_tool_message_without_the_generation_prompt_is_refused():
    with pytest.raises(ValueError, match="does not end with its generation prompt"):
        tool_delta_ids(char_tokenizer(NO_PROMPT_AFTER_TOOL), ["70"])


def test_the_plain_format_without_a_template():
    tokenizer = char_tokenizer(None)
    delta = tool_delta_ids(tokenizer, ["70"])
    assert (delta.role, delta.prefix_preserving, delta.truncated) == ("plain", True, [False])
    assert delta.ids == tokenizer("=70\n", add_special_tokens=False)["input_ids"]
    assert len(delta.ids) == 4  # one token per character
    both = tool_delta_ids(tokenizer, ["70", "12345"], max_tokens=2)
    assert text_of(tokenizer, both.ids) == "=70\n=12\n" and both.truncated == [False, True]
    assert text_of(tokenizer, tool_delta_ids(tokenizer, ["é→ 7\tx\ny"]).ids) == "=?? 7 x y\n"
    assert plain_text("a\r\nb") == "a  b"


def test_the_plain_format_is_chosen_when_the_prompts_do_not_use_the_template(smol):
    assert text_of(smol, tool_delta_ids(smol, ["70"], use_chat_template=False).ids) == "=70\n"
    char = char_tokenizer(build_char_tokenizer().chat_template)  # the char tokenizer has ChatML
    assert text_of(char, tool_delta_ids(char, ["70"]).ids) == CHATML_DELTA
    assert text_of(char, tool_delta_ids(char, ["70"], use_chat_template=False).ids) == "=70\n"


def test_after_eos_the_delta_starts_after_the_sampled_close(smol):
    """A hermes turn ends at EOS (`<|im_end|>`, sampled by the policy): the delta starts after it,
    so the turn's own EOS closes it; without `after_eos` the delta closes the turn itself."""
    assert smol.eos_token == "<|im_end|>"
    delta = tool_delta_ids(smol, ["70", "75"], after_eos=True)
    assert text_of(smol, delta.ids) == (
        "\n<|im_start|>tool\n70<|im_end|>\n"
        "<|im_start|>tool\n75<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
    assert delta.ids == tool_delta_ids(smol, ["70", "75"]).ids[1:]
    plain = tool_delta_ids(smol, ["70"], use_chat_template=False, after_eos=True)
    assert text_of(smol, plain.ids) == "=70\n"  # no close to skip


QWEN_TOOLS = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5's chat template without its system and tools preamble: user and plain assistant
turns, an assistant turn with tool calls, and consecutive tool messages in one user turn."""


def test_two_results_in_one_user_turn_as_qwen_renders_them():
    """A turn with two hermes calls, ended at EOS, then its two results and a final answer: the
    trajectory (prompt, the turn as sampled, the delta, the final turn) is the template's
    rendering of the conversation, the results in call order inside one user turn."""
    tokenizer = char_tokenizer(QWEN_TOOLS)
    assert tool_role(tokenizer) == "tool"  # Qwen renders the role `tool` (as a user turn)
    delta = tool_delta_ids(tokenizer, ["70", "75"], after_eos=True)
    assert text_of(tokenizer, delta.ids) == (
        "\n<|im_start|>user\n<tool_response>\n70\n</tool_response>\n<tool_response>\n75\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
    calls = [("lookup", {"key": "k07"}), ("calculator", {"expression": "70+5"})]
    turn = "\n".join(get_format("hermes").render_call(n, a) for n, a in calls)
    question = [{"role": "user", "content": "k07 and k07+5?"}]
    prompt = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    ids = [*tokenizer(prompt + turn, add_special_tokens=False)["input_ids"],
           tokenizer.eos_token_id, *delta.ids,
           *tokenizer("70, 75", add_special_tokens=False)["input_ids"],
           tokenizer.eos_token_id]  # fmt: skip
    messages = [*question,
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}}
                                for n, a in calls]},
                {"role": "tool", "content": "70"}, {"role": "tool", "content": "75"},
                {"role": "assistant", "content": "70, 75"}]  # fmt: skip
    # the rendering ends "<|im_end|>\n"; the final turn stops at its EOS, before the "\n"
    assert text_of(tokenizer, ids) + "\n" == tokenizer.apply_chat_template(messages, tokenize=False)
