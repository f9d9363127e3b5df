"""Prioritized sampler: P(group) proportional to priority ** exponent.

Priorities live in a sum tree (O(log N) update and draw). A draw without
replacement zeroes each drawn leaf and restores it when the generator closes,
so a batch costs O(batch * log N) whatever the table size.

The initial priority of a group is given by the table (by default the
standard deviation of its members' rewards plus a small floor: a GRPO group
whose members all scored the same has zero advantage and teaches nothing).
:meth:`update_priority` overrides it, e.g. with the learner's loss.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from omnirl_async.buffer.samplers.base import GroupInfo, Sampler

__all__ = ["PrioritizedSampler", "SumTree"]


class SumTree:
    """Binary tree over ``capacity`` leaves where each node holds the sum of its children."""

    def __init__(self, capacity: int = 1024) -> None:
        cap = 1
        while cap < capacity:
            cap *= 2
        self.capacity = cap
        self.tree = np.zeros(2 * cap, dtype=np.float64)

    def grow(self) -> None:
        leaves = self.tree[self.capacity:].copy()
        self.capacity *= 2
        self.tree = np.zeros(2 * self.capacity, dtype=np.float64)
        self.tree[self.capacity:self.capacity + len(leaves)] = leaves
        for i in range(self.capacity - 1, 0, -1):
            self.tree[i] = self.tree[2 * i] + self.tree[2 * i + 1]

    def set(self, slot: int, value: float) -> None:
        i = slot + self.capacity
        delta = value - self.tree[i]
        while i >= 1:
            self.tree[i] += delta
            i //= 2

    def get(self, slot: int) -> float:
        return float(self.tree[slot + self.capacity])

    @property
    def total(self) -> float:
        return float(self.tree[1])

    def find(self, u: float) -> int:
        """Leaf whose cumulative range holds ``u`` in [0, total)."""
        i = 1
        tree = self.tree
        while i < self.capacity:
            left = 2 * i
            if u < tree[left] or tree[left + 1] <= 0.0:
                i = left
            else:
                u -= tree[left]
                i = left + 1
        return i - self.capacity


class PrioritizedSampler(Sampler):
    """Draws groups with probability proportional to ``priority ** exponent``.

    ``exponent = 0`` is uniform; ``1`` is proportional to priority.
    """

    def __init__(self, exponent: float = 0.6, min_priority: float = 1e-3) -> None:
        if not (exponent >= 0 and math.isfinite(exponent)):
            raise ValueError(f"`buffer.priority_exponent` = {exponent!r}: must be a finite number >= 0")
        self.exponent = float(exponent)
        self.min_priority = float(min_priority)
        self._tree = SumTree()
        self._slot: dict[str, int] = {}
        self._gid: dict[int, str] = {}
        self._free: list[int] = []
        self._next = 0

    def _weight(self, priority: float) -> float:
        if not (priority >= 0 and math.isfinite(priority)):
            raise ValueError(f"priority {priority!r}: must be a finite number >= 0")
        return max(priority, self.min_priority) ** self.exponent

    def insert(self, gid: str, info: GroupInfo) -> None:
        if gid in self._slot:
            raise KeyError(f"group `{gid}` is already in the sampler")
        if self._free:
            slot = self._free.pop()
        else:
            if self._next == self._tree.capacity:
                self._tree.grow()
            slot = self._next
            self._next += 1
        self._slot[gid] = slot
        self._gid[slot] = gid
        self._tree.set(slot, self._weight(info.priority))

    def remove(self, gid: str) -> None:
        slot = self._slot.pop(gid)
        del self._gid[slot]
        self._tree.set(slot, 0.0)
        self._free.append(slot)

    def update_priority(self, gid: str, priority: float) -> None:
        slot = self._slot.get(gid)
        if slot is not None:
            self._tree.set(slot, self._weight(priority))

    def probability(self, gid: str) -> float:
        return self._tree.get(self._slot[gid]) / self._tree.total

    def draw(self, rng: np.random.Generator, *, learner_version: int) -> Iterator[str]:
        taken: list[tuple[int, float]] = []
        try:
            for _ in range(len(self._slot)):
                total = self._tree.total
                if total <= 1e-300:  # float residue only: the rest have zero weight
                    break
                slot = self._tree.find(float(rng.random()) * total)
                if slot not in self._gid or self._tree.get(slot) <= 0.0:
                    slot = next(s for s in self._gid if self._tree.get(s) > 0.0)
                taken.append((slot, self._tree.get(slot)))
                self._tree.set(slot, 0.0)
                yield self._gid[slot]
        finally:
            for slot, w in reversed(taken):
                self._tree.set(slot, w)

    def __len__(self) -> int:
        return len(self._slot)

    def ids(self) -> list[str]:
        return list(self._slot)
