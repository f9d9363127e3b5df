"""Removers choose which group leaves a full table.

Only *evictable* groups are ever handed to a remover: groups that have been
sampled at least once and may still be reused (``max_times_sampled > 1``).
A group that was never trained on is never evicted to make room – the table
blocks the producer instead (invariant "nothing lost"). Groups leave for
other reasons too, but not through the remover: sampled ``max_times_sampled``
times (:mod:`.max_times_sampled`), stale, or failed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

__all__ = ["Remover"]


class Remover(ABC):
    @abstractmethod
    def insert(self, gid: str, order: int) -> None:
        """``gid`` became evictable; ``order`` is its insertion order in the table."""

    @abstractmethod
    def remove(self, gid: str) -> None:
        """``gid`` left the table (no-op if it was never inserted)."""

    @abstractmethod
    def victim(self) -> str | None:
        """The group to evict next, or ``None`` when nothing is evictable. Does not remove it."""

    @abstractmethod
    def __len__(self) -> int:
        ...
