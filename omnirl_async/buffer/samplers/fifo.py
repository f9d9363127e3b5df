"""FIFO sampler: oldest complete group first (a queue; on-policy-friendly)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

import numpy as np

from omnirl_async.buffer.samplers.base import GroupInfo, Sampler

__all__ = ["FifoSampler"]


class FifoSampler(Sampler):
    """Yields groups in the order they became ready.

    Ordered by readiness rather than by first member so that a slow group
    does not hold back the groups completed after it.
    """

    def __init__(self) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()

    def insert(self, gid: str, info: GroupInfo) -> None:
        if gid in self._ids:
            raise KeyError(f"group `{gid}` is already in the sampler")
        self._ids[gid] = None

    def remove(self, gid: str) -> None:
        del self._ids[gid]

    def draw(self, rng: np.random.Generator, *, learner_version: int) -> Iterator[str]:
        yield from self._ids  # OrderedDict iteration: O(1) per item, no scan of removed ids

    def __len__(self) -> int:
        return len(self._ids)

    def ids(self) -> list[str]:
        return list(self._ids)
