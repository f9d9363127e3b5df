"""Uniform sampler: every ready group equally likely, without replacement within a batch."""

from __future__ import annotations

from typing import Iterator

import numpy as np

from omnirl_async.buffer.samplers.base import GroupInfo, Sampler, _IdList

__all__ = ["UniformSampler"]


class UniformSampler(Sampler):
    def __init__(self) -> None:
        self._list = _IdList()

    def insert(self, gid: str, info: GroupInfo) -> None:
        self._list.add(gid)

    def remove(self, gid: str) -> None:
        self._list.discard(gid)

    def draw(self, rng: np.random.Generator, *, learner_version: int) -> Iterator[str]:
        return self._list.iter_uniform(rng)

    def __len__(self) -> int:
        return len(self._list)

    def ids(self) -> list[str]:
        return list(self._list.ids)
