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

__all__ = ["RewardWorker", "RewardPool", "make_reward_actors", "failed_result"]


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

    def score(self, images: np.ndarray, prompts: Sequence[str]) -> RewardResult:
        t0 = time.perf_counter()
        try:
            return self.manager(images, prompts)
        finally:
            self.calls += 1
            self.samples += len(prompts)
            self.busy_s += time.perf_counter() - t0

    def stats(self) -> dict[str, Any]:
        return {"index": self.index, "pid": os.getpid(), "calls": self.calls, "samples": self.samples,
                "busy_s": self.busy_s}


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

    def __call__(self, images: np.ndarray, prompts: Sequence[str]) -> RewardResult:
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
                return ray.get(self.actors[i].score.remote(images, prompts), timeout=self.timeout_s)
            except RayActorError as e:
                with self._lock:
                    self._dead.add(i)
                errors.append(f"reward worker {i} died: {type(e).__name__}")
            except GetTimeoutError:
                return failed_result(len(prompts), f"reward worker {i} took longer than `reward.timeout_s` = "
                                                   f"{self.timeout_s} s")
            except RayTaskError as e:  # the manager itself raised (bad images / prompts): the group fails
                return failed_result(len(prompts), f"reward worker {i} raised {type(e.cause).__name__}: {e.cause}")


def make_reward_actors(reward_cfg: Any) -> list[Any]:
    """Start ``reward_cfg.num_workers`` :class:`RewardWorker` actors (none when 0)."""
    n = int(reward_cfg.num_workers)
    if n <= 0:
        return []
    import ray

    cls = ray.remote(num_cpus=reward_cfg.num_cpus_per_worker, max_concurrency=4)(RewardWorker)
    actors = [cls.remote(reward_cfg, index=i, num_threads=max(1, int(reward_cfg.num_cpus_per_worker)))
              for i in range(n)]
    ray.get([a.stats.remote() for a in actors])  # surface construction errors (bad reward config) here
    return actors
