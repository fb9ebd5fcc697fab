"""The rollout with images (`VLLMRollout`, real engines, tiny Qwen2.5-VL draft and guidance):
a batch from the image dataset's collate goes out with the model's expanded prompts, mix mode
gives exactly `mix_num_samples` guidance responses per prompt, and every response's behavior
log-probs are the emitting model's, equal to a plain HF forward with the images (1e-4); the
draft-only rollout likewise. Speculative guidance with images (sessions on both engines opened
with the image, then rewound round after round): every token's behavior is log((1-λ)p + λq),
its rollout and guidance log-probs p and q, all from HF forwards (log-probs list the whole
128-token vocabulary, so q̃ = q); at λ = 0 the guidance scores the draft's responses by prefill;
with a teacher prefix λ_t = 1 on its tokens."""

from __future__ import annotations

import os

import pytest
import torch
from speculative_helpers import chi2_counts_pvalue

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


def vision_config(guidance: str, response_length: int, **fields):
    """The rollout config of these tests (float32, eager, a small memory share), guidance on from
    `guidance` with the `offpolicy_guidance` `fields` set."""
    import dataclasses

    from verl.workers.rollout.config import RolloutConfig

    cfg = RolloutConfig(n=N, temperature=1.0, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.02,
                        prompt_length=64, response_length=response_length, seed=0)  # fmt: skip
    cfg.offpolicy_guidance = dataclasses.replace(cfg.offpolicy_guidance, enable=True, model_path=guidance,
                                                 dtype="float32", gpu_memory_utilization=0.02, **fields)  # fmt: skip
    cfg.validate("worker.rollout")
    return cfg


def open_rollout(draft: str, cfg):
    """A `VLLMRollout` of `draft` under `cfg`, for a `with` block."""
    from transformers import AutoTokenizer

    from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout

    tok = AutoTokenizer.from_pretrained(draft)
    return VLLMRollout(draft, cfg, tok.eos_token_id, tok.pad_token_id)


@pytest.fixture(scope="module")
def rollout(pair):
    draft, guidance, _ = pair
    with open_rollout(draft, vision_config(guidance, 6, mode="mix", mix_num_samples=1)) as engine:
        yield engine


def batch(dataset, rows: int | None = None, **meta) -> DataProto:
    """The first `rows` (None: all) of `dataset` collated, with `meta`."""
    from verl.utils.dataset import collate

    items = [dataset[i] for i in range(len(dataset) if rows is None else rows)]
    return DataProto.from_single_dict(collate(items, 64, 0), meta_info=meta)


def hf_rows(path: str, vision, ids: list[int]) -> torch.Tensor:
    """(len(ids), V) float64 log-softmax rows of one HF forward of `ids` (the expanded prompt with
    its images, then anything after), the image markers left out as the engines leave them."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from verl.utils.vision import mm_token_type_ids, vision_token_ids

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=tokens, pixel_values=vision.pixel_values, image_grid_thw=vision.image_grid_thw,
                       mm_token_type_ids=mm_token_type_ids(tokens, model.config.image_token_id)).logits[0]  # fmt: skip
    logits = logits.double()
    logits[:, list(vision_token_ids(model.config))] = float("-inf")  # the engines never emit them
    return torch.log_softmax(logits, -1)


def hf_log_probs(path: str, vision, response: list[int], whole: bool = False) -> torch.Tensor:
    """log p(response token | expanded prompt with its images, earlier tokens): one HF forward
    (`whole`: every row (T, V) instead)."""
    rows = hf_rows(path, vision, vision.input_ids + response)[len(vision.input_ids) - 1 : -1]
    if whole:
        return rows
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
        assert torch.allclose(behavior[row][mask[row]].double(), expected, atol=1e-4), row
    assert len(out.non_tensor_batch["multi_modal_inputs"]) == len(mask)  # the actor's image inputs


LAM = 0.5


@pytest.fixture(scope="module")
def speculative(pair):
    draft, guidance, _ = pair
    cfg = vision_config(guidance, 8, logprobs=128, lam=LAM, num_speculative_tokens=3)
    with open_rollout(draft, cfg) as engine:
        yield engine


@pytest.mark.parametrize(
    "meta", [{}, {"lam": 0.0}, {"prefix_fraction": 0.5}], ids=["lam", "prefill", "prefix"]
)
def test_speculative_guidance_after_images_is_exact(pair, speculative, meta):
    """λ = 0.5: μ = log((1-λ)p + λq) per token; λ = 0 (`teacher_only_prefill`): μ = p and the
    guidance's q of every draft token by prefill; a teacher prefix of half the 8 tokens: λ_t = 1
    on the first 4 (μ = q there), 0.5 after."""
    draft, guide, dataset = pair
    out = speculative.generate_sequences(batch(dataset, **meta))
    b = out.batch
    mask = b["response_mask"].bool()
    assert mask.sum() > 0
    for row in range(len(mask)):
        vision = dataset[row // N][4]
        prompt = b["prompts"][row][
            b["attention_mask"][row, : b["prompts"].shape[1]].bool()
        ].tolist()
        assert prompt == vision.input_ids
        response = b["responses"][row][mask[row]].tolist()
        at = torch.tensor(response)[:, None]
        p = hf_log_probs(draft, vision, response, whole=True).double()
        q = hf_log_probs(guide, vision, response, whole=True).double()
        lam = torch.full(
            (len(response),), 0.0 if meta.get("lam") == 0.0 else LAM, dtype=torch.float64
        )
        if "prefix_fraction" in meta:
            lam[:4] = 1.0
        mu = torch.logsumexp(torch.stack([p + (1 - lam[:, None]).log(), q + lam[:, None].log()]), 0)
        for key, expected in (
            ("behavior_log_probs", mu),
            ("rollout_log_probs", p),
            ("guidance_log_probs", q),
        ):
            got = b[key][row][mask[row]].double()
            torch.testing.assert_close(
                got, expected.gather(-1, at)[:, 0], rtol=0, atol=1e-4, msg=f"{key} row {row}"
            )


def test_first_guided_tokens_after_an_image_follow_q_lambda(pair, speculative):
    """3,000 first tokens of one image prompt under speculative guidance (λ = 0.5, one token each:
    the draft proposes in its session opened with the image, the guidance verifies in its own)
    against (1-λ)p + λq from HF forwards: a chi-square test at the 1e-3 level (cells expected
    fewer than 5 times pooled); the image markers never. Both models are random, so the target is
    spread wide (the test has power over many cells)."""
    draft, guide, dataset = pair
    samples = 3000
    out = speculative.generate_sequences(batch(dataset, rows=1, n=samples, max_tokens=1))
    first = out.batch["responses"][:, 0]
    vision = dataset[0][4]
    target = (1 - LAM) * first_row(draft, vision) + LAM * first_row(guide, vision)
    assert (target * samples >= 5).sum() >= 20
    counts = torch.bincount(first, minlength=len(target))
    assert chi2_counts_pvalue(counts, target, pool_below=5) > 1e-3


def first_row(path: str, vision) -> torch.Tensor:
    """(V,) the model's next-token probabilities after the prompt with its image (HF forward)."""
    return hf_log_probs(path, vision, [0], whole=True)[0].double().exp()


@pytest.mark.e2e
def test_two_ray_replicas_sharing_a_guidance_service_give_the_tokens_of_one(pair, rollout_gpus):
    """`RolloutGroup` with images: 2 draft replicas sharing 1 guidance service against one engine
    (its first replica given the whole batch, as a group of one replica gives it): identical tokens
    and masks, log-probs equal to float rounding, with speculative guidance and with the draft alone
    (guidance off for the call, as validation), and the counts of the merged meta_info equal to
    one replica's. The images travel to each replica with its rows; the service opens each
    replica's sessions with them under the replica's prefix. Sharing is the layout where the
    service has to keep two replicas' sessions apart; a replica with a service of its own runs the
    same replica code (the two-node runs of tests/trainer/test_two_nodes.py train with 2 + 2), and
    a text prompt is the same path without images (the e2e runs train with 2 replicas). Mix mode's
    split is checked on one engine in test_vllm_rollout.py (the same per-replica code)."""
    import numpy as np
    import ray
    from test_vllm_rollout import assert_same_sequences

    from verl.workers.rollout.worker import RolloutGroup, merge_rollout_meta

    draft, guidance, dataset = pair
    cfg = vision_config(guidance, 8, lam=LAM, num_replicas=1)
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, include_dashboard=False)
    outs = {}
    try:
        group = RolloutGroup(2, draft, cfg, **rollout_gpus(2, 1))
        assert len(group.services) == 1
        try:
            for mode, meta in (("spec", {}), ("off", {"guidance": False})):
                data = batch(dataset, global_step=1, **meta)
                data.non_tensor_batch["uid"] = np.array(["a", "b"], dtype=object)
                outs["many", mode] = group.generate_sequences(data)
                one = ray.get(group.replicas[0].generate_sequences.remote(data))
                one.meta_info = merge_rollout_meta([one.meta_info])
                outs["one", mode] = one
        finally:
            group.shutdown()
    finally:
        if started:
            ray.shutdown()
    for mode in ("spec", "off"):
        assert_same_sequences(outs["one", mode], outs["many", mode])
    one, shared = outs["one", "spec"], outs["many", "spec"]
    a, b = one.meta_info, shared.meta_info  # counts summed over the replicas
    assert a["emitted_tokens"] == b["emitted_tokens"] == int(one.batch["response_mask"].sum())
    assert a["accepted_tokens"] == b["accepted_tokens"] and a["accept_rate"] == b["accept_rate"]
    assert one.batch["offpolicy_mask"].any()
    assert not outs["one", "off"].batch["offpolicy_mask"].any()  # the draft alone wrote every token
