"""Exactly-once prompt leases.

The dispatcher owns the prompt order of every epoch and hands prompts out as
:class:`~omnirl_async.protocol.PromptLease` objects. A lease is *outstanding*
until the worker completes it (its samples reached the buffer) or it is
released (the worker failed or died); a released lease goes back to the front
of the queue so that its prompt is generated again, still once per epoch.

State (epoch, cursor, the order of the current epoch and the leases not yet
completed) is saved with checkpoints; on restore outstanding leases return to
the queue, so a crash neither loses nor duplicates a prompt.

The class is plain Python; ``ray.remote(PromptDispatcher)`` makes it the
shared actor of the asynchronous mode.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from omnirl_async.protocol import PromptLease, new_uid

__all__ = ["PromptDispatcher", "sample_seeds"]


def sample_seeds(lease: PromptLease) -> list[int | None]:
    """Per-sample seeds of a lease: a pure function of (lease seed, prompt index, sample index)."""
    if lease.seed is None:
        return [None] * lease.n
    state = np.random.SeedSequence([int(lease.seed), int(lease.index), int(lease.epoch)]).generate_state(lease.n)
    return [int(s) for s in state]


class PromptDispatcher:
    def __init__(self, prompts: list[str], *, n: int, shuffle: bool = True, data_seed: int = 1,
                 rollout_seed: int | None = 42, total_epochs: int | None = None,
                 negative_prompt: str | None = None):
        if not prompts:
            raise ValueError("`prompts` is empty: the prompt dataset has no rows; check `data.train_files`.")
        self.prompts = list(prompts)
        self.n, self.shuffle, self.data_seed = n, shuffle, data_seed
        self.rollout_seed, self.total_epochs = rollout_seed, total_epochs
        self.negative_prompt = negative_prompt
        self._lock = threading.Lock()
        self.epoch = 0
        self._order = self._epoch_order(0)
        self._cursor = 0
        self._returned: deque[tuple[int, int]] = deque()  # (prompt index, epoch)
        self._outstanding: dict[str, tuple[PromptLease, str]] = {}
        self._completed_this_epoch = 0

    # ------------------------------------------------------------------ order
    def _epoch_order(self, epoch: int) -> list[int]:
        idx = np.arange(len(self.prompts))
        if self.shuffle:
            np.random.default_rng([self.data_seed, epoch]).shuffle(idx)
        return idx.tolist()

    def _next_index(self) -> tuple[int, int] | None:
        if self._returned:
            return self._returned.popleft()
        if self._cursor >= len(self._order):
            return None
        i = self._order[self._cursor]
        self._cursor += 1
        return i, self.epoch

    def _maybe_advance_epoch(self) -> bool:
        """Start the next epoch once every prompt of this one was leased.

        Leases still outstanding keep their epoch number: if they come back
        they are generated again as part of their own epoch.
        """
        if (self._cursor >= len(self._order) and not self._returned
                and (self.total_epochs is None or self.epoch + 1 < self.total_epochs)):
            self.epoch += 1
            self._order = self._epoch_order(self.epoch)
            self._cursor = 0
            self._completed_this_epoch = 0
            return True
        return False

    # ------------------------------------------------------------------ leases
    def lease(self, num: int, *, global_step: int, worker_id: str = "driver",
              cross_epoch: bool = True) -> list[PromptLease]:
        """Up to ``num`` new leases. Fewer when the epoch (or the run) is exhausted.

        With ``cross_epoch`` the next epoch starts when the current one is fully
        leased, so one call may return prompts of two epochs.
        """
        out: list[PromptLease] = []
        with self._lock:
            while len(out) < num:
                nxt = self._next_index()
                if nxt is None:
                    if cross_epoch and self._maybe_advance_epoch():
                        continue
                    break
                i, epoch = nxt
                seed = None if self.rollout_seed is None else int(self.rollout_seed) + global_step - 1
                lease = PromptLease(lease_id=new_uid(), group_uid=new_uid(), prompt=self.prompts[i],
                                    epoch=epoch, index=i, n=self.n, seed=seed, global_step=global_step,
                                    negative_prompt=self.negative_prompt)
                self._outstanding[lease.lease_id] = (lease, worker_id)
                out.append(lease)
        return out

    def complete(self, lease_ids: list[str]) -> None:
        with self._lock:
            for lid in lease_ids:
                if self._outstanding.pop(lid, None) is None:
                    raise KeyError(f"lease {lid!r} is not outstanding (completed twice, or never leased)")
                self._completed_this_epoch += 1

    def release(self, lease_ids: list[str]) -> None:
        """Give leases back: their prompts are generated again (front of the queue)."""
        with self._lock:
            for lid in reversed(lease_ids):
                entry = self._outstanding.pop(lid, None)
                if entry is not None:
                    self._returned.appendleft((entry[0].index, entry[0].epoch))

    def release_worker(self, worker_id: str) -> int:
        """Return every lease held by a (dead) worker; returns how many."""
        with self._lock:
            ids = [lid for lid, (_, w) in self._outstanding.items() if w == worker_id]
        self.release(ids)
        return len(ids)

    def exhausted(self) -> bool:
        with self._lock:
            last = self.total_epochs is not None and self.epoch + 1 >= self.total_epochs
            return last and self._cursor >= len(self._order) and not self._returned and not self._outstanding

    def num_outstanding(self) -> int:
        with self._lock:
            return len(self._outstanding)

    # ------------------------------------------------------------------ state
    def get_state(self) -> dict:
        with self._lock:
            pending = [list(p) for p in self._returned] + \
                [[lease.index, lease.epoch] for lease, _ in self._outstanding.values()]
            return {"epoch": self.epoch, "cursor": self._cursor, "order": list(self._order),
                    "pending": pending, "num_prompts": len(self.prompts)}

    def set_state(self, state: dict) -> None:
        if state["num_prompts"] != len(self.prompts):
            raise ValueError(f"checkpoint has {state['num_prompts']} prompts but the dataset has "
                             f"{len(self.prompts)}; resume needs the same `data.train_files`.")
        with self._lock:
            self.epoch = int(state["epoch"])
            self._order = [int(i) for i in state["order"]]
            self._cursor = int(state["cursor"])
            self._returned = deque((int(i), int(e)) for i, e in state["pending"])
            self._outstanding.clear()
