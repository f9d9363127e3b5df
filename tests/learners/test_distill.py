"""Distillation towards a frozen teacher (``actor.use_distill_loss``) in both learners, on real tiny-model rollouts.

The teacher is a second tiny SD3 pipeline: the policy's own base weights (teacher path = the model path: every
term is exactly 0 at init, when the LoRA adds nothing) or the same architecture built with another seed (a
positive term whose gradient moves the LoRA). Also the start-up refusals: config validation and the driver's
preflight (before Ray), and the learner's own load check.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from omnirl_async.config import ConfigError, load_config
from omnirl_async.learners.learner import Learner, _embeds_from_fields
from omnirl_async.learners.preference_learner import PreferenceLearner
from omnirl_async.models.sde import sde_step_with_logprob
from omnirl_async.models.tiny import ensure_tiny_model
from omnirl_async.trainer.input_checks import find_input_problems
from tests.learners.test_learner import _generate
from tests.learners.test_preference_learner import RECIPES

KEY = "actor_rollout_ref.actor"
TEACHER = f"{KEY}.distill_teacher_path"
SAME = "embedded:tiny-sd3"  # = actor_rollout_ref.model.path of the SMALL overrides
MODES = ("distill_kl", "distill_fm_mse")
NOISE = "actor_rollout_ref.rollout.algo.noise_level"


def _distill(teacher: str, mode: str = "distill_fm_mse", coef: float = 1.0) -> list[str]:
    return [f"{KEY}.use_distill_loss=true", f"{TEACHER}='{teacher}'", f"{KEY}.distill_loss_mode={mode}",
            f"{KEY}.distill_loss_coef={coef}"]


@pytest.fixture(scope="module")
def other_teacher() -> str:
    """The tiny SD3 architecture with other random weights (seed 1)."""
    return str(ensure_tiny_model("sd3", seed=1))


@pytest.fixture(scope="module")
def pg_rollouts(small_overrides):
    cfg = load_config(small_overrides)
    torch.manual_seed(0)
    metas, fields = _generate(cfg)
    return fields, [m.tags.group_uid for m in metas]


def _pg_learner(small_overrides, teacher, mode="distill_fm_mse", coef=1.0):
    return Learner(load_config(small_overrides + _distill(teacher, mode, coef)))


def _pg_batch(learner, fields, gids):
    b = learner.prepare_batch(fields, gids)
    mbs = learner._micro_batches(torch.arange(len(gids)))
    learner.compute_proximal_log_probs(b, mbs)
    return learner._rows(b, mbs[0][0]), list(range(b["log_probs"].shape[1]))


def _grads(learner):
    out = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in learner.params]
    learner.optimizer.zero_grad(set_to_none=True)
    return out


# ----------------------------------------------------------------------------- policy gradient
@pytest.mark.parametrize("mode", MODES)
def test_pg_teacher_equal_to_the_base_weights_gives_exactly_zero_at_init(small_overrides, pg_rollouts, mode):
    fields, gids = pg_rollouts
    learner = _pg_learner(small_overrides, SAME, mode)
    assert learner.teacher is not None and learner.teacher.mode == "frozen"
    assert not any(p.requires_grad for p in learner.teacher.transformer.parameters())
    mb, steps = _pg_batch(learner, fields, gids)
    sums = learner.compute_losses(mb, steps, 1.0 / len(steps))
    assert sums["actor/distill_loss"] == 0.0
    assert sums["actor/loss"] == sums["actor/pg_loss"]  # nothing added


@pytest.mark.parametrize("mode", MODES)
def test_pg_term_matches_direct_computation_at_each_stored_latent(small_overrides, pg_rollouts, other_teacher, mode):
    fields, gids = pg_rollouts
    learner = _pg_learner(small_overrides, other_teacher, mode)
    mb, steps = _pg_batch(learner, fields, gids)
    sums = learner.compute_losses(mb, steps, 1.0 / len(steps))
    emb = _embeds_from_fields(mb)
    direct = 0.0
    with torch.no_grad():
        for j in steps:
            x, s, s_next = mb["latents"][:, j], mb["sigmas"][:, j], mb["sigmas_next"][:, j]
            v_s = learner.policy.predict_velocity(x, s, emb)
            v_t = learner.teacher.predict_velocity(x, s, emb)
            if mode == "distill_fm_mse":
                per = ((v_s - v_t) ** 2).mean(dim=(1, 2, 3))
            else:
                st = sde_step_with_logprob(v_s, s, s_next, x, noise_level=0.7, prev_sample=x)
                te = sde_step_with_logprob(v_t, s, s_next, x, noise_level=0.7, prev_sample=x)
                per = ((st.mean - te.mean) ** 2).mean(dim=(1, 2, 3)) / (2 * st.sig ** 2)
            direct += float(per.mean())
    assert direct > 0
    assert sums["actor/distill_loss"] == pytest.approx(direct, rel=1e-5)


def test_pg_coefficient_scales_the_added_loss_and_its_gradient(small_overrides, pg_rollouts, other_teacher):
    fields, gids = pg_rollouts
    learner = _pg_learner(small_overrides, other_teacher, "distill_kl", coef=0.5)
    mb, steps = _pg_batch(learner, fields, gids)
    low = learner.compute_losses(mb, steps, 1.0)
    g_low = _grads(learner)
    learner.actor_cfg.distill_loss_coef = 2.0
    high = learner.compute_losses(mb, steps, 1.0)
    g_high = _grads(learner)
    assert low["actor/distill_loss"] == high["actor/distill_loss"] > 0
    assert high["actor/loss"] - low["actor/loss"] == pytest.approx(1.5 * low["actor/distill_loss"], rel=1e-5)
    assert high["actor/pg_loss"] == low["actor/pg_loss"]
    assert max(float((h - lo).abs().max()) for h, lo in zip(g_high, g_low)) > 0  # 1.5 x the term's gradient


def test_pg_distill_gradient_alone_moves_the_lora_towards_the_teacher(small_overrides, pg_rollouts, other_teacher):
    fields, gids = pg_rollouts
    flat = {**fields, "rewards": np.zeros_like(fields["rewards"])}  # advantages 0: the policy-gradient part is 0
    learner = _pg_learner(small_overrides, other_teacher, "distill_fm_mse")
    mb, steps = _pg_batch(learner, flat, gids)
    assert float(mb["advantages"].abs().max()) == 0.0
    before = learner.compute_losses(mb, steps, 1.0 / len(steps))["actor/distill_loss"]
    grads = _grads(learner)
    norm = float(torch.sqrt(sum((g ** 2).sum() for g in grads)))
    assert norm > 0, "the distillation term sent no gradient to the LoRA"
    with torch.no_grad():  # a small gradient step on the LoRA alone
        for p, g in zip(learner.params, grads):
            p.sub_(1e-2 / norm * g)
    after = learner.compute_losses(mb, steps, 1.0 / len(steps))["actor/distill_loss"]
    assert after < before
    metrics = learner.update(flat, gids)
    assert metrics["actor/distill_loss"] > 0 and np.isfinite(metrics["actor/loss"])


# ----------------------------------------------------------------------------- direct preference
def _dp_cfg(small_overrides, algo, *extra):
    return load_config(small_overrides + RECIPES[algo] + [f"{NOISE}=0.7", "algorithm.timestep_fraction=0.5",
                                                          *extra])


def _dp_batch(learner, fields, gids):
    b = learner.prepare_batch(fields, gids)
    learner.compute_proximal(b, learner._micro_batches(torch.arange(learner.num_units(b))))  # AWM's v_prox
    return b, learner._rows(b, torch.arange(b["x0"].shape[0]))


@pytest.fixture(scope="module")
def dp_rollouts(small_overrides):
    out = {}
    for algo in ("awm", "dpo"):
        cfg = _dp_cfg(small_overrides, algo)
        torch.manual_seed(0)
        metas, fields = _generate(cfg)
        out[algo] = (fields, [m.tags.group_uid for m in metas])
    return out


@pytest.mark.parametrize("mode", MODES)
def test_dp_teacher_equal_to_the_base_weights_gives_exactly_zero_at_init(small_overrides, dp_rollouts, mode):
    fields, gids = dp_rollouts["awm"]
    learner = PreferenceLearner(_dp_cfg(small_overrides, "awm", *_distill(SAME, mode)))
    b, mb = _dp_batch(learner, fields, gids)
    sums = learner.compute_losses(mb, list(range(b["t"].shape[1])), 1.0)
    assert sums["actor/distill_loss"] == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_dp_term_matches_direct_computation_at_x_t(small_overrides, dp_rollouts, other_teacher, mode):
    fields, gids = dp_rollouts["awm"]
    learner = PreferenceLearner(_dp_cfg(small_overrides, "awm", *_distill(other_teacher, mode)))
    b, mb = _dp_batch(learner, fields, gids)
    grid = learner.policy.make_sigmas(4, 32, 32)
    for t, t_next in zip(b["t"].flatten().tolist(), b["t_next"].flatten().tolist()):
        i = int(torch.argmin((grid - t).abs()))
        assert grid[i] == t and grid[i + 1] == t_next  # the rollout grid's next sigma
    sums = learner.compute_losses(mb, [0], 1.0)
    emb = _embeds_from_fields(mb)
    t, t_next = mb["t"][:, 0], mb["t_next"][:, 0]
    x_t = (1 - t.view(-1, 1, 1, 1)) * mb["x0"] + t.view(-1, 1, 1, 1) * mb["eps"][:, 0]
    with torch.no_grad():
        v_s, v_t = learner.policy.predict_velocity(x_t, t, emb), learner.teacher.predict_velocity(x_t, t, emb)
    if mode == "distill_fm_mse":
        direct = ((v_s - v_t) ** 2).mean(dim=(1, 2, 3)).mean()
    else:
        st = sde_step_with_logprob(v_s, t, t_next, x_t, noise_level=0.7, prev_sample=x_t)
        te = sde_step_with_logprob(v_t, t, t_next, x_t, noise_level=0.7, prev_sample=x_t)
        direct = (((st.mean - te.mean) ** 2).mean(dim=(1, 2, 3)) / (2 * st.sig ** 2)).mean()
    assert float(direct) > 0
    assert sums["actor/distill_loss"] == pytest.approx(float(direct), rel=1e-5)


def test_dp_update_with_pairs_adds_the_term_and_trains(small_overrides, dp_rollouts, other_teacher):
    fields, gids = dp_rollouts["dpo"]
    learner = PreferenceLearner(_dp_cfg(small_overrides, "dpo", *_distill(other_teacher, "distill_kl", 3.0)))
    before = {k: v.clone() for k, v in learner.policy.lora_state_dict().items()}
    metrics = learner.update(fields, gids)
    assert metrics["actor/distill_loss"] > 0 and np.isfinite(metrics["actor/loss"])
    # actor/loss = DPO loss + 3 x the term (both averaged over the same trained timesteps)
    assert metrics["actor/loss"] == pytest.approx(metrics["actor/pg_loss"] + 3.0 * metrics["actor/distill_loss"],
                                                  rel=1e-5)
    after = learner.policy.lora_state_dict()
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 0


# ----------------------------------------------------------------------------- start-up refusals
@pytest.mark.parametrize("overrides, message", [
    ([f"{KEY}.use_distill_loss=true"],
     f"`{KEY}.use_distill_loss` = true needs a teacher, but `{TEACHER}` is null; set it to a local diffusers pipeline "
     "folder (model_index.json inside) or an embedded model (e.g. the policy's own `actor_rollout_ref.model.path`), "
     f"or set `{KEY}.use_distill_loss=false`."),
    ([f"{KEY}.distill_loss_coef=0.5"],
     f"`{KEY}.distill_loss_coef` = 0.5 is refused while `{KEY}.use_distill_loss` = false: distillation is off, so "
     f"nothing reads it; leave it at its default (1.0), or set `{KEY}.use_distill_loss` = true."),
    ([f"{KEY}.distill_loss_mode=distill_fm_mse"],
     f"`{KEY}.distill_loss_mode` = 'distill_fm_mse' is refused while `{KEY}.use_distill_loss` = false"),
    ([f"{TEACHER}=embedded:tiny-sd3"],
     f"`{TEACHER}` = 'embedded:tiny-sd3' is refused while `{KEY}.use_distill_loss` = false"),
    ([*_distill(SAME, "distill_kl"), f"{NOISE}=0"],
     f"`{KEY}.use_distill_loss` = True is refused with `{KEY}.distill_loss_mode` = 'distill_kl' while `{NOISE}` = 0: "
     "the Gaussian KL between the student's and the teacher's SDE steps needs the step's noise (sig > 0)"),
    ([*RECIPES["awm"], *_distill(SAME, "distill_kl"), f"{NOISE}=0"],
     f"set `{KEY}.distill_loss_mode=distill_fm_mse`"),
    ([*_distill(" ", "distill_kl")], f"`{TEACHER}` = ' ': expected a local diffusers pipeline folder"),
])
def test_config_refusals(small_overrides, overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(small_overrides + overrides)
    assert message in str(err.value)


def test_dp_distill_fm_mse_is_accepted_with_deterministic_rollouts(small_overrides):
    cfg = load_config(small_overrides + RECIPES["awm"] + _distill(SAME, "distill_fm_mse") + [f"{NOISE}=0"])
    assert cfg.actor_rollout_ref.actor.use_distill_loss


def _mismatched_copy(src, dst):
    """A copy of a pipeline folder (components linked) whose VAE and transformer configs say 8 latent channels."""
    dst.mkdir()
    for entry in src.iterdir():
        if entry.name not in ("vae", "transformer"):
            (dst / entry.name).symlink_to(entry)
    for name, field in (("vae", "latent_channels"), ("transformer", "in_channels")):
        shutil.copytree(src / name, dst / name)
        conf = json.loads((dst / name / "config.json").read_text())
        conf[field] = 8
        if name == "transformer":
            conf["out_channels"] = 8
        (dst / name / "config.json").write_text(json.dumps(conf))
    return dst


def test_preflight_refuses_a_teacher_that_is_missing_unknown_or_mismatched(small_overrides, tmp_path,
                                                                            tiny_sd3_path, other_teacher):
    def problems(teacher):
        return find_input_problems(load_config(small_overrides + _distill(teacher)))

    assert problems(SAME) == [] and problems(other_teacher) == []
    missing = tmp_path / "nowhere"
    assert problems(str(missing)) == [
        f"`{TEACHER}`: model folder {missing} does not exist; give a local diffusers pipeline folder (with "
        "model_index.json) or an embedded model such as embedded:tiny-sd3."]
    [unknown] = problems("embedded:tiny-sdxl")
    assert unknown.startswith(f"`{TEACHER}` = 'embedded:tiny-sdxl': unknown embedded model 'tiny-sdxl'")
    odd = _mismatched_copy(tiny_sd3_path, tmp_path / "odd")
    [mismatch] = problems(str(odd))
    assert mismatch.startswith(f"`{TEACHER}` = '{odd}': the teacher cannot be run on the policy's latents and "
                               "prompt embeddings (`actor_rollout_ref.model.path` = 'embedded:tiny-sd3'): latent "
                               "channels (VAE): policy 4, teacher 8; transformer input channels: policy 4, teacher 8")
    assert mismatch.endswith(f"or set `{KEY}.use_distill_loss=false`.")
    # with distillation off nothing about a teacher is checked
    assert find_input_problems(load_config(small_overrides)) == []


def test_the_learner_refuses_a_teacher_that_does_not_load_or_does_not_fit(small_overrides, tmp_path, tiny_sd3_path):
    from omnirl_async.models.setup import build_policy, build_teacher

    cfg = load_config(small_overrides)
    model = cfg.actor_rollout_ref.model
    policy = build_policy(model, torch.device("cpu"))
    odd = _mismatched_copy(tiny_sd3_path, tmp_path / "odd")  # configs that disagree with the weights
    with pytest.raises(RuntimeError, match=rf"`{TEACHER}` = '{odd}': the teacher pipeline at .* does not load"):
        build_teacher(str(odd), model, torch.device("cpu"), policy=policy)
    with pytest.raises(FileNotFoundError, match=rf"`{TEACHER}` = '{tmp_path}' is not a diffusers pipeline folder"):
        build_teacher(str(tmp_path), model, torch.device("cpu"), policy=policy)
    with pytest.raises(ValueError, match=r"pipeline family: policy 'sd3', teacher 'flux'"):
        build_teacher("embedded:tiny-flux", model, torch.device("cpu"), policy=policy)
