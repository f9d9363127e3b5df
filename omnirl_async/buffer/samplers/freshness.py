"""Freshness sampler: priority decays with the version lag of a group.

P(group) is proportional to ``decay ** lag`` with ``lag = learner_version -
policy_version`` (offline groups count as lag 0). Groups are bucketed by
policy version, so a draw costs O(#versions) – a handful under any sane
``max_off_policy_threshold`` – instead of re-weighting every group each time
the learner version moves.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from omnirl_async.buffer.samplers.base import GroupInfo, Sampler, _IdList

__all__ = ["FreshnessSampler"]


class FreshnessSampler(Sampler):
    def __init__(self, decay: float = 0.5) -> None:
        if not (0 < decay <= 1 and math.isfinite(decay)):
            raise ValueError(f"`buffer.freshness_decay` = {decay!r}: must be in (0, 1]")
        self.decay = float(decay)
        self._buckets: dict[int | None, _IdList] = {}
        self._version: dict[str, int | None] = {}

    def insert(self, gid: str, info: GroupInfo) -> None:
        if gid in self._version:
            raise KeyError(f"group `{gid}` is already in the sampler")
        self._buckets.setdefault(info.policy_version, _IdList()).add(gid)
        self._version[gid] = info.policy_version

    def remove(self, gid: str) -> None:
        v = self._version.pop(gid)
        b = self._buckets[v]
        b.discard(gid)
        if not len(b):
            del self._buckets[v]

    def weight(self, policy_version: int | None, learner_version: int) -> float:
        lag = 0 if policy_version is None else max(0, learner_version - policy_version)
        return self.decay ** lag

    def draw(self, rng: np.random.Generator, *, learner_version: int) -> Iterator[str]:
        versions = list(self._buckets)
        iters = [self._buckets[v].iter_uniform(rng) for v in versions]
        left = np.array([len(self._buckets[v]) for v in versions], dtype=np.float64)
        w = np.array([self.weight(v, learner_version) for v in versions], dtype=np.float64)
        while left.sum() > 0:
            mass = left * w
            total = mass.sum()
            if total <= 0:
                mass, total = left, left.sum()
            k = int(np.searchsorted(np.cumsum(mass), rng.random() * total, side="right"))
            k = min(k, len(versions) - 1)
            while left[k] == 0:  # float edge: step to a bucket that still has groups
                k = (k + 1) % len(versions)
            left[k] -= 1
            yield next(iters[k])

    def __len__(self) -> int:
        return len(self._version)

    def ids(self) -> list[str]:
        return list(self._version)
