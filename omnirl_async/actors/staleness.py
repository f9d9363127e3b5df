"""Admission control: never start a prompt whose samples would be too stale to train.

The rule itself (one function per question) is in :mod:`omnirl_async.staleness`.
Every prompt group gets a **ticket**, its position in one global order
(0, 1, 2, ...). The learner trains groups in ticket order: update ``u`` takes
tickets ``[u*B, (u+1)*B)`` (``B`` = prompts per learner batch), and the policy
version advances every ``P`` updates (``parameter_sync_step``), so ticket ``k``
is trained at version ``floor(k / (P*B))``.

A worker holding version ``v`` may therefore take ticket ``k`` only if::

    k < (threshold + v + 1) * P * B                                  (1)

because then ``floor(k / (P*B)) - v <= threshold``: the lag of every sample
it generates is within ``max_off_policy_threshold`` **by construction**, however
slow the worker is, so the ``wait`` strategy never has to drop anything. A
ticket whose lease is released (worker died) keeps its number and is handed
again only to a worker whose version satisfies (1) for it.

When updates differ in size (a tapered offline share hands the rows it frees
back to online groups), ``u*B`` is replaced by ``C(u)``, the first ticket of
update ``u`` in a :class:`~omnirl_async.actors.ticket_layout.TicketLayout`, and
(1) reads ``k < C((threshold + v + 1) * P)``: same argument, as ``C`` grows
by at least one ticket per update.

Why tickets and not "count the samples in flight" (AReaL's capacity formula,
which (1) is in prompt units)? Counting alone bounds the volume, but when a
slow worker's group finishes after younger groups, FIFO-by-completion would
train it later than its slot and its lag could exceed the bound. Training in
ticket order keeps the bound exact; the price is that the learner waits for
the oldest unfinished ticket (head-of-line), which the ``wait`` strategy
accepts by definition.

With ``max_off_policy_strategy=drop`` there is no admission control: workers
run ahead freely (bounded by the buffer's capacity), and the buffer evicts and
counts samples whose lag exceeds the threshold when the learner samples.

The threshold may change during the run (:meth:`AdmissionController.set_threshold`,
``max_off_policy_threshold: auto``): the next lease is admitted under the new
value at once, and every lease carries the value it was admitted under
(:meth:`AdmissionController.bound`, ``PromptLease.max_lag``), which its samples
keep (see :mod:`omnirl_async.staleness`). (1) holds for each lease with its own
``threshold``, so every lag stays within the bound of its own admission; raising
the value admits more tickets at once, lowering it admits none until the
workers' versions catch up, and the tickets already handed out keep their slots.
"""

from __future__ import annotations

import math
import threading

from omnirl_async import staleness as rule
from omnirl_async.actors.ticket_layout import TicketLayout

__all__ = ["AdmissionController", "LockedState"]


class LockedState:
    """Base for lock-guarded objects that travel to Ray actors: the lock stays behind (STYLE guideline 7)."""

    def __getstate__(self):
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()


class AdmissionController(LockedState):
    """Lock-guarded ticket bookkeeping for the ``wait`` strategy (and plain counting for ``drop``)."""

    def __init__(self, *, threshold: int, batch_groups: int | None = None, updates_per_version: int = 1,
                 strategy: str = "wait", max_ahead_batches: int | None = None, layout: TicketLayout | None = None):
        _check_threshold(threshold)
        if layout is not None:
            batch_groups = layout.groups
        if batch_groups is None or batch_groups <= 0:
            raise ValueError(f"`batch_groups` = {batch_groups}: must be > 0 (data.train_batch_size).")
        if updates_per_version <= 0:
            raise ValueError(f"`parameter_sync_step` = {updates_per_version}: must be > 0.")
        if strategy not in ("wait", "drop"):
            raise ValueError(f"`max_off_policy_strategy` = {strategy!r}: choose wait or drop.")
        self.threshold = threshold
        self.batch_groups = batch_groups  # of the first update (of every update with a fixed layout)
        self.layout = layout if layout is not None else TicketLayout.fixed(batch_groups)
        self.updates_per_version = updates_per_version
        self.strategy = strategy
        self.max_ahead_batches = max_ahead_batches
        self._lock = threading.Lock()
        self.learner_updates = 0  # updates the learner has finished (it trains ticket order)

    # ------------------------------------------------------------------ rule (1)
    def ticket_limit(self, worker_version: int) -> float:
        """First ticket a worker at ``worker_version`` may NOT take."""
        if self.strategy == "drop":
            if self.max_ahead_batches is None:
                return math.inf
            return self.layout.start(self.learner_updates + self.max_ahead_batches)
        return rule.ticket_limit(worker_version, threshold=self.threshold,
                                 updates_per_version=self.updates_per_version, layout=self.layout)

    def set_threshold(self, threshold: int) -> None:
        """Admit under ``threshold`` from the next lease on; leases already handed out keep their bound."""
        _check_threshold(threshold)
        with self._lock:
            self.threshold = int(threshold)

    def bound(self) -> int:
        """The threshold a lease admitted now is held to (it travels with the lease as ``max_lag``)."""
        with self._lock:
            return self.threshold

    def admits(self, ticket: int, worker_version: int) -> bool:
        with self._lock:
            return ticket < self.ticket_limit(worker_version)

    def trained_version(self, ticket: int) -> int:
        """The policy version at which the learner trains ``ticket``."""
        with self._lock:
            return rule.trained_version(ticket, updates_per_version=self.updates_per_version, layout=self.layout)

    def update_tickets(self, update: int) -> tuple[int, int]:
        """``(start, stop)`` of the tickets update ``update`` trains (laid out now if it was not yet)."""
        with self._lock:
            tickets = rule.update_tickets(update, layout=self.layout)
            return tickets.start, tickets.stop

    def update_of(self, ticket: int) -> int:
        """The update (0-based) that trains ``ticket``."""
        with self._lock:
            return self.layout.update_of(ticket)

    # ------------------------------------------------------------------ events
    def on_update(self, updates_done: int, time_progress: float | None = None) -> None:
        """The learner finished ``updates_done`` updates in total; ``time_progress``: the training time's share of
        ``trainer.total_time_minutes`` (updates laid out from now on use it; see :class:`TicketLayout`)."""
        with self._lock:
            self.learner_updates = max(self.learner_updates, int(updates_done))
            if time_progress is not None:
                self.layout.set_time_progress(time_progress)

    def state_dict(self) -> dict:
        """``learner_updates``, the ``threshold`` of the moment (a resumed ``auto`` run starts from it), and the
        update sizes laid out so far when they differ (``layout``)."""
        with self._lock:
            state = {"learner_updates": self.learner_updates, "threshold": self.threshold}
            layout = self.layout.state_dict()
            if layout:
                state["layout"] = layout
            return state

    def load_state_dict(self, state: dict) -> None:
        """Restore the update count and the layout; the threshold stays the configured one (the trainer restores
        an ``auto`` one)."""
        with self._lock:
            self.learner_updates = int(state["learner_updates"])
            self.layout.load_state_dict(state.get("layout", {}))


def _check_threshold(threshold) -> None:
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise ValueError(f"`trainer.v1.sampler.max_off_policy_threshold` = {threshold!r}: admission needs an integer "
                         ">= 0 (0 = on-policy).")
