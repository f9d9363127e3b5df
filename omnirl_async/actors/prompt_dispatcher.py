"""Exactly-once prompt leases.

The dispatcher owns the prompt order of every epoch and hands prompts out as
:class:`~omnirl_async.protocol.PromptLease` objects. A lease is *outstanding*
until the worker completes it (its samples reached the buffer) or it is
released (the worker failed or died); a released lease goes back to the front
of the queue so that its prompt is generated again, still once per epoch.

Every lease also carries a **ticket**, its place in the learner's training
order; with an :class:`~omnirl_async.actors.staleness.AdmissionController` the
dispatcher hands a ticket only to a worker whose policy version keeps the
staleness bound (``wait`` strategy). A released lease keeps its ticket and
group uid, so its samples keep their place when they are generated again.
Every lease handed out carries the threshold it was admitted under
(``max_lag``; a released lease is admitted, and stamped, again), so a threshold
changed mid-run (:meth:`set_threshold`) applies to the next lease at once while
the samples of earlier leases keep their own bound.

A lease also carries the other fields of its prompt's dataset row (``fields``:
ground truth, metadata; :class:`~omnirl_async.data.prompts.PromptSet`), so the
worker that scores it hands them to the reward in both modes.

A completed lease is remembered until the trainer says its group was
trained (:meth:`mark_trained`) or settled (:meth:`settle_below`: trained,
failed or dropped). State (epoch, cursor, the order of the current epoch,
tickets, the leases not yet completed and the completed ones not yet trained)
is saved with checkpoints; on restore outstanding leases return to the queue,
and so do completed-but-untrained ones when the buffer snapshot that held their
samples is not restored, so a crash neither loses nor duplicates a prompt.

The class is plain Python; ``ray.remote(PromptDispatcher)`` makes it the
shared actor of the asynchronous mode.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from omnirl_async.actors.staleness import AdmissionController, LockedState
from omnirl_async.protocol import PromptLease, new_uid

__all__ = ["PromptDispatcher", "sample_seeds"]


def sample_seeds(lease: PromptLease) -> list[int | None]:
    """Per-sample seeds of a lease: a pure function of (lease seed, prompt index, sample index)."""
    if lease.seed is None:
        return [None] * lease.n
    state = np.random.SeedSequence([int(lease.seed), int(lease.index), int(lease.epoch)]).generate_state(lease.n)
    return [int(s) for s in state]


class PromptDispatcher(LockedState):
    def __init__(self, prompts: list[str], *, n: int, shuffle: bool = True, data_seed: int = 1,
                 rollout_seed: int | None = 42, total_epochs: int | None = None,
                 negative_prompt: str | None = None, admission: AdmissionController | None = None,
                 batch_groups: int | None = None, fields: list[dict] | None = None):
        if not prompts:
            raise ValueError("`prompts` is empty: the prompt dataset has no rows; check `data.train_files`.")
        fields = getattr(prompts, "fields", None) if fields is None else fields  # a PromptSet carries its rows
        if fields is not None and len(fields) != len(prompts):
            raise ValueError(f"`fields` has {len(fields)} rows for {len(prompts)} prompts")
        self.fields = [f or None for f in fields] if fields is not None else None
        self.prompts = list(prompts)
        self.n, self.shuffle, self.data_seed = n, shuffle, data_seed
        self.rollout_seed, self.total_epochs = rollout_seed, total_epochs
        self.negative_prompt = negative_prompt
        self.admission = admission
        self.batch_groups = batch_groups or (admission.batch_groups if admission is not None else None)
        self._lock = threading.Lock()
        #: notified whenever a refused lease might now be granted (waiting leases, see ``lease(wait_s=...)``)
        self._changed = threading.Condition(self._lock)
        #: the newest weights version the trainer announced as published (``on_update(published_version=)``): a
        #: lease is admitted as if its worker held it, and the worker installs it before generating
        self._published: int | None = None
        self._woken_at = 0.0  # monotonic time of the last change that may admit a waiting lease
        self._next_ticket = 0
        self._done_frontier = 0  # every ticket below this one is completed
        self._done_above: set[int] = set()
        self._paused = False
        self._stopped = False
        self.epoch = 0
        self._order = self._epoch_order(0)
        self._cursor = 0
        self._returned: deque[PromptLease] = deque()  # released leases, re-issued with the same ticket
        self._outstanding: dict[str, tuple[PromptLease, str]] = {}
        self._untrained: dict[int, PromptLease] = {}  # completed leases by ticket, until trained or settled

    # ------------------------------------------------------------------ order
    def _epoch_order(self, epoch: int) -> list[int]:
        idx = np.arange(len(self.prompts))
        if self.shuffle:
            np.random.default_rng([self.data_seed, epoch]).shuffle(idx)
        return idx.tolist()

    def _fields_of(self, index: int) -> dict | None:
        """The other fields of prompt ``index``'s row (None without any, or for an unknown index)."""
        return self.fields[index] if self.fields is not None and 0 <= index < len(self.fields) else None

    def _admits(self, ticket: int, worker_version: int | None) -> bool:
        if self.admission is None:
            return True
        return self.admission.admits(ticket, 0 if worker_version is None else worker_version)

    def _take_returned(self, worker_version: int | None) -> PromptLease | None:
        for k, lease in enumerate(self._returned):
            if self._admits(lease.ticket, worker_version):
                del self._returned[k]
                return lease
        return None

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
            return True
        return False

    # ------------------------------------------------------------------ leases
    def lease(self, num: int, *, global_step: int | None, worker_id: str = "driver",
              worker_version: int | None = None, cross_epoch: bool = True,
              wait_s: float = 0.0) -> list[PromptLease]:
        """Up to ``num`` new leases; fewer when the run is exhausted, paused, or admission says wait.

        ``worker_version`` is the policy version the worker will generate with;
        admission control uses it. ``global_step=None`` means "the learner step
        that will train this ticket" (``ticket // batch_groups + 1``), which seeds
        the group the same way however the workers interleave. With ``cross_epoch`` the next epoch starts
        when the current one is fully leased, so one call may return prompts
        of two epochs.

        ``wait_s`` > 0: when nothing can be leased, wait up to that long for
        something that may change it (a learner update, leases given back or
        requeued, a new threshold, un-pausing, stop) instead of returning at
        once – one call per wait instead of a poll every few milliseconds. A
        learner update that publishes weights admits waiting leases at the new
        version at once (they return granted; the others keep waiting), so no
        worker has to come back to learn the version first. Returns early,
        empty, on stop. The actor needs a thread per waiting worker
        (``max_concurrency``).

        Each lease carries ``weights_version``: the version admission counted
        on, ``max(worker_version, newest published)``; the worker installs that
        version or a newer one before generating; and ``admission_wait_s``, how
        long this call waited, up to the change that admitted the lease.
        """
        start = time.monotonic()
        deadline = start + max(0.0, float(wait_s))
        waited = False
        with self._lock:
            while True:
                out = self._lease_locked(num, global_step, worker_id, worker_version, cross_epoch)
                now = time.monotonic()
                if out or now >= deadline or self._stopped:
                    if out and waited:  # the wait ends at the change that admitted it; what follows is delivery
                        end = self._woken_at if start < self._woken_at <= now else now
                        for lease in out:
                            lease.admission_wait_s = end - start
                    return out
                self._changed.wait(deadline - now)
                waited = True

    def published_version(self) -> int | None:
        """The newest weights version announced as published (None before the first announcement)."""
        with self._lock:
            return self._published

    def _lease_locked(self, num: int, global_step: int | None, worker_id: str, worker_version: int | None,
                      cross_epoch: bool) -> list[PromptLease]:
        out: list[PromptLease] = []
        if self._paused or self._stopped:
            return out
        bound = self.admission.bound() if self.admission is not None else None  # travels as max_lag
        if self._published is not None and (worker_version is None or worker_version < self._published):
            worker_version = self._published  # the worker installs it before generating (lease.weights_version)
        while len(out) < num:
            lease = self._take_returned(worker_version)
            if lease is not None:  # same ticket, group uid and seed; a new lease id, admitted again now
                lease = PromptLease(**{**_fields(lease), "lease_id": new_uid(), "max_lag": bound,
                                       "weights_version": worker_version, "admission_wait_s": 0.0})
            else:
                if not self._admits(self._next_ticket, worker_version):
                    break
                if self._cursor >= len(self._order):
                    if self._returned or not (cross_epoch and self._maybe_advance_epoch()):
                        break
                i = self._order[self._cursor]
                self._cursor += 1
                step = global_step if global_step is not None else self._step_of(self._next_ticket)
                seed = None if self.rollout_seed is None else int(self.rollout_seed) + step - 1
                lease = PromptLease(lease_id=new_uid(), group_uid=new_uid(), prompt=self.prompts[i],
                                    epoch=self.epoch, index=i, n=self.n, seed=seed, global_step=step,
                                    negative_prompt=self.negative_prompt, ticket=self._next_ticket,
                                    max_lag=bound, fields=self._fields_of(i), weights_version=worker_version)
                self._next_ticket += 1
            self._outstanding[lease.lease_id] = (lease, worker_id)
            out.append(lease)
        return out

    def _step_of(self, ticket: int, *, strict: bool = True) -> int:
        """The learner step (1-based) that trains ``ticket``: from admission's ticket layout, else
        ``ticket // batch_groups + 1``."""
        if self.admission is not None:
            return self.admission.update_of(ticket) + 1
        if not self.batch_groups:
            if not strict:
                return ticket + 1
            raise ValueError("`global_step` is None but the dispatcher has no batch_groups to derive it from the "
                             "ticket")
        return ticket // self.batch_groups + 1

    def update_tickets(self, update: int) -> tuple[int, int]:
        """``(start, stop)`` of the tickets update ``update`` (0-based) trains, from admission's layout (fixed
        the first time it is asked for; see :mod:`omnirl_async.actors.ticket_layout`)."""
        if self.admission is None:
            raise ValueError("`update_tickets` needs an AdmissionController (separate_async)")
        return self.admission.update_tickets(update)

    def _wake(self) -> None:
        """Under the lock: waiting leases look again."""
        self._woken_at = time.monotonic()
        self._changed.notify_all()

    def complete(self, lease_ids: list[str]) -> None:
        with self._lock:
            for lid in lease_ids:
                entry = self._outstanding.pop(lid, None)
                if entry is None:
                    raise KeyError(f"lease {lid!r} is not outstanding (completed twice, or never leased)")
                self._done_above.add(entry[0].ticket)
                self._untrained[entry[0].ticket] = entry[0]
            while self._done_frontier in self._done_above:
                self._done_above.discard(self._done_frontier)
                self._done_frontier += 1

    def release(self, lease_ids: list[str]) -> None:
        """Give leases back: their prompts are generated again (front of the queue)."""
        with self._lock:
            for lid in reversed(lease_ids):
                entry = self._outstanding.pop(lid, None)
                if entry is not None:
                    self._returned.appendleft(entry[0])
            self._wake()

    def mark_trained(self, tickets: list[int]) -> None:
        """The groups of these tickets were trained: forget their leases."""
        with self._lock:
            for t in tickets:
                self._untrained.pop(int(t), None)

    def settle_below(self, ticket: int) -> None:
        """Every ticket below ``ticket`` was trained, failed or dropped: forget their leases."""
        with self._lock:
            for t in [t for t in self._untrained if t < ticket]:
                del self._untrained[t]

    def num_untrained(self) -> int:
        with self._lock:
            return len(self._untrained)

    def requeue(self, group_uid: str, prompt: str, n: int, *, global_step: int | None = None,
                epoch: int | None = None) -> None:
        """Generate a group again under the same ``group_uid`` (the buffer evicted it: a member failed, or its
        payload died with the worker that owned it).

        It gets a new ticket at the end of the training order, so admission
        control treats it like any new prompt.
        """
        with self._lock:
            step = global_step if global_step is not None else self._step_of(self._next_ticket, strict=False)
            seed = None if self.rollout_seed is None else int(self.rollout_seed) + step - 1 + 7919
            orig = next((x for x in self._untrained.values() if x.group_uid == group_uid), None)
            if orig is not None and orig.prompt == prompt:  # its own row, also when two rows share the prompt
                index = orig.index
                # its samples are gone: the new lease stands for it (a resume must not generate it twice)
                self._untrained.pop(orig.ticket, None)
            else:
                index = self.prompts.index(prompt) if prompt in self.prompts else -1
            self._returned.append(PromptLease(lease_id=new_uid(), group_uid=group_uid, prompt=prompt,
                                              epoch=self.epoch if epoch is None else int(epoch), index=index, n=n, seed=seed, global_step=step,
                                              negative_prompt=self.negative_prompt, ticket=self._next_ticket,
                                              fields=self._fields_of(index)))
            self._next_ticket += 1
            self._wake()

    def release_worker(self, worker_id: str) -> int:
        """Return every lease held by a (dead) worker; returns how many."""
        with self._lock:
            ids = [lid for lid, (_, w) in self._outstanding.items() if w == worker_id]
        self.release(ids)
        return len(ids)

    def outstanding(self, worker_id: str | None = None) -> list[PromptLease]:
        with self._lock:
            return [lease for lease, w in self._outstanding.values() if worker_id is None or w == worker_id]

    def exhausted(self) -> bool:
        """No prompt is left to lease in the whole run (leases may still be outstanding)."""
        with self._lock:
            last = self.total_epochs is not None and self.epoch + 1 >= self.total_epochs
            return last and self._cursor >= len(self._order) and not self._returned

    def tickets_done(self) -> int:
        """``N`` such that every ticket below ``N`` is completed (its samples reached the buffer)."""
        with self._lock:
            return self._done_frontier

    def tickets_issued(self) -> int:
        with self._lock:
            return self._next_ticket

    def on_update(self, updates_done: int, time_progress: float | None = None, *,
                  published_version: int | None = None) -> None:
        """The learner finished ``updates_done`` updates (admission capacity grows); ``time_progress``: the share
        of ``trainer.total_time_minutes`` trained so far (sizes updates laid out from now on);
        ``published_version``: the weights version the weight store now holds as its newest (announce it only
        once a worker can fetch it): leases from now on are admitted at it and ask their worker to install it."""
        if self.admission is not None:
            self.admission.on_update(updates_done, time_progress)
        with self._lock:
            if published_version is not None:
                if self._published is not None and published_version < self._published:
                    raise ValueError(f"`published_version` {published_version} is older than the announced "
                                     f"{self._published}; versions only grow")
                self._published = published_version
            self._wake()

    def set_threshold(self, threshold: int) -> None:
        """Admit the next lease under ``threshold`` (``max_off_policy_threshold: auto``); needs admission control."""
        if self.admission is None:
            raise ValueError("`set_threshold` needs an AdmissionController (separate_async); sync trains on-policy")
        with self._lock:  # never between a lease's admission and its max_lag stamp
            self.admission.set_threshold(threshold)
            self._wake()

    def threshold(self) -> int | None:
        """The threshold the next lease is admitted under (None without admission control)."""
        return self.admission.bound() if self.admission is not None else None

    def pause(self, paused: bool = True) -> None:
        with self._lock:
            self._paused = paused
            self._wake()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._wake()

    def should_stop(self) -> bool:
        with self._lock:
            return self._stopped

    def epoch_now(self) -> int:
        with self._lock:
            return self.epoch

    def num_outstanding(self) -> int:
        with self._lock:
            return len(self._outstanding)

    # ------------------------------------------------------------------ state
    def get_state(self) -> dict:
        with self._lock:
            pending = [_fields(x) for x in self._returned] + [_fields(x) for x, _ in self._outstanding.values()]
            return {"epoch": self.epoch, "cursor": self._cursor, "order": list(self._order),
                    "pending": pending, "num_prompts": len(self.prompts), "next_ticket": self._next_ticket,
                    "done_frontier": self._done_frontier, "done_above": sorted(self._done_above),
                    "untrained": [_fields(x) for _, x in sorted(self._untrained.items())],
                    "admission": self.admission.state_dict() if self.admission is not None else None}

    def set_state(self, state: dict, *, samples_restored: bool = True) -> int:
        """Restore a :meth:`get_state`; returns how many completed-but-untrained groups were leased again.

        ``samples_restored`` says whether the buffer snapshot holding the
        samples of completed, untrained groups was restored too; when it was
        not, those groups go back to the queue (same ticket, group uid and
        seed) and their tickets count as not done, so they are generated again
        and trained once. So do the groups of the tickets listed under
        ``state["held"]`` in any case: the trainer had already taken them out
        of the buffer for its next update when it saved (separate_async
        samples a batch ahead), so no snapshot holds them.
        """
        if state["num_prompts"] != len(self.prompts):
            raise ValueError(f"checkpoint has {state['num_prompts']} prompts but the dataset has "
                             f"{len(self.prompts)}; resume needs the same `data.train_files`.")
        untrained = [PromptLease(**p) for p in state.get("untrained", [])]
        held = {int(t) for t in state.get("held", [])}
        lost = untrained if not samples_restored else [x for x in untrained if x.ticket in held]
        with self._lock:
            self.epoch = int(state["epoch"])
            self._order = [int(i) for i in state["order"]]
            self._cursor = int(state["cursor"])
            pending = [PromptLease(**p) for p in state["pending"]]
            done_above = {int(t) for t in state["done_above"]}
            frontier = int(state["done_frontier"])
            redo = {x.ticket for x in lost}
            self._untrained = {x.ticket: x for x in untrained if x.ticket not in redo}
            if redo:
                # their samples are gone with the process: generate them again under their own tickets
                pending += lost
                below = [t for t in range(frontier) if t in redo]
                if below:
                    done_above |= set(range(min(below), frontier)) - redo
                    frontier = min(below)
                done_above -= redo
            self._returned = deque(sorted(pending, key=lambda x: x.ticket))
            self._outstanding.clear()
            self._next_ticket = int(state["next_ticket"])
            self._done_frontier = frontier
            self._done_above = done_above
        if self.admission is not None and state.get("admission"):
            self.admission.load_state_dict(state["admission"])
        return len(lost)


def _fields(lease: PromptLease) -> dict:
    return {f: getattr(lease, f) for f in lease.__struct_fields__}
