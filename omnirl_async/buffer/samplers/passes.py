"""Shuffled passes: the offline table's sampler (every pair once per pass, each pass in a new order).

The offline table is a fixed pool (ingested preference pairs) that the
learner draws from again and again, so its sampler walks *passes* over the
pool, like epochs over a dataset: within a pass every group comes up exactly
once, in an order shuffled per pass. A uniform draw with replacement would
train some pairs many times before others once; a fixed order would repeat
the same mini-batch neighbours every pass.

The order of pass ``p`` is a permutation drawn from ``numpy.random.
default_rng([seed, p])`` over the groups in insertion order, not from the
table's generator, so the sequence of draws depends only on the seed and
the pool, and :meth:`state_dict` (pass number, its order, position) makes it
continue exactly after a buffer snapshot is restored. A group inserted during
a pass joins at the next pass. When one draw runs past the end of a pass, the
groups already taken in that draw go to the end of the next pass, so a draw
never yields a group twice and each pass still holds every group once.

Examples:
    >>> from omnirl_async.buffer.samplers.base import GroupInfo
    >>> s = ShuffledPassSampler(seed=0)
    >>> for i in range(3):
    ...     s.insert(f"g{i}", GroupInfo(order=i, policy_version=None, size=2))
    >>> first = list(s.draw(None, learner_version=0))
    >>> sorted(first), len(s)
    (['g0', 'g1', 'g2'], 3)
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from omnirl_async.buffer.samplers.base import GroupInfo, Sampler

__all__ = ["ShuffledPassSampler"]


class ShuffledPassSampler(Sampler):
    """Every group once per pass; pass ``p`` shuffled by ``default_rng([seed, p])`` (the draw's rng is unused)."""

    def __init__(self, seed: int | None = 0) -> None:
        self.seed = int(seed or 0)
        self._orders: dict[str, int] = {}  # gid -> insertion order
        self._pass_order: list[str] = []
        self._pos = 0
        self._passes = 0  # passes started

    def insert(self, gid: str, info: GroupInfo) -> None:
        if gid in self._orders:
            raise KeyError(f"group `{gid}` is already in the sampler")
        self._orders[gid] = info.order

    def remove(self, gid: str) -> None:
        self._orders.pop(gid, None)  # its place in the current pass is skipped when it comes up

    def _new_pass(self, taken: list[str]) -> None:
        """Start the next pass: the groups not taken by the running draw shuffled, then those taken."""
        held = set(taken)
        ids = sorted((g for g in self._orders if g not in held), key=self._orders.__getitem__)
        perm = np.random.default_rng([self.seed, self._passes]).permutation(len(ids))
        self._pass_order = [ids[int(i)] for i in perm] + [g for g in taken if g in self._orders]
        self._pos = 0
        self._passes += 1

    def draw(self, rng: Any, *, learner_version: int) -> Iterator[str]:
        taken: list[str] = []
        seen: set[str] = set()
        while len(taken) < len(self._orders):
            if self._pos >= len(self._pass_order):
                self._new_pass(taken)
                if not self._pass_order:
                    return
            gid = self._pass_order[self._pos]
            if gid not in self._orders:  # removed since the pass started
                self._pos += 1
                continue
            if gid in seen:  # this draw went round the whole pool
                return
            self._pos += 1
            seen.add(gid)
            taken.append(gid)
            yield gid

    def __len__(self) -> int:
        return len(self._orders)

    def ids(self) -> list[str]:
        return list(self._orders)

    @property
    def passes(self) -> int:
        """Passes started so far (1 during the first pass)."""
        return self._passes

    def state_dict(self) -> dict[str, Any]:
        return {"passes": self._passes, "order": list(self._pass_order), "pos": self._pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._passes = int(state["passes"])
        self._pass_order = [str(g) for g in state["order"]]
        self._pos = int(state["pos"])
