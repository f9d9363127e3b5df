"""The buffer core: tables per source, one lock, blocking with timeouts.

Shared by :class:`~omnirl_async.buffer.local.LocalReplayBuffer` (payload =
dict of arrays) and the Ray transfer-queue controller (payload = ``ObjectRef``
owned by a storage unit). The core never touches tensor bytes, so the same
code enforces the same semantics in both.

Capacity, in order of checks on a put:

1. ``buffer.max_size`` – samples per table;
2. ``transfer_queue.total_storage_size`` – samples in all tables, or, when it
   is null, ``transfer_queue.memory_budget_bytes`` – bytes in all tables.

When a put does not fit, groups the remover marks evictable (already sampled,
kept for reuse) are evicted oldest first; if that is not enough, the producer
waits – data never sampled is never dropped to make room.

The offline table is a fixed pool of preference pairs (filled from the run's
offline store, :mod:`.offline_table`): its groups stay when drawn and are
never evicted, it draws shuffled passes (:mod:`.samplers.passes`), and it is
outside the rate limiter, the staleness accounting and ``ready`` (which count
the online rollouts). :meth:`BufferCore.sample_offline` draws the offline
share that goes with an online batch, ``buffer.offline_mix_ratio`` of all
rows drawn, carrying the rounding over from call to call.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

import numpy as np

from omnirl_async.buffer.metrics import BufferMetrics
from omnirl_async.buffer.rate_limiters import MinSize, RateLimiter, SampleToInsertRatio
from omnirl_async.buffer.removers import MaxTimesSampled, make_remover
from omnirl_async.buffer.samplers import ShuffledPassSampler, make_sampler
from omnirl_async.buffer.schema import FieldSpec
from omnirl_async.buffer.spec import BufferSpec, RateSpec
from omnirl_async.buffer.staleness import StalenessPolicy
from omnirl_async.buffer.table import Item, Table
from omnirl_async.protocol import RefillRequest, SampleMeta, SampleSource, SampleStatus

__all__ = ["BufferCore"]


class BufferCore:
    """The tables and their lock, built from a :class:`~omnirl_async.buffer.spec.BufferSpec` (checked there)."""

    def __init__(self, spec: BufferSpec, *, seed: int | None = None) -> None:
        if not isinstance(spec, BufferSpec):
            raise ValueError(f"`spec` = {spec!r}: must be a BufferSpec (build one from the config sections with "
                             "BufferSpec.from_sections)")
        self.spec = spec
        t = spec.table
        self.max_times = MaxTimesSampled(t.max_times_sampled)
        self.limiter = self._make_limiter(spec.rate)
        self.staleness = StalenessPolicy(spec.staleness.threshold, spec.staleness.strategy)
        self.offline_mix_ratio = float(spec.offline_mix_ratio)
        self.total_storage_size = spec.capacity.total_storage_size
        self.memory_budget_bytes = int(spec.capacity.memory_budget_bytes)
        self.default_timeout = float(spec.capacity.put_timeout_s)
        self.metrics = BufferMetrics()
        self.tables: dict[str, Table] = {}
        for src in SampleSource:
            offline = src is SampleSource.OFFLINE
            sampler = ShuffledPassSampler(seed) if offline else make_sampler(
                t.sampler, custom_path=t.custom_sampler_path, custom_name=t.custom_sampler_name,
                defaults=t.sampler_defaults(), kwargs=t.sampler_kwargs)
            self.tables[src.value] = Table(
                src, sampler=sampler, remover=make_remover(t.remover), max_times=self.max_times,
                max_size=t.max_size, staleness=self.staleness, limiter=self.limiter, metrics=self.metrics,
                drop_incomplete_groups=bool(t.drop_incomplete_groups), max_refill_rounds=int(t.max_refill_rounds),
                keep_drawn=offline)
        #: offline groups filled from an offline store: group uid -> the pair's position in the store
        #: (snapshots refer to these rows instead of copying them; see :mod:`.offline_table`)
        self.store_rows: dict[str, int] = {}
        #: the offline store they come from: {"dir": ..., "content_hash": ...} (None: not filled from one)
        self.offline_store: dict[str, str] | None = None
        self.rng = np.random.default_rng(seed)
        self.cond = threading.Condition()
        self.learner_version: int | None = None

    @staticmethod
    def _make_limiter(rate: RateSpec) -> RateLimiter:
        if rate.samples_per_insert is None:
            return MinSize(rate.min_size)
        return SampleToInsertRatio(rate.samples_per_insert, rate.min_size, rate.error_buffer)

    # ------------------------------------------------------------------ helpers
    def _deadline(self, timeout: float | None) -> float:
        t = self.default_timeout if timeout is None else float(timeout)
        return time.monotonic() + max(0.0, t)

    def _exists(self, key: str) -> bool:
        return any(key in t.items for t in self.tables.values())

    @property
    def size(self) -> int:
        return sum(t.size for t in self.tables.values())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tables.values())

    def _global_fits(self, n: int, nbytes: int) -> bool:
        if self.total_storage_size is not None:
            return self.size + n <= self.total_storage_size
        return self.nbytes + nbytes <= self.memory_budget_bytes

    def _make_room(self, table: Table, n: int, nbytes: int) -> bool:
        while table.size + n > table.max_size:
            if not table.evict_one():
                return False
        while not self._global_fits(n, nbytes):
            if not any(t.evict_one() for t in self.tables.values()):
                return False
        return True

    def _capacity_text(self, table: Table) -> str:
        bound = (f"total_storage_size {self.size}/{self.total_storage_size} samples"
                 if self.total_storage_size is not None
                 else f"memory {self.nbytes}/{self.memory_budget_bytes} bytes")
        return f"{table.name} table {table.size}/{table.max_size} samples (`buffer.max_size`), {bound}"

    # ---------------------------------------------------------------------- put
    def put(self, metas: Sequence[SampleMeta], payload: Any, spec: dict[str, FieldSpec], row_nbytes: int, *,
            timeout: float | None = None) -> int:
        metas = list(metas)
        if not metas:
            return 0
        for m in metas:
            if not isinstance(m, SampleMeta):
                raise ValueError(f"put rejected: `metas` must hold SampleMeta, got {type(m).__name__}")
        sources = {m.tags.source for m in metas}
        if len(sources) > 1:
            raise ValueError(f"put rejected (first key `{metas[0].key}`): one put holds samples of one source, "
                             f"got {sorted(s.value for s in sources)}")
        table = self.tables[SampleSource(sources.pop()).value]
        pool = table.keep_drawn  # the offline pool: outside the rate limiter and the insert counters
        n = sum(1 for m in metas if m.status is SampleStatus.SUCCESS)
        nbytes = n * row_nbytes
        deadline = self._deadline(timeout)
        with self.cond:
            if n > table.max_size or (self.total_storage_size is not None and n > self.total_storage_size) or (
                    self.total_storage_size is None and nbytes > self.memory_budget_bytes):
                raise ValueError(f"put rejected (first key `{metas[0].key}`): {n} samples / {nbytes} bytes can "
                                 f"never fit: {self._capacity_text(table)}; put smaller batches or raise the bound")
            if not pool and self.limiter.observe(insert_size=n):
                self.cond.notify_all()
            while True:
                table.validate(metas, spec, self._exists)  # again after every wait: keys may have arrived
                if n == 0 or (self._make_room(table, n, nbytes) and (pool or self.limiter.can_insert(n))):
                    table.insert(metas, payload, row_nbytes, self.learner_version)
                    if not pool:
                        self.limiter.on_insert(n)
                        self.metrics.on_insert(n)
                    self.cond.notify_all()
                    return n
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"put of {n} samples (first key `{metas[0].key}`) timed out waiting for room: "
                        f"{self._capacity_text(table)}; rate limiter {self.limiter.describe()}. The learner "
                        "is not consuming: check it is alive, or raise `transfer_queue.put_timeout_s`")
                self.cond.wait(remaining)

    # ------------------------------------------------------------------- sample
    def _plan(self, batch_size: int, source: SampleSource | str | None) -> list[tuple[Table, int]]:
        if source is not None:
            return [(self.tables[SampleSource(source).value], batch_size)]
        n_off = int(round(batch_size * self.offline_mix_ratio))
        plan = [(self.tables["online"], batch_size - n_off), (self.tables["offline"], n_off)]
        return [(t, m) for t, m in plan if m > 0]

    def sample(self, batch_size: int, *, learner_version: int, timeout: float | None = None,
               source: SampleSource | str | None = None):
        if not (isinstance(batch_size, (int, np.integer)) and batch_size > 0):
            raise ValueError(f"`batch_size` = {batch_size!r}: must be an integer > 0")
        if not isinstance(learner_version, (int, np.integer)):
            raise ValueError(f"`learner_version` = {learner_version!r}: must be an integer")
        batch_size, learner_version = int(batch_size), int(learner_version)
        plan = self._plan(batch_size, source)
        limited = sum(m for t, m in plan if not t.keep_drawn)  # the rate limiter paces the online rollouts only
        offline = self.tables[SampleSource.OFFLINE.value]
        if any(t is offline for t, _ in plan) and not offline.ready_samples:
            raise ValueError(self._empty_offline_text())
        deadline = self._deadline(timeout)
        with self.cond:
            if limited and self.limiter.observe(sample_size=limited):
                self.cond.notify_all()
            self.learner_version = max(learner_version, self.learner_version or learner_version)
            while True:
                dropped = sum(t.evict_stale(learner_version) for t in self.tables.values())
                if dropped:
                    self.cond.notify_all()
                if all(t.ready_samples >= m or t.keep_drawn for t, m in plan) and (
                        not limited or self.limiter.can_sample(limited, size=self.size)):
                    return self._take(plan, learner_version)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    need = ", ".join(f"{m} from {t.name}" for t, m in plan)
                    have = "; ".join(t.describe(learner_version) for t, _ in plan)
                    raise TimeoutError(
                        f"sample(batch_size={batch_size}, learner_version={learner_version}) timed out: need "
                        f"{need}; have {have}; {self.metrics.counters['dropped_stale']} samples dropped stale "
                        f"so far (max_off_policy_threshold={self.staleness.threshold}); rate limiter "
                        f"{self.limiter.describe()}")
                self.cond.wait(remaining)

    def sample_tickets(self, below: int, *, learner_version: int):
        """Every ready online group with a ticket below ``below``, at once (possibly none).

        Under the ``wait`` strategy update ``u`` trains exactly the tickets
        ``[u*B, (u+1)*B)``: the groups of those tickets that failed (evicted,
        refilled under a later ticket) simply make the batch smaller, so what
        the learner consumes always matches what admission control counted.
        """
        if not isinstance(below, (int, np.integer)) or below < 0:
            raise ValueError(f"`below` = {below!r}: must be an integer >= 0")
        with self.cond:
            self.learner_version = max(int(learner_version), self.learner_version or int(learner_version))
            if sum(t.evict_stale(int(learner_version)) for t in self.tables.values()):
                self.cond.notify_all()
            online = self.tables["online"]
            return self._collect([online.sample_tickets(int(below))], int(learner_version))

    def sample_offline(self, num_online: int, *, learner_version: int, ratio: float | None = None):
        """The offline share that goes with an online batch of ``num_online`` samples (whole pairs; never blocks).

        Over all calls the offline rows make up ``offline_mix_ratio`` of every row drawn:
        after this call ``offline / (online + offline)`` is as close to the ratio as whole groups
        allow (the rounding of one call is carried into the next, so the share is exact over a run
        however small the batches). ``ratio`` replaces ``offline_mix_ratio`` for this call (a tapered
        share): the call adds ``ratio / (1 - ratio) * num_online`` offline rows to the running target.
        ``num_online`` = 0 (an empty step) draws nothing.
        """
        if not isinstance(num_online, (int, np.integer)) or num_online < 0:
            raise ValueError(f"`num_online` = {num_online!r}: must be an integer >= 0")
        r = self.offline_mix_ratio if ratio is None else float(ratio)
        if not 0.0 <= r <= 1.0:
            raise ValueError(f"`ratio` = {ratio!r}: must be in [0, 1]")
        if r >= 1.0:
            raise ValueError("`buffer.offline_mix_ratio` = 1 leaves no room for online samples; draw from the "
                             "offline table alone with sample(batch_size, source='offline') "
                             "(`algorithm.sample_source=offline`)")
        with self.cond:
            if r <= 0.0 or num_online == 0:
                return self._collect([], int(learner_version))
            offline = self.tables[SampleSource.OFFLINE.value]
            if not offline.ready_samples:
                raise ValueError(self._empty_offline_text())
            c = self.metrics.counters
            c["mix_online"] += int(num_online)
            c["mix_target"] += r / (1.0 - r) * int(num_online)
            want = c["mix_target"] - c["mix_offline"]
            m = int(np.floor(want + 0.5))
            taken = [self._draw(offline, m, int(learner_version))] if m > 0 else []
            c["mix_offline"] += sum(len(items) for groups in taken for _, items in groups)
            return self._collect(taken, int(learner_version))

    def _empty_offline_text(self) -> str:
        return ("the offline table is empty: fill it from the run's offline store (`omnirl-async ingest DATASET "
                "--run-dir RUN_DIR`, or `data.offline_files`) before drawing offline samples")

    def _take(self, plan: list[tuple[Table, int]], learner_version: int):
        return self._collect([self._draw(t, m, learner_version) for t, m in plan], learner_version)

    def _draw(self, table: Table, m: int, learner_version: int) -> list:
        """Whole groups holding >= ``m`` samples; the offline pool goes round again when ``m`` exceeds it."""
        if not table.keep_drawn or m <= table.ready_samples:
            return table.sample(m, learner_version, self.rng)
        out: list = []
        while m > 0:
            part = table.sample(min(m, table.ready_samples), learner_version, self.rng)
            m -= sum(len(items) for _, items in part)
            out.extend(part)
        return out

    def _collect(self, taken: list[list], learner_version: int):
        metas: list[SampleMeta] = []
        parts: list[tuple[Any, list[int]]] = []
        lags: list[int] = []  # every row's lag (offline: 0), for `info`
        online_lags: list[int] = []
        for groups in taken:
            for g, items in groups:
                for it in items:
                    metas.append(it.meta)
                    lag = self.staleness.lag(it.meta.tags.policy_version, learner_version)
                    lags.append(lag)
                    if it.meta.tags.source is SampleSource.ONLINE:
                        online_lags.append(lag)
                    _append_part(parts, it)
        n_offline = len(metas) - len(online_lags)
        self.limiter.on_sample(len(online_lags))
        self.metrics.on_sample(online_lags)  # offline rows have no policy version: never in the staleness counts
        if n_offline:
            self.metrics.on_offline_sample(n_offline)
        self.cond.notify_all()
        info = {"staleness": np.asarray(lags, dtype=np.int64),
                "times_sampled": np.asarray([m.times_sampled for m in metas], dtype=np.int64)}
        return metas, parts, info

    # -------------------------------------------------------------------- query
    def ready(self, learner_version: int | None) -> tuple[int, int]:
        """(groups, samples) of the online table ready and fresh; the offline table is a fixed pool
        (``buffer/offline_size``), always there to draw from."""
        lv = self.learner_version if learner_version is None else learner_version
        with self.cond:
            return self.tables[SampleSource.ONLINE.value].ready_groups(lv)

    def take_refill_requests(self) -> list[RefillRequest]:
        with self.cond:
            out = [r for t in self.tables.values() for r in t.refills]
            for t in self.tables.values():
                t.refills.clear()
            return out

    def lose_groups(self, group_uids: Sequence[str], reason: str) -> int:
        """Groups whose payload died with its producer: removed; those never trained are generated again
        (a :class:`RefillRequest` each, ``buffer/regenerated_groups``). Returns the number of refills."""
        with self.cond:
            n = 0
            for uid in group_uids:
                for t in self.tables.values():
                    g = t.groups.get(uid)
                    if g is not None:
                        n += t.lose(g, reason)
            self.cond.notify_all()
            return n

    def lose_taken(self, metas: Sequence[SampleMeta], reason: str) -> int:
        """Rows already handed out whose payload could not be read (its owner died): their groups leave the
        buffer, and a group on its first draw (never trained) is generated again. Returns the number of refills."""
        first_draw: dict[str, SampleMeta] = {}
        for m in metas:
            if m.times_sampled <= 1 and m.tags.source is SampleSource.ONLINE:
                first_draw.setdefault(m.tags.group_uid, m)
        with self.cond:
            uids = {m.tags.group_uid for m in metas}
            for t in self.tables.values():  # a group kept for reuse is still in its table: it leaves too
                for uid in uids:
                    g = t.groups.get(uid)
                    if g is not None and not t.keep_drawn:
                        t.limiter.on_drop(len(g.members), g.times_sampled)
                        t._remove(g)
            online = self.tables[SampleSource.ONLINE.value]
            for m in first_draw.values():
                online.refill_lost(m, reason)
            self.cond.notify_all()
            return len(first_draw)

    def update_priorities(self, group_uids: Sequence[str], priorities: Sequence[float]) -> None:
        if len(group_uids) != len(priorities):
            raise ValueError(f"`priorities` has {len(priorities)} entries for {len(group_uids)} group uids")
        with self.cond:
            for gid, p in zip(group_uids, priorities):
                for t in self.tables.values():
                    t.update_priority(gid, float(p))

    def get(self, keys: Sequence[str]):
        with self.cond:
            metas, parts = [], []
            for k in keys:
                it = next((t.items[k] for t in self.tables.values() if k in t.items), None)
                if it is None:
                    raise KeyError(f"`keys`: sample `{k}` is not in the buffer (never put, sampled out, or evicted)")
                metas.append(it.meta)
                _append_part(parts, it)
            return metas, parts

    def list_keys(self, partition: str | None, source: Any, tag_filter: dict[str, Any]) -> list[str]:
        from omnirl_async.protocol import SampleTags
        unknown = sorted(set(tag_filter) - set(SampleTags.__struct_fields__))
        if unknown:
            raise ValueError(f"`{unknown[0]}` is not a sample tag; filter on one of {list(SampleTags.__struct_fields__)}")
        with self.cond:
            tables = self.tables.values() if source is None else [self.tables[SampleSource(source).value]]
            return [k for t in tables for k in t.list_keys(partition, tag_filter)]

    def clear(self) -> None:
        with self.cond:
            for t in self.tables.values():
                t.clear()
            self.store_rows.clear()
            self.offline_store = None
            self.cond.notify_all()

    def metrics_dict(self) -> dict[str, float]:
        with self.cond:
            groups, ready = self.tables[SampleSource.ONLINE.value].ready_groups(self.learner_version)
            incomplete = sum(1 for t in self.tables.values() for g in t.groups.values() if g.reported < g.size)
            return self.metrics.snapshot(
                size=self.size, ready_samples=ready, ready_groups=groups, incomplete_groups=incomplete,
                bytes=self.nbytes, online_size=self.tables["online"].size,
                offline_size=self.tables["offline"].size,
                learner_version=-1 if self.learner_version is None else self.learner_version)

    def payloads(self) -> list[Any]:
        """Every distinct payload held (identity), e.g. to release them."""
        with self.cond:
            seen: dict[int, Any] = {}
            for t in self.tables.values():
                for it in t.items.values():
                    seen.setdefault(id(it.payload), it.payload)
            return list(seen.values())


def _append_part(parts: list[tuple[Any, list[int]]], it: Item) -> None:
    if parts and parts[-1][0] is it.payload:
        parts[-1][1].append(it.row)
    else:
        parts.append((it.payload, [it.row]))
