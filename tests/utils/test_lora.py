"""verl/utils/lora.py on plain tensors and a tiny model (no FSDP): the merge by hand, merged
weights = the HF+PEFT function, names, and the one-line refusals before any weight loads."""

from __future__ import annotations

import pickle

import pytest
import torch

from verl.tasks.tiny_lm import TinyLMSpec, save_tiny_lm
from verl.utils import lora as L
from verl.utils.config_checks import ConfigError
from verl.workers.actor.config import LoraConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_lm(str(tmp_path_factory.mktemp("tiny")),
                        TinyLMSpec(hidden_size=64, num_hidden_layers=2, vocab_size=100, seed=5))  # fmt: skip


def test_merge_by_hand():
    # W = [[1, 2], [3, 4]], A = [[1, -1]] (r = 1), B = [[2], [0.5]], s = alpha / r = 2 / 1:
    # B·A = [[2, -2], [0.5, -0.5]]; W + 2·B·A = [[1 + 4, 2 - 4], [3 + 1, 4 - 1]] = [[5, -2], [4, 3]]
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    a, b = torch.tensor([[1.0, -1.0]]), torch.tensor([[2.0], [0.5]])
    assert torch.equal(L.merge(w, a, b, 2.0), torch.tensor([[5.0, -2.0], [4.0, 3.0]]))
    assert L.merge(w.bfloat16(), a, b, 2.0).dtype == torch.bfloat16  # the base weight's dtype


def test_names_map_to_the_base_model():
    assert L.hf_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert L.hf_name("base_model.model.model.embed_tokens.weight") == "model.embed_tokens.weight"
    names = ["base_model.model.model.layers.1.mlp.up_proj.base_layer.weight",
             "base_model.model.model.layers.1.mlp.up_proj.lora_A.default.weight",
             "base_model.model.model.layers.1.mlp.up_proj.lora_B.default.weight"]  # fmt: skip
    assert L.adapted_weights(names) == {"model.layers.1.mlp.up_proj.weight": tuple(names)}
    assert L.target_list("all-linear") == "all-linear"


def test_a_sync_sends_whole_modules_around_the_adapted_weights():
    # q_proj adapted in layer 0: all of layer 0's attention (vLLM fuses q/k/v, with biases) is
    # sent, q merged; the MLP, layer 1 and the embeddings are not
    pre = "base_model.model.model."
    names = [f"{pre}embed_tokens.weight",
             f"{pre}layers.0.self_attn.q_proj.base_layer.weight", f"{pre}layers.0.self_attn.q_proj.base_layer.bias",
             f"{pre}layers.0.self_attn.q_proj.lora_A.default.weight", f"{pre}layers.0.self_attn.q_proj.lora_B.default.weight",
             f"{pre}layers.0.self_attn.k_proj.weight", f"{pre}layers.0.self_attn.k_proj.bias",
             f"{pre}layers.0.self_attn.o_proj.weight", f"{pre}layers.0.mlp.up_proj.weight",
             f"{pre}layers.1.self_attn.k_proj.weight"]  # fmt: skip
    assert L.sync_sources(names) == {
        "model.layers.0.self_attn.q_proj.weight": tuple(names[1:2] + names[3:5]),
        "model.layers.0.self_attn.q_proj.bias": (names[2],),
        "model.layers.0.self_attn.k_proj.weight": (names[5],),
        "model.layers.0.self_attn.k_proj.bias": (names[6],),
        "model.layers.0.self_attn.o_proj.weight": (names[7],),
    }
    assert L.target_list(" q_proj, v_proj ,") == ["q_proj", "v_proj"]


def _peft(path, rank=4, alpha=8, targets="all-linear", seed=0):
    """The HF+PEFT model with random (non-zero) B, so the adapters change the function."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = L.apply_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                         LoraConfig(rank=rank, alpha=alpha, target_modules=targets))  # fmt: skip
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    return model.eval()


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,down_proj"])
def test_merged_state_is_the_peft_models_function(tiny, targets):
    from transformers import AutoModelForCausalLM

    model = _peft(tiny, targets=targets)
    merged = L.merged_state(model.state_dict(), L.scaling_of(model))
    plain = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    assert set(merged) == set(plain.state_dict())  # every name the base model's
    plain.load_state_dict(merged)
    ids = torch.randint(1, 100, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = model(input_ids=ids).logits, plain(input_ids=ids).logits
        with model.disable_adapter():  # the adapters do change the function
            base = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (base - want).abs().max() > 1e-2
    adapted = L.adapted_weights(model.state_dict())
    assert len(adapted) == (14 if targets == "all-linear" else 4)  # 7 Linear a layer x 2 layers


def test_adapters_off_is_the_base_model(tiny):
    from transformers import AutoModelForCausalLM

    model = _peft(tiny)
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    plain = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(L.AdaptersOff(model)(input_ids=ids).logits,
                                   plain(input_ids=ids).logits, rtol=0, atol=0)  # fmt: skip
        assert (model(input_ids=ids).logits - plain(input_ids=ids).logits).abs().max() > 1e-2


def test_saved_adapter_loads_in_peft(tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = _peft(tiny, targets="q_proj,v_proj")
    L.save_adapter(model, model.state_dict(), str(tmp_path / "adapter"))
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    ids = torch.randint(1, 100, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=0, atol=0)  # fmt: skip


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        (LoraConfig(rank=4, target_modules="q_proj,nope"),
         "worker.actor.model.lora.target_modules: 'nope' names no module of"),
        (LoraConfig(rank=4, target_modules="embed_tokens"),
         "worker.actor.model.lora.target_modules: 'embed_tokens' is not a Linear (model.embed_tokens)"),
        (LoraConfig(rank=4, target_modules="lm_head"),
         "worker.actor.model.lora.target_modules: 'lm_head' is the LM head tied to the embeddings"),
        (LoraConfig(rank=4, target_modules=" , "),
         "worker.actor.model.lora.target_modules is empty"),
        # hidden 64, one head of 64, intermediate 128: every Linear's smaller side is 64
        (LoraConfig(rank=65), "worker.actor.model.lora.rank=65 exceeds the smallest side (64)"),
    ],
)  # fmt: skip
def test_targets_are_checked_against_the_model_in_one_line(tiny, lora, message):
    with pytest.raises(ValueError) as error:
        L.check_lora_targets(lora, tiny)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_the_valid_names_leave_out_a_tied_head(tiny):
    """The embedded model ties its LM head to the embeddings, so `lm_head` is refused as a
    target and is not among the names the error offers."""
    with pytest.raises(ValueError) as error:
        L.check_lora_targets(LoraConfig(rank=4, target_modules="foo_proj"), tiny)
    valid = str(error.value).split("Linear names: ")[1].split(", ")
    assert "lm_head" not in valid and {"q_proj", "down_proj"} <= set(valid)


def test_valid_targets_pass(tiny):
    L.check_lora_targets(LoraConfig(rank=64), tiny)
    L.check_lora_targets(LoraConfig(rank=8, target_modules="q_proj,v_proj,up_proj"), tiny)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rank": -1}, "worker.actor.model.lora.rank=-1 is not valid; expected an integer >= 0"),
        ({"rank": 4, "alpha": 0}, "worker.actor.model.lora.alpha=0 is not valid; expected a value in (0, inf]"),
        ({"rank": 4, "dropout": 1.0}, "worker.actor.model.lora.dropout=1.0 is not valid; expected a value in [0, 1)"),
    ],
)  # fmt: skip
def test_config_values_fail_in_one_line(fields, message):
    with pytest.raises(ConfigError) as error:
        LoraConfig(**fields).validate("worker.actor.model.lora")
    assert str(error.value).startswith(message)


def adapted_linear(b_value: float):
    """One Linear (256 -> 256, bias) with a rank-8 adapter (alpha 16, s = 2) built by `apply_lora`,
    B = ±`b_value` (a first AdamW step at lr = b_value moves every entry of B by ±lr)."""
    from torch import nn

    torch.manual_seed(0)
    model = L.apply_lora(nn.Sequential(nn.Linear(256, 256)),
                         LoraConfig(rank=8, alpha=16, target_modules="0"))  # fmt: skip
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lora_B[L.ADAPTER].weight.copy_(b_value * torch.randn(256, 8).sign())
    return layer


def test_a_bfloat16_adapted_linear_rounds_its_output_once():
    """`RoundOnceLinear` in bfloat16 returns round(x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ) (the exact sum, in
    float64 here, rounded once) for all but a few outputs, where PEFT's own forward, which rounds
    x·Wᵀ + b first, keeps the adapters' term only in part: after a first step at lr 1e-4 the term
    is ~5e-4 of an output (median), under half a bfloat16 step (2^-9 ≈ 2e-3). In float32 both
    forwards are one function, bit for bit, and in bfloat16 the gradients of x, A and B under a
    fixed upstream gradient are PEFT's, bit for bit (the backward is the Linear's own)."""
    from peft.tuners.lora.layer import Linear

    layer = adapted_linear(1e-4)
    assert type(layer) is L.RoundOnceLinear
    assert type(pickle.loads(pickle.dumps(layer))) is L.RoundOnceLinear  # a class found by name
    x32 = torch.randn(32, 256, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(layer(x32), Linear.forward(layer, x32), rtol=0, atol=0)
    layer.bfloat16()
    x = x32.bfloat16().requires_grad_()
    w, bias = layer.base_layer.weight.double(), layer.base_layer.bias.double()
    a, b = layer.lora_A[L.ADAPTER].weight.double(), layer.lora_B[L.ADAPTER].weight.double()
    exact = (x.double() @ w.T + bias + 2.0 * (x.double() @ a.T) @ b.T).bfloat16()
    ours, peft = layer(x), Linear.forward(layer, x)
    # measured: 99.89 % of the 8,192 outputs for ours (the rest: the term's own bfloat16
    # rounding at a tie), 86.3 % for PEFT's forward
    assert (ours == exact).float().mean() > 0.995
    assert (peft == exact).float().mean() < 0.9
    g = torch.randn(32, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    trained = (x, layer.lora_A[L.ADAPTER].weight, layer.lora_B[L.ADAPTER].weight)
    grads = [torch.autograd.grad((y * g).float().sum(), trained) for y in (ours, peft)]
    for got, want in zip(*grads, strict=True):
        assert torch.equal(got, want)


@pytest.mark.gpu
def test_the_cuda_float32_output_gemm_equals_a_float32_matmul():
    """On CUDA `linear_float32` takes the bfloat16 GEMM with a float32 output; its values are the
    float32 matmul of the same bfloat16 values up to the order of the sums (1e-5 relative)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 5, 256, device="cuda", generator=g).bfloat16()
    w = torch.randn(64, 256, device="cuda", generator=g).bfloat16()
    b = torch.randn(64, device="cuda", generator=g).bfloat16()
    got = L.linear_float32(x, w, b)
    want = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert got.dtype == torch.float32 and L._MM_FLOAT32_OUT[0], "the out_dtype GEMM was refused"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
