"""One replay table: the samples of one source, grouped, sampled and removed.

A table composes (Reverb ``Table``; torchrl samplers/writers):

* a **schema** (:mod:`.schema`) – what a stored row looks like;
* a **sampler** (:mod:`.samplers`) – which *ready* groups a batch takes;
* **max_times_sampled** (:mod:`.removers.max_times_sampled`) – when a group
  leaves after use, and a **remover** (:mod:`.removers`) – which used group
  leaves first when room is needed;
* the **staleness policy** (:mod:`.staleness`) shared by all tables.

Group lifecycle: members arrive (in one put or several) → the group is
*complete* when all ``group_size`` members are reported → it becomes *ready*
(inserted into the sampler) unless it has no successful member, is stale, or
has a failed member under ``drop_incomplete_groups`` (then it is evicted and a
:class:`RefillRequest` is queued). Failed members are never stored with data;
they are counted in ``buffer/dropped_failed``.

The offline table (``keep_drawn``) is a fixed pool instead: a drawn group
stays, is never handed to the remover (so never evicted to make room) and
``max_times_sampled`` does not apply; its sampler walks shuffled passes
(:mod:`.samplers.passes`).

The table is not thread-safe; :class:`~omnirl_async.buffer.core.BufferCore`
holds the lock and does the blocking. Payloads are opaque to the table (a dict
of arrays in-process, an ``ObjectRef`` under Ray): an item is ``(payload,
row)``.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable, Sequence

import msgspec
import numpy as np

from omnirl_async.buffer.metrics import BufferMetrics
from omnirl_async.buffer.rate_limiters import RateLimiter
from omnirl_async.buffer.removers import MaxTimesSampled, Remover
from omnirl_async.buffer.samplers import GroupInfo, Sampler
from omnirl_async.buffer.schema import FieldSpec, Schema
from omnirl_async.buffer.staleness import StalenessPolicy
from omnirl_async.protocol import RefillRequest, SampleMeta, SampleSource, SampleStatus

__all__ = ["Table", "Item", "Group"]

log = logging.getLogger(__name__)


class Item:
    __slots__ = ("meta", "payload", "row", "nbytes")

    def __init__(self, meta: SampleMeta, payload: Any, row: int, nbytes: int) -> None:
        self.meta, self.payload, self.row, self.nbytes = meta, payload, row, nbytes


def group_ticket(g: "Group") -> int:
    """The group's admission ticket (every member carries the same one; -1 = none)."""
    tickets = [it.meta.tags.ticket for it in g.members.values()] + [m.tags.ticket for m in g.failed.values()]
    return min(tickets) if tickets else -1


def _bounds(g: "Group") -> list[int | None]:
    """The staleness bounds the group's members were admitted under (``tags.max_lag``; None = the threshold)."""
    return [it.meta.tags.max_lag for it in g.members.values()]


class Group:
    __slots__ = ("uid", "size", "order", "members", "failed", "times_sampled", "ready", "priority", "version",
                 "expiry")

    def __init__(self, uid: str, size: int, order: int) -> None:
        self.uid, self.size, self.order = uid, size, order
        self.members: dict[int, Item] = {}
        self.failed: dict[int, SampleMeta] = {}
        self.times_sampled = 0
        self.ready = False
        self.priority = 1.0
        self.version: int | None = None
        self.expiry: int | None = None  # the newest learner version that may train it (set when ready)

    @property
    def reported(self) -> int:
        return len(self.members) + len(self.failed)

    def items(self) -> list[Item]:
        return [self.members[i] for i in sorted(self.members)]


class Table:
    def __init__(self, source: SampleSource, *, sampler: Sampler, remover: Remover, max_times: MaxTimesSampled,
                 max_size: int, staleness: StalenessPolicy, limiter: RateLimiter, metrics: BufferMetrics,
                 drop_incomplete_groups: bool = False, max_refill_rounds: int = 3, keep_drawn: bool = False) -> None:
        self.source = SampleSource(source)
        #: a fixed pool (the offline table): drawn groups stay and are never evicted to make room
        self.keep_drawn = keep_drawn
        self.name = self.source.value
        self.schema = Schema(table=self.name)
        self.sampler, self.remover, self.max_times = sampler, remover, max_times
        self.max_size, self.staleness, self.limiter, self.metrics = max_size, staleness, limiter, metrics
        self.drop_incomplete_groups, self.max_refill_rounds = drop_incomplete_groups, max_refill_rounds
        self.items: dict[str, Item] = {}
        self.groups: dict[str, Group] = {}
        self.by_expiry: dict[int, set[str]] = {}  # ready online groups by the last learner version to train them
        self.refill_rounds: dict[str, int] = {}
        self.refills: list[RefillRequest] = []
        self.ready_samples = 0
        self.nbytes = 0
        self._order = 0
        #: called with each group as it leaves the table, whatever the reason (the Ray controller counts the
        #: rows still pointing at each payload: :mod:`.wire_ledger`)
        self.on_remove: Callable[[Group], None] | None = None

    @property
    def size(self) -> int:
        return len(self.items)

    # ---------------------------------------------------------------- put
    def validate(self, metas: Sequence[SampleMeta], spec: dict[str, FieldSpec],
                 exists: Callable[[str], bool]) -> None:
        """Raise ``ValueError`` (naming the key) if any sample of the batch may not be stored."""
        slots: set[tuple[str, int]] = set()
        seen: set[str] = set()
        for m in metas:
            k = m.key
            if k in seen or exists(k):
                raise ValueError(f"put rejected: key `{k}` is already in the buffer (or twice in this put)")
            seen.add(k)
            t = m.tags
            if m.status not in (SampleStatus.SUCCESS, SampleStatus.FAILURE):
                raise ValueError(f"put rejected: sample `{k}` has status {m.status.value!r}; only 'success' "
                                 "or 'failure' (with a reason) can be put")
            if not (isinstance(t.group_size, int) and t.group_size >= 1
                    and isinstance(t.sample_index, int) and 0 <= t.sample_index < t.group_size):
                raise ValueError(f"put rejected: sample `{k}` has tags.sample_index={t.sample_index!r}, "
                                 f"tags.group_size={t.group_size!r}; need 0 <= sample_index < group_size")
            g = self.groups.get(t.group_uid)
            if g is not None and g.size != t.group_size:
                raise ValueError(f"put rejected: sample `{k}` says group `{t.group_uid}` has group_size "
                                 f"{t.group_size}, earlier members said {g.size}")
            slot = (t.group_uid, t.sample_index)
            if slot in slots or (g is not None and (t.sample_index in g.members or t.sample_index in g.failed)):
                raise ValueError(f"put rejected: sample `{k}`: member {t.sample_index} of group "
                                 f"`{t.group_uid}` was already reported")
            slots.add(slot)
            if m.status is SampleStatus.SUCCESS:
                if m.reward is None or not math.isfinite(m.reward):
                    raise ValueError(f"put rejected: sample `{k}` field `reward` = {m.reward!r}; a successful "
                                     "sample needs a finite reward (report it as status='failure' with a "
                                     "reason instead)")
                if self.source is SampleSource.ONLINE and not isinstance(t.policy_version, int):
                    raise ValueError(f"put rejected: sample `{k}` field `tags.policy_version` = "
                                     f"{t.policy_version!r}; online samples need the version that generated them")
        first_ok = next((m.key for m in metas if m.status is SampleStatus.SUCCESS), None)
        if first_ok is not None:
            self.schema.check(spec, key=first_ok)

    def insert(self, metas: Sequence[SampleMeta], payload: Any, row_nbytes: int,
               learner_version: int | None) -> int:
        """Store a validated batch; returns the number of successful samples stored."""
        row = 0
        touched: dict[str, Group] = {}
        for m in metas:
            t = m.tags
            g = self.groups.get(t.group_uid)
            if g is None:
                g = self.groups[t.group_uid] = Group(t.group_uid, t.group_size, self._order)
                self._order += 1
            if t.policy_version is not None:
                g.version = t.policy_version if g.version is None else min(g.version, t.policy_version)
            if m.status is SampleStatus.SUCCESS:
                item = Item(m, payload, row, row_nbytes)
                row += 1
                g.members[t.sample_index] = item
                self.items[m.key] = item
                self.nbytes += row_nbytes
            else:
                g.failed[t.sample_index] = m
                self.metrics.on_failed(m.reason, t.prompt)
            touched[g.uid] = g
        for g in touched.values():
            if g.reported == g.size:
                self._complete(g, learner_version)
        return row

    def _complete(self, g: Group, learner_version: int | None) -> None:
        n_failed = len(g.failed)
        if n_failed:
            self.metrics.count("dropped_failed", n_failed)
        if n_failed and self.drop_incomplete_groups:
            self._refill_or_drop(g)  # also a group with no successful member: it is the most incomplete
            return
        if not g.members:
            self._remove(g)
            return
        self.refill_rounds.pop(g.uid, None)
        if learner_version is not None and self.staleness.is_stale(g.version, learner_version, _bounds(g)):
            self._drop_stale(g, learner_version)
            return
        rewards = [it.meta.reward for it in g.members.values()]
        g.priority = float(np.std(rewards)) if len(rewards) > 1 else 1.0
        g.ready = True
        self.ready_samples += len(g.members)
        self.sampler.insert(g.uid, GroupInfo(order=g.order, policy_version=g.version, size=len(g.members),
                                             priority=g.priority, ticket=group_ticket(g)))
        self.index_fresh(g)

    def index_fresh(self, g: Group) -> None:
        """Index a ready online group by the newest learner version that may train it (its policy version plus
        the bound it was admitted under, ``tags.max_lag``, else the threshold), so eviction finds it in O(1)."""
        g.expiry = self.staleness.last_trainable_version(g.version, _bounds(g))
        if self.source is SampleSource.ONLINE and g.expiry is not None:
            self.by_expiry.setdefault(g.expiry, set()).add(g.uid)

    def _refill_or_drop(self, g: Group) -> None:
        rounds = self.refill_rounds.get(g.uid, 0)
        any_meta = next(iter(g.members.values())).meta if g.members else next(iter(g.failed.values()))
        failed = [g.failed[i] for i in sorted(g.failed)]
        self.limiter.on_drop(len(g.members), 0)
        self._remove(g)
        if rounds >= self.max_refill_rounds:
            self.refill_rounds.pop(g.uid, None)
            self.metrics.count("dropped_incomplete_groups")
            log.warning("group `%s` still had failed members after %d refill rounds; dropped", g.uid, rounds)
            return
        self.refill_rounds[g.uid] = rounds + 1
        t = any_meta.tags
        self.refills.append(RefillRequest(
            group_uid=g.uid, prompt=t.prompt, n=g.size, round=rounds + 1, failed_keys=[m.key for m in failed],
            reasons=[m.reason or "" for m in failed], seed=t.seed, epoch=t.epoch, global_step=t.global_step,
            source=self.source))
        self.metrics.count("refill_requests")

    # ------------------------------------------------------------- lost payloads
    def lose(self, g: Group, reason: str) -> bool:
        """The group's payload died with its owner: remove it; regenerate it (a refill) if it was never trained.

        Returns whether a refill was queued. A group already drawn once (kept
        for reuse, ``max_times_sampled`` > 1) was trained: it just leaves.
        """
        first = next(iter(g.members.values())).meta if g.members else None
        self.limiter.on_drop(len(g.members), g.times_sampled)
        self._remove(g)
        if first is None or g.times_sampled > 0 or self.keep_drawn:
            return False
        self.refill_lost(first, reason)
        return True

    def refill_lost(self, meta: SampleMeta, reason: str) -> None:
        """Queue the regeneration of ``meta``'s group, whose payload was lost before it was ever trained."""
        t = meta.tags
        self.refills.append(RefillRequest(
            group_uid=t.group_uid, prompt=t.prompt, n=t.group_size, round=self.refill_rounds.get(t.group_uid, 0),
            reasons=[reason], seed=t.seed, epoch=t.epoch, global_step=t.global_step, source=self.source))
        self.metrics.count("regenerated_groups")

    # ------------------------------------------------------------- removal
    def _remove(self, g: Group) -> None:
        """The one way out of the table for a group (and its rows)."""
        if self.on_remove is not None:
            self.on_remove(g)
        for it in g.members.values():
            del self.items[it.meta.key]
            self.nbytes -= it.nbytes
        if g.ready:
            self.sampler.remove(g.uid)
            self.ready_samples -= len(g.members)
            if g.expiry is not None and self.source is SampleSource.ONLINE:
                bucket = self.by_expiry.get(g.expiry)
                if bucket is not None:
                    bucket.discard(g.uid)
                    if not bucket:
                        del self.by_expiry[g.expiry]
        self.remover.remove(g.uid)
        del self.groups[g.uid]

    def _drop_stale(self, g: Group, learner_version: int) -> None:
        n = len(g.members)
        self.limiter.on_drop(n, g.times_sampled)
        self.metrics.count("dropped_stale", n)
        self.staleness.on_dropped(n, learner_version)
        self._remove(g)

    def evict_stale(self, learner_version: int) -> int:
        """Evict ready groups too old for ``learner_version`` (each by its own bound); O(evicted + #versions)."""
        n = 0
        for e in [e for e in self.by_expiry if e < learner_version]:
            for gid in list(self.by_expiry.get(e, ())):
                g = self.groups[gid]
                n += len(g.members)
                self._drop_stale(g, learner_version)
        return n

    def evict_one(self) -> bool:
        """Evict the remover's victim (a group already sampled); False if none is evictable."""
        gid = self.remover.victim()
        if gid is None:
            return False
        g = self.groups[gid]
        self.limiter.on_drop(len(g.members), g.times_sampled)
        self.metrics.count("evicted", len(g.members))
        self._remove(g)
        return True

    def clear(self) -> None:
        """Remove every group; the schema is inferred again from the next put."""
        for g in list(self.groups.values()):
            self._remove(g)
        self.refills.clear()
        self.refill_rounds.clear()
        self.schema = Schema(table=self.name)

    # -------------------------------------------------------------- sample
    def ready_groups(self, learner_version: int | None) -> tuple[int, int]:
        """(groups, samples) ready and fresh at ``learner_version``."""
        if learner_version is None:
            return len(self.sampler), self.ready_samples
        stale = [self.groups[gid] for e, s in self.by_expiry.items() if e < learner_version for gid in s]
        return len(self.sampler) - len(stale), self.ready_samples - sum(len(g.members) for g in stale)

    def sample(self, m: int, learner_version: int, rng: np.random.Generator) -> list[tuple[Group, list[Item]]]:
        """Take whole ready groups until they hold >= ``m`` samples (caller checked availability)."""
        chosen: list[Group] = []
        total = 0
        gen = self.sampler.draw(rng, learner_version=learner_version)
        try:
            for gid in gen:
                g = self.groups[gid]
                chosen.append(g)
                total += len(g.members)
                if total >= m:
                    break
        finally:
            gen.close()
        if total < m:
            raise RuntimeError(f"{type(self.sampler).__name__} yielded {total} samples, {m} were available")
        return self._take(chosen)

    def ticket_range_ready(self, below: int) -> list[Group]:
        """Ready groups with an admission ticket in ``[0, below)``, lowest ticket first."""
        found = [(group_ticket(g), g.order, g) for g in self.groups.values() if g.ready]
        return [g for t, _, g in sorted(found, key=lambda x: (x[0], x[1])) if 0 <= t < below]

    def sample_tickets(self, below: int) -> list[tuple[Group, list[Item]]]:
        """Take every ready group whose ticket is below ``below`` (the learner's next update, ``wait``)."""
        return self._take(self.ticket_range_ready(below))

    def _take(self, chosen: list[Group]) -> list[tuple[Group, list[Item]]]:
        out = []
        for g in chosen:
            g.times_sampled += 1
            items = g.items()
            for it in items:
                it.meta = msgspec.structs.replace(it.meta, times_sampled=it.meta.times_sampled + 1)
            out.append((g, items))
            if self.keep_drawn:
                continue
            if self.max_times.exhausted(g.times_sampled):
                self._remove(g)
            else:
                self.remover.insert(g.uid, g.order)
        return out

    def update_priority(self, gid: str, priority: float) -> None:
        g = self.groups.get(gid)
        if g is not None:
            g.priority = float(priority)
            if g.ready:
                self.sampler.update_priority(gid, g.priority)

    # --------------------------------------------------------------- query
    def list_keys(self, partition: str | None, tag_filter: dict[str, Any]) -> Iterable[str]:
        for k, it in self.items.items():
            m = it.meta
            if partition is not None and m.partition != partition:
                continue
            if all(getattr(m.tags, name) == want for name, want in tag_filter.items()):
                yield k

    def describe(self, learner_version: int | None = None) -> str:
        rg, rs = self.ready_groups(learner_version)
        incomplete = sum(1 for g in self.groups.values() if g.reported < g.size)
        pending = sum(len(g.members) for g in self.groups.values() if g.reported < g.size)
        return (f"{self.name} table: {rs} ready samples in {rg} complete groups, {incomplete} incomplete "
                f"groups holding {pending} samples, {self.size}/{self.max_size} stored")
