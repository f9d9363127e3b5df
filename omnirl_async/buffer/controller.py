"""The transfer queue's actors: the controller (metadata, tables, sampling, who holds which payload) and the
storage units (owners of copied payloads). The client that talks to them is
:class:`omnirl_async.buffer.transfer_queue.RayReplayBuffer`, whose docstring
describes who holds what; the calls' wire format is :mod:`.rpc`.
"""

from __future__ import annotations

import time
import zlib

import msgspec
import numpy as np
import ray

from omnirl_async.buffer.core import BufferCore
from omnirl_async.buffer.ref_wire import check_supported, from_wire, is_wire, to_wire
from omnirl_async.buffer.rpc import Pickled, guard, packed, unpack
from omnirl_async.buffer.schema import FieldSpec
from omnirl_async.buffer.spec import BufferSpec
from omnirl_async.buffer.wire_ledger import ReadHolds, WireLedger
from omnirl_async.protocol import SampleMeta, SampleStatus
from omnirl_async.waits import bounded_get

__all__ = ["CONTROLLER_CONCURRENCY", "LOST_REASON", "READ_HOLD_S", "StorageUnit", "TransferQueueController",
           "unit_for"]

_METAS = msgspec.msgpack.Decoder(list[SampleMeta])
_ENC = msgspec.msgpack.Encoder()
CONTROLLER_CONCURRENCY = 64
LOST_REASON = "payload lost: its producer (a rollout worker) died before the group was trained"
#: how long the controller keeps the refs of a batch it handed out and the reader never acknowledged
#: (a reader that died, or a ``sample_async`` request never resolved); a later read of them fails as lost
READ_HOLD_S = 1800.0

check_supported()


def unit_for(group_uid: str, k: int) -> int:
    """Storage unit of a group: a stable hash (not Python's salted ``hash``)."""
    return zlib.crc32(group_uid.encode()) % k


class _StorageUnit:
    """Owner of tensor payloads in the object store; holds no Python-side copies."""

    def __init__(self, index: int) -> None:
        self.index = index

    def store(self, payload: dict) -> list:
        """Copy ``payload`` into an object this unit owns; returns ``[ref]`` (wrapped: not resolved)."""
        return [ray.put(payload)]

    def assert_healthy(self) -> int:
        return self.index


class _Controller:
    """Metadata, tables and blocking logic; payloads are ``ObjectRef`` s owned by the units."""

    def __init__(self, spec: BufferSpec, seed: int | None, units: list, read_hold_s: float = READ_HOLD_S) -> None:
        self.core = BufferCore(spec, seed=seed)
        self.units = units
        #: group uid -> producer of its payload, for payloads a producer owns (pruned as groups leave)
        self.producer_of: dict[str, str] = {}
        #: batches handed out as ref bytes (:mod:`.ref_wire`), held until the reader acknowledges them
        self.reading = ReadHolds(read_hold_s)
        #: payloads registered as bytes (producer-owned): who still needs each (:mod:`.wire_ledger`)
        self.ledger = WireLedger(forget_after_s=read_hold_s)
        for t in self.core.tables.values():
            t.on_remove = self.ledger.on_remove
        self.put_calls = 0  # registration calls received (`buffer/put_calls`)

    def assert_healthy(self) -> int:
        bounded_get([u.assert_healthy.remote() for u in self.units], 60.0,
                    f"replay buffer: the {len(self.units)} storage unit(s)' `assert_healthy`",
                    "A unit may not have started (Ray lacks the resources it asks for, see `ray status`) or be stuck.",
                    key=None)
        return len(self.units)

    @guard
    def put(self, metas_msgpack: bytes, wrapped_ref: list, spec: dict, row_nbytes: int,
            timeout: float | None, producer: str | None = None, holder: str | None = None) -> int:
        """One registration. ``wrapped_ref``: ``[payload]`` – arrays (inline), a ref (a storage unit's), ref bytes
        (:mod:`.ref_wire`: producer-owned, kept alive by ``holder``, the registering process, until
        :meth:`put_many` / :meth:`released` hand its id back), or None (no successful row)."""
        metas = _METAS.decode(metas_msgpack)
        spec_ = {k: FieldSpec.from_list(v) for k, v in spec.items()}
        payload = wrapped_ref[0]
        if isinstance(payload, dict):  # inline: own a copy, not a view of the call's buffer (a blob's arrays are)
            payload = {k: v if v.flags.owndata else np.array(v, copy=True) for k, v in payload.items()}
        rows = 0
        if is_wire(payload):
            if holder is None:
                raise ValueError("put rejected: a payload registered as ref bytes needs its `holder` process")
            rows = sum(1 for m in metas if m.status is SampleStatus.SUCCESS)
            with self.core.cond:  # counted before it is stored: a group may leave within the put (e.g. stale)
                self.ledger.add(payload, rows, holder, time.monotonic())
        try:
            n = self.core.put(metas, payload, spec_, row_nbytes, timeout=timeout)
        except BaseException:
            if rows:
                with self.core.cond:
                    self.ledger.discard(payload, rows)
            raise
        if producer is not None and payload is not None and not isinstance(payload, dict):
            self.producer_of.update((m.tags.group_uid, producer) for m in metas)
            if len(self.producer_of) > 2 * self.core.size + 1024:  # forget groups that left
                with self.core.cond:
                    held = {g for t in self.core.tables.values() for g in t.groups}
                self.producer_of = {g: p for g, p in self.producer_of.items() if g in held}
        return n

    @guard
    def put_many(self, items: list[tuple], holder: str | None = None) -> tuple[list[tuple], list[bytes]]:
        """Several :meth:`put` s of process ``holder`` in one call, in order: (one ("ok", n) / ("err", exc) per
        item, the ids of the payloads ``holder`` registered as bytes that nobody needs any more)."""
        results = [self.put(*item, holder) for item in items]
        return results, self._released(holder, call=True)

    @packed
    def put_packed(self, blob: bytes):
        """:meth:`put_many` with its arguments as one blob (:func:`.rpc.pack`: ``[items, holder]``, payloads ref
        bytes, inline arrays or None – not ObjectRefs). All admitted: the blob ``[[n per item], released ids]``;
        else (results, released) as :meth:`put_many` returns it (pickled: a refusal carries its exception)."""
        items, holder = unpack(blob)
        results = [self.put(metas, [tuple(p) if isinstance(p, list) else p], spec, row_nbytes, timeout, owner,
                            holder) for metas, (p,), spec, row_nbytes, timeout, owner in items]
        released = self._released(holder, call=True)
        if all(st == "ok" for st, _ in results):
            return [[n for _, n in results], released]
        return Pickled((results, released))

    def _released(self, holder: str | None, *, call: bool = False) -> list[bytes]:
        """What ``holder`` may drop; ``call``: the end of a registration call (counted: ``buffer/put_calls``)."""
        with self.core.cond:
            self.put_calls += call
            return [] if holder is None else self.ledger.take(holder, time.monotonic())

    @guard
    def released(self, holder: str) -> list[bytes]:
        """The idle poll of a process holding payload refs (:mod:`.held_refs`): the ids it may drop."""
        return self._released(holder)

    @guard
    def drop_producer(self, producer: str) -> int:
        """``producer`` died: its groups' payloads are gone; returns how many groups will be generated again."""
        uids = [g for g, p in self.producer_of.items() if p == producer]
        for g in uids:
            del self.producer_of[g]
        return self.core.lose_groups(uids, LOST_REASON)

    @guard
    def lose_taken(self, metas_msgpack: bytes) -> int:
        return self.core.lose_taken(_METAS.decode(metas_msgpack), LOST_REASON)

    def _hand_out(self, metas, parts, info) -> tuple:
        """A read's reply, built with ``core.cond`` held (the draw and the hold are one step for the ledger):
        refs go out as bytes (:mod:`.ref_wire`) and are kept here under a token until the reader acknowledges it
        (``acks`` of a later call, or :meth:`release`) – no borrower protocol per reply; payloads registered as
        bytes are held in the ledger until then."""
        refs = [p for p, _ in parts if not isinstance(p, (dict, tuple))]
        oids = [p[1] for p, _ in parts if is_wire(p)]
        token = None
        if refs or oids:
            self.ledger.hold(oids)
            token = self.reading.open(refs, oids, time.monotonic())
            parts = [(p if isinstance(p, (dict, tuple)) else to_wire(p), rows) for p, rows in parts]
        return _ENC.encode(metas), parts, info, token

    def _release(self, acks) -> None:
        oids = self.reading.close(acks, time.monotonic())
        if oids:
            with self.core.cond:
                self.ledger.unhold(oids)

    @guard
    def release(self, acks: list[int]) -> int:
        """The reader has read the batches ``acks``: their refs may go. Returns the batches still held."""
        self._release(acks)
        return len(self.reading)

    # The reads take their arguments as one msgpack blob (:func:`.rpc.request`) and reply with one (:func:`.rpc.pack`).
    @packed
    def sample(self, request: bytes):
        """``request``: msgpack ``[batch_size, learner_version, timeout, source, acks]``."""
        batch_size, learner_version, timeout, source, acks = msgspec.msgpack.decode(request)
        self._release(acks)  # first: a read that fails or times out still acknowledges the earlier ones
        with self.core.cond:  # re-entrant; its wait inside releases it
            return self._hand_out(*self.core.sample(batch_size, learner_version=learner_version, timeout=timeout,
                                                    source=source))

    @packed
    def sample_tickets(self, request: bytes):
        """``request``: msgpack ``[below, learner_version, acks]``."""
        below, learner_version, acks = msgspec.msgpack.decode(request)
        self._release(acks)
        with self.core.cond:
            return self._hand_out(*self.core.sample_tickets(below, learner_version=learner_version))

    @packed
    def sample_offline(self, request: bytes):
        """``request``: msgpack ``[num_online, learner_version, ratio, acks]``."""
        num_online, learner_version, ratio, acks = msgspec.msgpack.decode(request)
        self._release(acks)
        with self.core.cond:
            return self._hand_out(*self.core.sample_offline(num_online, learner_version=learner_version,
                                                            ratio=ratio))

    @guard
    def load_offline(self, run_dir: str):
        from omnirl_async.buffer.offline_table import fill_from_store
        counter = iter(range(1 << 62))
        units = self.units
        return fill_from_store(self.core, run_dir, wrap=lambda arrays: ray.get(
            units[next(counter) % len(units)].store.remote(arrays))[0])

    @packed
    def get(self, request: bytes):
        """Rows by key, as a read: ``request`` msgpack ``[keys, acks]``; ``(metas, parts, {}, token)``."""
        keys, acks = msgspec.msgpack.decode(request)
        self._release(acks)
        with self.core.cond:
            return self._hand_out(*self.core.get(keys), {})

    @guard
    def call(self, name: str, *args, **kwargs):
        """Small queries: size, ready, refills, priorities, list_keys, clear, metrics."""
        core = self.core
        if name == "size":
            with core.cond:
                return core.size
        if name == "ready":
            return core.ready(*args)
        if name == "take_refill_requests":
            return _ENC.encode(core.take_refill_requests())
        if name == "update_priorities":
            return core.update_priorities(*args)
        if name == "list_keys":
            return core.list_keys(*args)
        if name == "clear":
            return core.clear()
        if name == "metrics":
            out = core.metrics_dict()
            with core.cond:  # what keeps payloads alive: a leak of either shows here first
                out["buffer/payloads_held_by_producers"] = float(len(self.ledger))
                out["buffer/reads_unacknowledged"] = float(len(self.reading))
                out["buffer/put_calls"] = float(self.put_calls)  # registration calls (put_linger_s batches them)
            return out
        raise ValueError(f"unknown controller call {name!r}")

    @guard
    def snapshot(self, path: str) -> int:
        """Write a snapshot; groups whose payload died with its producer are dropped (and regenerated) first.
        Returns the number of such groups."""
        from omnirl_async.buffer.persistence import write_snapshot
        lost_total = 0
        while True:
            lost: list = []

            def resolve(p):
                if isinstance(p, dict):
                    return p
                try:
                    return ray.get(from_wire(p) if is_wire(p) else p)
                except ray.exceptions.ObjectLostError:
                    lost.append(p)
                    raise

            try:
                write_snapshot(self.core, path, resolve=resolve)
                return lost_total
            except ray.exceptions.ObjectLostError:
                if not lost:
                    raise
                with self.core.cond:
                    uids = {t_g for t in self.core.tables.values() for t_g, g in t.groups.items()
                            if any(it.payload is lost[0] for it in g.members.values())}
                if not uids:
                    raise
                self.core.lose_groups(sorted(uids), LOST_REASON)
                lost_total += len(uids)

    @guard
    def restore(self, path: str) -> None:
        from omnirl_async.buffer.persistence import read_snapshot
        counter = iter(range(1 << 62))
        units = self.units
        read_snapshot(self.core, path,
                      wrap=lambda arrays: ray.get(units[next(counter) % len(units)].store.remote(arrays))[0])


# Plain classes wrapped here (not decorated) so that cloudpickle finds their methods by
# reference in this module instead of serialising them by value.
StorageUnit = ray.remote(num_cpus=0, max_concurrency=16)(_StorageUnit)
TransferQueueController = ray.remote(num_cpus=0, max_concurrency=CONTROLLER_CONCURRENCY)(_Controller)
