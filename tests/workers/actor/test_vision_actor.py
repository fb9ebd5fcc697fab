"""The actor with images (a tiny Qwen2.5-VL): response log-probs, entropy and Σπ² equal a plain HF
forward of each sequence with its own pixel values, image grid and `mm_token_type_ids`, padded and
padding-free (one packed row or several, where the images must follow the packed order), through
the chunked-head path too; and an update trains the language model and the vision tower."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.workers.actor.config import ActorConfig
from verl.workers.actor.dp_actor import VISION_KEY, DataParallelPPOActor

T = 6


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(HF model in float32, processor) of a tiny Qwen2.5-VL."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from verl.tasks.tiny_vlm import save_tiny_vlm
    from verl.utils.vision import load_processor

    path = save_tiny_vlm(str(tmp_path_factory.mktemp("vlm") / "model"))
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return model, load_processor(path)


@pytest.fixture(scope="module")
def batch(vlm):
    """Four rows as the rollout hands them over: expanded prompts (left-padded to P) with a wide
    image, one image, none and two images, responses of 3, 6, 4 and 5 tokens (right-padded):
    38, 40, 34 and 37 tokens in all."""
    from verl.tasks.tiny_vlm import draw_shapes
    from verl.utils.vision import encode_vision_prompt

    _, processor = vlm
    wide = draw_shapes(3, size=84, seed=2).crop((0, 0, 84, 28))
    rows = [("Count.", [wide]), ("<image>How many?", [draw_shapes(2, seed=1)]), ("No picture.", []),
            ("<image>+<image>", [draw_shapes(1, seed=3), draw_shapes(4, seed=4)])]  # fmt: skip
    prompts = [encode_vision_prompt(processor, text, images, f"row {i}") for i, (text, images) in enumerate(rows)]  # fmt: skip
    lengths = [3, 6, 4, 5]
    P = max(len(p.input_ids) for p in prompts)
    gen = torch.Generator().manual_seed(0)
    ids = torch.zeros(len(rows), P + T, dtype=torch.long)
    attn = torch.zeros_like(ids)
    responses = torch.zeros(len(rows), T, dtype=torch.long)
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        ids[i, P - len(prompt.input_ids) : P] = torch.tensor(prompt.input_ids)
        responses[i, :n] = torch.randint(4, 100, (n,), generator=gen)
        attn[i, P - len(prompt.input_ids) : P + n] = 1
    ids[:, P:] = responses
    response_mask = attn[:, P:].clone()
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0) * attn
    inputs = np.array([{"pixel_values": p.pixel_values, "image_grid_thw": p.image_grid_thw} if len(p.images) else {}
                       for p in prompts], dtype=object)  # fmt: skip
    data = DataProto.from_dict({"input_ids": ids, "attention_mask": attn, "position_ids": position_ids,
                                "responses": responses, "response_mask": response_mask},
                               non_tensors={VISION_KEY: inputs}, meta_info={"temperature": 0.7})  # fmt: skip
    return data, prompts, lengths


def reference(model, prompts, data, lengths, temperature=0.7) -> dict[str, torch.Tensor]:
    """One plain HF forward per sequence (its expanded prompt and response, its own images), the
    softmax over the ids the policy emits (the four image markers left out, as the engines do)."""
    from verl.utils.vision import mm_token_type_ids, vision_token_ids

    out = {k: torch.zeros(len(prompts), T) for k in ("log_probs", "entropy", "sum_pi_squared")}
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        response = data.batch["responses"][i, :n]
        ids = torch.cat([torch.tensor(prompt.input_ids), response])[None]
        extra = (
            {"pixel_values": prompt.pixel_values, "image_grid_thw": prompt.image_grid_thw}
            if prompt.images
            else {}
        )
        with torch.no_grad():
            logits = model(input_ids=ids, mm_token_type_ids=mm_token_type_ids(ids, model.config.image_token_id),
                           **extra).logits[0, -n - 1 : -1].double() / temperature  # fmt: skip
        logits[:, list(vision_token_ids(model.config))] = float("-inf")  # the policy's ids
        logp = torch.log_softmax(logits, -1)
        out["log_probs"][i, :n] = logp.gather(-1, response[:, None])[:, 0].float()
        out["entropy"][i, :n] = -(logp.exp() * logp.clamp(min=-1e30)).sum(-1).float()
        out["sum_pi_squared"][i, :n] = (logp.exp() ** 2).sum(-1).float()
    return out


@pytest.mark.parametrize("setting", [dict(padding_free=False), dict(padding_free=True),
                                     dict(padding_free=True, row_tokens=80),
                                     dict(padding_free=True, sum_pi_squared_checkpointing=True)],
                         ids=["padded", "one_row", "several_rows", "chunked_head"])  # fmt: skip
def test_log_probs_with_images_equal_a_plain_hf_forward(vlm, batch, setting):
    model, _ = vlm
    data, prompts, lengths = batch
    setting = dict(setting)
    rows = setting.pop("row_tokens", None)
    actor = DataParallelPPOActor(ActorConfig(micro_batch_size_per_device_for_experience=4,
                                             calculate_sum_pi_squared=True, **setting), model.eval())  # fmt: skip
    actor.packed_row_tokens = rows
    if (
        rows
    ):  # two packed rows of at most 80 tokens: rows 1 and 2, then 0 and 3 (`balanced_partition`'s
        # longest-first placement), so the images are not in the batch's order
        from verl.workers.actor.dp_actor import _as_dict

        kwargs, _ = actor._model_inputs(_as_dict(data))
        assert kwargs["input_ids"].shape == (2, 75)
        in_batch_order = torch.cat([p.image_grid_thw for p in prompts]).tolist()
        assert sorted(kwargs["image_grid_thw"].tolist()) == sorted(in_batch_order)
        assert kwargs["image_grid_thw"].tolist() != in_batch_order
    got = actor.compute_log_prob(data, calculate_entropy=True).batch
    want = reference(model, prompts, data, lengths)
    mask = data.batch["response_mask"].bool()
    for key, name in (("log_probs", "old_log_probs"), ("entropy", "entropy"), ("sum_pi_squared", "sum_pi_squared")):  # fmt: skip
        assert torch.allclose(got[name][mask], want[key][mask], atol=2e-5), key
        assert (got[name][~mask] == 0).all()


def one_update(model, data: DataProto) -> set[str]:
    """One padding-free PPO step of SGD (lr 0.5) on `data`, advantages +1 / -1 by row, over the
    model's trainable parameters: the names of the parameters that moved (metrics finite)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    actor = DataParallelPPOActor(ActorConfig(micro_batch_size_per_device_for_experience=4,
                                             micro_batch_size_per_device_for_update=2, global_batch_size=4),
                                 model, torch.optim.SGD(trainable, lr=0.5))  # fmt: skip
    old = actor.compute_log_prob(data).batch["old_log_probs"]
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None]
    advantages = signs * data.batch["response_mask"]
    step = data.union(DataProto.from_dict({"old_log_probs": old, "advantages": advantages}))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    metrics = actor.update_policy(step)
    assert all(np.isfinite(v).all() for v in metrics.values())
    return {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}


def test_an_update_with_images_trains_the_language_model_and_the_vision_tower(vlm, batch):
    """One PPO step (`one_update`): the language model's and the vision tower's weights both move
    (EasyR1's `freeze_vision_tower` off)."""
    import copy

    moved = one_update(copy.deepcopy(vlm[0]).train(), batch[0])
    assert any(name.startswith("model.visual.") for name in moved)
    assert any(name.startswith("model.language_model.") for name in moved)


def test_a_frozen_vision_tower_keeps_its_weights_while_the_language_model_trains(vlm, batch):
    """`freeze_vision_tower` (EasyR1's `worker.actor.model.freeze_vision_tower`): the same step
    moves no vision weight and still moves the language model; a text model is refused in one
    line."""
    import copy

    from verl.tasks.tiny_lm import TinyLMSpec, build_tiny_qwen2
    from verl.utils.vision import freeze_vision_tower

    model = copy.deepcopy(vlm[0]).train()
    assert freeze_vision_tower(model) == sum(p.numel() for p in model.model.visual.parameters()) > 0
    moved = one_update(model, batch[0])
    assert moved and not any(name.startswith("model.visual.") for name in moved)
    with pytest.raises(ValueError, match=r"^worker.actor.model.freeze_vision_tower: Qwen2ForCausalLM has no vision tower"):  # fmt: skip
        freeze_vision_tower(build_tiny_qwen2(TinyLMSpec(hidden_size=64, num_hidden_layers=1)))


def test_ids_left_out_have_zero_probability_and_finite_gradients():
    """token_stats with -inf logits (the image markers): under autograd the entropy is the
    entropy over the other ids and the gradients are finite (no 0·inf). Hand values: logits
    (0, ln 3, -inf) give π = (1/4, 3/4, 0) and H = -(¼ ln ¼ + ¾ ln ¾) = 0.5623."""
    from verl.workers.actor.dp_actor import token_stats

    logits = torch.tensor([[0.0, float(np.log(3.0)), float("-inf")]], requires_grad=True)
    out = token_stats(logits, torch.tensor([1]), 1.0, entropy=True)
    assert out["log_probs"].item() == pytest.approx(np.log(0.75), abs=1e-6)
    assert out["entropy"].item() == pytest.approx(
        -(0.25 * np.log(0.25) + 0.75 * np.log(0.75)), abs=1e-6
    )
    (out["log_probs"] + out["entropy"]).sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 2] == 0


def test_lora_adapts_the_language_model_alone_and_its_reference_sees_the_images(vlm, batch):
    """LoRA on a vision-language model (`apply_lora`): adapters on the language model's Linear
    layers only, none in the vision tower, which stays frozen; an update moves adapter weights
    alone; then the actor (adapters on) and its reference (`AdaptersOff`, the base model) compute
    log-probs with the images, padding-free, through the PEFT wrappers: the reference equals a
    plain HF forward of the base model (2e-5) and the actor does not (the adapters moved)."""
    import copy

    from verl.utils.lora import AdaptersOff, apply_lora
    from verl.workers.actor.config import LoraConfig

    model, _ = vlm
    data, prompts, lengths = batch
    peft = apply_lora(copy.deepcopy(model), LoraConfig(rank=4, alpha=8)).train()
    adapted = [n for n, _ in peft.named_parameters() if ".lora_" in n]
    assert adapted and not any(".visual." in n for n in adapted)
    assert all(".lora_" in n for n, p in peft.named_parameters() if p.requires_grad)
    moved = one_update(peft, data)
    assert moved and all(".lora_B." in n or ".lora_A." in n for n in moved)
    assert any(".lora_B." in n for n in moved)  # B starts at 0: the adapters now change the output
    want = reference(model, prompts, data, lengths)
    mask = data.batch["response_mask"].bool()
    config = ActorConfig(micro_batch_size_per_device_for_experience=4, padding_free=True)
    for module, equal in ((AdaptersOff(peft), True), (peft, False)):
        got = (
            DataParallelPPOActor(config, module.eval())
            .compute_log_prob(data)
            .batch["old_log_probs"]
        )
        assert torch.allclose(got[mask], want["log_probs"][mask], atol=2e-5) == equal


def test_lora_targets_of_a_vision_language_model_are_its_language_models(tmp_path):
    """`check_lora_targets` before any weight loads: a name only the vision tower has (`qkv`) is
    refused in one line listing the language model's Linear names; one both have (`gate_proj`)
    is valid and adapts the language model's alone."""
    from verl.tasks.tiny_vlm import save_tiny_vlm
    from verl.utils.lora import check_lora_targets
    from verl.workers.actor.config import LoraConfig

    path = save_tiny_vlm(str(tmp_path / "m"))
    with pytest.raises(ValueError, match=r"^worker.actor.model.lora.target_modules: 'qkv' names no module of .*; valid: all-linear or Linear names: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj$"):  # fmt: skip
        check_lora_targets(LoraConfig(rank=4, target_modules="qkv"), path)
    both = LoraConfig(rank=4, target_modules="gate_proj")
    check_lora_targets(both, path)
    from transformers import Qwen2_5_VLForConditionalGeneration

    from verl.utils.lora import apply_lora

    peft = apply_lora(Qwen2_5_VLForConditionalGeneration.from_pretrained(path), both)
    adapted = {n.split(".lora_")[0] for n, _ in peft.named_parameters() if ".lora_" in n}
    assert adapted and all(".language_model." in n and n.endswith("gate_proj") for n in adapted)
