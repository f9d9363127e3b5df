"""Algorithm presets: `model.algorithm=X` (and `rollout.algo.sde_type`) set X's documented defaults, unless set.

Precedence under test: schema < trainer YAML < preset < recipe YAML < command line; validation after presets.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
import warnings

import pytest
import torch

from omnirl_async.cli import main as cli_main
from omnirl_async.config import ConfigError, DiffusionTrainerConfig, load_config
from omnirl_async.config import presets
from omnirl_async.config.loader import default_config_dir, to_yaml
from omnirl_async.config.presets import ALGORITHM, SDE_TYPE, applied_presets, is_user_set
from omnirl_async.config.validate import _check_rule, type_at

ALG = "actor_rollout_ref.model.algorithm"
NOISE = "actor_rollout_ref.rollout.algo.noise_level"
SDE = "actor_rollout_ref.rollout.algo.sde_type"
CLIP = "actor_rollout_ref.actor.diffusion_loss.clip_ratio"
GSTD = "algorithm.global_std"
TT = "algorithm.trainer_type"
STATES = "actor_rollout_ref.model.policy_state_adapters"
RADAPTER = "actor_rollout_ref.rollout.rollout_adapter"

#: The documented defaults each choice must produce at load (written out here, not read from the table).
EXPECTED: dict[str, dict[str, object]] = {
    f"{ALG}=flow_grpo": {NOISE: 0.7, SDE: "sde", CLIP: 1e-4, GSTD: True, TT: "policy_gradient"},
    f"{ALG}=dance_grpo": {SDE: "dance", NOISE: 0.3, GSTD: False, CLIP: 1e-4, TT: "policy_gradient"},
    f"{ALG}=grpo_guard": {CLIP: 2e-6, GSTD: False, NOISE: 0.7, SDE: "sde"},
    f"{ALG}=flow_dppo": {"actor_rollout_ref.actor.diffusion_loss.kl_mask_threshold": 1e-5,
                         "actor_rollout_ref.actor.diffusion_loss.add_kl_coefficient": True,
                         "algorithm.adv_estimator": "flow_dppo", "actor_rollout_ref.actor.diffusion_loss.loss_mode":
                         "flow_dppo", TT: "policy_gradient"},
    f"{SDE}=cps": {NOISE: 0.8, CLIP: 1e-5, GSTD: True},
    f"{SDE}=dance": {NOISE: 0.3},
    f"{ALG}=diffusion_nft": {TT: "direct_preference", STATES: ["default", "old"], RADAPTER: "old", NOISE: 0.0,
                             "algorithm.old_policy_decay_schedule": "linear_to_0_5",
                             "actor_rollout_ref.actor.diffusion_loss.mix_beta": 1.0},
    f"{ALG}=dpo": {TT: "direct_preference", "algorithm.paired_preference": True, NOISE: 0.0},
    f"{ALG}=awm": {TT: "direct_preference", NOISE: 0.0},
}


def _get(cfg, key):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return list(node) if isinstance(node, (list, tuple)) else node


def _check(cfg, expected):
    for key, want in expected.items():
        got = _get(cfg, key)
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-12, abs=0), (key, got, want)
        else:
            assert got == want, (key, got, want)


@pytest.mark.parametrize("mode", ["sync", "separate_async"])
@pytest.mark.parametrize("choice", list(EXPECTED))
def test_each_preset_gives_its_documented_values_at_load(choice, mode):
    cfg = load_config([f"trainer.v1.trainer_mode={mode}", choice])
    _check(cfg, EXPECTED[choice])


def test_the_table_covers_every_expected_choice_and_nothing_else():
    table = {f"{key}={choice}" for key, t in presets.STAGES for choice in t}
    assert table == {c for c in EXPECTED if c != f"{ALG}=flow_grpo"}
    assert not applied_presets(load_config()), "the shipped default (flow_grpo on sde) applies no preset"


# ------------------------------------------------------------------------------------ what you set wins
@pytest.mark.parametrize("overrides, expected", [
    # the same value as the trainer YAML, but written by you: kept (the rule is where a key is set, not its value)
    ([f"{ALG}=grpo_guard", f"{CLIP}=1e-4"], {CLIP: 1e-4, GSTD: False}),
    ([f"{ALG}=grpo_guard", f"{GSTD}=true"], {CLIP: 2e-6, GSTD: True}),
    # a section written as a mapping sets only its own keys (Hydra merges it)
    ([f"{ALG}=grpo_guard", "actor_rollout_ref.actor.diffusion_loss={clip_ratio: 0.001}"], {CLIP: 1e-3}),
    ([f"{ALG}=grpo_guard", "actor_rollout_ref.actor.diffusion_loss={adv_clip_max: 3.0}"], {CLIP: 2e-6}),
    ([f"++{CLIP}=3e-6", f"{ALG}=grpo_guard"], {CLIP: 3e-6}),
    # dance_grpo with your own step: the step's preset follows the step you chose
    ([f"{ALG}=dance_grpo", f"{SDE}=sde"], {SDE: "sde", NOISE: 0.7, GSTD: False}),
    ([f"{ALG}=dance_grpo", f"{SDE}=cps"], {SDE: "cps", NOISE: 0.8, CLIP: 1e-5, GSTD: False}),
    ([f"{ALG}=dance_grpo", f"{NOISE}=0.5"], {SDE: "dance", NOISE: 0.5}),
    # the algorithm's preset wins over the step's on a key both set
    ([f"{ALG}=grpo_guard", f"{SDE}=cps"], {CLIP: 2e-6, NOISE: 0.8, GSTD: False}),
    ([f"{SDE}=cps", f"{CLIP}=1e-4"], {CLIP: 1e-4, NOISE: 0.8}),
    # the step presets are for the policy-gradient trainer type: direct preference keeps its ODE rollouts
    ([f"{ALG}=awm", f"{SDE}=cps"], {NOISE: 0.0, CLIP: 1e-4, TT: "direct_preference"}),
    ([f"{ALG}=diffusion_nft", f"{NOISE}=0.5", "actor_rollout_ref.actor.diffusion_loss.mix_beta=0.3"],
     {NOISE: 0.5, "actor_rollout_ref.actor.diffusion_loss.mix_beta": 0.3, RADAPTER: "old"}),
    ([f"{ALG}=dpo", "actor_rollout_ref.rollout.n=2"], {"algorithm.paired_preference": True}),
])
def test_a_key_set_on_the_command_line_wins_over_the_preset(overrides, expected):
    _check(load_config(overrides), expected)


def _config_dir(tmp_path, **recipes: str):
    shutil.copy(default_config_dir() / "diffusion_trainer.yaml", tmp_path / "diffusion_trainer.yaml")
    for name, text in recipes.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    return tmp_path


GUARD_RECIPE = """\
defaults:
  - diffusion_trainer
  - _self_
actor_rollout_ref:
  model:
    algorithm: grpo_guard
  actor:
    diffusion_loss:
      clip_ratio: 1.0e-4      # the trainer YAML's value, written again: the recipe's choice
"""


def test_a_key_set_in_a_recipe_wins_over_the_preset(tmp_path):
    cdir = _config_dir(tmp_path, guard=GUARD_RECIPE,
                       child="defaults:\n  - guard\n  - _self_\nalgorithm:\n  norm_adv_by_std_in_grpo: false\n")
    cfg = load_config(config_name="guard", config_dir=cdir)
    _check(cfg, {CLIP: 1e-4, GSTD: False, "algorithm.adv_estimator": "grpo_guard"})
    report = applied_presets(cfg)
    assert [s.key for s in report.applied] == [GSTD]
    assert [(s.key, s.yours) for s in report.kept] == [(CLIP, 1e-4)]
    # a recipe that includes the recipe: what either file writes is yours
    _check(load_config(config_name="child", config_dir=cdir), {CLIP: 1e-4, GSTD: False,
                                                                "algorithm.norm_adv_by_std_in_grpo": False})
    # the command line wins over the recipe, and the preset still fills what neither sets
    _check(load_config([f"{CLIP}=5e-6"], config_name="guard", config_dir=cdir), {CLIP: 5e-6, GSTD: False})
    # the trainer YAML itself (which writes clip_ratio 1e-4) is not "yours": the preset replaces its values
    only = _config_dir(tmp_path, only="defaults:\n  - diffusion_trainer\n  - _self_\n"
                                      "actor_rollout_ref:\n  model:\n    algorithm: grpo_guard\n")
    _check(load_config(config_name="only", config_dir=only), {CLIP: 2e-6, GSTD: False})


def test_a_saved_resolved_config_is_all_yours(tmp_path):
    """`resolved_config.yaml` (every key written) composes back to the very run: no preset changes it."""
    cfg = load_config([f"{ALG}=dance_grpo"])
    (tmp_path / "resolved_config.yaml").write_text("defaults:\n  - diffusion_trainer_schema\n  - _self_\n"
                                                   + to_yaml(cfg))
    again = load_config(config_name="resolved_config", config_dir=tmp_path)
    assert to_yaml(again) == to_yaml(cfg)
    assert not applied_presets(again).applied
    switched = load_config([f"{ALG}=grpo_guard"], config_name="resolved_config", config_dir=tmp_path)
    _check(switched, {CLIP: 1e-4, GSTD: False, SDE: "dance"})  # the saved values are yours
    assert {s.key for s in applied_presets(switched).kept} == {CLIP, GSTD, NOISE}  # NOISE: sde_type=dance


@pytest.mark.parametrize("name, expected", [
    ("diffusion_nft", {TT: "direct_preference", STATES: ["default", "old"], RADAPTER: "old", NOISE: 0.0,
                       "algorithm.old_policy_decay_schedule": "linear_to_0_5", "algorithm.timestep_fraction": 0.5,
                       "actor_rollout_ref.actor.diffusion_loss.mix_beta": 1.0,
                       "actor_rollout_ref.actor.diffusion_loss.ref_kl_coef": 0.0,
                       "trainer.experiment_name": "tiny_diffusion_nft"}),
    ("dpo", {TT: "direct_preference", "algorithm.paired_preference": True, NOISE: 0.0,
             "actor_rollout_ref.actor.optim.lr": 1e-4, "actor_rollout_ref.actor.diffusion_loss.dpo_beta": 2000.0}),
    ("awm", {TT: "direct_preference", NOISE: 0.0, STATES: ["default", "old"], "algorithm.old_policy_decay": 0.9,
             "actor_rollout_ref.actor.diffusion_loss.old_kl_coef": 0.01, "algorithm.timestep_fraction": 0.5}),
])
@pytest.mark.parametrize("mode", ["sync", "separate_async"])
def test_the_recipes_still_give_their_settings(name, expected, mode):
    _check(load_config([f"trainer.v1.trainer_mode={mode}"], config_name=name), expected)


# ------------------------------------------------------------------------------------ flow_dppo
@pytest.mark.parametrize("mode", ["sync", "separate_async"])
def test_flow_dppo_loads_and_validates(mode):
    cfg = load_config([f"trainer.v1.trainer_mode={mode}", f"{ALG}=flow_dppo", "actor_rollout_ref.rollout.n=2"])
    assert cfg.algorithm.adv_estimator == "flow_dppo"
    assert cfg.actor_rollout_ref.actor.diffusion_loss.loss_mode == "flow_dppo"
    with pytest.raises(ConfigError, match=r"`actor_rollout_ref\.rollout\.n` = 1: group advantages"):
        load_config([f"{ALG}=flow_dppo", "actor_rollout_ref.rollout.n=1"])


def test_flow_dppo_advantage_is_the_flow_grpo_group_advantage():
    from omnirl_async.algos.advantage import compute_flow_grpo_outcome_advantage, get_diffusion_adv_estimator_fn

    fn = get_diffusion_adv_estimator_fn("flow_dppo")
    assert fn is compute_flow_grpo_outcome_advantage
    rewards = torch.tensor([0.1, 0.5, 0.9, 0.2, 0.2, 0.7])
    adv, _ = fn(rewards, [0, 0, 0, 1, 1, 1], global_std=True)
    centred = rewards - torch.tensor([0.5, 0.5, 0.5, 0.3666667, 0.3666667, 0.3666667])
    assert torch.allclose(adv, centred / (rewards.std(correction=0) + 1e-4), atol=1e-5)


# ------------------------------------------------------------------------------------ validation after presets
def test_validation_sees_the_preset_values_and_names_the_preset():
    # the cross-key check of the old adapter: lora_rank=0 cannot hold the preset's second adapter
    with pytest.raises(ConfigError) as err:
        load_config([f"{ALG}=diffusion_nft", "actor_rollout_ref.model.lora_rank=0"])
    msg = str(err.value)
    assert msg.startswith(f"`{STATES}` holds 'old', a second LoRA adapter"), msg
    assert f"comes from the preset of `{ALG}=diffusion_nft`; set `{STATES}` yourself" in msg, msg
    # you overrode the preset's trainer type: the refusal of the preset's adapters says which override did it
    with pytest.raises(ConfigError) as err:
        load_config([f"{ALG}=diffusion_nft", f"{TT}=policy_gradient"])
    msg = str(err.value)
    assert msg.startswith(f"`{STATES}` = ['default', 'old'] is refused with `{TT}` = policy_gradient"), msg
    assert f"you set `{TT}=policy_gradient` (the preset's: direct_preference)" in msg, msg
    # cps's preset clip keeps the cps warning quiet; your own large clip still warns
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config([f"{SDE}=cps"])
    with pytest.warns(UserWarning, match="sde_type=cps uses unscaled log-probs"):
        load_config([f"{SDE}=cps", f"{CLIP}=0.01"])


# ------------------------------------------------------------------------------------ omnirl-async config
def test_the_config_command_shows_the_preset_applied(capsys):
    assert cli_main(["config", f"{ALG}=grpo_guard", f"{GSTD}=true"]) == 0
    out = capsys.readouterr().out
    head = [line for line in out.splitlines() if line.startswith("#")]
    assert head[0].startswith("# Presets (omnirl_async/config/presets.py)"), out
    assert f"#   preset of {ALG}=grpo_guard  (ALGORITHMS.md \"GRPO-Guard\"" in head[1], head
    assert f"#     applied  {CLIP}=2e-06" in head, head
    assert f"#     yours    {GSTD}=true  (the preset's: false)" in head, head
    assert "clip_ratio: 2.0e-06" in out and "global_std: true" in out
    # the shipped default applies none: plain YAML
    assert cli_main(["config"]) == 0
    assert not capsys.readouterr().out.startswith("#")
    # a recipe: its own keys are listed as yours
    assert cli_main(["config", "--config-name", "diffusion_nft"]) == 0
    out = capsys.readouterr().out
    assert f"#   preset of {ALG}=diffusion_nft" in out and f"#     applied  {TT}=direct_preference" in out, out


def test_to_yaml_stays_plain_yaml_unless_asked():
    cfg = load_config([f"{ALG}=dance_grpo"])
    assert not to_yaml(cfg).startswith("#")
    assert to_yaml(cfg, show_presets=True).startswith("# Presets")


# ------------------------------------------------------------------------------------ the table itself
def _schema_default(key: str):
    parent, _, name = key.rpartition(".")
    tp = type_at(DiffusionTrainerConfig, parent)
    return {f.name: f for f in dataclasses.fields(tp)}[name]


@pytest.mark.parametrize("trigger, choice, preset",
                         [(k, c, p) for k, t in presets.STAGES for c, p in t.items()],
                         ids=[f"{k.rsplit('.', 1)[-1]}={c}" for k, t in presets.STAGES for c in t])
def test_a_preset_sets_only_schema_keys_with_values_their_rule_allows(trigger, choice, preset):
    trig = _schema_default(trigger)
    _check_rule(choice, trig.metadata["rule"], trigger)  # the choice itself is one the trigger key takes
    assert preset.source.startswith(("ALGORITHMS.md", "docs/")), preset.source
    for key, value in preset.values.items():
        tp = type_at(DiffusionTrainerConfig, key)
        assert tp is not None, f"{trigger}={choice} sets `{key}`, which is not a config key"
        assert not dataclasses.is_dataclass(tp), f"{trigger}={choice} sets the section `{key}`; set its keys"
        if tp in (int, float, bool, str):
            assert isinstance(value, tp) and (tp is not int or not isinstance(value, bool)), (key, value, tp)
        rule = _schema_default(key).metadata.get("rule")
        if rule is not None:
            _check_rule(value, rule, key)


def test_user_set_is_decided_by_key_path():
    assert is_user_set("a.b.c", ["a.b.c"])
    assert is_user_set("a.b.c", ["a.b"])         # a section replaced or deleted above it
    assert is_user_set("a.b", ["a.b.0"])          # an element below it
    assert not is_user_set("a.b.c", ["a.b.cd", "a.bb", "x"])


def test_user_set_keys_reads_the_overrides_and_the_recipe_files(tmp_path):
    from hydra import initialize_config_dir

    from omnirl_async.config.loader import register_configs, user_set_keys

    cdir = _config_dir(tmp_path, guard=GUARD_RECIPE)
    register_configs()
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(cdir), version_base="1.3"):
        keys = user_set_keys("guard", ["data.train_batch_size=4", "~trainer.logger",
                                       "algorithm.rollout_correction={rollout_is: token, bypass_mode: true}"])
    assert keys == {ALG, CLIP, "data.train_batch_size", "trainer.logger", "algorithm.rollout_correction.rollout_is",
                    "algorithm.rollout_correction.bypass_mode"}


def test_user_set_keys_follow_a_recipe_rewritten_between_two_loads(tmp_path):
    """The keys the recipe files write are cached per composition; rewriting a file (same size, at once), switching
    a config group or adding a file to the group is seen at the next load."""
    cdir = _config_dir(tmp_path, guard=GUARD_RECIPE)
    kept = applied_presets(load_config(config_name="guard", config_dir=cdir)).kept
    assert [(s.key, s.yours) for s in kept] == [(CLIP, 1e-4)]
    # the same number of bytes, written at once: the recipe now writes adv_clip_max, and the preset sets clip_ratio
    (cdir / "guard.yaml").write_text(GUARD_RECIPE.replace("clip_ratio: 1.0e-4", "adv_clip_max: 5.00"))
    assert (cdir / "guard.yaml").stat().st_size == len(GUARD_RECIPE)
    cfg = load_config(config_name="guard", config_dir=cdir)
    _check(cfg, {CLIP: 2e-6, "actor_rollout_ref.actor.diffusion_loss.adv_clip_max": 5.0})
    assert CLIP in [s.key for s in applied_presets(cfg).applied]
    # a config group: the choice decides which file's keys are the user's
    (cdir / "loss").mkdir()
    (cdir / "loss" / "tight.yaml").write_text("# @package actor_rollout_ref.actor.diffusion_loss\n"
                                              "clip_ratio: 3.0e-6\n")
    (cdir / "grouped.yaml").write_text("defaults:\n  - diffusion_trainer\n  - loss: tight\n  - _self_\n"
                                       "actor_rollout_ref:\n  model:\n    algorithm: grpo_guard\n")
    _check(load_config(config_name="grouped", config_dir=cdir), {CLIP: 3e-6})
    (cdir / "loss" / "plain.yaml").write_text("# @package actor_rollout_ref.actor.diffusion_loss\n"
                                              "adv_clip_max: 4.0\n")
    _check(load_config(["loss=plain"], config_name="grouped", config_dir=cdir), {CLIP: 2e-6})
    _check(load_config(["loss=tight"], config_name="grouped", config_dir=cdir), {CLIP: 3e-6})


def test_the_cache_reads_only_the_yaml_files_of_a_config_folder(tmp_path, monkeypatch):
    from omnirl_async.config import loader

    cdir = _config_dir(tmp_path, guard=GUARD_RECIPE)
    (cdir / "adapter.safetensors").write_bytes(b"\0" * 1024)  # e.g. a LoRA kept beside the recipes
    opened: list[str] = []
    real_open = open

    def spy(path, *a, **kw):
        opened.append(Path(path).name)
        return real_open(path, *a, **kw)

    monkeypatch.setattr(loader, "open", spy, raising=False)
    load_config(config_name="guard", config_dir=cdir)
    assert sorted(set(opened)) == ["diffusion_trainer.yaml", "guard.yaml"]


def test_presets_module_names_its_triggers():
    assert ALGORITHM == ALG and SDE_TYPE == SDE
