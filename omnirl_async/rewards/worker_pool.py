"""A pool of reward worker actors (``reward.num_workers > 0``).

By default every rollout worker scores its groups inline, in a few threads of
its own process. With ``reward.num_workers = N`` the trainer starts N
:class:`RewardWorker` Ray actors, each holding a :class:`RewardManager` built
from the same ``reward`` config, and every rollout worker sends each group's
images to one of them through a :class:`RewardPool` (round robin). The
rollout worker waits for the answer in its scoring thread, so sampling of the
next group goes on meanwhile. Use a pool when scoring is heavy Python (one
process per scorer sidesteps the GIL and the rollout worker's CPU share), or
when the scorer must live apart from generation (its own CPUs or GPU).

Each prompt's dataset row (its other fields: ground truth, metadata) travels
with the images (``rows``), so a reward sees the same arguments on the pool as
inline. ``reward.num_gpus_per_worker`` reserves GPUs for each reward worker
(a judge model on its own GPU); Ray then sets ``CUDA_VISIBLE_DEVICES`` in the
actor. Asking for GPUs that the cluster does not have is refused at once,
naming the key and the cluster's resources, instead of waiting forever for
an actor Ray cannot place; so is a pool that does not start within
``timeout_s``.

Failures are data, as inline: a reward function that raises or returns bad
values marks samples failed inside the actor. An actor that dies is dropped
from the rotation and the group is retried on the next one; when no actor is
left (or a call outlives ``reward.timeout_s``) every sample of the group is
marked failed with the reason, and training goes on without it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Sequence

import numpy as np

from omnirl_async.rewards.base import RewardResult
from omnirl_async.rewards.manager import RewardManager

__all__ = ["RewardWorker", "RewardPool", "make_reward_actors", "reward_actor_options", "check_gpus_available",
           "failed_result"]


class RewardWorker:
    """Ray actor body: one RewardManager, scoring whole groups."""

    def __init__(self, reward_cfg: Any, *, index: int = 0, num_threads: int | None = None):
        if num_threads:
            import torch

            torch.set_num_threads(num_threads)
        self.index = index
        self.manager = RewardManager.from_config(reward_cfg)
        self.calls = 0
        self.samples = 0
        self.busy_s = 0.0

    def score(self, images: np.ndarray, prompts: Sequence[str], rows: Sequence[dict | None] | None = None
              ) -> RewardResult:
        t0 = time.perf_counter()
        try:
            return self.manager(images, prompts, rows)
        finally:
            self.calls += 1
            self.samples += len(prompts)
            self.busy_s += time.perf_counter() - t0

    def stats(self) -> dict[str, Any]:
        import ray

        return {"index": self.index, "pid": os.getpid(), "calls": self.calls, "samples": self.samples,
                "busy_s": self.busy_s, "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def failed_result(batch: int, reason: str) -> RewardResult:
    """Every sample failed for ``reason`` (nothing scored)."""
    return RewardResult(scores=np.zeros(batch, np.float32), extra={}, failed=np.ones(batch, bool),
                        reasons=[reason] * batch)


class RewardPool:
    """Client side: callable like :class:`RewardManager`, scoring on the pool's actors.

    Thread-safe; several scoring threads of one rollout worker share it.
    """

    def __init__(self, actors: Sequence[Any], *, timeout_s: float | None = None):
        if not actors:
            raise ValueError("a RewardPool needs at least one reward worker actor; "
                             "set `reward.num_workers` > 0 or score inline")
        self.actors = list(actors)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._next = 0
        self._dead: set[int] = set()

    def _pick(self) -> int | None:
        with self._lock:
            for _ in range(len(self.actors)):
                i = self._next % len(self.actors)
                self._next += 1
                if i not in self._dead:
                    return i
            return None

    @property
    def alive(self) -> int:
        with self._lock:
            return len(self.actors) - len(self._dead)

    def __call__(self, images: np.ndarray, prompts: Sequence[str], rows: Sequence[dict | None] | None = None
                 ) -> RewardResult:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        prompts = list(prompts)
        errors: list[str] = []
        while True:
            i = self._pick()
            if i is None:
                detail = "; ".join(errors) if errors else "all reward workers died earlier"
                return failed_result(len(prompts), f"no reward worker left ({detail})")
            try:
                return ray.get(self.actors[i].score.remote(images, prompts, rows), timeout=self.timeout_s)
            except RayActorError as e:
                with self._lock:
                    self._dead.add(i)
                errors.append(f"reward worker {i} died: {type(e).__name__}")
            except GetTimeoutError:
                return failed_result(len(prompts), f"reward worker {i} took longer than `reward.timeout_s` = "
                                                   f"{self.timeout_s} s")
            except RayTaskError as e:  # the manager itself raised (bad images / prompts): the group fails
                return failed_result(len(prompts), f"reward worker {i} raised {type(e.cause).__name__}: {e.cause}")


def reward_actor_options(reward_cfg: Any) -> dict[str, Any]:
    """The Ray actor options of one reward worker: its CPUs, its GPUs and the calls it serves at once."""
    return {"num_cpus": float(reward_cfg.num_cpus_per_worker),
            "num_gpus": float(getattr(reward_cfg, "num_gpus_per_worker", 0.0) or 0.0),
            "max_concurrency": 4}


def check_gpus_available(reward_cfg: Any, cluster_gpus: float) -> None:
    """Raise ``ValueError`` when the pool asks for more GPUs than the cluster has (Ray would wait forever)."""
    per = float(getattr(reward_cfg, "num_gpus_per_worker", 0.0) or 0.0)
    need = per * int(reward_cfg.num_workers)
    if per <= 0 or need <= cluster_gpus + 1e-9:
        return
    have = "has no GPUs" if cluster_gpus <= 0 else f"has {cluster_gpus:g} GPU(s) in all"
    raise ValueError(f"`reward.num_gpus_per_worker` = {per:g} with `reward.num_workers` = {reward_cfg.num_workers} "
                     f"asks for {need:g} GPU(s), but the Ray cluster {have}; set `reward.num_gpus_per_worker=0` "
                     "to score on CPUs, lower `reward.num_workers`, or add GPU nodes (`ray status` lists them)")


def make_reward_actors(reward_cfg: Any, *, timeout_s: float | None = 600.0, placement: Any = None) -> list[Any]:
    """Start ``reward_cfg.num_workers`` :class:`RewardWorker` actors (none when 0).

    ``placement(i)``: Ray actor options of worker ``i`` from the trainer's placement group of the role
    (its CPUs, GPUs, custom resources and bundle); None = :func:`reward_actor_options`.

    Refuses GPUs the cluster does not have before starting anything, and
    raises ``TimeoutError`` when the actors are not up within ``timeout_s``.
    """
    n = int(reward_cfg.num_workers)
    if n <= 0:
        return []
    import ray

    options = reward_actor_options(reward_cfg)
    if options["num_gpus"] > 0:
        check_gpus_available(reward_cfg, float(ray.cluster_resources().get("GPU", 0.0)))
    cls = ray.remote(**options)(RewardWorker)
    actors = [(cls.options(**placement(i)) if placement else cls).remote(
        reward_cfg, index=i, num_threads=max(1, int(reward_cfg.num_cpus_per_worker))) for i in range(n)]
    try:  # surface construction errors (bad reward config) here
        ray.get([a.stats.remote() for a in actors], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        for a in actors:
            ray.kill(a)
        raise TimeoutError(f"{n} reward workers did not start within {timeout_s:g} s: Ray may lack the resources "
                           f"they ask for ({options['num_cpus']:g} CPU, {options['num_gpus']:g} GPU each: "
                           "`reward.num_cpus_per_worker`, `reward.num_gpus_per_worker`; see `ray status`)") from None
    return actors
