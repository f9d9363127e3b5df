"""Ticket sampler: lowest admission ticket first.

Under ``max_off_policy_strategy=wait`` the prompt dispatcher numbers prompt
groups with tickets in the order the learner must train them (see
:mod:`omnirl_async.actors.staleness`); training a group no later than its
ticket's slot is what keeps its lag within the threshold. This sampler yields
ready groups by ticket, so the oldest admitted group always goes first even
when a younger one finished earlier. Groups without a ticket (``-1``: offline
data, or a producer that does not use tickets) come after, by readiness.
"""

from __future__ import annotations

import bisect
import math
from typing import Iterator

import numpy as np

from omnirl_async.buffer.samplers.base import GroupInfo, Sampler

__all__ = ["TicketSampler"]


class TicketSampler(Sampler):
    def __init__(self) -> None:
        self._sorted: list[tuple[float, int, str]] = []
        self._key: dict[str, tuple[float, int, str]] = {}

    def insert(self, gid: str, info: GroupInfo) -> None:
        if gid in self._key:
            raise KeyError(f"group `{gid}` is already in the sampler")
        key = (info.ticket if info.ticket >= 0 else math.inf, info.order, gid)
        self._key[gid] = key
        bisect.insort(self._sorted, key)

    def remove(self, gid: str) -> None:
        key = self._key.pop(gid)
        del self._sorted[bisect.bisect_left(self._sorted, key)]

    def draw(self, rng: np.random.Generator, *, learner_version: int) -> Iterator[str]:
        for _, _, gid in self._sorted:
            yield gid

    def __len__(self) -> int:
        return len(self._sorted)

    def ids(self) -> list[str]:
        return [gid for _, _, gid in self._sorted]
