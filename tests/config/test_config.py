"""The config surface: defaults, typing, unknown keys, rules, not-built features."""

from __future__ import annotations

import pytest

from omnirl_async.cli import main as cli_main
from omnirl_async.config import ConfigError, DiffusionTrainerConfig, load_config


def test_defaults_compose_into_typed_dataclasses():
    cfg = load_config()
    assert isinstance(cfg, DiffusionTrainerConfig)
    assert cfg.trainer.use_v1 is True
    assert cfg.trainer.v1.trainer_mode == "sync"
    assert cfg.trainer.v1.sampler.max_off_policy_threshold == 1
    assert cfg.trainer.v1.sampler.max_off_policy_strategy == "wait"
    assert cfg.transfer_queue.num_data_storage_units == 2
    assert cfg.actor_rollout_ref.actor.diffusion_loss.clip_ratio == pytest.approx(1e-4)
    # interpolations resolve to the model's algorithm
    assert cfg.algorithm.adv_estimator == "flow_grpo"
    assert cfg.actor_rollout_ref.actor.diffusion_loss.loss_mode == "flow_grpo"
    # the per-actor rollout_correction mirrors algorithm.rollout_correction
    assert cfg.actor_rollout_ref.actor.rollout_correction == cfg.algorithm.rollout_correction


def test_overrides_follow_verl_key_paths():
    cfg = load_config(["actor_rollout_ref.rollout.n=8", "actor_rollout_ref.model.algorithm=mix_grpo",
                       "actor_rollout_ref.rollout.algo.sde_window_size=2",
                       "actor_rollout_ref.rollout.algo.sde_window_range=[0,5]",
                       "algorithm.rollout_correction.rollout_is=token"])
    assert cfg.actor_rollout_ref.rollout.n == 8
    assert cfg.algorithm.adv_estimator == "mix_grpo"
    assert cfg.actor_rollout_ref.actor.diffusion_loss.loss_mode == "mix_grpo"
    assert list(cfg.actor_rollout_ref.rollout.algo.sde_window_range) == [0, 5]
    assert cfg.actor_rollout_ref.actor.rollout_correction.rollout_is == "token"


@pytest.mark.parametrize("override, key, needle", [
    ("actor_rollout_ref.rollout.n=0", "actor_rollout_ref.rollout.n", "must be > 0"),
    ("actor_rollout_ref.rollout.algo.sde_type=ode", "actor_rollout_ref.rollout.algo.sde_type", "choose one of"),
    ("algorithm.timestep_fraction=1.5", "algorithm.timestep_fraction", "<= 1.0"),
    ("actor_rollout_ref.actor.diffusion_loss.loss_mode=nope", "actor_rollout_ref.actor.diffusion_loss.loss_mode",
     "flow_grpo"),
    ("algorithm.adv_estimator=nope", "algorithm.adv_estimator", "flow_grpo"),
    ("reward.reward_fn_name=nope", "reward.reward_fn_name", "jpeg_compressibility"),
    ("data.train_batch_size=abc", "data.train_batch_size", ""),
    ("buffer.sampler=lifo", "buffer.sampler", "fifo"),
    ("trainer.logger=[console,mlflow]", "trainer.logger", "mlflow"),
])
def test_bad_values_name_the_key_path(override, key, needle):
    with pytest.raises(ConfigError) as err:
        load_config([override])
    msg = str(err.value)
    assert f"`{key}" in msg, msg
    assert needle in msg, msg


def test_unknown_keys_are_rejected_with_their_path():
    with pytest.raises(ConfigError, match=r"`actor_rollout_ref\.rollout\.pipeline\.hieght`"):
        load_config(["+actor_rollout_ref.rollout.pipeline.hieght=64"])
    with pytest.raises(ConfigError, match=r"`bogus`"):
        load_config(["+bogus=1"])


def test_unknown_key_in_a_recipe_yaml_is_rejected(tmp_path):
    import shutil

    from omnirl_async.config.loader import default_config_dir

    shutil.copy(default_config_dir() / "diffusion_trainer.yaml", tmp_path / "diffusion_trainer.yaml")
    (tmp_path / "recipe.yaml").write_text("defaults:\n  - diffusion_trainer\n  - _self_\n"
                                          "trainer:\n  save_frequency: 3\n")
    with pytest.raises(ConfigError, match="save_frequency"):
        load_config(config_name="recipe", config_dir=tmp_path)


@pytest.mark.parametrize("override, needle", [
    ("trainer.v1.trainer_mode=omni_sync", "not built"),
    ("actor_rollout_ref.rollout.name=vllm_omni", "vLLM"),
    ("actor_rollout_ref.actor.strategy=fsdp", "FSDP"),
])
def test_features_not_built_yet_are_refused_loudly(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config([override])
    assert override.split("=")[0] in str(err.value)
    assert needle in str(err.value)


@pytest.mark.parametrize("overrides, needles", [
    # a preference loss with the policy-gradient trainer, and the reverse (`model.algorithm=diffusion_nft` alone
    # is valid: its preset sets the trainer type, tests/config/test_presets.py)
    (["actor_rollout_ref.actor.diffusion_loss.loss_mode=diffusion_nft"],
     ["loss_mode", "algorithm.trainer_type=direct_preference"]),
    (["actor_rollout_ref.model.algorithm=diffusion_nft", "algorithm.trainer_type=policy_gradient"],
     ["policy_state_adapters", "policy_gradient", "preset of `actor_rollout_ref.model.algorithm=diffusion_nft`",
      "you set `algorithm.trainer_type=policy_gradient`"]),
    (["algorithm.trainer_type=direct_preference"], ["'flow_grpo' is a policy-gradient loss", "diffusion_nft, dpo"]),
    # rollouts with an adapter that does not exist
    (["actor_rollout_ref.rollout.rollout_adapter=old"], ["rollout_adapter", "[default,old]"]),
    (["actor_rollout_ref.model.algorithm=diffusion_nft", "actor_rollout_ref.model.policy_state_adapters=[default]",
      "algorithm.old_policy_decay_schedule=copy"], ["rollout_adapter", "[default,old]"]),
    (["actor_rollout_ref.model.algorithm=diffusion_nft", "actor_rollout_ref.model.policy_state_adapters=[default]",
      "actor_rollout_ref.rollout.rollout_adapter=default", "algorithm.old_policy_decay_schedule=copy"],
     ["diffusion_nft mixes the trained velocity", "policy_state_adapters", "[default,old]"]),
    (["actor_rollout_ref.model.algorithm=dpo", "algorithm.paired_preference=false"],
     ["algorithm.paired_preference=true"]),
    (["algorithm.paired_preference=true"], ["only the pair-based loss (dpo)"]),
    (["actor_rollout_ref.model.algorithm=awm", "algorithm.trainer_type=direct_preference",
      "actor_rollout_ref.actor.diffusion_loss.old_kl_coef=0.1"], ["old_kl_coef", "[default,old]"]),
    (["actor_rollout_ref.model.algorithm=awm", "algorithm.trainer_type=direct_preference",
      "algorithm.rollout_correction.rollout_is=token"], ["rollout_correction.rollout_is", "no per-step"]),
    (["actor_rollout_ref.model.algorithm=awm", "algorithm.trainer_type=direct_preference",
      "actor_rollout_ref.model.policy_state_adapters=[default,new]"], ["policy_state_adapters", "distinct names"]),
    (["actor_rollout_ref.model.algorithm=awm", "algorithm.trainer_type=direct_preference",
      "actor_rollout_ref.model.policy_state_adapters=[default,old]", "actor_rollout_ref.model.lora_rank=0"],
     ["lora_rank", "second LoRA adapter"]),
])
def test_direct_preference_mismatches_are_refused_with_the_fix(overrides, needles):
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    for needle in needles:
        assert needle in str(err.value), f"{needle!r} not in: {err.value}"


def test_cross_field_rules():
    with pytest.raises(ConfigError, match="ppo_mini_batch_size"):
        load_config(["actor_rollout_ref.actor.ppo_mini_batch_size=16", "data.train_batch_size=8"])
    with pytest.raises(ConfigError, match="at least 2"):
        load_config(["actor_rollout_ref.rollout.n=1"])
    with pytest.raises(ConfigError, match="sde_window_size"):
        load_config(["actor_rollout_ref.rollout.algo.sde_window_size=20"])
    with pytest.raises(ConfigError, match="mutually exclusive"):
        load_config(["reward.custom_reward_function.path=/x.py", "reward.custom_reward_function.name=f",
                     "+reward.reward_functions={a: {name: brightness, weight: 1.0}}"])


def test_cli_reports_config_errors_with_exit_code_2(capsys):
    assert cli_main(["config", "actor_rollout_ref.rollout.n=-3"]) == 2
    assert "`actor_rollout_ref.rollout.n`" in capsys.readouterr().err
    assert cli_main(["config", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2"]) == 0
    assert "train_batch_size: 4" in capsys.readouterr().out


def test_unknown_key_without_plus_names_it_and_suggests_the_near_miss():
    with pytest.raises(ConfigError) as err:
        load_config(["actor_rollout_ref.rollout.pipeline.hieght=64"])
    msg = str(err.value)
    assert msg.startswith("`actor_rollout_ref.rollout.pipeline.hieght` is not a known config key. Did you mean one "
                          "of ['height']?"), msg


def test_cli_prints_one_line_without_traceback(capsys):
    assert cli_main(["config", "actor_rollout_ref.rollout.n=-3"]) == 2
    assert capsys.readouterr().err == "omnirl-async: `actor_rollout_ref.rollout.n` = -3 must be > 0.\n"


@pytest.mark.parametrize("override, key", [
    ("buffer.sampler=uniform", "`buffer.sampler` = 'uniform'"),
    ("buffer.samples_per_insert=1.0", "`buffer.samples_per_insert` = 1.0"),
    ("buffer.min_size_to_sample=8", "`buffer.min_size_to_sample` = 8"),
])
def test_wait_strategy_refuses_buffer_settings_it_cannot_apply(override, key):
    from omnirl_async.config.validate import ConfigError

    with pytest.raises(ConfigError, match="under `trainer.v1.trainer_mode` = separate_async") as err:
        load_config(["trainer.v1.trainer_mode=separate_async", override])
    assert key in str(err.value)
    load_config(["trainer.v1.trainer_mode=separate_async", "trainer.v1.sampler.max_off_policy_strategy=drop",
                 override])  # the drop strategy samples through the table: accepted


@pytest.mark.parametrize("override, start", [
    ("actor_rollout_ref.model.lora_init_weights=loftq",
     "`actor_rollout_ref.model.lora_init_weights` = 'loftq' is not supported (loftq quantises the base model"),
    ("algorithm.rollout_correction.rollout_is_threshold=[1,2]",
     "`algorithm.rollout_correction.rollout_is_threshold` = [1, 2]: write a single threshold as a number"),
    ("algorithm.rollout_correction.rollout_rs=seq_max_k1",
     "`algorithm.rollout_correction.rollout_rs` criterion 'seq_max_k1' is not known"),
])
def test_settings_refused_at_build_time_are_refused_at_start_up(override, start):
    with pytest.raises(ConfigError) as err:
        load_config([override])
    assert start in str(err.value)
