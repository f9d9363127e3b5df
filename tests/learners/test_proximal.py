"""Decoupled rollout correction with the proximal log-probs read off the update's own forward
(omnirl_async/learners/proximal.py): the same update, weights and metrics as the separate no-grad pass, one pass
fewer, used only when it is exact; and why it matters: bypass mode clips stale samples away."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnirl_async.config import load_config
from omnirl_async.learners.learner import Learner

RC = "algorithm.rollout_correction"


def _stale_learner(cfg, fuse: bool) -> Learner:
    """A learner whose weights moved since the batch was generated (as one a few updates ahead would)."""
    learner = Learner(cfg)
    learner.fuse_proximal = fuse
    with torch.no_grad():
        for name, p in learner.policy.transformer.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.02)
    return learner


def _counting(learner: Learner) -> list[bool]:
    """Records, per step forward, whether it ran with gradients (training) or without (the proximal pass)."""
    calls: list[bool] = []
    orig = learner._step_forward

    def spy(mb, j, emb, **kw):
        calls.append(torch.is_grad_enabled())
        return orig(mb, j, emb, **kw)

    learner._step_forward = spy
    return calls


@pytest.mark.parametrize("correction, drops", [
    ([], False),                                                                # no IS: the proximal ratio only
    ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=1.05"], False),     # truncated IS
    ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=0.99_1.01"], True), # masked IS drops steps
    ([f"{RC}.rollout_rs=token_k2", f"{RC}.rollout_rs_threshold=1e-5"], True),   # token rejection drops steps
], ids=["no-is", "tis", "masked-is", "token-rs"])
def test_fused_proximal_gives_the_separate_pass_update_with_one_pass_fewer(small_overrides, batch, correction,
                                                                           drops):
    fields, gids = batch
    cfg = load_config(small_overrides + [f"{RC}.bypass_mode=false", *correction])
    results = {}
    for fuse in (False, True):
        learner = _stale_learner(cfg, fuse)
        calls = _counting(learner)
        metrics = learner.update(fields, gids)
        results[fuse] = (learner.get_weights(), metrics, len(calls))
    (w_sep, m_sep, n_sep), (w_fused, m_fused, n_fused) = results[False], results[True]
    num_steps = fields["log_probs"].shape[1]
    assert n_sep == 2 * num_steps and n_fused == num_steps  # the no-grad pass visited every step once; now none
    moved = 0
    for k in w_sep:
        torch.testing.assert_close(w_fused[k], w_sep[k], rtol=0, atol=1e-7)
        moved += int("lora_B" in k)
    assert moved > 0
    corr = sorted(k for k in m_sep if k.startswith("rollout_corr/"))
    assert corr and corr == sorted(k for k in m_fused if k.startswith("rollout_corr/"))
    for k in corr + ["actor/pg_loss", "actor/ratio_mean", "actor/pg_clipfrac", "actor/grad_norm"]:
        assert m_fused[k] == pytest.approx(m_sep[k], rel=1e-5, abs=1e-9), k
    assert m_sep["rollout_corr/kl"] > 0  # the batch is stale: there is something to correct
    if drops:  # the options had an effect on this batch, and the same one both ways
        assert 0 < m_sep["rollout_corr/rs_reject_frac"] < 1 or 0 < m_sep["rollout_corr/is_weight_mean"] < 1


@pytest.mark.parametrize("override, fused", [
    ("actor_rollout_ref.actor.ppo_epochs=2", False),               # the weights move before epoch 2's forwards
    ("actor_rollout_ref.actor.ppo_mini_batch_size=1", False),      # ... before the second mini-batch's
    ("algorithm.timestep_fraction=0.5", False),                    # untrained steps would have no proximal
    (f"{RC}.rollout_is=sequence", False),                          # a row's weight needs all its steps first
    (f"{RC}.rollout_is_batch_normalize=true", False),              # the batch mean needs every row first
    (f"{RC}.rollout_is=token", True),
])
def test_the_separate_pass_runs_whenever_fusing_would_not_be_exact(small_overrides, batch, override, fused):
    fields, gids = batch
    cfg = load_config(small_overrides + [f"{RC}.bypass_mode=false", override])
    learner = Learner(cfg)
    calls = _counting(learner)
    metrics = learner.update(fields, gids)
    num_steps = fields["log_probs"].shape[1]
    trained = int(np.ceil(0.5 * num_steps)) if "timestep_fraction" in override else num_steps
    training, proximal_pass = calls.count(True), calls.count(False)
    micro_batches_per_epoch = training // (trained * cfg.actor_rollout_ref.actor.ppo_epochs)
    assert training == trained * cfg.actor_rollout_ref.actor.ppo_epochs * micro_batches_per_epoch
    assert proximal_pass == (0 if fused else num_steps * micro_batches_per_epoch)
    assert "rollout_corr/kl" in metrics


def test_bypass_mode_clips_stale_steps_that_the_decoupled_mode_trains_on(small_overrides, batch):
    """FlowGRPO's clip range is tiny; in bypass mode the ratio is against the behaviour policy, so a sample
    generated before the weights moved is clipped on many steps and gives no gradient there. Decoupled, the
    ratio starts at 1 against the proximal policy and the staleness is carried by the IS weight instead."""
    fields, gids = batch
    out = {}
    for bypass in ("true", "false"):
        is_weights = [] if bypass == "true" else [f"{RC}.rollout_is=token"]  # bypass: the ratio is the IS term
        cfg = load_config(small_overrides + [f"{RC}.bypass_mode={bypass}", *is_weights,
                                             "actor_rollout_ref.actor.diffusion_loss.clip_ratio=1e-4"])
        out[bypass] = _stale_learner(cfg, fuse=True).update(fields, gids)
    assert out["true"]["actor/pg_clipfrac"] > 0.2
    assert out["false"]["actor/pg_clipfrac"] == 0.0 and out["false"]["actor/ratio_mean"] == 1.0
    assert out["false"]["actor/grad_norm"] > 1.2 * out["true"]["actor/grad_norm"]  # the clipped steps' share
    assert out["false"]["rollout_corr/kl"] == pytest.approx(out["true"]["rollout_corr/kl"], rel=1e-4)


@pytest.mark.parametrize("mode, threshold, bypass, warned", [
    ("separate_async", 2, "true", True),
    ("separate_async", "auto", "true", True),
    ("separate_async", 0, "true", False),      # on-policy: nothing is stale
    ("sync", 0, "true", False),
    ("separate_async", 2, "false", False),
])
def test_start_up_warns_when_bypass_mode_meets_stale_samples(small_overrides, mode, threshold, bypass, warned):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(small_overrides + [f"trainer.v1.trainer_mode={mode}", f"{RC}.bypass_mode={bypass}",
                                       f"trainer.v1.sampler.max_off_policy_threshold={threshold}"])
    hits = [str(w.message) for w in caught if "bypass_mode` = true in separate_async" in str(w.message)]
    assert bool(hits) == warned
    if warned:
        assert f"max_off_policy_threshold` = {threshold!r}" in hits[0] and "bypass_mode=false" in hits[0]
