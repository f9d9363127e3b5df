"""FIFO remover: the oldest evictable group (by insertion order) leaves first."""

from __future__ import annotations

import heapq

from omnirl_async.buffer.removers.base import Remover

__all__ = ["FifoRemover"]


class FifoRemover(Remover):
    """A min-heap on insertion order with lazy deletion: O(log N) per operation."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, str]] = []
        self._live: dict[str, int] = {}

    def insert(self, gid: str, order: int) -> None:
        if gid in self._live:
            return
        self._live[gid] = order
        heapq.heappush(self._heap, (order, gid))

    def remove(self, gid: str) -> None:
        self._live.pop(gid, None)

    def victim(self) -> str | None:
        while self._heap:
            order, gid = self._heap[0]
            if self._live.get(gid) == order:
                return gid
            heapq.heappop(self._heap)
        return None

    def __len__(self) -> int:
        return len(self._live)
