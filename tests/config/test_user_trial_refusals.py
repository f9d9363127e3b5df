"""Refusals added after a user trial: the read-only copy of algorithm.rollout_correction, string keys given a
number, and image sizes the model cannot take; each message names the key, the value and the fix."""

from __future__ import annotations

import pytest

from omnirl_async.config import ConfigError, load_config
from omnirl_async.config.loader import to_yaml
from omnirl_async.config.model import EMBEDDED_PIXEL_STEP, pixel_step

COPY = "actor_rollout_ref.actor.rollout_correction"
READ_ONLY = (f"is refused: `{COPY}` is a read-only copy of `algorithm.rollout_correction` (it follows that section, "
             "which is what the learner reads)")


@pytest.mark.parametrize("override, message", [
    (f"{COPY}.rollout_is=token", f"`{COPY}.rollout_is` = 'token' {READ_ONLY}; set "
                                 "`algorithm.rollout_correction.rollout_is=token` instead (no `+`)."),
    (f"+{COPY}.rollout_is=token", f"`{COPY}.rollout_is` = 'token' {READ_ONLY}; set "
                                  "`algorithm.rollout_correction.rollout_is=token` instead (no `+`)."),
    (f"+{COPY}.bypass_mode=true", f"`{COPY}.bypass_mode` = true {READ_ONLY}; set "
                                  "`algorithm.rollout_correction.bypass_mode=true` instead (no `+`)."),
    (f"{COPY}={{rollout_is: sequence}}", f"`{COPY}.rollout_is` = 'sequence' {READ_ONLY}; set "
                                         "`algorithm.rollout_correction.rollout_is=sequence` instead (no `+`)."),
    (f"+{COPY}.bogus=1", f"`{COPY}.bogus` = 1 {READ_ONLY}; and `algorithm.rollout_correction.bogus` is not a known "
                         "config key."),
    (f"{COPY}.bogus=1", f"`{COPY}.bogus` = 1 {READ_ONLY}; and `algorithm.rollout_correction.bogus` is not a known "
                        "config key."),
    (f"{COPY}=null", f"`{COPY}` = null {READ_ONLY}; leave it out and set the keys under `algorithm.rollout_correction` "
                     "instead."),
])
def test_the_rollout_correction_copy_is_read_only(override, message):
    with pytest.raises(ConfigError) as err:
        load_config([override])
    assert str(err.value).startswith(message), f"\n got: {err.value}\nwant: {message}"
    assert f"+{COPY}" not in str(err.value)  # never the advice to add the key with `+`


def test_the_copy_follows_its_section_and_a_written_out_copy_loads(tmp_path):
    cfg = load_config([f"{COPY}=${{algorithm.rollout_correction}}", "algorithm.rollout_correction.rollout_is=token"])
    assert cfg.actor_rollout_ref.actor.rollout_correction.rollout_is == "token"
    # a run's resolved_config.yaml holds the copy written out: it loads (eval --run) while it matches
    (tmp_path / "resolved_config.yaml").write_text(to_yaml(load_config(["trainer.logger=[console]"])))
    run = load_config([], config_name="resolved_config", config_dir=tmp_path)
    assert run.actor_rollout_ref.actor.rollout_correction == run.algorithm.rollout_correction
    with pytest.raises(ConfigError, match=r"written out .* link it back with "
                                          rf"`'{COPY}=\$\{{algorithm.rollout_correction\}}'`"):
        load_config(["algorithm.rollout_correction.rollout_is=sequence"], config_name="resolved_config",
                    config_dir=tmp_path)
    fixed = load_config(["algorithm.rollout_correction.rollout_is=sequence",
                         f"{COPY}=${{algorithm.rollout_correction}}"],
                        config_name="resolved_config", config_dir=tmp_path)
    assert fixed.actor_rollout_ref.actor.rollout_correction.rollout_is == "sequence"


@pytest.mark.parametrize("key", ["reward.custom_reward_function.name", "trainer.v1.sampler.custom_sampler.name",
                                 "actor_rollout_ref.model.lora_adapter_path", "trainer.resume_from_path"])
@pytest.mark.parametrize("value, shown, kind", [("nan", "nan", "a number"), ("5", "5", "an integer"),
                                                ("true", "True", "a bool")])
def test_a_string_key_given_a_number_says_to_quote_it(key, value, shown, kind):
    others = {"reward.custom_reward_function.name": ["reward.custom_reward_function.path=/some/file.py"],
              "trainer.v1.sampler.custom_sampler.name": ["trainer.v1.sampler.custom_sampler.path=/x.py"]}.get(key, [])
    leaf = key.rpartition(".")[2]
    with pytest.raises(ConfigError) as err:
        load_config([*others, f"{key}={value}"])
    want = (f"`{key}` = {shown} is not a string (an unquoted {value} is read as {kind}); quote it: "
            f"`'{key}=\"{value}\"'` on the command line, `{leaf}: \"{value}\"` in YAML.")
    assert str(err.value) == want


def test_a_quoted_name_is_a_string():
    cfg = load_config(["reward.custom_reward_function.path=/some/file.py", 'reward.custom_reward_function.name="nan"'])
    assert cfg.reward.custom_reward_function.name == "nan"


@pytest.mark.parametrize("pipeline", ["actor_rollout_ref.rollout.pipeline",
                                      "actor_rollout_ref.rollout.val_kwargs.pipeline"])
@pytest.mark.parametrize("key", ["height", "width"])
def test_an_image_size_the_model_cannot_take_is_refused_at_start_up(pipeline, key):
    with pytest.raises(ConfigError) as err:
        load_config([f"{pipeline}.{key}=33"])
    assert str(err.value) == (f"`{pipeline}.{key}` = 33 must be a multiple of 4 for the model "
                              "`actor_rollout_ref.model.path` = 'embedded:shapes' (its VAE scale x patch); use 32 or "
                              "36.")
    load_config([f"{pipeline}.{key}=36"])


def test_the_size_step_follows_the_model():
    with pytest.raises(ConfigError, match=r"`actor_rollout_ref.rollout.pipeline.height` = 36 must be a multiple of 8 "
                                          r"for the model `actor_rollout_ref.model.path` = 'embedded:tiny-sd3'"):
        load_config(["actor_rollout_ref.model.path=embedded:tiny-sd3", "actor_rollout_ref.rollout.pipeline.height=36"])


def test_the_embedded_steps_are_the_models_own():
    """The config's table and its reading of a pipeline folder agree with the models' ``latent_grid`` check."""
    from omnirl_async.models.latent_codec import folder_latent_shape
    from omnirl_async.models.resolve import EMBEDDED_MODELS, resolve_model_path

    assert set(EMBEDDED_PIXEL_STEP) == set(EMBEDDED_MODELS)
    for name, step in EMBEDDED_PIXEL_STEP.items():
        folder = resolve_model_path(f"embedded:{name}")
        assert pixel_step(str(folder)) == step, name
        folder_latent_shape(folder, step * 4, step * 4)
        with pytest.raises(ValueError, match="positive multiple"):
            folder_latent_shape(folder, step * 4 + step // 2, step * 4)
