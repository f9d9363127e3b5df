"""Weight publishing: one copy per version in the object store, under a long-lived owner.

The learner (rank 0) sends the LoRA state dict – or the whole transformer when
``lora_rank=0`` – to the :class:`WeightStore` actor, which puts it into Ray's
object store **once** per version and so owns it: the weights outlive the
learner process that produced them (objects die with their owner, and Ray
2.56 removed ``ray.put(..., _owner=...)``, so the owner must do the put).
The trainer announces each version to the prompt dispatcher once it is held
here; a granted lease names the version its group needs
(``PromptLease.weights_version``) and the rollout worker fetches the tensors
only when that is newer than what it holds; numpy arrays come back as
zero-copy views of shared memory.

The store keeps the newest ``keep`` versions so a worker that fetched the
number of version ``v`` can still get it after ``v+1`` appeared.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from omnirl_async.protocol import WeightsInfo

__all__ = ["WeightStore", "publish_weights", "fetch_weights_if_newer"]


class WeightStore:
    """Ray actor body: version → ObjectRef of a ``dict[str, np.ndarray]``."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._refs: dict[int, Any] = {}
        self._infos: dict[int, WeightsInfo] = {}
        self._latest = -1
        self._lock = threading.Lock()

    def publish(self, info: WeightsInfo, weights: dict[str, np.ndarray]) -> int:
        """Own a copy of ``weights`` in the object store as version ``info.version``."""
        import ray

        with self._lock:
            if info.version <= self._latest:
                raise ValueError(f"weights version {info.version} is not newer than the published {self._latest}")
            self._refs[info.version] = ray.put(weights)
            self._infos[info.version] = info
            self._latest = info.version
            for v in sorted(self._refs)[:-self.keep]:
                del self._refs[v], self._infos[v]
            return self._latest

    def latest_version(self) -> int:
        return self._latest

    def get(self, version: int | None = None) -> tuple[WeightsInfo, list]:
        with self._lock:
            v = self._latest if version is None else version
            if v not in self._refs:
                raise KeyError(f"weights version {v} is not held (held: {sorted(self._refs)})")
            return self._infos[v], [self._refs[v]]

    def assert_healthy(self) -> int:
        return self._latest


def publish_weights(store, version: int, weights: dict[str, np.ndarray], *, is_lora: bool,
                    adapter_versions: dict[str, int] | None = None) -> WeightsInfo:
    """Hand ``weights`` to ``store`` (which owns the object-store copy) and announce ``version``."""
    import ray

    info = WeightsInfo(version=version, num_bytes=int(sum(v.nbytes for v in weights.values())), is_lora=is_lora,
                       published_at=time.time(), adapter_versions=dict(adapter_versions or {}))
    ray.get(store.publish.remote(info, weights))
    return info


def fetch_weights_if_newer(store, have_version: int, *, latest: int | None = None
                           ) -> tuple[WeightsInfo, dict[str, np.ndarray]] | None:
    """The newest weights when they are newer than ``have_version``, else None (one cheap call).

    ``latest``: a version the caller knows the store holds – its newest as the caller just read it, or the one a
    lease was admitted for (``PromptLease.weights_version``) – which saves asking for the newest. What comes back
    is then the newest version the store holds *now*: ``latest`` or a later one (an older one only if the store
    never held ``latest``, which the rollout loop refuses).
    """
    import ray

    if latest is None:
        latest = ray.get(store.latest_version.remote())
    if latest <= have_version:
        return None
    info, wrapped = ray.get(store.get.remote(None))
    return info, ray.get(wrapped[0])
