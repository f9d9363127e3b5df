"""LearnerGroup: 2 learners under gloo give the update of 1; bypass equals decoupled at lag 0."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnirl_async.actors.prompt_dispatcher import PromptDispatcher
from omnirl_async.actors.rollout_worker import RolloutWorker
from omnirl_async.config import load_config
from omnirl_async.learners.learner import Learner
from omnirl_async.learners.learner_group import LearnerGroup

PROMPTS = ["two red circles", "a blue square to the left of a yellow triangle"]


@pytest.fixture(scope="module")
def batch(small_overrides):
    cfg = load_config(small_overrides)
    metas, fields, _ = RolloutWorker(cfg).generate(PromptDispatcher(PROMPTS, n=4, shuffle=False).lease(
        2, global_step=1))
    fields["rewards"] = np.linspace(0.0, 1.0, len(metas), dtype=np.float32)
    return fields, [m.tags.group_uid for m in metas]


def test_two_gloo_learners_match_one(ray_cluster, small_overrides, batch):
    fields, gids = batch
    results = {}
    for workers in (1, 2):
        cfg = load_config(small_overrides + [f"learner.num_workers={workers}",
                                             "actor_rollout_ref.actor.ppo_epochs=2"])
        group = LearnerGroup(cfg, use_ray=True, num_threads=1)
        try:
            metrics = group.update(fields, gids)
            results[workers] = (group.get_weights(), metrics)
        finally:
            group.stop()
    w1, w2 = results[1][0], results[2][0]
    assert set(w1) == set(w2)
    moved = 0
    for k in w1:
        np.testing.assert_allclose(w2[k], w1[k], rtol=0, atol=1e-6, err_msg=k)
        moved += int(np.abs(w1[k]).max() > 0 and "lora_B" in k)
    assert moved > 0
    assert results[2][1]["actor/num_updates"] == results[1][1]["actor/num_updates"] == 2.0


def test_bypass_equals_decoupled_when_lag_is_zero(small_overrides, batch):
    fields, gids = batch
    weights = {}
    for bypass in (False, True):
        cfg = load_config(small_overrides + [f"algorithm.rollout_correction.bypass_mode={str(bypass).lower()}",
                                             "algorithm.rollout_correction.rollout_is=token"])
        learner = Learner(cfg)
        m = learner.update(fields, gids)
        assert m["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
        weights[bypass] = learner.get_weights()
    for k in weights[False]:
        torch.testing.assert_close(weights[True][k], weights[False][k], rtol=0, atol=1e-6)
