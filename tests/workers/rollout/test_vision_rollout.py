"""The rollout with images (`VLLMRollout`, real engines, tiny Qwen2.5-VL draft and guidance):
a batch from the image dataset's collate goes out with the model's expanded prompts, mix mode
gives exactly `mix_num_samples` guidance responses per prompt, and every response's behavior
log-probs are the emitting model's, equal to a plain HF forward with the images (1e-4); the
draft-only rollout likewise."""

from __future__ import annotations

import os

import pytest
import torch

from verl.protocol import DataProto

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
N = 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(draft folder, guidance folder, dataset of 2 counting rows): two tiny Qwen2.5-VL models of
    different seeds (one tokenizer and image processor)."""
    from transformers import AutoTokenizer

    from verl.tasks.tiny_vlm import TinyVLMSpec, save_tiny_vlm, write_count_data
    from verl.utils.dataset import ImageSettings, PromptEncoder, RLDataset

    root = tmp_path_factory.mktemp("vlm")
    draft, guidance = (save_tiny_vlm(str(root / name), TinyVLMSpec(seed=seed)) for name, seed in (("draft", 0), ("guidance", 1)))  # fmt: skip
    data = write_count_data(str(root / "data"), 2, seed=3)
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(draft), 64)
    dataset = RLDataset(
        data, encoder, "prompt", "answer", images=ImageSettings(draft, image_dir=str(root / "data"))
    )
    return draft, guidance, dataset


@pytest.fixture(scope="module")
def rollout(pair):
    from transformers import AutoTokenizer

    from verl.workers.rollout.config import RolloutConfig
    from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout

    draft, guidance, _ = pair
    tok = AutoTokenizer.from_pretrained(draft)
    cfg = RolloutConfig(n=N, temperature=1.0, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.02,
                        prompt_length=64, response_length=6, seed=0)  # fmt: skip
    g = cfg.offpolicy_guidance
    g.enable, g.model_path, g.dtype, g.gpu_memory_utilization, g.mode, g.mix_num_samples = (
        True, guidance, "float32", 0.02, "mix", 1)  # fmt: skip
    with VLLMRollout(draft, cfg, tok.eos_token_id, tok.pad_token_id) as engine:
        yield engine


def batch(dataset, **meta) -> DataProto:
    from verl.utils.dataset import collate

    items = [dataset[i] for i in range(len(dataset))]
    return DataProto.from_single_dict(collate(items, 64, 0), meta_info=meta)


def hf_log_probs(path: str, vision, response: list[int]) -> torch.Tensor:
    """log p(response token | expanded prompt with its images, earlier tokens): one HF forward."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from verl.utils.vision import mm_token_type_ids, vision_token_ids

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([vision.input_ids + response])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=vision.pixel_values, image_grid_thw=vision.image_grid_thw,
                       mm_token_type_ids=mm_token_type_ids(ids, model.config.image_token_id)).logits[0]  # fmt: skip
    rows = logits[len(vision.input_ids) - 1 : -1].float()
    rows[:, list(vision_token_ids(model.config))] = float("-inf")  # the engines never emit them
    rows = torch.log_softmax(rows, -1)
    return rows.gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.mark.parametrize("guidance", [True, False], ids=["mix", "draft_only"])
def test_responses_after_images_carry_the_emitting_models_log_probs(pair, rollout, guidance):
    draft, guide, dataset = pair
    out = rollout.generate_sequences(batch(dataset, guidance=guidance))
    b = out.batch
    mask = b["response_mask"].bool()
    guided = (b["offpolicy_mask"] & mask).any(-1) if "offpolicy_mask" in b.keys() else torch.zeros(len(mask), dtype=torch.bool)  # fmt: skip
    assert guided.view(-1, N).sum(-1).tolist() == ([1, 1] if guidance else [0, 0])
    behavior = (
        b["behavior_log_probs"] if "behavior_log_probs" in b.keys() else b["rollout_log_probs"]
    )
    for row in range(len(mask)):
        vision = dataset[row // N][4]
        prompt = b["prompts"][row][
            b["attention_mask"][row, : b["prompts"].shape[1]].bool()
        ].tolist()
        assert prompt == vision.input_ids  # the model's (expanded) prompt goes on to the actor
        response = b["responses"][row][mask[row]].tolist()
        expected = hf_log_probs(guide if guided[row] else draft, vision, response)
        assert torch.allclose(behavior[row][mask[row]], expected, atol=1e-4), row
    assert len(out.non_tensor_batch["multi_modal_inputs"]) == len(mask)  # the actor's image inputs
