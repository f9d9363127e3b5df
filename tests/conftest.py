"""Shared fixtures: small configs on the embedded tiny model, one Ray per test module."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
torch.set_num_threads(1)

SMALL = [
    "actor_rollout_ref.model.path=embedded:tiny-sd3",
    "data.train_batch_size=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.pipeline.num_inference_steps=4",
    "trainer.logger=[tensorboard]",
    "trainer.progress_bar=false",
    "trainer.device=cpu",
]


@pytest.fixture(scope="session")
def small_overrides():
    return list(SMALL)


@pytest.fixture(scope="session")
def tiny_sd3_path():
    from omnirl_async.models.tiny import ensure_tiny_model

    return ensure_tiny_model("sd3")


@pytest.fixture(scope="module")
def ray_cluster():
    """A small local Ray (auth token on, as Ray 2.60 sets it), shut down after the module."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        yield ray
    finally:
        ray.shutdown()
