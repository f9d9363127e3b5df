"""The reward worker pool (`reward.num_workers > 0`): same scores as inline, failover, timeouts."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from omnirl_async.config import load_config
from omnirl_async.data.shapes import render_batch
from omnirl_async.rewards import RewardManager
from omnirl_async.rewards.base import failure_kind
from omnirl_async.rewards.worker_pool import RewardPool, make_reward_actors
from tests.ray_kill import kill_and_wait_until_dead

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
    actors = make_reward_actors(_reward_cfg("reward.num_workers=2", "reward.num_cpus_per_worker=0.5"))
    pool = RewardPool(actors)
    kill_and_wait_until_dead(actors[0])
    for _ in range(3):  # every call lands on the survivor, whichever actor the rotation tries first
        res = pool(_images(), PROMPTS)
        assert not res.failed.any() and res.scores.max() > 0
    assert pool.alive == 1
    kill_and_wait_until_dead(actors[1])
    res = pool(_images(), PROMPTS)
    assert res.failed.all() and (res.scores == 0).all()
    assert "no reward worker left" in res.reasons[0] and "died" in res.reasons[0]


@pytest.mark.slow  # a failure path of the pool; the pool itself is covered fast above
def test_a_reward_worker_whose_process_died_is_restarted_and_one_that_always_dies_is_dropped(ray_cluster, tmp_path):
    """A reward that crashes its process (a native library's segfault, an OOM kill) once: Ray restarts the worker
    and the group is scored by it (a dead worker used to leave the pool for good, failing every later group). One
    that crashes on every call: after Ray's restarts the group fails with the reason and the worker is dropped."""
    path = tmp_path / "crash.py"
    marker = tmp_path / "crashed"
    path.write_text(textwrap.dedent(f"""
        import os
        def crash_once(images, prompts, **kw):
            if not os.path.exists({str(marker)!r}):
                open({str(marker)!r}, "w").close()
                os._exit(3)
            return [1.0] * len(prompts)
        def crash_always(images, prompts, **kw):
            os._exit(3)
    """))
    for name in ("crash_once", "crash_always"):
        cfg = _reward_cfg("reward.num_workers=1", "reward.num_cpus_per_worker=0.5",
                          f"reward.custom_reward_function.path={path}", f"reward.custom_reward_function.name={name}")
        actors = make_reward_actors(cfg)
        try:
            pool = RewardPool(actors, timeout_s=60)
            res = pool(_images(), PROMPTS)
            if name == "crash_once":
                assert marker.exists() and not res.failed.any() and res.scores.tolist() == [1.0] * len(PROMPTS)
                assert pool.alive == 1 and not pool(_images(), PROMPTS).failed.any()
            else:
                assert res.failed.all() and res.reasons[0].startswith("no reward worker left (reward worker 0 ")
                assert failure_kind(res.reasons[0]) == "no_worker" and pool.alive == 0
        finally:
            for a in actors:
                ray_cluster.kill(a)


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


VERL_REWARD = """
def compute_score(data_source, solution_image, ground_truth, extra_info=None):
    return float(ground_truth) + (0.5 if data_source == "bonus" else 0.0)
"""
ROWS = [{"ground_truth": 1}, {"ground_truth": 0, "data_source": "bonus"}, {"ground_truth": 2}, None]


def _check_rows_scored(res):
    assert res.scores.tolist() == [1.0, 0.5, 2.0, 0.0] and res.failed.tolist() == [False, False, False, True]
    assert "raised TypeError: float() argument must be" in res.reasons[3]  # a row without ground truth


def test_rows_reach_a_per_sample_reward_on_a_reward_worker(tmp_path):
    from omnirl_async.rewards.worker_pool import RewardWorker

    (tmp_path / "verl_reward.py").write_text(VERL_REWARD)
    cfg = _reward_cfg("reward.num_workers=1", f"reward.custom_reward_function.path={tmp_path / 'verl_reward.py'}",
                      "reward.custom_reward_function.name=compute_score")
    _check_rows_scored(RewardWorker(cfg).score(_images(), PROMPTS, ROWS))  # the actor's body, in this process


@pytest.mark.slow  # the same through Ray actors (the fast test above runs the actor's body)
def test_rows_reach_a_per_sample_reward_on_the_pool(ray_cluster, tmp_path):
    import ray

    (tmp_path / "verl_reward.py").write_text(VERL_REWARD)
    cfg = _reward_cfg("reward.num_workers=1", "reward.num_cpus_per_worker=0.5",
                      f"reward.custom_reward_function.path={tmp_path / 'verl_reward.py'}",
                      "reward.custom_reward_function.name=compute_score")
    actors = make_reward_actors(cfg)
    try:
        _check_rows_scored(RewardPool(actors)(_images(), PROMPTS, ROWS))
    finally:
        ray.kill(actors[0])


def test_reward_workers_refuse_gpus_the_cluster_does_not_have(ray_cluster):
    cfg = _reward_cfg("reward.num_workers=2", "reward.num_gpus_per_worker=0.5")
    with pytest.raises(ValueError) as info:  # refused before starting anything (no TimeoutError after 60 s)
        make_reward_actors(cfg, timeout_s=60)
    assert str(info.value) == (
        "`reward.num_gpus_per_worker` = 0.5 with `reward.num_workers` = 2 asks for 1 GPU(s), but the Ray cluster has "
        "no GPUs; set `reward.num_gpus_per_worker=0` to score on CPUs, lower `reward.num_workers`, or add GPU nodes "
        "(`ray status` lists them)")


def test_reward_worker_gpus_go_into_the_actor_options():
    from omnirl_async.rewards.worker_pool import check_gpus_available, reward_actor_options

    assert reward_actor_options(_reward_cfg("reward.num_workers=1")) == {
        "num_cpus": 1.0, "num_gpus": 0.0, "max_concurrency": 4}
    cfg = _reward_cfg("reward.num_workers=2", "reward.num_gpus_per_worker=1", "reward.num_cpus_per_worker=2")
    assert reward_actor_options(cfg) == {"num_cpus": 2.0, "num_gpus": 1.0, "max_concurrency": 4}
    check_gpus_available(cfg, 2.0)  # fits
    with pytest.raises(ValueError, match="asks for 2 GPU\\(s\\), but the Ray cluster has 1 GPU\\(s\\) in all"):
        check_gpus_available(cfg, 1.0)


def test_reward_gpus_without_reward_workers_are_refused_at_start():
    from omnirl_async.config import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config(["reward.num_gpus_per_worker=1"])
    assert "`reward.num_gpus_per_worker` = 1" in str(info.value) and "reward.num_workers" in str(info.value)
    load_config(["reward.num_gpus_per_worker=1", "reward.num_workers=1"])  # with reward workers: accepted


def test_empty_pool_is_refused():
    with pytest.raises(ValueError, match="reward.num_workers"):
        RewardPool([])


@pytest.mark.parametrize("override", ["reward.num_workers=-1", "reward.num_cpus_per_worker=0",
                                      "reward.timeout_s=0"])
def test_pool_config_rules_name_the_key(override):
    from omnirl_async.config import ConfigError

    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config([override])
