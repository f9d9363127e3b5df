"""Samplers choose which complete groups a learner batch takes.

A sampler sees only *ready* groups (complete, not stale): the table inserts a
group when its last member arrives and removes it when it leaves. Its one main
method, :meth:`Sampler.draw`, yields distinct group ids lazily, so a batch
costs O(batch) draws whatever the table size (the table stops the generator
once it has enough samples). The table never inserts or removes while a draw
generator is open.

Write a custom sampler by subclassing :class:`Sampler` and point
``trainer.v1.sampler.custom_sampler.{path,name}`` at it; it is built with
``**trainer.v1.sampler.sampler_kwargs``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator

import numpy as np

__all__ = ["GroupInfo", "Sampler"]


@dataclass(frozen=True)
class GroupInfo:
    """What a sampler may know about a group."""

    order: int                   # insertion order of the group (monotone per table)
    policy_version: int | None   # oldest policy version among its members; None = offline
    size: int                    # successful members (rows it contributes)
    priority: float = 1.0        # initial priority (prioritized sampler)
    ticket: int = -1             # admission ticket (training order under the wait strategy); -1 = none


class Sampler(ABC):
    """Chooses groups. Subclasses keep their own index of the inserted ids."""

    @abstractmethod
    def insert(self, gid: str, info: GroupInfo) -> None:
        """A group became ready."""

    @abstractmethod
    def remove(self, gid: str) -> None:
        """A group left the table (sampled out, evicted, stale, cleared)."""

    @abstractmethod
    def draw(self, rng: np.random.Generator, *, learner_version: int) -> Iterator[str]:
        """Yield distinct inserted group ids, in the order this sampler prefers them.

        Exhausting the generator yields every inserted id exactly once.
        """

    @abstractmethod
    def __len__(self) -> int:
        ...

    def update_priority(self, gid: str, priority: float) -> None:
        """Change a group's priority; samplers without priorities ignore it."""

    def clear(self) -> None:
        for gid in list(self.ids()):
            self.remove(gid)

    @abstractmethod
    def ids(self) -> list[str]:
        """All inserted ids (any order)."""

    def state_dict(self) -> dict | None:
        """Position state a buffer snapshot keeps (msgpack-able); None = nothing beyond the inserted groups."""
        return None

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` after the groups were inserted again."""

    def __getstate__(self):
        # Samplers hold no RNG and no lock; the table owns both (STYLE guideline 7).
        return self.__dict__.copy()


class _IdList:
    """Ids in a list with O(1) insert, remove and random pick (swap-remove)."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.pos: dict[str, int] = {}

    def add(self, gid: str) -> None:
        if gid in self.pos:
            raise KeyError(f"group `{gid}` is already in the sampler")
        self.pos[gid] = len(self.ids)
        self.ids.append(gid)

    def discard(self, gid: str) -> None:
        i = self.pos.pop(gid)
        last = self.ids.pop()
        if i < len(self.ids):
            self.ids[i] = last
            self.pos[last] = i

    def __len__(self) -> int:
        return len(self.ids)

    def iter_uniform(self, rng: np.random.Generator) -> Iterator[str]:
        """Every id once, in uniformly random order, drawn lazily.

        Rejection sampling while fewer than half are taken (O(1) per draw),
        then one shuffle of the rest; the list must not change meanwhile.
        """
        n = len(self.ids)
        taken: set[str] = set()
        while len(taken) * 2 < n:
            gid = self.ids[int(rng.integers(n))]
            if gid not in taken:
                taken.add(gid)
                yield gid
        rest = [g for g in self.ids if g not in taken]
        for i in rng.permutation(len(rest)):
            yield rest[int(i)]
