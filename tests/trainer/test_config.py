"""Tests of the configuration system: defaults, derived keys, merge order, docs and errors."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from omegaconf import DictConfig, ListConfig

from verl.trainer.config import PPOConfig, load_config, to_dict
from verl.trainer.core_algos.advantage import ADV_ESTIMATORS
from verl.trainer.core_algos.distill import DISTILL_MODES
from verl.trainer.core_algos.guidance import BEHAVIORS, GUIDANCE_MODES, LAM_SCHEDULES
from verl.trainer.core_algos.kl import KL_ESTIMATORS
from verl.trainer.core_algos.offpolicy import RATIO_LEVELS
from verl.trainer.core_algos.policy_loss import LOSS_AGG_MODES, POLICY_LOSSES, PolicyLossConfig
from verl.utils.config_checks import ConfigError
from verl.workers.actor.config import ActorConfig

GUIDANCE = "worker.rollout.offpolicy_guidance"

EXAMPLE_YAML = """\
# A typical user config: GRPO on a small model, guidance off.
data:
  train_files: data/math@train
  val_files: data/math@test
  prompt_key: problem
  max_prompt_length: 256
  max_response_length: 1024
  rollout_batch_size: 64

worker:
  actor:
    global_batch_size: 32
    policy_loss:
      loss_agg_mode: seq-mean-token-mean
      clip_ratio_high: 0.3
    model:
      model_path: /models/qwen2.5-0.5b
    optim:
      lr: 2.0e-6
  rollout:
    n: 8
    temperature: 0.9

algorithm:
  adv_estimator: rloo
  kl_coef: 0.001

trainer:
  project_name: my_project
  experiment_name: yaml_run
  logger: [console]
  total_epochs: 2
"""


@pytest.fixture
def example_yaml(tmp_path: Path) -> str:
    path = tmp_path / "example.yaml"
    path.write_text(EXAMPLE_YAML)
    return str(path)


# ---------------------------------------------------------------------------------- defaults


def test_defaults_and_derived_keys():
    config = load_config()
    assert isinstance(config, PPOConfig)
    assert config.data.max_prompt_length == 512
    assert config.worker.rollout.n == 5
    # derived keys filled by post_init
    assert config.worker.rollout.prompt_length == config.data.max_prompt_length
    assert config.worker.rollout.response_length == config.data.max_response_length
    assert config.algorithm.tis_level == "none"
    actor, algo = config.worker.actor, config.algorithm
    assert actor.use_kl_loss is True  # algorithm.use_kl_loss and not disable_kl
    assert actor.kl_penalty == algo.kl_penalty == "k3"
    assert actor.kl_coef == algo.kl_coef == 1e-2
    assert config.trainer.save_checkpoint_path == os.path.join("checkpoints", "easy_r1", "demo")


def test_derived_keys_follow_the_algorithm_and_data_sections():
    config = load_config(
        [
            "data.max_prompt_length=100",
            "data.max_response_length=300",
            "algorithm.kl_penalty=low_var_kl",
            "algorithm.kl_coef=0.05",
            "algorithm.importance_clamp_min=0.1",
            "algorithm.importance_clamp_max=5.0",
            "algorithm.importance_detach=false",
            "algorithm.opsm_delta=0.2",
            "trainer.project_name=p",
            "trainer.experiment_name=e",
        ]
    )
    actor = config.worker.actor
    assert config.worker.rollout.prompt_length == 100
    assert config.worker.rollout.response_length == 300
    assert actor.kl_penalty == "low_var_kl"
    assert actor.kl_coef == 0.05
    assert actor.policy_loss.importance_clamp_min == 0.1
    assert actor.policy_loss.importance_clamp_max == 5.0
    assert actor.policy_loss.importance_detach is False
    assert actor.policy_loss.opsm_delta == 0.2
    assert config.trainer.save_checkpoint_path == os.path.join("checkpoints", "p", "e")


@pytest.mark.parametrize(("mode", "actor_coef"), [("reward", 0.0), ("loss", 0.3)])
def test_distill_keys_reach_the_actor_only_in_loss_mode(mode, actor_coef):
    config = load_config([f"{GUIDANCE}.enable=true", f"{GUIDANCE}.model_path=/models/guide", "algorithm.adv_estimator=none",
                          "algorithm.distill.coef=0.3", f"algorithm.distill.mode={mode}", "algorithm.distill.estimator=k3"])  # fmt: skip
    assert config.worker.actor.distill_coef == actor_coef
    assert config.worker.actor.distill_estimator == "k3"
    assert not config.worker.actor.distill_topk_forward
    assert not config.worker.rollout.offpolicy_guidance.keep_topk


def test_topk_forward_reaches_actor_and_rollout():
    config = load_config([f"{GUIDANCE}.enable=true", f"{GUIDANCE}.model_path=/m", f"{GUIDANCE}.lam=0", "algorithm.distill.coef=1",
                          "algorithm.distill.mode=loss", "algorithm.distill.topk_forward=true"])  # fmt: skip
    assert (
        config.worker.actor.distill_topk_forward
        and config.worker.rollout.offpolicy_guidance.keep_topk
    )


def test_explicit_save_checkpoint_path_is_kept():
    config = load_config(["trainer.save_checkpoint_path=/tmp/ckpt"])
    assert config.trainer.save_checkpoint_path == "/tmp/ckpt"


@pytest.mark.parametrize(
    "args, expected",
    [
        ([], True),
        (["algorithm.use_kl_loss=false"], False),
        (["algorithm.disable_kl=true"], False),
    ],
)
def test_actor_use_kl_loss_is_derived(args, expected):
    assert load_config(args).worker.actor.use_kl_loss is expected


def test_tis_level_auto_resolves_to_token_with_guidance():
    config = load_config([f"{GUIDANCE}.enable=true", f"{GUIDANCE}.model_path=/models/guide"])
    assert config.algorithm.tis_level == "token"
    assert config.uses_importance_weights is True


def test_explicit_tis_level_is_kept():
    config = load_config(["algorithm.tis_level=sequence"])
    assert config.algorithm.tis_level == "sequence"
    assert config.uses_importance_weights is True
    guided = load_config(
        [f"{GUIDANCE}.enable=true", f"{GUIDANCE}.model_path=/m", "algorithm.tis_level=none"]
    )
    assert guided.algorithm.tis_level == "none"
    assert guided.uses_importance_weights is False


def test_guidance_disabled_is_vanilla_grpo():
    config = load_config()
    assert config.worker.rollout.offpolicy_guidance.enable is False
    assert config.algorithm.tis_level == "none"
    assert config.uses_importance_weights is False
    assert config.worker.actor.policy_loss.loss_type == "ppo"
    assert config.algorithm.adv_estimator == "grpo"
    assert config.algorithm.mis_level == "none"
    assert config.algorithm.geometric_mask is False
    assert config.algorithm.opsm_delta is None
    assert config.worker.actor.policy_loss.luffy_shaping is False


# ---------------------------------------------------------------------------------- merge order


def test_example_yaml_loads(example_yaml):
    config = load_config([f"config={example_yaml}"])
    assert config.data.train_files == "data/math@train"
    assert config.data.prompt_key == "problem"
    assert config.worker.actor.policy_loss.loss_agg_mode == "seq-mean-token-mean"
    assert config.worker.actor.model.model_path == "/models/qwen2.5-0.5b"
    assert config.worker.actor.optim.lr == 2.0e-6
    assert config.worker.rollout.n == 8
    assert config.worker.rollout.temperature == 0.9
    assert config.worker.rollout.prompt_length == 256
    assert config.worker.rollout.response_length == 1024
    assert config.algorithm.adv_estimator == "rloo"
    assert config.worker.actor.kl_coef == 0.001
    assert config.trainer.logger == ["console"]
    assert config.trainer.save_checkpoint_path == os.path.join(
        "checkpoints", "my_project", "yaml_run"
    )
    # keys the YAML does not mention keep their defaults
    assert config.worker.actor.policy_loss.clip_ratio_low == 0.2
    assert config.worker.rollout.top_p == 1.0


def test_yaml_overrides_defaults(example_yaml):
    default = load_config()
    config = load_config([f"config={example_yaml}"])
    assert default.worker.rollout.n == 5 and config.worker.rollout.n == 8
    assert default.data.max_prompt_length == 512 and config.data.max_prompt_length == 256


def test_cli_overrides_yaml(example_yaml):
    config = load_config(
        [f"config={example_yaml}", "worker.rollout.n=4", "data.max_prompt_length=128"]
    )
    assert config.worker.rollout.n == 4
    assert config.data.max_prompt_length == 128
    assert config.worker.rollout.prompt_length == 128
    assert config.worker.rollout.temperature == 0.9  # from the YAML, not overridden
    # the position of `config=` in the argument list does not change the precedence
    config = load_config(["worker.rollout.n=4", f"config={example_yaml}"])
    assert config.worker.rollout.n == 4


def test_overrides_dict_overrides_yaml_and_cli(example_yaml):
    config = load_config(
        [f"config={example_yaml}", "worker.rollout.n=4"],
        overrides={"worker": {"rollout": {"n": 3}}, "trainer": {"experiment_name": "ovr"}},
    )
    assert config.worker.rollout.n == 3
    assert config.trainer.experiment_name == "ovr"
    assert config.trainer.project_name == "my_project"  # from the YAML
    assert config.trainer.save_checkpoint_path == os.path.join("checkpoints", "my_project", "ovr")


def test_empty_cli_value_means_empty_string_for_keys_whose_default_is_empty(example_yaml):
    # OmegaConf alone reads `data.val_files=` as None, which a str field refuses
    config = load_config([f"config={example_yaml}", "data.val_files="])
    assert config.data.val_files == ""  # the YAML's data/math@test is cleared: no validation set
    assert config.data.train_files == "data/math@train"
    assert load_config(["data.train_files=", "data.val_files="]).data.train_files == ""
    # an explicit empty string and the empty value agree
    assert load_config(["data.val_files=''"]).data.val_files == ""


def test_empty_cli_value_is_none_for_optional_keys_and_refused_for_other_str_keys(example_yaml):
    assert load_config(["data.format_prompt="]).data.format_prompt is None
    with pytest.raises(ConfigError, match=r"^data\.prompt_key: empty value; give a string"):
        load_config([f"config={example_yaml}", "data.prompt_key="])
    with pytest.raises(ConfigError, match=r"algorithm\.adv_estimator: empty value"):
        load_config(["algorithm.adv_estimator="])
    # a non-str key keeps OmegaConf's one-line type error; an unknown key its key list
    with pytest.raises(ConfigError, match=r"data\.max_prompt_length: .*'int'"):
        load_config(["data.max_prompt_length="])
    with pytest.raises(ConfigError, match=r"unknown config key 'data\.val_file'"):
        load_config(["data.val_file="])


def test_cli_with_empty_val_files_runs_without_validation_set(example_yaml, capsys, tmp_path, monkeypatch):  # fmt: skip
    from verl.trainer.main import main

    # the dry run checks the model folder; the uncached data/math@train passes (the run downloads it)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    model = f"worker.actor.model.model_path={tmp_path / 'model'}"
    # the argument list exactly as the shell hands it over: `... data.val_files=` (empty value)
    assert main(["--dry-run", f"config={example_yaml}", "data.val_files=", model]) == 0
    out = capsys.readouterr().out
    assert "  val_files: ''\n" in out and "  train_files: data/math@train\n" in out


# ---------------------------------------------------------------------------------- errors


def _choices(valid) -> str:
    return "valid: " + ", ".join(valid)


CHOICE_CASES = [
    ("algorithm.adv_estimator", ADV_ESTIMATORS.names()),
    ("worker.actor.policy_loss.loss_type", POLICY_LOSSES.names()),
    ("worker.actor.policy_loss.loss_agg_mode", LOSS_AGG_MODES.names()),
    ("algorithm.kl_penalty", KL_ESTIMATORS.names()),
    ("algorithm.tis_level", ["auto", "none", *RATIO_LEVELS.names()]),
    ("algorithm.mis_level", ["none", *RATIO_LEVELS.names()]),
    (f"{GUIDANCE}.mode", GUIDANCE_MODES.names()),
    (f"{GUIDANCE}.behavior", BEHAVIORS.names()),
    (f"{GUIDANCE}.lam_schedule", LAM_SCHEDULES.names()),
    ("algorithm.distill.mode", DISTILL_MODES.names()),
    ("algorithm.distill.estimator", KL_ESTIMATORS.names()),
]


@pytest.mark.parametrize("key, valid", CHOICE_CASES, ids=[k for k, _ in CHOICE_CASES])
def test_unknown_choice_names_key_value_and_registry_names(key, valid):
    assert valid, "a registry is empty"
    with pytest.raises(ConfigError) as err:
        load_config([f"{key}=not_a_real_name"])
    msg = str(err.value)
    assert "\n" not in msg
    assert f"{key}='not_a_real_name'" in msg
    assert msg.endswith(_choices(valid))
    for name in valid:
        assert name in msg


def test_valid_choices_follow_the_registry(monkeypatch):
    """A loss registered at run time becomes a valid config value (no hand-copied list)."""
    monkeypatch.setattr(POLICY_LOSSES, "_table", dict(POLICY_LOSSES._table))
    monkeypatch.setattr(POLICY_LOSSES, "_aliases", dict(POLICY_LOSSES._aliases))
    with pytest.raises(ConfigError, match="my_test_loss"):
        load_config(["worker.actor.policy_loss.loss_type=my_test_loss"])
    POLICY_LOSSES.register("my_test_loss")(lambda *args, **kwargs: None)
    assert load_config(
        ["worker.actor.policy_loss.loss_type=my_test_loss"]
    ).worker.actor.policy_loss.loss_type == ("my_test_loss")
    with pytest.raises(ConfigError) as err:
        load_config(["worker.actor.policy_loss.loss_type=nope"])
    assert "my_test_loss" in str(err.value)


ERROR_CASES = [
    # (id, args, fragments the one-line message must contain)
    ("lam_above_1", [f"{GUIDANCE}.lam=1.5"], [f"{GUIDANCE}.lam=1.5", "[0.0, 1.0]"]),
    ("lam_below_0", [f"{GUIDANCE}.lam=-0.1"], [f"{GUIDANCE}.lam=-0.1", "[0.0, 1.0]"]),
    (
        "no_pipeline_group",
        [f"{GUIDANCE}.pipeline_groups=0"],
        [f"{GUIDANCE}.pipeline_groups=0", "[1, inf]"],
    ),
    (
        "mix_num_samples_above_n",
        ["worker.rollout.n=4", f"{GUIDANCE}.mix_num_samples=5"],
        [f"{GUIDANCE}.mix_num_samples=5", "[0, 4]"],
    ),
    (
        "guidance_without_model_path",
        [f"{GUIDANCE}.enable=true"],
        [f"{GUIDANCE}.model_path=None", "guidance is enabled"],
    ),
    (
        "otb_without_sum_pi_squared",
        ["algorithm.adv_estimator=optimal_token_baseline"],
        ["worker.actor.calculate_sum_pi_squared=False", "optimal_token_baseline"],
    ),
    (
        "otb_alias_without_sum_pi_squared",
        ["algorithm.adv_estimator=tir_otb"],
        ["worker.actor.calculate_sum_pi_squared=False", "tir_otb"],
    ),
    (
        "importance_clamp_min_above_max",
        ["algorithm.importance_clamp_min=3.0", "algorithm.importance_clamp_max=2.5"],
        ["algorithm.importance_clamp_min=3.0", "algorithm.importance_clamp_max=2.5"],
    ),
    (
        "mis_lower_above_upper",
        ["algorithm.mis_threshold_lower=1.5", "algorithm.mis_threshold_upper=1.2"],
        ["algorithm.mis_threshold_lower=1.5", "algorithm.mis_threshold_upper=1.2"],
    ),
    (
        "geometric_lower_above_upper",
        ["algorithm.geometric_mask_lower=3.0", "algorithm.geometric_mask_upper=2.0"],
        ["algorithm.geometric_mask_lower=3.0", "algorithm.geometric_mask_upper=2.0"],
    ),
    (
        "distill_without_guidance",
        ["algorithm.distill.coef=0.1"],
        ["algorithm.distill.coef=0.1", "offpolicy_guidance.enable=true"],
    ),
    (
        "no_outcome_advantage_without_distill",
        ["algorithm.adv_estimator=none"],
        ["algorithm.adv_estimator='none'", "algorithm.distill.coef > 0"],
    ),
    (
        "topk_forward_in_reward_mode_under_guided_sampling",
        [
            f"{GUIDANCE}.enable=true",
            f"{GUIDANCE}.model_path=/m",
            "algorithm.distill.coef=0.1",
            "algorithm.distill.topk_forward=true",
        ],
        [
            "algorithm.distill.topk_forward=True",
            "algorithm.distill.mode=loss",
            "lam=0 at every step",
        ],
    ),
    (
        "topk_forward_with_overlapped_scoring",
        [
            f"{GUIDANCE}.enable=true",
            f"{GUIDANCE}.model_path=/m",
            f"{GUIDANCE}.lam=0",
            "algorithm.distill.coef=0.1",
            "algorithm.distill.mode=loss",
            "algorithm.distill.topk_forward=true",
            f"{GUIDANCE}.teacher_scoring=overlap",
        ],
        ["algorithm.distill.topk_forward=True", "teacher_scoring=prefill"],
    ),
    (
        "distill_coef_negative",
        ["algorithm.distill.coef=-1"],
        ["algorithm.distill.coef=-1.0", "[0.0, inf]"],
    ),
    ("rollout_n_zero", ["worker.rollout.n=0"], ["worker.rollout.n=0", "[1, inf]"]),
    (
        "temperature_zero",
        ["worker.rollout.temperature=0"],
        ["worker.rollout.temperature=0.0", "(0.0, inf]"],
    ),
    ("top_p_zero", ["worker.rollout.top_p=0"], ["worker.rollout.top_p=0.0", "(0.0, 1.0]"]),
    (
        "unknown_key",
        ["worker.rollout.not_a_key=1"],
        [
            "worker.rollout.not_a_key",
            "valid keys under 'worker.rollout'",
            *[f.name for f in dataclasses.fields(type(PPOConfig().worker.rollout))],
        ],
    ),
    (
        "unknown_nested_key",
        [f"{GUIDANCE}.lamm=0.3"],
        [f"{GUIDANCE}.lamm", f"valid keys under '{GUIDANCE}'", "lam_schedule", "mix_num_samples"],
    ),
    (
        "unknown_top_level_key",
        ["bogus.x=1"],
        ["'bogus", "<root>", "algorithm", "data", "trainer", "worker"],
    ),
    ("wrong_type", ["worker.rollout.n=abc"], ["worker.rollout.n", "abc"]),
    ("zero_replicas", ["worker.rollout.num_replicas=0"], ["worker.rollout.num_replicas=0"]),
    (
        "more_guidance_than_drafts",
        ["worker.rollout.num_replicas=2", f"{GUIDANCE}.num_replicas=3"],
        [f"{GUIDANCE}.num_replicas=3", "at most worker.rollout.num_replicas = 2"],
    ),
    (
        "wide_guidance",
        [f"{GUIDANCE}.tensor_parallel_size=2"],
        [f"{GUIDANCE}.tensor_parallel_size=2", "expected 1"],
    ),
    (
        "zero_bucket",
        ["worker.rollout.weight_sync_bucket_mb=0"],
        ["worker.rollout.weight_sync_bucket_mb=0"],
    ),
    ("no_equals", ["worker.rollout.n"], ["'worker.rollout.n'", "key=value"]),
    ("bad_guide_when", [f"{GUIDANCE}.guide_when=sometimes"],
     [f"{GUIDANCE}.guide_when", "sometimes", "always", "group_fails"]),
    ("prefix_in_mix_mode", [f"{GUIDANCE}.mode=mix", f"{GUIDANCE}.prefix_fraction=0.3"],
     [f"{GUIDANCE}.prefix_fraction=0.3", "mode=speculative only"]),
    ("prefix_above_one", [f"{GUIDANCE}.prefix_fraction=1.5"], [f"{GUIDANCE}.prefix_fraction", "1.5"]),
    ("bad_prefix_draw", [f"{GUIDANCE}.prefix_draw=poisson"], [f"{GUIDANCE}.prefix_draw", "fixed", "uniform"]),
    ("group_fails_without_guided", [f"{GUIDANCE}.guide_when=group_fails", f"{GUIDANCE}.guided_samples=0"],
     [f"{GUIDANCE}.guided_samples", "expected >= 1"]),
    ("group_fails_multi_turn", [f"{GUIDANCE}.enable=true", f"{GUIDANCE}.model_path=/g",
                                "worker.rollout.multi_turn.enable=true", "worker.rollout.multi_turn.tools=[lookup]",
                                f"{GUIDANCE}.guide_when=group_fails"],
     [f"{GUIDANCE}.guide_when", "one stage"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "args, fragments", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES]
)
def test_bad_input_gives_one_line_config_error(args, fragments):
    with pytest.raises(ConfigError) as err:
        load_config(args)
    msg = str(err.value)
    assert "\n" not in msg
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"


def test_missing_yaml_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as err:
        load_config([f"config={missing}"])
    msg = str(err.value)
    assert "\n" not in msg
    assert str(missing) in msg and "not found" in msg


def test_unknown_key_in_yaml_names_full_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("worker:\n  actor:\n    optim:\n      learning_rate: 1.0e-5\n")
    with pytest.raises(ConfigError) as err:
        load_config([f"config={path}"])
    msg = str(err.value)
    assert "\n" not in msg
    assert "worker.actor.optim.learning_rate" in msg
    assert "lr" in msg and "weight_decay" in msg


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ValueError):
        load_config(["worker.rollout.n=-3"])


# ---------------------------------------------------------------------------------- policy loss


def _non_default(value):
    if isinstance(value, bool):
        return not value
    if value is None:
        return 7
    if isinstance(value, int):
        return value + 3
    if isinstance(value, float):
        return value + 0.0123
    if isinstance(value, str):
        return value + "-changed"
    raise AssertionError(f"no non-default value for {value!r}")


def test_policy_loss_is_one_nested_block_read_by_the_actor():
    """The loss settings are declared once (PolicyLossConfig) and nested as worker.actor.policy_loss:
    no PolicyLossConfig field is repeated on ActorConfig."""
    loss_names = {f.name for f in dataclasses.fields(PolicyLossConfig)}
    actor_names = {f.name for f in dataclasses.fields(ActorConfig)}
    assert not loss_names & actor_names
    config = load_config(
        ["worker.actor.policy_loss.clip_ratio_high=0.4", "algorithm.importance_clamp_max=3.0"]
    )
    loss = config.worker.actor.policy_loss
    assert isinstance(loss, PolicyLossConfig)
    assert loss.clip_ratio_high == 0.4 and loss.importance_clamp_max == 3.0


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("worker.actor.clip_ratio_low=0.1", "worker.actor.policy_loss.clip_ratio_low"),
        ("worker.actor.loss_type=cppo", "worker.actor.policy_loss.loss_type"),
        ("worker.actor.importance_clamp_max=5", "algorithm.importance_clamp_max"),
        ("worker.actor.opsm_delta=0.7", "algorithm.opsm_delta"),
    ],
)
def test_flat_loss_keys_of_easyr1_habit_say_where_they_live(key, hint):
    with pytest.raises(ConfigError) as error:
        load_config([key])
    message = str(error.value)
    assert "\n" not in message and key.split("=")[0] in message and hint in message


# ---------------------------------------------------------------------------------- to_dict


def _assert_plain(value, path="config"):
    assert not isinstance(value, DictConfig | ListConfig), path
    if isinstance(value, dict):
        for key, item in value.items():
            assert isinstance(key, str), f"{path}.{key}"
            _assert_plain(item, f"{path}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _assert_plain(item, f"{path}[{i}]")
    else:
        assert value is None or isinstance(value, bool | int | float | str), (path, value)


def test_to_dict_is_plain_and_round_trips(example_yaml):
    config = load_config(
        [
            f"config={example_yaml}",
            f"{GUIDANCE}.enable=true",
            f"{GUIDANCE}.model_path=/models/guide",
            f"{GUIDANCE}.lam=0.7",
            f"{GUIDANCE}.sampling_overrides={{temperature: 0.5}}",
            "worker.rollout.val_override_config={n: 1}",
            "worker.actor.optim.betas=[0.8,0.95]",
            "algorithm.opsm_delta=0.1",
        ]
    )
    data = to_dict(config)
    assert type(data) is dict
    _assert_plain(data)
    assert set(data) == {"data", "worker", "algorithm", "trainer", "async_training"}
    assert data["worker"]["rollout"]["offpolicy_guidance"]["lam"] == 0.7
    assert data["worker"]["rollout"]["offpolicy_guidance"]["sampling_overrides"] == {
        "temperature": 0.5
    }
    assert data["algorithm"]["tis_level"] == "token"
    assert list(data["worker"]["actor"]["optim"]["betas"]) == [0.8, 0.95]
    again = load_config(overrides=data)
    assert again == config
    assert to_dict(again) == data


def test_to_dict_round_trips_defaults():
    config = load_config()
    assert load_config(overrides=to_dict(config)) == config


def test_responses_must_split_evenly_over_the_workers():
    # 3 prompts x n=5 = 15 responses over 1 x 2 = 2 workers: refused before any work
    args = ["data.rollout_batch_size=3", "worker.rollout.n=5", "trainer.n_gpus_per_node=2"]
    with pytest.raises(ConfigError, match=r"data\.rollout_batch_size.*15 responses.*2 workers"):
        load_config(args)
    assert load_config(["data.rollout_batch_size=4", *args[1:]]).data.rollout_batch_size == 4


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["data.train_files=embedded://arithmetic@train"], "arithmetic"),
        (["data.train_files=math.jsonl"], "math"),
        (
            ["data.train_files=embedded://arithmetic@train", "worker.reward.reward_function=math"],
            "math",
        ),
    ],
)
def test_reward_function_default_follows_the_data(args, expected):
    assert load_config(args).worker.reward.reward_function == expected


def test_replica_counts_resolve_in_the_post_init_pass():
    """CPU: one draft replica and one guidance engine per draft replica; with dedicated guidance
    GPUs, one engine per dedicated GPU (2 nodes x 1), never more than the draft replicas.
    (trainer.device=cpu: the same on a machine with GPUs.)"""
    auto = load_config(["trainer.device=cpu"])
    assert (
        auto.worker.rollout.num_replicas == 1
        and auto.worker.rollout.offpolicy_guidance.num_replicas == 1
    )
    dedicated = load_config(["trainer.device=cpu", "trainer.nnodes=2",
                             "worker.rollout.num_replicas=4", f"{GUIDANCE}.n_gpus_per_node=1"])  # fmt: skip
    assert dedicated.worker.rollout.offpolicy_guidance.num_replicas == 2
    capped = load_config(
        ["trainer.device=cpu", "trainer.nnodes=2", f"{GUIDANCE}.n_gpus_per_node=3"]
    )  # 6 GPUs, 1 draft replica
    assert capped.worker.rollout.offpolicy_guidance.num_replicas == 1


def test_more_draft_replicas_than_gpus_are_refused_in_one_line():
    """On GPUs a draft replica holds a GPU (tensor_parallel_size of them): more replicas than
    that would wait forever for a placement. On CPU the replicas share the cores: any number."""
    gpus = ["trainer.device=cuda", "trainer.nnodes=2", "trainer.n_gpus_per_node=2"]  # 4 GPUs
    assert load_config([*gpus]).worker.rollout.num_replicas == 4  # auto: one per GPU
    assert load_config([*gpus, "worker.rollout.num_replicas=4"]).worker.rollout.num_replicas == 4
    with pytest.raises(ConfigError) as err:
        load_config([*gpus, "worker.rollout.num_replicas=5"])
    assert str(err.value) == (
        "worker.rollout.num_replicas=5 is not valid; expected at most 4: trainer.nnodes x "
        "trainer.n_gpus_per_node = 4 GPUs, one draft engine per GPU (more would wait forever for "
        "a GPU placement)"
    )
    cpu = ["trainer.device=cpu", "trainer.n_gpus_per_node=2", "worker.rollout.num_replicas=5"]
    assert load_config(cpu).worker.rollout.num_replicas == 5


def test_draft_gpus_of_their_own_give_one_replica_each():
    """`worker.rollout.n_gpus_per_node: D`: one draft replica per dedicated slot (nnodes x D), on
    GPUs and on CPU alike, the guidance one per replica unless it has slots of its own; more
    replicas than slots, or a negative D, are refused in one line."""
    gpus = ["trainer.device=cuda", "trainer.nnodes=2", "trainer.n_gpus_per_node=4"]
    own = load_config([*gpus, "worker.rollout.n_gpus_per_node=2"])
    assert own.worker.rollout.num_replicas == 4  # 2 nodes x 2, not the 8 ranks' GPUs
    assert own.worker.rollout.offpolicy_guidance.num_replicas == 4
    cpu = load_config(["trainer.device=cpu", "trainer.nnodes=2", "worker.rollout.n_gpus_per_node=1",
                       f"{GUIDANCE}.n_gpus_per_node=1"])  # fmt: skip
    assert cpu.worker.rollout.num_replicas == 2
    assert cpu.worker.rollout.offpolicy_guidance.num_replicas == 2
    with pytest.raises(ConfigError) as err:
        load_config([*gpus, "worker.rollout.n_gpus_per_node=2", "worker.rollout.num_replicas=5"])
    assert str(err.value) == (
        "worker.rollout.num_replicas=5 is not valid; expected at most trainer.nnodes x "
        "worker.rollout.n_gpus_per_node = 4 (one draft engine per dedicated GPU)"
    )
    with pytest.raises(ConfigError, match=r"^worker\.rollout\.n_gpus_per_node=-1 is not valid"):
        load_config(["worker.rollout.n_gpus_per_node=-1"])


# ---------------------------------------------------------------------------------- derived keys


def _nested(key: str, value) -> dict:
    out: dict = {}
    node = out
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return out


DERIVED = [(key, source, value) for key, source, value in PPOConfig().derived_keys()]


@pytest.mark.parametrize(("key", "source", "value"), DERIVED, ids=[d[0] for d in DERIVED])
def test_every_derived_key_set_by_hand_is_used_when_it_agrees_and_refused_when_not(
    key, source, value
):
    """Each derived key copies one owner key: a hand-set value equal to the owner's runs as set;
    a different one is refused in one line that names both keys (never silently replaced)."""
    same = load_config([], overrides=_nested(key, value))
    parent, _, leaf = key.rpartition(".")
    assert getattr(dataclasses_get(same, parent), leaf) == value
    other = _non_default(value)
    with pytest.raises(ConfigError) as error:
        load_config([], overrides=_nested(key, other))
    message = str(error.value)
    assert "\n" not in message and key in message and source.split(" ")[0] in message


def dataclasses_get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("algorithm.tis_level", "sequence"),
        ("worker.rollout.num_replicas", 1),
        ("worker.rollout.offpolicy_guidance.num_replicas", 1),
        ("worker.reward.reward_function", "math"),
        ("trainer.save_checkpoint_path", "/tmp/somewhere"),
        ("worker.actor.optim.training_steps", 17),
    ],
)
def test_auto_keys_set_by_hand_keep_the_users_value(key, value):
    """Keys whose default is 'auto' (filled by post_init or the trainer) keep a value the user set."""
    config = load_config([], overrides=_nested(key, value))
    parent, _, leaf = key.rpartition(".")
    assert getattr(dataclasses_get(config, parent), leaf) == value


def test_derived_keys_cover_every_auto_field_docstring():
    """Every field documented 'auto: <owner>' is in derived_keys (filled and checked there)."""
    import verl.tools.docs as docs
    from verl.trainer.config import AlgorithmConfig, DataConfig, TrainerConfig
    from verl.workers.rollout.config import OffPolicyGuidanceConfig, RolloutConfig

    blocks = {"worker.actor": ActorConfig, "worker.actor.policy_loss": PolicyLossConfig,
              "worker.rollout": RolloutConfig, "worker.rollout.offpolicy_guidance": OffPolicyGuidanceConfig,
              "algorithm": AlgorithmConfig, "data": DataConfig, "trainer": TrainerConfig}  # fmt: skip
    auto = {f"{prefix}.{name}" for prefix, cls in blocks.items()
            for name, doc in docs.field_docs(cls).items() if doc.startswith("auto: ")}  # fmt: skip
    assert auto and auto <= {key for key, _, _ in DERIVED}


def test_async_training_corrects_stale_samples_with_importance_weights():
    """Staleness >= 1 resolves tis_level auto to token even without guidance (π_old/μ corrects
    the older weights); staleness 0 leaves the synchronous defaults alone."""
    stale = load_config(["async_training.staleness=2"])
    assert stale.algorithm.tis_level == "token" and stale.uses_importance_weights
    assert load_config(["async_training.staleness=0"]).algorithm.tis_level == "none"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["async_training.staleness=-1"], "async_training.staleness=-1 is not valid"),
        (["async_training.staleness=1", "algorithm.tis_level=none"],
         "algorithm.tis_level='none' is not valid; async_training.staleness=1 trains on samples of older weights"),
        (["async_training.staleness=1", "trainer.device=cuda"],
         "worker.rollout.free_cache_engine=True is not valid; with async_training.staleness=1 the draft engine"),
        (["async_training.staleness=1", "trainer.val_only=true"],
         "async_training.staleness=1 is not valid; trainer.val_only=true trains nothing"),
    ],
)  # fmt: skip
def test_async_settings_that_cannot_run_ahead_are_refused_in_one_line(args, message):
    with pytest.raises(ConfigError) as refused:
        load_config(args)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_the_async_overlay_loads_on_the_guided_example():
    config = load_config(["config=examples/grpo_guided.yaml", "config=configs/async.yaml"])
    assert config.async_training.staleness == 1 and not config.worker.rollout.free_cache_engine
    assert config.algorithm.tis_level == "token"
