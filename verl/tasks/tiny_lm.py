"""Tiny causal LMs and a character-level tokenizer, built by the project's own code.

No model hub is reachable on our machines, so tests, benchmarks and the embedded demo build their
models here: a Qwen2 architecture (loads in transformers and vLLM), `head_dim = 64` (the vLLM CPU
attention kernel refuses 16) and a char-level tokenizer shared by draft and guidance. A second
family keeps tests from resting on one architecture and one tokenizer: a Llama model (untied
embeddings) with a byte-level BPE tokenizer trained here, with merges (`build_bpe_tokenizer`).
"""

from __future__ import annotations

import json
import os
import string
from dataclasses import asdict, dataclass

import torch

PAD, EOS, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, EOS, IM_START, IM_END)
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's reversible byte -> printable-unicode table, in byte order."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def char_vocab() -> dict[str, int]:
    """Token -> id: the special tokens first, then one byte-level symbol per printable ASCII char."""
    table = _bytes_to_unicode()
    return {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *(table[ord(c)] for c in CHARS)))}


def build_char_tokenizer():
    """A one-token-per-character tokenizer (eos = <|im_end|>, pad = <|pad|>).

    It is a byte-level BPE with an empty merge list, so every loader that rebuilds a Qwen2
    tokenizer from the saved files (transformers' AutoTokenizer, vLLM) tokenizes identically.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    core = Tokenizer(models.BPE(vocab=char_vocab(), merges=[], unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    return _as_transformers(core)


def _as_transformers(core):
    """A `tokenizers` core as a transformers tokenizer with the project's special tokens (eos =
    <|im_end|>, pad = <|pad|>, no bos) and chat template."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=IM_END, bos_token=None,
        additional_special_tokens=[EOS, IM_START], clean_up_tokenization_spaces=False,
    )  # fmt: skip
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def arithmetic_corpus() -> list[str]:
    """Text a tiny BPE tokenizer is trained on: every a+b=c for a, b < 100 and a few words."""
    sums = [f"{a}+{b}={a + b}" for a in range(100) for b in range(100)]
    words = ["user", "assistant", "system", "Answer", "the sum", "Compute", "digits reversed"]
    return sums + [f"{w}: {s}\n" for w in words for s in sums[::97]]


def build_bpe_tokenizer(vocab_size: int = 100, corpus: list[str] | None = None):
    """A byte-level BPE tokenizer with merges, trained on `corpus` (default `arithmetic_corpus`),
    `vocab_size` tokens in all, special tokens and eos/pad as in `build_char_tokenizer`. Its
    alphabet is the corpus's characters (no unknown token: other text does not encode)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  show_progress=False)  # fmt: skip
    core.train_from_iterator(corpus or arithmetic_corpus(), trainer)
    return _as_transformers(core)


@dataclass
class TinyLMSpec:
    """Shape of a tiny Qwen2 (or Llama) model."""

    hidden_size: int = 128
    """Model width; a multiple of 64 (head_dim)."""
    num_hidden_layers: int = 2
    """Decoder layers."""
    intermediate_size: int | None = None
    """MLP width (None: 2 x hidden_size)."""
    num_key_value_heads: int = 1
    """KV heads (grouped-query attention)."""
    vocab_size: int = 128
    """Embedding rows; at least the tokenizer's vocabulary (padded vocab allowed)."""
    max_position_embeddings: int = 512
    """Longest sequence."""
    seed: int = 0
    """Initialisation seed."""
    arch: str = "qwen2"
    """Architecture: qwen2 (tied embeddings) or llama (untied)."""


def build_tiny_qwen2(spec: TinyLMSpec, tokenizer=None):
    """A randomly initialised Qwen2ForCausalLM (LlamaForCausalLM for `arch: llama`) of `spec`
    whose special ids match the tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    archs = {"qwen2": (Qwen2Config, Qwen2ForCausalLM, True), "llama": (LlamaConfig, LlamaForCausalLM, False)}  # fmt: skip
    if spec.arch not in archs:
        raise ValueError(f"arch must be one of {sorted(archs)}, got {spec.arch!r}")
    config_cls, model_cls, tied = archs[spec.arch]
    tokenizer = tokenizer or build_char_tokenizer()
    if spec.hidden_size % 64:
        raise ValueError(f"hidden_size must be a multiple of 64 (head_dim), got {spec.hidden_size}")
    if spec.vocab_size < len(tokenizer):
        raise ValueError(
            f"vocab_size {spec.vocab_size} is smaller than the tokenizer's {len(tokenizer)}"
        )
    heads = spec.hidden_size // 64
    config = config_cls(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size or 2 * spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=min(spec.num_key_value_heads, heads),
        max_position_embeddings=spec.max_position_embeddings,
        head_dim=64,
        tie_word_embeddings=tied,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(spec.seed)
    return model_cls(config)


def save_tiny_lm(path: str, spec: TinyLMSpec | None = None, model=None, tokenizer=None) -> str:
    """Write a tiny model (built from `spec` unless given) and its tokenizer (default: the char
    tokenizer) to `path`."""
    spec = spec or TinyLMSpec()
    tokenizer = tokenizer or build_char_tokenizer()
    model = model or build_tiny_qwen2(spec, tokenizer)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "tiny_lm_spec.json"), "w") as f:
        json.dump(asdict(spec), f)
    return path


def save_call_prone_lm(path: str, seed: int = 1, weight: float = 40.0) -> str:
    """Write a tiny char model (vocabulary 100) that closes tool calls often: its final norm keeps
    hidden dim 0 only and its head maps that dim to `]` alone, with `weight`, so wherever the dim
    is positive `]` (the embedded call format's stop string) dominates. For multi-turn tests."""
    spec = TinyLMSpec(hidden_size=64, num_hidden_layers=1, vocab_size=100, seed=seed)
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen2(spec, tokenizer)
    with torch.no_grad():
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[tokenizer.convert_tokens_to_ids("]"), 0] = weight
    return save_tiny_lm(path, spec, model=model, tokenizer=tokenizer)
