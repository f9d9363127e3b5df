"""One API over 0 (in-process) or N Ray learner actors.

``LearnerGroup(config, use_ray=False)`` runs a single :class:`Learner` in the
calling process – unit tests need no cluster. With ``use_ray=True`` it starts
``learner.num_workers`` actors; for N > 1 they form one torch.distributed
group (gloo on CPU, NCCL on GPU) and average gradients of the trainable
parameters, so N learners give the same update as one on the same batch.

Remote failures come back as the original exception type (Ray re-raises the
actor's error on ``ray.get``), with the rank added to the message.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import numpy as np
import torch

from omnirl_async.learners.learner import Learner
from omnirl_async.models.data_parallel import free_port
from omnirl_async.metrics import reduce_metrics

__all__ = ["LearnerGroup", "LearnerWorker"]


class LearnerWorker:
    """The body of one learner actor."""

    def __init__(self, config, rank: int, world_size: int, num_threads: int | None = None):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.config, self.rank, self.world_size = config, rank, world_size
        self.learner: Learner | None = None

    def address(self) -> tuple[str, int]:
        return socket.gethostbyname(socket.gethostname()), free_port()

    def setup(self, master: tuple[str, int] | None) -> bool:
        if self.world_size > 1:
            import torch.distributed as dist

            backend = self.config.learner.backend
            if backend == "auto":
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend=backend, init_method=f"tcp://{master[0]}:{master[1]}",
                                    rank=self.rank, world_size=self.world_size)
        self.learner = Learner(self.config, rank=self.rank, world_size=self.world_size)
        return True

    def update(self, fields, group_ids):
        return self.learner.update(fields, group_ids)

    def get_weights(self) -> dict[str, np.ndarray]:
        return {k: v.detach().cpu().float().numpy() if v.dtype == torch.bfloat16 else v.detach().cpu().numpy()
                for k, v in self.learner.get_weights().items()}

    def get_state(self) -> dict[str, Any]:
        return self.learner.get_state()

    def set_state(self, state) -> bool:
        self.learner.set_state(state)
        return True

    def save_lora(self, folder: str) -> bool:
        self.learner.save_lora(folder)
        return True

    def publish(self, store, version: int):
        """Put this rank's weights into the object store owned by ``store`` (called on rank 0)."""
        from omnirl_async.learners.weight_store import publish_weights

        return publish_weights(store, version, self.get_weights(),
                               is_lora=self.config.actor_rollout_ref.model.lora_rank > 0)

    def assert_healthy(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid(), "step": self.learner.global_step if self.learner else -1}

    def stop(self) -> bool:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        return True


class LearnerGroup:
    def __init__(self, config, *, use_ray: bool = True, num_threads: int | None = None):
        self.config = config
        lcfg = config.learner
        self.num_workers = lcfg.num_workers
        self.use_ray = use_ray
        if not use_ray:
            if self.num_workers != 1:
                raise ValueError(f"`learner.num_workers` = {self.num_workers} needs Ray; the in-process learner "
                                 "group has exactly one learner.")
            self.local = LearnerWorker(config, 0, 1, num_threads)
            self.local.setup(None)
            self.actors = []
            return
        import ray

        cls = ray.remote(num_cpus=lcfg.num_cpus_per_worker, num_gpus=lcfg.num_gpus_per_worker)(LearnerWorker)
        self.actors = [cls.options(name=None).remote(config, r, self.num_workers, num_threads)
                       for r in range(self.num_workers)]
        master = ray.get(self.actors[0].address.remote()) if self.num_workers > 1 else None
        ray.get([a.setup.remote(master) for a in self.actors])
        self.local = None

    # ------------------------------------------------------------------ calls
    def _all(self, method: str, *args) -> list:
        if self.local is not None:
            return [getattr(self.local, method)(*args)]
        import ray

        refs = [getattr(a, method).remote(*args) for a in self.actors]
        return ray.get(refs)

    def _rank0(self, method: str, *args):
        if self.local is not None:
            return getattr(self.local, method)(*args)
        import ray

        return ray.get(getattr(self.actors[0], method).remote(*args))

    def update(self, fields: dict[str, np.ndarray], group_ids: list[str]) -> dict[str, float]:
        if self.local is None:
            import ray

            fields_ref = ray.put(fields)  # one copy in the object store, shared by every rank
            return reduce_metrics(self._all("update", fields_ref, group_ids))
        return reduce_metrics(self._all("update", fields, group_ids))

    def get_weights(self) -> dict[str, np.ndarray]:
        return self._rank0("get_weights")

    def get_state(self) -> dict[str, Any]:
        return self._rank0("get_state")

    def set_state(self, state) -> None:
        self._all("set_state", state)

    def save_lora(self, folder: str) -> None:
        self._rank0("save_lora", folder)

    def publish(self, store, version: int):
        """Rank 0 publishes weights ``version`` through the weight store; returns its WeightsInfo."""
        return self._rank0("publish", store, version)

    def assert_healthy(self) -> list[dict]:
        return self._all("assert_healthy")

    def stop(self) -> None:
        if self.actors:
            import ray

            try:
                ray.get([a.stop.remote() for a in self.actors], timeout=30)
            finally:
                for a in self.actors:
                    ray.kill(a)
            self.actors = []
        elif self.local is not None:
            self.local.stop()
