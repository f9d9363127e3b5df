"""The learner's chain of steps, checked step by step against direct computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnirl_async.actors.prompt_dispatcher import PromptDispatcher
from omnirl_async.actors.rollout_worker import RolloutWorker
from omnirl_async.config import load_config
from omnirl_async.learners.learner import Learner


def _generate(cfg, prompts=("two red circles", "a blue square to the left of a yellow triangle")):
    worker = RolloutWorker(cfg)
    d = PromptDispatcher(list(prompts), n=cfg.actor_rollout_ref.rollout.n, shuffle=False)
    metas, fields, _ = worker.generate(d.lease(len(prompts), global_step=1))
    # make rewards distinct so that every group carries signal
    fields["rewards"] = np.linspace(0.0, 1.0, len(metas), dtype=np.float32)
    return metas, fields


@pytest.fixture(scope="module")
def setup(small_overrides):
    cfg = load_config(small_overrides + ["actor_rollout_ref.actor.use_kl_loss=true"])
    torch.manual_seed(0)
    metas, fields = _generate(cfg)
    return cfg, metas, fields


def test_on_policy_ratio_is_exactly_one_and_gradient_is_minus_a_grad_logp(setup):
    cfg, metas, fields = setup
    learner = Learner(cfg)
    gids = [m.tags.group_uid for m in metas]
    b = learner.prepare_batch(fields, gids)
    perm = torch.arange(len(gids))
    minibatches = learner._micro_batches(perm)
    assert len(minibatches) == 1 and len(minibatches[0]) == 1  # one mini-batch, one micro-batch
    learner.compute_proximal_log_probs(b, minibatches)
    # the learner's recompute matches the rollout's behaviour log-probs
    assert torch.allclose(b["old_log_probs"], b["log_probs"], atol=1e-5)
    rows = minibatches[0][0]
    mb = learner._rows(b, rows)
    steps = list(range(b["log_probs"].shape[1]))
    scale = 1.0 / len(steps)
    sums = learner.compute_losses(mb, steps, scale)
    assert sums["actor/ratio_mean"] == len(steps) * 1.0
    assert sums["actor/ratio_max"] == len(steps) * 1.0 and sums["actor/ratio_min"] == len(steps) * 1.0
    assert sums["actor/pg_clipfrac"] == 0.0
    grads = [p.grad.detach().clone() for p in learner.params]

    # direct: d/dθ of  -(1/T) Σ_j mean_i A_i log p_ij  (+ KL term, zero gradient at init is not assumed)
    for p in learner.params:
        p.grad = None
    from omnirl_async.learners.learner import _embeds_from_fields

    emb = _embeds_from_fields(mb)
    adv = mb["advantages"].clamp(-5, 5)
    total = 0.0
    for j in steps:
        out = learner._step_forward(mb, j, emb)
        total = total - (adv * out.log_prob).mean() * scale
        with learner.policy.disable_adapter(), torch.no_grad():
            ref = learner._step_forward(mb, j, emb)
        kl = (((out.mean - ref.mean) ** 2).mean(dim=tuple(range(1, out.mean.dim()))) / (2 * out.sig ** 2)).mean()
        total = total + cfg.actor_rollout_ref.actor.kl_loss_coef * kl * scale
    direct = torch.autograd.grad(total, learner.params, allow_unused=True)
    checked = 0
    for g, d in zip(grads, direct):
        d = torch.zeros_like(g) if d is None else d
        torch.testing.assert_close(g, d, rtol=1e-5, atol=1e-9)
        checked += int(g.abs().sum() > 0)
    assert checked > 0, "no parameter received a gradient"


def test_kl_is_zero_at_init_and_positive_after_a_change(setup):
    cfg, metas, fields = setup
    learner = Learner(cfg)
    gids = [m.tags.group_uid for m in metas]
    b = learner.prepare_batch(fields, gids)
    mbs = learner._micro_batches(torch.arange(len(gids)))
    learner.compute_proximal_log_probs(b, mbs)
    sums = learner.compute_losses(learner._rows(b, mbs[0][0]), [0, 1], 0.5)
    assert sums["actor/kl_loss"] == 0.0
    with torch.no_grad():
        for name, p in learner.policy.transformer.named_parameters():
            if "lora_B" in name:
                p.add_(0.05)
    sums = learner.compute_losses(learner._rows(b, mbs[0][0]), [0, 1], 0.5)
    assert sums["actor/kl_loss"] > 0.0


def test_update_changes_lora_weights_and_reports_metrics(setup):
    cfg, metas, fields = setup
    learner = Learner(cfg)
    before = {k: v.clone() for k, v in learner.get_weights().items()}
    metrics = learner.update(fields, [m.tags.group_uid for m in metas])
    after = learner.get_weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert metrics["actor/ratio_mean"] == 1.0  # one mini-batch, one epoch: on-policy
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "actor/grad_norm", "critic/advantages/max",
                "rollout_corr/logprob_abs_diff_mean", "timing_s/old_log_prob", "timing_s/update_actor"):
        assert key in metrics and np.isfinite(metrics[key]), key
    assert metrics["actor/num_updates"] == 1.0


def test_timestep_fraction_trains_a_subset_of_steps(small_overrides):
    cfg = load_config(small_overrides + ["algorithm.timestep_fraction=0.5"])
    metas, fields = _generate(cfg)
    learner = Learner(cfg)
    calls = []
    orig = learner._step_forward

    def spy(mb, j, emb, **kw):
        calls.append(j)
        return orig(mb, j, emb, **kw)

    learner._step_forward = spy
    learner.update(fields, [m.tags.group_uid for m in metas])
    num_steps = fields["log_probs"].shape[1]
    # proximal recompute visits every step once; training visits ceil(0.5 * T) of them
    assert len(calls) == num_steps + int(np.ceil(0.5 * num_steps))


def test_several_mini_batches_and_epochs_count_updates(small_overrides):
    cfg = load_config(small_overrides + ["actor_rollout_ref.actor.ppo_mini_batch_size=1",
                                         "actor_rollout_ref.actor.ppo_epochs=2"])
    metas, fields = _generate(cfg)
    learner = Learner(cfg)
    metrics = learner.update(fields, [m.tags.group_uid for m in metas])
    assert metrics["actor/num_updates"] == 4.0  # 2 mini-batches x 2 epochs


def test_full_weight_path_when_lora_rank_is_zero(small_overrides):
    cfg = load_config(small_overrides + ["actor_rollout_ref.model.lora_rank=0", "actor_rollout_ref.actor.optim.lr=1e-3"])
    metas, fields = _generate(cfg)
    learner = Learner(cfg)
    n_params = sum(p.numel() for p in learner.policy.transformer.parameters())
    assert sum(p.numel() for p in learner.params) == n_params  # everything trains
    learner.update(fields, [m.tags.group_uid for m in metas])
    weights = learner.get_weights()
    assert not any("lora" in k for k in weights)
    worker = RolloutWorker(cfg)
    worker.set_weights(1, {k: v.numpy() for k, v in weights.items()})
    x = torch.randn(2, *fields["latents"].shape[2:])
    emb = worker.policy.encode_prompt(["two red circles"] * 2, max_sequence_length=8)
    s = torch.full((2,), 0.5)
    with torch.no_grad():
        torch.testing.assert_close(worker.policy.predict_velocity(x, s, emb), learner.policy.predict_velocity(x, s, emb),
                                   rtol=0, atol=0)
