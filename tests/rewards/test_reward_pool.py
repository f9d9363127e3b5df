"""The reward worker pool (`reward.num_workers > 0`): same scores as inline, failover, timeouts."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from omnirl_async.config import load_config
from omnirl_async.data.shapes import render_batch
from omnirl_async.rewards import RewardManager
from omnirl_async.rewards.worker_pool import RewardPool, make_reward_actors

PROMPTS = ["a red circle", "two blue squares", "a green triangle above a white circle", "three yellow triangles"]


def _images(seed=0):
    images, _ = render_batch(PROMPTS, np.random.default_rng(seed))
    return images


def _reward_cfg(*overrides):
    return load_config(list(overrides)).reward


def test_pool_scores_equal_inline_scores_and_rotate_over_actors(ray_cluster):
    import ray

    cfg = _reward_cfg("reward.num_workers=2", "reward.num_cpus_per_worker=0.5")
    actors = make_reward_actors(cfg)
    try:
        pool = RewardPool(actors)
        inline = RewardManager.from_config(cfg)
        for seed in range(4):
            images = _images(seed)
            images[1] = 0  # a blank image: some clauses fail, so scores differ between samples
            got, want = pool(images, PROMPTS), inline(images, PROMPTS)
            np.testing.assert_array_equal(got.scores, want.scores)
            np.testing.assert_array_equal(got.failed, want.failed)
            assert got.extra.keys() == want.extra.keys()
            for key in want.extra:
                np.testing.assert_array_equal(got.extra[key], want.extra[key])
        assert [s["calls"] for s in ray.get([a.stats.remote() for a in actors])] == [2, 2]
    finally:
        for a in actors:
            ray.kill(a)


@pytest.mark.slow  # a failure path of the pool; the pool itself is covered fast above
def test_dead_actor_is_skipped_and_no_actor_left_fails_the_group_with_a_reason(ray_cluster):
    import ray

    actors = make_reward_actors(_reward_cfg("reward.num_workers=2", "reward.num_cpus_per_worker=0.5"))
    pool = RewardPool(actors)
    ray.kill(actors[0])
    for _ in range(3):  # every call lands on the survivor, whichever actor the rotation tries first
        res = pool(_images(), PROMPTS)
        assert not res.failed.any() and res.scores.max() > 0
    assert pool.alive == 1
    ray.kill(actors[1])
    res = pool(_images(), PROMPTS)
    assert res.failed.all() and (res.scores == 0).all()
    assert "no reward worker left" in res.reasons[0] and "died" in res.reasons[0]


@pytest.mark.slow  # a failure path of the pool; the pool itself is covered fast above
def test_slow_reward_times_out_into_failed_samples(ray_cluster, tmp_path):
    import ray

    path = tmp_path / "slow_reward.py"
    path.write_text(textwrap.dedent("""
        import time
        def slow(images, prompts, **kw):
            time.sleep(5)
            return [1.0] * len(prompts)
    """))
    cfg = _reward_cfg("reward.num_workers=1", "reward.num_cpus_per_worker=0.5", "reward.timeout_s=0.5",
                      f"reward.custom_reward_function.path={path}", "reward.custom_reward_function.name=slow")
    actors = make_reward_actors(cfg)
    try:
        res = RewardPool(actors, timeout_s=cfg.timeout_s)(_images(), PROMPTS)
        assert res.failed.all() and "reward.timeout_s" in res.reasons[0]
    finally:
        ray.kill(actors[0])


@pytest.mark.slow  # a failure path of the pool; the pool itself is covered fast above
def test_bad_reward_config_fails_when_the_pool_starts(ray_cluster, tmp_path):
    cfg = _reward_cfg("reward.num_workers=1", "reward.num_cpus_per_worker=0.5",
                      f"reward.custom_reward_function.path={tmp_path / 'missing.py'}",
                      "reward.custom_reward_function.name=fn")
    with pytest.raises(Exception, match="missing.py"):
        make_reward_actors(cfg)


def test_empty_pool_is_refused():
    with pytest.raises(ValueError, match="reward.num_workers"):
        RewardPool([])


@pytest.mark.parametrize("override", ["reward.num_workers=-1", "reward.num_cpus_per_worker=0",
                                      "reward.timeout_s=0"])
def test_pool_config_rules_name_the_key(override):
    from omnirl_async.config import ConfigError

    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config([override])
