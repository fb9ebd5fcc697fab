"""A real vLLM engine with images (the tiny Qwen2.5-VL of `verl.tasks.tiny_vlm`, built here):
its log-probs equal a plain HF forward of the documented inputs, an expanded prompt is refused
before it reaches the engine (vLLM takes it silently and computes another prompt), and first
tokens after an image follow the model's distribution."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(folder, processor, HF model, engine) of a tiny Qwen2.5-VL, float32."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from verl.tasks.tiny_vlm import save_tiny_vlm
    from verl.utils.vision import load_processor
    from verl.workers.rollout.vllm_engine import build_llm, close_llm

    path = save_tiny_vlm(str(tmp_path_factory.mktemp("vlm") / "model"))
    processor = load_processor(path)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    llm, _ = build_llm({"model": path, "dtype": "float32", "enforce_eager": True, "max_model_len": 256,
                        "max_logprobs": 200, "gpu_memory_utilization": 0.02, "seed": 0,
                        "enable_prefix_caching": False})  # fmt: skip
    yield path, processor, hf, llm
    close_llm(llm)


def prompts(processor):
    """Three prompts: one image of 56 px, one of 28 x 84 px before its text, two images."""
    from verl.tasks.tiny_vlm import draw_shapes
    from verl.utils.vision import encode_vision_prompt

    wide = draw_shapes(3, size=84, seed=2).crop((0, 0, 84, 28))
    rows = [("<image>How many squares?", [draw_shapes(2, seed=1)]),
            ("Count them.", [wide]),
            ("<image> plus <image>?", [draw_shapes(1, seed=3), draw_shapes(4, seed=4)])]  # fmt: skip
    return [encode_vision_prompt(processor, text, images, f"row {i}") for i, (text, images) in enumerate(rows)]  # fmt: skip


def hf_rows(hf, prompt, tokens: list[int], start: int | None = None) -> torch.Tensor:
    """(len(tokens) + 1, V) log-softmax rows of one HF forward over the prompt (expanded, with its
    pixel values, image grid and `mm_token_type_ids`) and `tokens`: row i is the distribution of
    token i given the prompt and tokens[:i], over the ids the engine may emit (the four image
    markers left out). `start`: the rows from that position instead (row t - start scores
    position t + 1)."""
    from verl.utils.vision import mm_token_type_ids, vision_token_ids

    ids = torch.tensor([prompt.input_ids + tokens])
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=prompt.pixel_values,
                    image_grid_thw=prompt.image_grid_thw,
                    mm_token_type_ids=mm_token_type_ids(ids, hf.config.image_token_id)).logits[0]  # fmt: skip
    first = len(prompt.input_ids) - 1 if start is None else start
    rows = logits[first:].float()
    rows[:, list(vision_token_ids(hf.config))] = float("-inf")  # the engine never emits them
    return torch.log_softmax(rows, -1)


def engine_input(prompt) -> dict:
    return {"prompt_token_ids": prompt.raw_prompt_ids, "multi_modal_data": {"image": prompt.images}}


def test_engine_log_probs_equal_an_hf_forward_with_the_images(vlm):
    """Sampled tokens' log-probs from the engine equal HF's forward over the processor's expanded
    prompt, its pixel values, image grid and `mm_token_type_ids` (max difference 1e-4 nats), for
    one image, a non-square image and two images; and the expanded prompt, which vLLM would take
    without an error, is refused by `check_engine_prompt` and would have given other log-probs."""
    from vllm import SamplingParams

    from verl.utils.vision import check_engine_prompt

    _, processor, hf, llm = vlm
    params = SamplingParams(max_tokens=12, temperature=1.0, logprobs=0, seed=3, ignore_eos=True)
    batch = prompts(processor)
    assert [len(p.image_grid_thw) for p in batch] == [1, 1, 2]
    # 28 x 84 = 2,352 px is under min_pixels = 4 x 28² = 3,136: smart_resize scales both sides by
    # √(3136 / 2352) = 1.155 and rounds up to multiples of 28: 56 x 112 px, 4 x 8 patches of 14 px
    assert batch[1].image_grid_thw.tolist() == [[1, 4, 8]]
    outs = llm.generate([engine_input(p) for p in batch], params, use_tqdm=False)
    for prompt, out in zip(batch, outs):
        sample = out.outputs[0]
        engine = torch.tensor([lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids)])
        tokens = list(sample.token_ids)
        reference = hf_rows(hf, prompt, tokens)[:-1].gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        assert torch.allclose(engine, reference, atol=1e-4)
    expanded = batch[0].input_ids
    with pytest.raises(
        ValueError, match=r"row 0: the engine's prompt has 4 image pads for 1 images"
    ):
        check_engine_prompt(expanded, 1, processor.image_token_id, "row 0")
    wrong = llm.generate([{"prompt_token_ids": expanded, "multi_modal_data": {"image": batch[0].images}}],
                         SamplingParams(max_tokens=1, temperature=1.0, logprobs=20, seed=3), use_tqdm=False)  # fmt: skip
    right = llm.generate([engine_input(batch[0])], SamplingParams(max_tokens=1, temperature=1.0, logprobs=20, seed=3),
                         use_tqdm=False)  # fmt: skip
    first = {t: v.logprob for t, v in wrong[0].outputs[0].logprobs[0].items()}
    truth = {t: v.logprob for t, v in right[0].outputs[0].logprobs[0].items()}
    assert max(abs(first[t] - truth[t]) for t in truth if t in first) > 1e-3


def test_first_tokens_after_an_image_follow_the_model(vlm):
    """4,000 first tokens sampled after the two-image prompt against HF's softmax at the prompt's
    last position: a chi-square test over the tokens expected at least 5 times (the rest pooled),
    at the 1e-3 level; the four image markers never. The model is random, so its first-token
    distribution is spread wide."""
    from scipy.stats import chisquare
    from vllm import SamplingParams

    _, processor, hf, llm = vlm
    prompt = prompts(processor)[2]
    samples = 4000
    out = llm.generate([engine_input(prompt)], SamplingParams(n=samples, max_tokens=1, temperature=1.0, seed=11),
                       use_tqdm=False)[0]  # fmt: skip
    vocab = hf.config.text_config.vocab_size
    counts = torch.bincount(
        torch.tensor([o.token_ids[0] for o in out.outputs]), minlength=vocab
    ).double()
    probs = hf_rows(hf, prompt, [])[0].double().exp()
    expected = probs * samples
    zero = expected == 0  # the image markers: never sampled
    assert zero.sum() == 4 and counts[zero].sum() == 0
    big, rare = expected >= 5, (expected < 5) & ~zero
    assert big.sum() >= 20  # a spread distribution: the test has power
    observed, wanted = counts[big], expected[big]
    if rare.any():  # the rare tokens pooled into one bin
        observed = torch.cat([observed, counts[rare].sum()[None]])
        wanted = torch.cat([wanted, expected[rare].sum()[None]])
    assert chisquare(observed.numpy(), wanted.numpy() * samples / wanted.sum().item()).pvalue > 1e-3


def test_a_weight_sync_reaches_the_vision_tower(vlm):
    """The actor's state dict (transformers' in-memory names: `model.visual.*`,
    `model.language_model.*`) loaded into the live engine (`reload_weights`, as every sync does)
    after every vision and language weight moved: the engine's log-probs equal the moved HF
    model's again (1e-4), and differ from the old ones (the sync did something). The same image
    was embedded before the sync: the engine's cached image embeddings must not be reused (vLLM
    also raises "Encoder cache miss" when they are not dropped)."""
    import copy

    from vllm import SamplingParams

    from verl.workers.rollout.vllm_engine import reload_weights

    _, processor, hf, llm = vlm
    prompt = prompts(processor)[0]
    params = SamplingParams(max_tokens=6, temperature=1.0, logprobs=0, seed=5, ignore_eos=True)
    moved = copy.deepcopy(hf)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    try:
        reload_weights(llm, moved.state_dict())
        sample = llm.generate([engine_input(prompt)], params, use_tqdm=False)[0].outputs[0]
        tokens = list(sample.token_ids)
        engine = torch.tensor([lp[t].logprob for lp, t in zip(sample.logprobs, tokens)])
        picked = torch.tensor(tokens)[:, None]
        assert torch.allclose(
            engine, hf_rows(moved, prompt, tokens)[:-1].gather(-1, picked)[:, 0], atol=1e-4
        )
        assert not torch.allclose(
            engine, hf_rows(hf, prompt, tokens)[:-1].gather(-1, picked)[:, 0], atol=1e-3
        )
        visual_only = {
            k: v for k, v in hf.state_dict().items() if not k.startswith("model.visual.")
        }
        reload_weights(
            llm, {**moved.state_dict(), **visual_only}
        )  # the old language model, moved vision
        mixed = llm.generate([engine_input(prompt)], params, use_tqdm=False)[0].outputs[0]
        again = torch.tensor([lp[t].logprob for lp, t in zip(mixed.logprobs, mixed.token_ids)])
        expect = hf_rows(hf, prompt, list(mixed.token_ids))[:-1].gather(-1, torch.tensor(mixed.token_ids)[:, None])[:, 0]  # fmt: skip
        assert not torch.allclose(again, expect, atol=1e-3)  # the moved vision tower shows
    finally:
        reload_weights(llm, hf.state_dict())


def test_a_session_opened_with_images_rewinds_and_scores_exactly(vlm):
    """Speculative guidance's sessions with an image (`SessionEngine.expect`): the first chunk
    gives the processor's expanded prompt, the engine opens it as one pad per image plus the
    image and runs the same expanded sequence (`prompt_ids`); its sampled tokens' and prompt rows' log-probs equal HF's (1e-4); a rewind
    given the expanded sequence with the last sampled tokens replaced keeps the image and scores
    the new token and samples after it exactly."""
    from verl.workers.rollout.vllm_sessions import SessionEngine, scoring_params

    _, processor, hf, llm = vlm
    prompt = prompts(processor)[0]
    engine = SessionEngine(llm)
    params = scoring_params(4, 5, {"temperature": 1.0})
    engine.expect({"img": prompt.opening()})
    out = engine.run([("img", prompt.input_ids, 4, None)], lambda *_: params)["img"]
    try:
        assert engine.prompt_ids("img") == prompt.input_ids  # vLLM expands as the processor does
        tokens = list(out.token_ids)
        rows = hf_rows(hf, prompt, tokens)
        ids, values = out.listed()
        assert (ids[:, 0] == tokens).all()
        assert torch.allclose(
            torch.tensor(values[:, 0]), rows[torch.arange(4), torch.tensor(tokens)], atol=1e-4
        )
        P = len(prompt.input_ids)
        whole = hf_rows(hf, prompt, [], start=0)  # row t scores prompt token t + 1
        expected = whole[torch.arange(P - 1), torch.tensor(prompt.input_ids[1:])]
        scored = out.prompt_logprobs.logprobs[: P - 1, 0]
        finite = torch.isfinite(expected)  # rows scoring an image marker: -inf on both sides
        assert torch.equal(torch.isfinite(scored), finite)
        assert torch.allclose(scored[finite], expected[finite], atol=1e-4)
        replaced = (tokens[1] + 1) % 100  # recomputed from position P: row P scores it
        again = engine.run(
            [("img", [*prompt.input_ids, tokens[0], replaced], 2, P)], lambda *_: params
        )["img"]
        rows = hf_rows(hf, prompt, [tokens[0], replaced, *again.token_ids])
        assert abs(again.prompt_logprobs.logprobs[P, 0].item() - rows[1, replaced].item()) < 1e-4
        _, values = again.listed()
        assert torch.allclose(torch.tensor(values[:, 0]), rows[2 + torch.arange(2), torch.tensor(again.token_ids)], atol=1e-4)  # fmt: skip
    finally:
        engine.close()


def test_a_session_whose_images_expand_otherwise_is_refused(vlm):
    """A session opened with an expanded prompt that is not what vLLM makes of the images (here
    one image pad short, as a processor with another pixel budget would give) is refused in one
    line naming the session and both lengths, before it runs."""
    from verl.utils.vision import ImagePrompt
    from verl.workers.rollout.vllm_sessions import SessionEngine, scoring_params

    _, processor, _, llm = vlm
    prompt = prompts(processor)[0]
    pad = processor.image_token_id
    short = list(prompt.input_ids)
    del short[short.index(pad)]
    engine = SessionEngine(llm)
    engine.expect({"s": ImagePrompt(prompt.raw_prompt_ids, short, {"image": prompt.images})})
    P = len(prompt.input_ids)
    with pytest.raises(ValueError, match=rf"^session s: vLLM expanded the prompt's images to {P + 1} tokens, the model's processor to {P}; both must run one image processor"):  # fmt: skip
        engine.run([("s", [*short, 5], 1, None)], lambda *_: scoring_params(1, 1, {}))
    assert engine.session_ids == []
    engine.close()
