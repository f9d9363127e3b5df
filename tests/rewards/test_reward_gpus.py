"""Reward workers that request GPUs get them from Ray (a Ray started with one logical GPU, so it runs on CPUs)."""

from __future__ import annotations

import numpy as np
import pytest

from omnirl_async.config import load_config
from omnirl_async.rewards.worker_pool import RewardPool, make_reward_actors

pytestmark = pytest.mark.slow  # its own Ray instance (the fast refusal test runs in test_reward_pool.py)


@pytest.fixture(scope="module")
def ray_with_a_gpu():
    import ray

    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        yield ray
    finally:
        ray.shutdown()


def test_reward_workers_are_placed_on_the_gpu_they_ask_for(ray_with_a_gpu):
    ray = ray_with_a_gpu
    cfg = load_config(["reward.num_workers=2", "reward.num_gpus_per_worker=0.5", "reward.num_cpus_per_worker=0.5",
                       "reward.reward_fn_name=brightness"]).reward
    actors = make_reward_actors(cfg, timeout_s=120)
    try:
        stats = ray.get([a.stats.remote() for a in actors])
        assert [s["gpu_ids"] for s in stats] == [["0"], ["0"]]  # two halves of the one GPU
        assert [s["cuda_visible_devices"] for s in stats] == ["0", "0"]
        assert ray.available_resources().get("GPU", 0.0) == 0.0
        res = RewardPool(actors)(np.full((2, 4, 4, 3), 255, np.uint8), ["a", "b"])
        assert res.scores.tolist() == [1.0, 1.0]
    finally:
        for a in actors:
            ray.kill(a)
    too_many = load_config(["reward.num_workers=2", "reward.num_gpus_per_worker=1"]).reward
    with pytest.raises(ValueError, match=r"asks for 2 GPU\(s\), but the Ray cluster has 1 GPU\(s\) in all"):
        make_reward_actors(too_many)
