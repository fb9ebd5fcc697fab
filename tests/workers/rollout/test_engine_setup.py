"""How the rollout builds its vLLM engines (`vllm_engine.py`, `engine_args`, `VLLMRollout`,
`RolloutGroup`), with stand-ins where a guard must fire: the V1 runner pinned, async scheduling
off, explicit KV budgets from the config, engines on one GPU started one after the other, the
vocabulary restricted to the rows both models embed, and the config keys vLLM's GPU path
cannot serve refused in one line. No engine is built here."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from verl.utils.config_checks import ConfigError
from verl.workers.rollout import vllm_engine
from verl.workers.rollout.config import RolloutConfig
from verl.workers.rollout.vllm_engine import ENGINE_KEY, GiB

KEY = "worker.rollout.gpu_memory_utilization"


# ------------------------------------------------------------------ the model runner
def test_pin_sets_the_v1_runner_and_refuses_an_environment_asking_for_v2(monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    vllm_engine.pin_v1_model_runner()
    import os

    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(RuntimeError) as info:
        vllm_engine.build_llm({"model": "/no/such/model", "kv_cache_memory_bytes": 1})
    message = str(info.value)  # refused before vLLM looks at the model
    assert "\n" not in message and message.startswith(
        "VLLM_USE_V2_MODEL_RUNNER='1' is not supported"
    )
    assert message.endswith("unset it or set it to 0")


# ------------------------------------------------------------------ KV budgets
def test_kv_budget_is_the_share_minus_weights_and_reserve_by_hand():
    # 0.4 x 80 GiB = 32 GiB; minus 3 GiB of weights and a 3 GiB reserve: 26 GiB
    assert vllm_engine.kv_cache_bytes(0.4, 80 * GiB, 3 * GiB, 3 * GiB, KEY) == 26 * GiB
    # reserve of a 151,936-token vocabulary at 1024 sequences: 1 GiB + 3 x 1024 x 151,936 x 4 B
    assert vllm_engine.reserve_bytes(151_936, 1024) == GiB + 1_866_989_568  # 3 x 622,329,856
    with pytest.raises(ConfigError) as info:  # 0.05 x 80 GiB = 4 GiB < 3 + 3 GiB
        vllm_engine.kv_cache_bytes(0.05, 80 * GiB, 3 * GiB, 3 * GiB, KEY)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{KEY}=0.05 is not valid; 0.05 x 80.0 GiB leaves no KV cache")
    assert message.endswith("expected more than 0.075")  # (3 + 3) / 80


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from verl.tasks.tiny_lm import TinyLMSpec, save_tiny_lm

    root = tmp_path_factory.mktemp("setup")
    paths = {}
    for name, rows, width in (("d128", 128, 64), ("g160", 160, 128), ("g128", 128, 128)):
        spec = TinyLMSpec(hidden_size=width, num_hidden_layers=1, vocab_size=rows, seed=1)
        paths[name] = save_tiny_lm(str(root / name), spec)
    return paths


def test_weight_bytes_count_the_parameters_without_loading_them(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["g160"])
    count = sum(p.numel() for p in model.parameters())
    assert vllm_engine.weight_bytes(tiny["g160"], "bfloat16") == 2 * count
    assert vllm_engine.weight_bytes(tiny["g160"], "float32") == 4 * count


def test_cuda_memory_args_are_an_explicit_budget_from_the_config(tiny, monkeypatch):
    """CUDA (stand-in device of 80 GiB, 1 GiB of it free: what another engine loading leaves):
    the KV budget comes from the share and the device's total, never from its free memory."""
    monkeypatch.setattr(vllm_engine.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm_engine.torch.cuda, "mem_get_info", lambda: (1 * GiB, 80 * GiB))
    args = {"model": tiny["g160"], "dtype": "bfloat16", "max_num_seqs": 64,
            "gpu_memory_utilization": 0.3}  # fmt: skip
    weights = vllm_engine.weight_bytes(tiny["g160"], "bfloat16")
    reserve = vllm_engine.ACTIVATION_RESERVE_BYTES + 3 * 64 * 160 * 4
    expected = int(0.3 * 80 * GiB) - weights - reserve
    assert vllm_engine.memory_args(args, KEY) == {"kv_cache_memory_bytes": expected}
    with pytest.raises(ConfigError, match=rf"^{KEY}=0\.01 is not valid; .*expected more than 0\.013$"):  # fmt: skip
        vllm_engine.memory_args({**args, "gpu_memory_utilization": 0.01}, KEY)
    # an explicit budget is kept as given
    assert vllm_engine.memory_args({**args, "kv_cache_memory_bytes": 5}, KEY) == {}


def test_cpu_memory_args_are_the_share_of_system_memory():
    import psutil

    args = vllm_engine.memory_args({"gpu_memory_utilization": 0.02, "model": "unused"}, KEY)
    total = psutil.virtual_memory().total
    assert args == {"gpu_memory_utilization": None, "kv_cache_memory_bytes": int(0.02 * total)}


# ------------------------------------------------------------------ engine arguments
def _config(draft_rows_path: str | None = None, guidance: str | None = None) -> RolloutConfig:
    cfg = RolloutConfig(prompt_length=8, response_length=8, dtype="float32")
    g = cfg.offpolicy_guidance
    g.enable, g.model_path, g.logprobs = guidance is not None, guidance, 1000
    return cfg


def test_both_engines_turn_async_scheduling_off_and_carry_their_memory_key(tiny):
    from verl.workers.rollout.engine_config import engine_args

    draft, teacher, k = engine_args(tiny["d128"], _config(guidance=tiny["g128"]))
    assert draft["async_scheduling"] is False and teacher["async_scheduling"] is False
    assert draft[ENGINE_KEY] == {"memory_key": KEY, "vocab_rows": None}
    assert teacher[ENGINE_KEY] == {
        "memory_key": "worker.rollout.offpolicy_guidance.gpu_memory_utilization",
        "vocab_rows": None,
    }
    assert (draft["gpu_memory_utilization"], teacher["gpu_memory_utilization"]) == (0.6, 0.3)
    assert k == 128


@pytest.mark.parametrize("chunked", [True, False])
def test_both_engines_get_the_configured_chunked_prefill(tiny, chunked):
    from verl.workers.rollout.engine_config import engine_args

    config = _config(guidance=tiny["g128"])
    assert config.enable_chunked_prefill is True  # vLLM 0.32's own default for these models
    config.enable_chunked_prefill = chunked
    draft, teacher, _ = engine_args(tiny["d128"], config)
    assert (
        draft["enable_chunked_prefill"] is chunked and teacher["enable_chunked_prefill"] is chunked
    )


@pytest.mark.parametrize("disable_tqdm", [True, False])
def test_whole_response_generation_shows_vllms_bar_unless_disabled(disable_tqdm):
    """`disable_tqdm` reaches the draft engine's generate call (a recording stand-in engine)."""
    from verl.workers.rollout.context import Engines, RolloutContext
    from verl.workers.rollout.modes import draft_responses

    calls = []

    class Recorder:
        def generate(self, prompts, params, use_tqdm):
            calls.append(use_tqdm)
            return []

    config = RolloutConfig(disable_tqdm=disable_tqdm)
    ctx = RolloutContext(config, Engines(Recorder(), None), num_logprobs=1, eos_token_id=2,
                         pad_token_id=0, max_tokens=8, temperature=1.0, ignore_eos=False)  # fmt: skip
    assert draft_responses(ctx, [], []) == []
    assert calls == [not disable_tqdm]


def test_the_engine_with_more_embedding_rows_is_restricted_to_the_common_ones(tiny):
    """The README's pair in small: a 128-row draft with a 160-row guidance (the same tokenizer):
    the guidance gives ids 128..159 probability 0 and lists at most 128; reversed, the draft."""
    from verl.workers.rollout.engine_config import engine_args

    draft, teacher, k = engine_args(tiny["d128"], _config(guidance=tiny["g160"]))
    assert draft[ENGINE_KEY]["vocab_rows"] is None and teacher[ENGINE_KEY]["vocab_rows"] == 128
    assert k == 128 and teacher["max_logprobs"] == 128
    draft, teacher, k = engine_args(tiny["g160"], _config(guidance=tiny["d128"]))
    assert draft[ENGINE_KEY]["vocab_rows"] == 128 and teacher[ENGINE_KEY]["vocab_rows"] is None


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("worker.rollout.tensor_parallel_size=2",
         "worker.rollout.tensor_parallel_size=2 is not valid; expected 1: vLLM runs a wider draft engine"),
        ("worker.rollout.sleep_level=2",
         "worker.rollout.sleep_level=2 is not valid; expected 1: level 2 discards the weights"),
    ],
)  # fmt: skip
def test_config_keys_the_gpu_path_cannot_serve_are_refused_in_one_line(override, expected):
    from verl.trainer.config import load_config

    with pytest.raises(ConfigError) as info:
        load_config([override])
    assert "\n" not in str(info.value) and str(info.value).startswith(expected)
    assert load_config().worker.rollout.sleep_level == 1


# ------------------------------------------------------------------ start-up order
def test_the_draft_engine_is_built_before_the_guidance_engine_starts(monkeypatch):
    """`VLLMRollout` with stand-ins recording what happens when: the guidance's process is
    spawned first (it imports vLLM), its engine is only asked for once the draft's is built;
    when the draft fails, the guidance process is stopped and its engine never started."""
    from verl.workers.rollout import engine_lifecycle as spmd
    from verl.workers.rollout.vllm_rollout_spmd import VLLMRollout

    events = []

    class Process:  # stand-in GuidanceProcess
        def __init__(self, llm_kwargs=None, env=None):
            assert llm_kwargs is None
            events.append("guidance process spawned")

        def start(self, kwargs):
            events.append(f"guidance engine started ({kwargs['model']})")

        def wait_ready(self):
            events.append("guidance engine ready")
            return {"runner": "stand-in"}

        def shutdown(self):
            events.append("guidance process stopped")

    def build(kwargs):
        events.append("draft build begins")
        time.sleep(0.05)
        if kwargs["model"] == "broken":
            raise RuntimeError("draft failed")
        events.append("draft built")
        return SimpleNamespace(), {"runner": "stand-in"}

    cfg = _config(guidance="g")
    monkeypatch.setattr(spmd, "check_same_tokenizer", lambda a, b: None)
    monkeypatch.setattr(spmd, "engine_args", lambda path, c: ({"model": path}, {"model": "g"}, 5))
    monkeypatch.setattr(spmd, "GuidanceProcess", Process)
    monkeypatch.setattr(spmd, "build_llm", build)
    monkeypatch.setattr(spmd, "SessionEngine", lambda llm: None)
    monkeypatch.setattr(spmd, "split_cpu_threads", lambda: {})
    VLLMRollout("d", cfg, 0, 0)
    assert events == ["guidance process spawned", "draft build begins", "draft built",
                      "guidance engine started (g)", "guidance engine ready"]  # fmt: skip
    events.clear()
    with pytest.raises(RuntimeError, match="draft failed"):
        VLLMRollout("broken", cfg, 0, 0)
    assert events == ["guidance process spawned", "draft build begins", "guidance process stopped"]


@pytest.mark.parametrize("dedicated", [False, True])
def test_colocated_guidance_services_start_after_every_draft_engine(monkeypatch, dedicated):
    """`RolloutGroup` with a stand-in Ray: colocated guidance services (on the drafts' GPUs)
    start only after every draft replica is built; dedicated ones while the drafts build."""
    from verl.workers.rollout import worker

    events = []

    class Handle:
        def __init__(self, i):
            self.__ray_ready__ = SimpleNamespace(remote=lambda: f"ready {i}")

    class Remote:
        def __init__(self):
            self.count = 0

        def options(self, **kwargs):
            return self

        def remote(self, *args):
            self.count += 1
            return Handle(self.count)

    def get(refs, **kwargs):
        events.append(f"drafts built ({', '.join(refs)})")

    stand_in = SimpleNamespace(remote=lambda **kw: lambda cls: Remote(), get=get)
    monkeypatch.setattr(worker, "ray", stand_in)
    monkeypatch.setattr(worker, "Queue", lambda *a, **k: None)
    monkeypatch.setattr(
        worker.RolloutGroup, "_start_guidance", lambda self: events.append("guidance started")
    )
    monkeypatch.setattr(worker.RolloutGroup, "_connect_guidance", lambda self: events.append("guidance connected"))  # fmt: skip
    worker.RolloutGroup(2, "d", _config(guidance="g"),
                        guidance_placement=SimpleNamespace() if dedicated else None)  # fmt: skip
    drafts = "drafts built (ready 1, ready 2)"
    if dedicated:
        assert events == ["guidance started", drafts, "guidance connected"]
    else:
        assert events == [drafts, "guidance started", "guidance connected"]


def test_build_llm_pins_the_runner_applies_the_patch_checks_and_restricts(monkeypatch):
    """`build_llm`'s steps in order on a stand-in `vllm.LLM`: the ENGINE_KEY entry never
    reaches vLLM, the V1 runner is pinned before the engine is built, the live engine checked,
    then its vocabulary restricted."""
    import os
    import sys

    from verl_patches import vllm_session_rewind

    events = []
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)

    class LLM:
        def __init__(self, **kwargs):
            events.append(("built", os.environ.get("VLLM_USE_V2_MODEL_RUNNER"), sorted(kwargs)))

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=LLM))
    monkeypatch.setattr(vllm_session_rewind, "apply", lambda: events.append("patched"))
    monkeypatch.setattr(vllm_session_rewind, "check_engine", lambda llm: events.append("checked") or "R")  # fmt: skip
    monkeypatch.setattr(vllm_session_rewind, "restrict_vocab", lambda llm, rows, banned: events.append(("rows", rows, banned)))  # fmt: skip
    kwargs = {"model": "m", "kv_cache_memory_bytes": 7, "gpu_memory_utilization": 0.3,
              ENGINE_KEY: {"memory_key": KEY, "vocab_rows": 128}}  # fmt: skip
    _, facts = vllm_engine.build_llm(kwargs)
    assert events == ["patched", ("built", "0", ["gpu_memory_utilization", "kv_cache_memory_bytes", "model"]),
                      "checked", ("rows", 128, ())]  # fmt: skip
    assert facts == {"runner": "R", "kv_cache_bytes": 7, "vocab_rows": 128}
    assert ENGINE_KEY in kwargs  # the caller's arguments are left as they were
    events.clear()  # an eager engine: the sampler's ranks are made eager before it is built
    monkeypatch.setattr(vllm_engine, "eager_sampler_ranks", lambda: events.append("eager ranks"))
    vllm_engine.build_llm({"model": "m", "enforce_eager": True})
    assert events[:3] == ["patched", "eager ranks", ("built", "0", ["enforce_eager", "model"])]


def test_eager_sampler_ranks_are_the_compiled_helpers_function(monkeypatch):
    """The rank counter vLLM's sampler calls becomes the plain function its compiled helper
    wraps: no compile, the same counts."""
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs

    monkeypatch.setattr(sampler, "batched_count_greater_than", logprobs.batched_count_greater_than)
    vllm_engine.eager_sampler_ranks()
    plain = sampler.batched_count_greater_than
    assert plain is logprobs.batched_count_greater_than.__wrapped__
    x = torch.tensor([[0.1, -1.0, 0.3, 0.3], [2.0, 1.0, 0.0, -1.0]])
    # row 0: 0.3, 0.3 are >= 0.3 -> 2; row 1: 2.0, 1.0 are >= 1.0 -> 2; row 1 against 5.0 -> 0
    assert plain(x, torch.tensor([[0.3], [1.0]])).tolist() == [2, 2]
    assert plain(x, torch.tensor([[0.3], [5.0]])).tolist() == [2, 0]


def test_cpu_has_no_device_lock_to_hold():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine has a device to lock")
    assert vllm_engine.device_key() is None
    with vllm_engine.device_lock():  # nothing held, nothing waits
        pass
