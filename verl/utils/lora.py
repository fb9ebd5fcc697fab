"""LoRA adapters on the actor (`worker.actor.model.lora`), built with PEFT.

A LoRA layer computes y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ with the frozen base weight W (out, in), the trained
A (r, in) and B (out, r), and s = alpha / r (https://arxiv.org/abs/2106.09685). The rollout
engines never see adapters: the actor hands them merged weights W' = W + s·B·A under the base
model's own names, the same function up to float rounding, so the draft engine's p (and the
guided rollout's μ built from it) is the HF+PEFT model's. Only the adapted weights change during a
run (everything else is frozen and the engine loaded it from the same folder), so a sync moves
the modules that hold them (`sync_sources`) and nothing else. The reference policy is the same module with the adapters switched off
(`AdaptersOff`): the base model, without a second copy of its weights.

Low-precision compute (FSDP2's `mp_param_dtype=bfloat16` on GPU, or `torch_dtype=bfloat16`): an
adapted Linear adds s·(x·Aᵀ)·Bᵀ to x·Wᵀ before its output is rounded, once (`RoundOnceLinear`).
PEFT's own Linear rounds x·Wᵀ to bfloat16 first and then adds the adapters' term, which after a
first step (B ~ lr) is ~5e-4 of a typical output, under half a bfloat16 step (2^-9), and is rounded
away: a first step in bfloat16 moved log π a third as far as in float32 on an H200 (0.69 of it on
CPU, tests/workers/test_lora_worker.py). The adapters' masters, their
gradients and AdamW's state are float32 as in every recipe (the worker loads the trainable model
in float32; FSDP2 casts only the compute copy), which alone does not keep the term.

Names: PEFT wraps the model as `base_model.model.<hf name>`, and an adapted Linear keeps its
weight under `<module>.base_layer.weight` with `<module>.lora_A.default.weight` and
`<module>.lora_B.default.weight` beside it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from verl.utils.vision import vision_tower_prefix

PEFT_PREFIX = "base_model.model."
ADAPTER = "default"
ALL_LINEAR = "all-linear"
ADAPTER_DIR = "lora_adapter"
"""Where an HF export puts the adapter alone, in PEFT's format, beside the merged model."""


def target_list(target_modules: str) -> str | list[str]:
    """The config's string as PEFT takes it: "all-linear", or the comma-separated suffixes."""
    text = target_modules.strip()
    if text == ALL_LINEAR:
        return ALL_LINEAR
    return [part.strip() for part in text.split(",") if part.strip()]


def vision_linears(model: nn.Module) -> list[str]:
    """The Linear layers of a vision-language model's vision tower (and its merger), by name: LoRA
    leaves them out, so the tower keeps its weights (empty for a text model)."""
    prefix = vision_tower_prefix(model)
    if prefix is None:
        return []
    return [
        n for n, m in model.named_modules() if n.startswith(prefix) and isinstance(m, nn.Linear)
    ]


def apply_lora(model: nn.Module, lora) -> nn.Module:
    """`model` wrapped by PEFT with adapters of `lora` (a `LoraConfig` of the actor); the base
    weights frozen, A random and B zero, so the wrapped model starts as the base model. Every
    adapted Linear is a `RoundOnceLinear`. A vision-language model's adapters go on its language
    model alone: the vision tower gets none and stays frozen (`vision_linears`)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=target_list(lora.target_modules), bias="none",
                        exclude_modules=vision_linears(model) or None)  # fmt: skip
    config._register_custom_module({nn.Linear: round_once_linear()})
    return get_peft_model(model, config)


LOW_PRECISION = (torch.bfloat16, torch.float16)


def linear_float32(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x·Wᵀ + b in float32 from low-precision x and W (..., in) x (out, in) -> (..., out): on CUDA
    the low-precision GEMM with a float32 output (`torch.mm(out_dtype=)`, the tensor cores' own
    float32 accumulation), elsewhere, or where that kernel is missing, a float32 matmul of the
    same values (every product of two bfloat16 values is exact in float32)."""
    if x.is_cuda and x.dtype == weight.dtype and _MM_FLOAT32_OUT[0]:
        try:
            flat = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
        # no such kernel in this build (NotImplementedError is a RuntimeError)
        except (TypeError, RuntimeError):
            _MM_FLOAT32_OUT[0] = False
        else:
            out = flat.reshape(*x.shape[:-1], weight.shape[0])
            return out if bias is None else out + bias.float()
    return nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())


_MM_FLOAT32_OUT = [True]
"""Whether this torch's CUDA GEMM takes `out_dtype` (cleared at the first call that refuses it)."""


class _FrozenLinearFloat32(torch.autograd.Function):
    """x·Wᵀ + b of a frozen Linear in float32, not rounded to x's dtype. With W and x in bfloat16
    every product is exact in float32, so this is the bfloat16 matmul's own float32 accumulation
    before its final rounding. Backward: dx = g·W in x's dtype (what the Linear's own backward
    computes); W and b get no gradient (frozen), and only W is kept for backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.x_dtype = x.dtype
        return linear_float32(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (weight,) = ctx.saved_tensors
        return grad.to(ctx.x_dtype) @ weight.to(ctx.x_dtype), None, None


@functools.cache
def round_once_linear() -> type:
    """`RoundOnceLinear`: PEFT's LoRA Linear whose low-precision output is rounded once. Made on
    first use (PEFT is imported only by LoRA runs); `verl.utils.lora.RoundOnceLinear` names it
    (module `__getattr__`), so a pickled module finds its class."""
    from peft.tuners.lora.layer import Linear

    class RoundOnceLinear(Linear):
        """PEFT's LoRA Linear, y = x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ, with the sum formed in float32 and
        rounded once to x's dtype when x is bfloat16 or float16 (`_FrozenLinearFloat32` for the
        base product; the adapters' term in their compute dtype, as PEFT computes it). In float32,
        with the adapters off or merged, a trainable base layer or PEFT's extra arguments, it is
        PEFT's forward unchanged."""

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            base = self.base_layer
            frozen = not any(p.requires_grad for p in base.parameters())
            if (x.dtype not in LOW_PRECISION or args or kwargs or self.disable_adapters
                    or self.merged or not frozen or getattr(self, "lora_variant", None)):  # fmt: skip
                return super().forward(x, *args, **kwargs)
            result = _FrozenLinearFloat32.apply(x, base.weight, base.bias)
            for name in self.active_adapters:
                if name not in self.lora_A:
                    continue
                lora_a, lora_b = self.lora_A[name], self.lora_B[name]
                h = self._cast_input_dtype(x, lora_a.weight.dtype)
                term = lora_b(lora_a(self.lora_dropout[name](h)))
                result = result + term.float() * self.scaling[name]
            return result.to(x.dtype)

    RoundOnceLinear.__module__, RoundOnceLinear.__qualname__ = __name__, "RoundOnceLinear"
    return RoundOnceLinear


def __getattr__(name: str) -> Any:
    if name == "RoundOnceLinear":
        return round_once_linear()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_lora(model: nn.Module) -> bool:
    """Whether `model` is a PEFT model (the actor with adapters)."""
    return hasattr(model, "peft_config")


def hf_name(name: str) -> str:
    """A PEFT state-dict name -> the base model's name of the same tensor (adapters' own names
    are returned without the prefix only)."""
    name = name.removeprefix(PEFT_PREFIX)
    return name.replace(".base_layer.", ".")


def adapted_weights(names: Iterable[str]) -> dict[str, tuple[str, str, str]]:
    """Base-model name of every adapted weight -> its PEFT names (base weight, A, B), in order."""
    out = {}
    for name in names:
        if name.endswith(f".lora_A.{ADAPTER}.weight"):
            module = name[: -len(f".lora_A.{ADAPTER}.weight")]
            out[hf_name(module) + ".weight"] = (
                f"{module}.base_layer.weight",
                name,
                f"{module}.lora_B.{ADAPTER}.weight",
            )
    return out


def sync_sources(names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """What a weight sync sends, in state-dict order: base-model name -> its PEFT source names,
    (W, A, B) for an adapted weight (sent merged), (name,) for a frozen one sent as it is.

    Sent: every tensor of a module whose parent holds an adapted weight (all of a layer's
    attention projections with their biases when q_proj alone is adapted). vLLM fuses sibling
    projections into one layer (q/k/v into qkv_proj, gate/up into gate_up_proj) and its in-place
    reload rebuilds a layer from the tensors it was sent: a layer sent in part (q and v without
    k, or weights without biases) gets garbage in the rest (seen on vLLM 0.32's CPU build).
    """
    names = list(names)
    adapted = adapted_weights(names)
    parents = {name.rsplit(".", 2)[0] for name in adapted}
    out = {}
    for name in names:
        if ".lora_" in name:
            continue
        base = hf_name(name)
        if base in adapted:
            out[base] = adapted[base]
        elif base.rsplit(".", 2)[0] in parents:
            out[base] = (name,)
    return out


def merge(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + s·B·A in float32, returned in W's dtype. Shapes: W (out, in), A (r, in), B (out, r)."""
    merged = base.float() + scaling * (b.float() @ a.float())
    return merged.to(base.dtype)


def scaling_of(model: nn.Module) -> float:
    """s = alpha / r of the model's adapter (one value for every layer: one config)."""
    config = model.peft_config[ADAPTER]
    return config.lora_alpha / config.r


def merged_state(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A PEFT model's full state dict -> the merged model's, under the base model's names."""
    adapted = adapted_weights(state)
    parts = {n for names in adapted.values() for n in names}
    out = {}
    for name, tensor in state.items():
        if name in parts:
            continue
        out[hf_name(name)] = tensor
    for name, (base, a, b) in adapted.items():
        out[name] = merge(state[base], state[a], state[b], scaling)
    return out


class AdaptersOff(nn.Module):
    """The reference policy of a LoRA actor: its PEFT model run with the adapters disabled, i.e.
    the frozen base model, sharing the actor's weights (no second copy)."""

    def __init__(self, peft_model: nn.Module) -> None:
        super().__init__()
        self.peft_model = peft_model

    def forward(self, *args: Any, **kwargs: Any):
        with self.peft_model.disable_adapter():
            return self.peft_model(*args, **kwargs)

    def get_output_embeddings(self) -> nn.Module:
        return self.peft_model.get_output_embeddings()

    def get_decoder(self) -> nn.Module:
        return self.peft_model.get_decoder()


def hf_model(module: nn.Module) -> nn.Module:
    """The Hugging Face model inside `module`: itself, a PEFT model's base (its adapted layers in
    place, adapters active), or the PEFT model's base under `AdaptersOff` (for what does not depend
    on the weights: the config, a vision-language model's rotary index)."""
    if isinstance(module, AdaptersOff):
        module = module.peft_model
    return module.get_base_model() if is_lora(module) else module


def save_adapter(model: nn.Module, state: dict[str, torch.Tensor], path: str) -> None:
    """The adapter alone in PEFT's format at `path` (`PeftModel.from_pretrained(base, path)`
    loads it), from the PEFT model's full state dict `state`."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    adapter = get_peft_model_state_dict(model, state_dict=state, adapter_name=ADAPTER)
    save_file({k: v.contiguous() for k, v in adapter.items()},
              os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    model.peft_config[ADAPTER].save_pretrained(path)


def check_lora_targets(lora, model_path: str, key: str = "worker.actor.model.lora") -> None:
    """One-line ValueError, before any weight is loaded, when the adapters cannot be built or
    synced exactly: a target that names no Linear of the model (of its language model, for a
    vision-language model) (the model built on the meta
    device from its config), a rank above a target's smaller side, or a target that is the LM
    head tied to the embeddings (the engine would get one merged matrix for both)."""
    from transformers import AutoConfig

    from verl.utils.model_path import auto_model_class

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config)
    tower = set(vision_linears(model))  # never adapted
    tower_prefix = vision_tower_prefix(model) or "\0"
    linear = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in tower}
    head = next((n for n, m in model.named_modules() if m is model.get_output_embeddings()), None)
    targets = target_list(lora.target_modules)
    if targets == ALL_LINEAR:
        chosen = {n: m for n, m in linear.items() if n != head}
    else:
        if not targets:
            raise ValueError(f"{key}.target_modules is empty; valid: {ALL_LINEAR} or module names")
        names = dict(model.named_modules())
        chosen = {}
        for target in targets:
            hits = [n for n in names if (n == target or n.endswith("." + target))
                    and not n.startswith(tower_prefix)]  # fmt: skip
            bad = [n for n in hits if n not in linear]
            if not hits or bad:
                tied = getattr(config, "tie_word_embeddings", False)
                suffixes = sorted(
                    {n.rsplit(".", 1)[-1] for n in linear if not (tied and n == head)}
                )
                what = "names no module" if not hits else f"is not a Linear ({bad[0]})"
                raise ValueError(f"{key}.target_modules: {target!r} {what} of {model_path}; "
                                 f"valid: {ALL_LINEAR} or Linear names: {', '.join(suffixes)}")  # fmt: skip
            chosen |= {n: linear[n] for n in hits}
    if head in chosen and getattr(config, "tie_word_embeddings", False):
        raise ValueError(f"{key}.target_modules: {head!r} is the LM head tied to the embeddings "
                         "of this model; LoRA there cannot be synced exactly; target the decoder's "
                         f"Linear layers ({ALL_LINEAR} leaves the head out)")  # fmt: skip
    smallest = min(min(m.in_features, m.out_features) for m in chosen.values())
    if lora.rank > smallest:
        raise ValueError(f"{key}.rank={lora.rank} exceeds the smallest side ({smallest}) of the "
                         f"adapted layers; valid: 1..{smallest}")  # fmt: skip
