"""The direct-preference learner (DiffusionNFT, Diffusion-DPO, AWM) on real rollouts of the tiny model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnirl_async.actors.prompt_dispatcher import PromptDispatcher
from omnirl_async.actors.rollout_worker import RolloutWorker
from omnirl_async.algos import decay_at
from omnirl_async.config import load_config
from omnirl_async.learners.learner_group import learner_class
from omnirl_async.learners.preference_learner import PreferenceLearner

PROMPTS = ("two red circles", "a blue square to the left of a yellow triangle")

RECIPES = {
    "diffusion_nft": ["actor_rollout_ref.model.algorithm=diffusion_nft", "algorithm.trainer_type=direct_preference",
                      "actor_rollout_ref.model.policy_state_adapters=[default,old]",
                      "actor_rollout_ref.rollout.rollout_adapter=old",
                      "actor_rollout_ref.actor.diffusion_loss.ref_kl_coef=0.1",
                      "algorithm.old_policy_decay_schedule=linear_to_0_5"],
    "dpo": ["actor_rollout_ref.model.algorithm=dpo", "algorithm.trainer_type=direct_preference",
            "algorithm.paired_preference=true", "actor_rollout_ref.actor.diffusion_loss.dpo_beta=50"],
    "awm": ["actor_rollout_ref.model.algorithm=awm", "algorithm.trainer_type=direct_preference",
            "actor_rollout_ref.model.policy_state_adapters=[default,old]",
            "actor_rollout_ref.actor.diffusion_loss.old_kl_coef=0.01",
            "actor_rollout_ref.actor.diffusion_loss.ref_kl_coef=0.01"],
}


def _config(small_overrides, algo, *extra):
    return load_config(small_overrides + RECIPES[algo] + ["algorithm.timestep_fraction=0.5",
                                                          "actor_rollout_ref.actor.optim.lr=1e-2", *extra])


def _generate(cfg):
    worker = RolloutWorker(cfg)
    d = PromptDispatcher(list(PROMPTS), n=cfg.actor_rollout_ref.rollout.n, shuffle=False)
    metas, fields, _ = worker.generate(d.lease(len(PROMPTS), global_step=1))
    fields["rewards"] = np.linspace(0.0, 1.0, len(metas), dtype=np.float32)  # every group carries signal
    return metas, fields


@pytest.fixture(scope="module")
def batches(small_overrides):
    out = {}
    for algo in RECIPES:
        cfg = _config(small_overrides, algo)
        torch.manual_seed(0)
        out[algo] = (cfg, *_generate(cfg))
    return out


def test_rollouts_store_x0_and_no_trajectory(batches):
    cfg, metas, fields = batches["diffusion_nft"]
    assert "x0" in fields and "log_probs" not in fields and "latents" not in fields
    assert fields["x0"].shape[0] == len(metas) == 2 * cfg.actor_rollout_ref.rollout.n
    assert np.isfinite(fields["x0"]).all()


@pytest.mark.parametrize("algo", sorted(RECIPES))
def test_update_trains_the_default_adapter_with_a_finite_loss(batches, algo):
    cfg, metas, fields = batches[algo]
    assert learner_class(cfg) is PreferenceLearner
    learner = PreferenceLearner(cfg)
    before = {k: v.clone() for k, v in learner.policy.lora_state_dict().items()}
    metrics = learner.update(fields, [m.tags.group_uid for m in metas])
    assert np.isfinite(metrics["actor/loss"]) and metrics["actor/num_updates"] == 1
    after = learner.policy.lora_state_dict()
    moved = max(float((after[k] - before[k]).abs().max()) for k in before)
    assert moved > 0, f"{algo}: the adapter did not move"
    if algo == "dpo":
        assert 0.0 <= metrics["actor/dpo/implicit_acc"] <= 1.0
        assert metrics["actor/dpo/num_pairs"] == len(PROMPTS)
    if algo == "diffusion_nft":
        assert {"actor/nft/x0_err_pos", "actor/old_policy/decay", "actor/old_policy/version"} <= set(metrics)


def test_dpo_first_loss_is_log2_and_pairs_share_t_and_eps(batches):
    cfg, metas, fields = batches["dpo"]
    learner = PreferenceLearner(cfg)
    b = learner.prepare_batch(fields, [m.tags.group_uid for m in metas])
    assert b["x0"].shape[0] == 2 * len(PROMPTS)  # best and worst of each group, interleaved
    assert torch.equal(b["t"][0::2], b["t"][1::2]) and torch.equal(b["eps"][0::2], b["eps"][1::2])
    assert (b["rewards"][0::2] > b["rewards"][1::2]).all()  # winners first in each pair
    mb = learner._rows(b, torch.arange(b["x0"].shape[0]))
    sums = learner.compute_losses(mb, [0], 1.0)
    assert sums["actor/pg_loss"] == pytest.approx(float(np.log(2.0)), abs=1e-6)  # policy == reference at init


def test_pairs_are_never_split_across_minibatches_or_ranks(batches):
    cfg, metas, fields = batches["dpo"]
    learner = PreferenceLearner(cfg)
    for world in (1, 2):
        for rank in range(world):
            learner.world_size, learner.rank = world, rank
            for micro_list in learner._micro_batches(torch.randperm(len(PROMPTS))):
                for rows in micro_list:
                    assert len(rows) % 2 == 0
                    assert (rows[0::2] % 2 == 0).all() and torch.equal(rows[1::2], rows[0::2] + 1)


def test_timestep_fraction_sets_the_trained_timesteps_per_sample(batches, small_overrides):
    cfg, metas, fields = batches["awm"]
    gids = [m.tags.group_uid for m in metas]
    for frac, expected in ((0.5, 2), (1.0, 4), (0.25, 1)):
        c = _config(small_overrides, "awm", f"algorithm.timestep_fraction={frac}")
        b = PreferenceLearner(c).prepare_batch(fields, gids)
        assert b["t"].shape == (len(gids), expected)
        for row in b["t"]:  # distinct sigmas of the scheduler grid
            assert len(set(row.tolist())) == expected


def test_awm_ratio_is_one_on_the_first_step(batches):
    cfg, metas, fields = batches["awm"]
    learner = PreferenceLearner(cfg)
    b = learner.prepare_batch(fields, [m.tags.group_uid for m in metas])
    minibatches = learner._micro_batches(torch.arange(len(metas)))
    learner.compute_proximal(b, minibatches)
    sums = learner.compute_losses(learner._rows(b, minibatches[0][0]), [0], 1.0)
    assert sums["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)


def test_old_adapter_follows_the_schedule_and_rollouts_get_it(batches):
    cfg, metas, fields = batches["diffusion_nft"]
    learner = PreferenceLearner(cfg)
    gids = [m.tags.group_uid for m in metas]
    old0 = learner.policy.lora_state_dict("old")
    learner.update(fields, gids)  # optimizer step 0: linear_to_0_5 gives d = 0, the old adapter copies
    default, old = learner.policy.lora_state_dict(), learner.policy.lora_state_dict("old")
    assert all(torch.equal(default[k], old[k]) for k in default)
    assert any(not torch.equal(old0[k], old[k]) for k in old)
    prev_old, prev_default = old, default
    learner.update(fields, gids)  # step 1: d = 0.001
    d = decay_at(1, "linear_to_0_5")
    default, old = learner.policy.lora_state_dict(), learner.policy.lora_state_dict("old")
    for k in old:
        assert torch.allclose(old[k], d * prev_old[k] + (1 - d) * default[k], atol=1e-6)
    # rollout_adapter=old: the published weights are the old adapter's, with both versions
    published = learner.get_weights()
    assert all(torch.equal(published[k], old[k]) for k in old)
    assert learner.adapter_versions() == {"default": 2, "old": 2}
    # the checkpoint state carries the old adapter and restores it
    state = learner.get_state()
    fresh = PreferenceLearner(cfg)
    fresh.set_state(state)
    assert all(torch.equal(fresh.policy.lora_state_dict("old")[k], old[k]) for k in old)
    assert fresh.optimizer_steps == learner.optimizer_steps == 2


def test_interval_delays_the_old_adapter_refresh(batches, small_overrides):
    cfg, metas, fields = batches["diffusion_nft"]
    gids = [m.tags.group_uid for m in metas]
    c = _config(small_overrides, "diffusion_nft", "algorithm.old_policy_update_interval=2")
    learner = PreferenceLearner(c)
    old0 = learner.policy.lora_state_dict("old")
    learner.update(fields, gids)
    assert all(torch.equal(old0[k], v) for k, v in learner.policy.lora_state_dict("old").items())
    learner.update(fields, gids)
    assert any(not torch.equal(old0[k], v) for k, v in learner.policy.lora_state_dict("old").items())
