"""The staleness rule, in one place: one function per question.

Versions count weight publications; the learner publishes version ``v+1``
after every ``P`` updates (``parameter_sync_step``; 1 in sync mode). A
sample's **lag** is the learner's version when it is trained minus the version
that generated it; ``max_off_policy_threshold`` ``T`` bounds it.

Under the ``wait`` strategy every prompt group gets a **ticket**, its place in
the training order, and update ``u`` trains exactly the tickets
``[u*B, (u+1)*B)`` (``B`` = prompt groups per batch), so ticket ``k`` is
trained at version ``floor(k / (P*B))``. A worker holding version ``v`` may
start ticket ``k`` only if ``k < (T + v + 1) * P * B``: then every lag is
within ``T`` by construction, however slow the worker. Under ``drop`` no
ticket is refused and the buffer evicts what went stale. When updates differ
in size (a tapered offline share hands its rows back to online groups),
``u*B`` becomes ``C(u)``, the prefix sum of the sizes
(:mod:`omnirl_async.actors.ticket_layout`), and the same argument holds with
``C((T + v + 1) * P)`` as the limit.

A threshold that changes during the run (``max_off_policy_threshold: auto``)
keeps the bound exact per sample: admission applies the value current when a
ticket is leased, the lease and its samples carry it (``max_lag``), and every
later check of a sample (the buffer's eviction) uses the bound it carries, not
the value of the moment. Lowering the threshold therefore never strands a
sample admitted under the old one, and raising it never loosens a sample's
bound after the fact: rule (1) holds lease by lease, so every trained sample
keeps ``lag <= max_lag``. (Why not re-check every sample against the current
value? Under ``wait`` a lowered value would evict groups that admission
promised a slot to, and the learner would wait on tickets that never land.)

Used by admission control (:mod:`omnirl_async.actors.staleness`), the
buffer's eviction (:mod:`omnirl_async.buffer.staleness`) and the trainer's
wait for a batch (:mod:`omnirl_async.trainer.separate_async`).
"""

from __future__ import annotations

__all__ = ["lag", "is_stale", "oldest_trainable_version", "last_trainable_version", "sample_bound", "ticket_limit",
           "trained_version", "update_tickets", "startup_batches"]


def lag(policy_version: int | None, learner_version: int) -> int:
    """How many versions behind the learner a sample is (offline samples, version None: 0)."""
    return 0 if policy_version is None else learner_version - policy_version


def is_stale(policy_version: int | None, learner_version: int, threshold: int | None) -> bool:
    """True when a sample of ``policy_version`` may not be trained at ``learner_version``."""
    return threshold is not None and lag(policy_version, learner_version) > threshold


def oldest_trainable_version(learner_version: int, threshold: int | None) -> int | None:
    """The smallest policy version still trainable at ``learner_version`` (None = no bound)."""
    return None if threshold is None else learner_version - threshold


def sample_bound(admitted: int | None, threshold: int | None) -> int | None:
    """The bound a sample is held to: the threshold it was admitted under (``max_lag``), else ``threshold``."""
    return threshold if admitted is None else admitted


def last_trainable_version(policy_version: int | None, bound: int | None) -> int | None:
    """The newest learner version that may train a sample of ``policy_version`` held to ``bound`` (None = any)."""
    return None if policy_version is None or bound is None else policy_version + bound


def _start(update: int, batch_groups: int | None, layout) -> int:
    """The first ticket of ``update``: ``update * batch_groups``, or ``layout.start(update)`` for updates that
    differ in size (:class:`~omnirl_async.actors.ticket_layout.TicketLayout`)."""
    if layout is not None:
        return layout.start(update)
    if not batch_groups:
        raise ValueError("the ticket rule needs `batch_groups` (groups per update) or a `layout`")
    return update * batch_groups


def ticket_limit(worker_version: int, *, threshold: int, updates_per_version: int, batch_groups: int | None = None,
                 layout=None) -> int:
    """The first ticket a worker holding ``worker_version`` may NOT start (``wait`` strategy)."""
    return _start((threshold + worker_version + 1) * updates_per_version, batch_groups, layout)


def trained_version(ticket: int, *, updates_per_version: int, batch_groups: int | None = None, layout=None) -> int:
    """The learner version at which ``ticket`` is trained."""
    if layout is not None:
        return layout.update_of(ticket) // updates_per_version
    return ticket // (updates_per_version * batch_groups)


def update_tickets(update: int, *, batch_groups: int | None = None, layout=None) -> range:
    """The tickets update ``update`` (0-based) trains."""
    return range(_start(update, batch_groups, layout), _start(update + 1, batch_groups, layout))


def startup_batches(*, threshold: int, updates_per_version: int) -> int:
    """Batches admission lets in before the first publication: a warm-up larger than this never fills."""
    return (threshold + 1) * updates_per_version
