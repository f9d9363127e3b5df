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
values marks samples failed inside the actor. An actor whose process dies (a
crash in a native library, out of memory) is restarted by Ray, up to
``RESTARTS`` times each (its model is built again); the group it was scoring
is tried again once it is back (Ray reports the call as unavailable) or on
the other actors, and when every actor died on it (or a call outlives
``reward.timeout_s``) every sample of the group is marked failed with the
reason, and training goes on without it. An actor that died more
than ``RESTARTS`` times leaves the rotation; with none left, every group fails
with that reason (and ``reward.max_failed_frac`` stops the job).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Sequence

import numpy as np

from omnirl_async.rewards.base import RewardResult
from omnirl_async.rewards.manager import RewardManager

#: times Ray restarts a reward worker whose process died
RESTARTS = 3
#: how long a call waits for a reward worker that Ray is restarting (its reward model is built again)
RESTART_WAIT_S = 120.0

__all__ = ["RESTARTS", "RewardWorker", "RewardPool", "make_reward_actors", "reward_actor_options",
           "check_gpus_available", "failed_result"]


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
        self._deaths = [0] * len(self.actors)

    def _pick(self, tried: set[int]) -> int | None:
        with self._lock:
            for _ in range(len(self.actors)):
                i = self._next % len(self.actors)
                self._next += 1
                if i not in self._dead and i not in tried:
                    return i
            return None

    @property
    def alive(self) -> int:
        with self._lock:
            return len(self.actors) - len(self._dead)

    def _state_after_death(self, i: int, wait_s: float = 0.0) -> str:
        """Actor ``i`` after a failed call: "back" (it answers), "restarting" (Ray is restarting it; waited for
        up to ``wait_s``), or "gone" (killed, or out of restarts). A death Ray has not settled yet reads as
        restarting."""
        import ray
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        deadline = time.monotonic() + wait_s
        while True:
            try:
                ray.get(self.actors[i].__ray_ready__.remote(), timeout=max(1.0, deadline - time.monotonic()))
                return "back"
            except ActorUnavailableError:
                if time.monotonic() >= deadline:
                    return "restarting"
                time.sleep(0.2)
            except RayActorError:
                return "gone"
            except GetTimeoutError:
                return "restarting"

    def __call__(self, images: np.ndarray, prompts: Sequence[str], rows: Sequence[dict | None] | None = None
                 ) -> RewardResult:
        import ray
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

        prompts = list(prompts)
        errors: list[str] = []
        tried: set[int] = set()
        while True:
            i = self._pick(tried)
            if i is None:
                left = "no reward worker left" if self.alive == 0 else "every reward worker tried died on it"
                detail = "; ".join(errors) or f"each died more than {RESTARTS + 1} times"
                return failed_result(len(prompts), f"{left} ({detail}; worker logs: /tmp/ray/session_latest/logs)")
            tried.add(i)
            try:
                return ray.get(self.actors[i].score.remote(images, prompts, rows), timeout=self.timeout_s)
            except ActorUnavailableError:  # restarting after an earlier death; this call never ran: wait, retry
                state = self._state_after_death(i, RESTART_WAIT_S)
                if state == "back":
                    tried.discard(i)
                    continue
                errors.append(f"reward worker {i} did not come back from a restart within {RESTART_WAIT_S:g} s")
                if state == "gone":
                    self._drop(i)
            except RayActorError as e:  # its process died during this call: Ray restarts it, up to RESTARTS times
                with self._lock:
                    self._deaths[i] += 1
                    spent = self._deaths[i] > RESTARTS
                if spent or self._state_after_death(i) == "gone":
                    self._drop(i)
                errors.append(f"reward worker {i} died: {type(e).__name__}")
            except GetTimeoutError:
                return failed_result(len(prompts), f"reward worker {i} took longer than `reward.timeout_s` = "
                                                   f"{self.timeout_s} s")
            except RayTaskError as e:  # the manager itself raised (bad images / prompts): the group fails
                return failed_result(len(prompts), f"reward worker {i} raised {type(e.cause).__name__}: {e.cause}")

    def _drop(self, i: int) -> None:
        with self._lock:
            self._dead.add(i)


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
    cls = ray.remote(**options, max_restarts=RESTARTS)(RewardWorker)
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
