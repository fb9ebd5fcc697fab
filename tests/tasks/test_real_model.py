"""The real pretrained pair (verl/tasks/real_model.py): cached, consistent, fluent, and the same
in transformers and in vLLM's CPU build (greedy tokens, sampled-token log-probs to 1e-4)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from verl.tasks.real_model import (
    CHAT_PROMPTS,
    DROPPED_LAYERS,
    EOS_TOKEN,
    RECORD_FILE,
    _matches,
    _publish,
    build_pair,
    chat_prompt_ids,
    drop_layers,
    greedy_continuation,
    recipe,
    token_log_probs,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PROMPTS = CHAT_PROMPTS[:3]
MAX_NEW_TOKENS = 48


def snapshot(folder) -> dict[str, tuple[int, int, int]]:
    return {
        f.name: (f.stat().st_ino, f.stat().st_mtime_ns, f.stat().st_size) for f in folder.iterdir()
    }


def test_second_build_is_a_cache_hit_with_the_same_files(real_pair, monkeypatch):
    import verl.tasks.real_model as real_model

    before = {name: snapshot(getattr(real_pair, name)) for name in ("guidance", "draft")}
    # a hit reads the records only: neither the GGUF source nor a rebuild
    monkeypatch.setattr(real_model, "load_source", lambda *a: pytest.fail("loaded the GGUF"))
    again = build_pair(real_pair.guidance.parent, log=lambda line: pytest.fail(f"rebuilt: {line}"))
    assert again == real_pair
    assert {name: snapshot(getattr(again, name)) for name in ("guidance", "draft")} == before


def test_a_changed_recipe_or_a_half_built_folder_is_not_reused(real_pair, tmp_path):
    folder = tmp_path / "draft"
    folder.mkdir()
    shutil.copy(real_pair.draft / RECORD_FILE, folder / RECORD_FILE)
    assert _matches(folder, recipe("draft"))
    assert not _matches(folder, recipe("draft", DROPPED_LAYERS[:2]))  # other layers dropped
    assert not _matches(folder, recipe("guidance"))
    record = json.loads((folder / RECORD_FILE).read_text())
    (folder / RECORD_FILE).write_text(json.dumps({**record, "recipe_version": 0}))
    assert not _matches(folder, recipe("draft"))
    (folder / RECORD_FILE).unlink()  # a folder without its record is an unfinished build
    assert not _matches(folder, recipe("draft"))
    # publishing replaces the whole folder at once: nothing of the old one is left
    (folder / "old.bin").write_text("old")
    partial = tmp_path / ".draft.partial-1"
    partial.mkdir()
    (partial / "new.bin").write_text("new")
    _publish(partial, folder)
    assert sorted(p.name for p in folder.iterdir()) == ["new.bin"] and not partial.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]


def test_drop_layers_renumbers_the_kept_layers():
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=5)
    state = {"model.embed_tokens.weight": torch.zeros(1)}
    state |= {f"model.layers.{i}.mlp.up_proj.weight": torch.full((1,), float(i)) for i in range(5)}
    new_config, new_state = drop_layers(config, state, [1, 2])
    assert new_config.num_hidden_layers == 3 and config.num_hidden_layers == 5
    kept = {k: v.item() for k, v in new_state.items() if k.startswith("model.layers.")}
    assert kept == {"model.layers.0.mlp.up_proj.weight": 0.0, "model.layers.1.mlp.up_proj.weight": 3.0,
                    "model.layers.2.mlp.up_proj.weight": 4.0}  # fmt: skip
    with pytest.raises(ValueError, match="proper subset"):
        drop_layers(config, state, range(5))


def test_draft_has_fewer_layers_and_the_same_tokenizer(real_pair):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from verl.workers.rollout.engine_config import check_same_tokenizer

    guidance, draft = (AutoConfig.from_pretrained(p) for p in (real_pair.guidance, real_pair.draft))
    assert (guidance.num_hidden_layers, draft.num_hidden_layers) == (30, 30 - len(DROPPED_LAYERS))
    assert guidance.vocab_size == draft.vocab_size == 49152 and draft.tie_word_embeddings
    for name in TOKENIZER_FILES:
        assert (real_pair.guidance / name).read_bytes() == (real_pair.draft / name).read_bytes(), (
            name
        )
    check_same_tokenizer(str(real_pair.draft), str(real_pair.guidance))
    tokenizer = AutoTokenizer.from_pretrained(real_pair.draft)
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.eos_token_id == 2
    assert GenerationConfig.from_pretrained(real_pair.draft).eos_token_id == 2
    # the draft's layer 16 is the guidance's layer 20 (16-19 dropped), bit for bit
    key = "model.layers.{}.self_attn.q_proj.weight"
    with safe_open(real_pair.draft / "model.safetensors", "pt") as d, \
         safe_open(real_pair.guidance / "model.safetensors", "pt") as g:  # fmt: skip
        assert d.get_tensor(key.format(16)).dtype == torch.float32
        assert torch.equal(d.get_tensor(key.format(16)), g.get_tensor(key.format(20)))
        assert torch.equal(d.get_tensor(key.format(15)), g.get_tensor(key.format(15)))


@pytest.fixture(scope="module")
def hf(real_pair):
    """The tokenizer, both models in transformers (float32), the chat prompts' ids, and the
    greedy continuations that the tests compute (by (model, prompt index)), shared."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_pair.guidance)
    models = {name: AutoModelForCausalLM.from_pretrained(getattr(real_pair, name), dtype=torch.float32).eval()
              for name in ("guidance", "draft")}  # fmt: skip
    prompts = [chat_prompt_ids(tokenizer, q) for q in PROMPTS]
    return {"tokenizer": tokenizer, "models": models, "prompts": prompts, "greedy": {}}


def hf_greedy(hf, name: str, index: int) -> list[int]:
    """transformers' greedy continuation of prompt `index` by model `name` (computed once)."""
    if (name, index) not in hf["greedy"]:
        hf["greedy"][name, index] = greedy_continuation(
            hf["models"][name], hf["prompts"][index], hf["tokenizer"].eos_token_id, MAX_NEW_TOKENS
        )
    return hf["greedy"][name, index]


def test_both_models_answer_chat_prompts_fluently_and_the_draft_is_weaker(hf):
    tokenizer = hf["tokenizer"]
    answers = {("guidance", 0), ("guidance", 2), ("draft", 2)}
    for name, index in sorted(answers):
        answer = hf_greedy(hf, name, index)
        text = tokenizer.decode(answer)
        assert answer[-1] == tokenizer.eos_token_id, f"{name}: no {EOS_TOKEN} in {text!r}"
        assert len(text.split()) >= 3 and EOS_TOKEN not in tokenizer.decode(answer[:-1]), text
    # per-token NLL of the guidance's own greedy answers: 0.565 under the guidance and 1.394
    # under the draft on the module's six prompts (module docstring); here on two of them
    scored = [(hf["prompts"][i], hf_greedy(hf, "guidance", i)) for i in (0, 2)]
    nll = {name: -torch.cat([token_log_probs(m, p, a) for p, a in scored]).mean().item()
           for name, m in hf["models"].items()}  # fmt: skip
    assert nll["guidance"] < 1.0 and nll["draft"] > nll["guidance"] + 0.4, nll


@pytest.fixture(scope="module", params=["guidance", "draft"])
def engine(request, real_pair):
    """A vLLM CPU engine on one of the two folders (shut down before the next one starts)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    llm = LLM(model=str(getattr(real_pair, request.param)), dtype="float32", enforce_eager=True,
              max_model_len=512, kv_cache_memory_bytes=2**28, seed=0, max_logprobs=20)  # fmt: skip
    yield request.param, llm
    # (vLLM's CPU worker also pins torch to its threads and disables torch.set_num_threads for
    # the rest of the process; the transformers computations after this run on those threads)
    llm.llm_engine.engine_core.shutdown()


@pytest.mark.vllm
def test_vllm_greedy_equals_transformers_and_ends_with_im_end(engine, hf):
    """vLLM's greedy answers to the chat prompts end with <|im_end|>, and their first 16 tokens
    are transformers' greedy tokens: transformers' argmax at every position of vLLM's answer
    (teacher-forced, the same thing as greedy decoding) and, where a test ran it,
    transformers' own `generate`."""
    from vllm import SamplingParams

    name, llm = engine
    tokenizer = hf["tokenizer"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}],
                                         add_generation_prompt=True, tokenize=False)  # fmt: skip
    assert llm.get_tokenizer()(text, add_special_tokens=False)["input_ids"] == hf["prompts"][0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, skip_special_tokens=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in hf["prompts"]], params, use_tqdm=False)
    model = hf["models"][name]
    for index, (out, prompt) in enumerate(zip(outs, hf["prompts"])):
        tokens = list(out.outputs[0].token_ids)
        assert out.outputs[0].finish_reason == "stop" and tokens[-1] == tokenizer.eos_token_id
        assert len(out.outputs[0].text.split()) >= 3, out.outputs[0].text
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens[:16]])).logits[0, len(prompt) - 1 : -1]
        assert logits.argmax(-1).tolist() == tokens[:16], tokenizer.decode(tokens)
        if (name, index) in hf["greedy"]:
            assert hf["greedy"][name, index][:16] == tokens[:16]


@pytest.mark.vllm
def test_vllm_sampled_log_probs_match_transformers(engine, hf):
    from vllm import SamplingParams

    name, llm = engine
    # ignore_eos keeps the batch at three rows: vLLM compiles its log-prob rank kernel once per
    # batch shape (about 10 s on 2 cores)
    params = SamplingParams(temperature=1.0, max_tokens=16, logprobs=0, seed=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in hf["prompts"]], params, use_tqdm=False)
    worst = 0.0
    for out, prompt in zip(outs, hf["prompts"]):
        sample = out.outputs[0]
        tokens = list(sample.token_ids)
        served = torch.tensor([step[t].logprob for step, t in zip(sample.logprobs, tokens)])
        reference = token_log_probs(hf["models"][name], prompt, tokens)
        worst = max(worst, (served - reference).abs().max().item())
    assert worst < 1e-4, f"{name}: |vLLM - transformers| log-prob up to {worst:.2e}"
