"""Snapshot and restore of a whole buffer: msgpack metadata + safetensors tensors.

Layout of a snapshot directory::

    meta.msgpack             Snapshot struct (format name and version, counters,
                             tables, groups with their SampleMeta, row locations)
    chunk-00000.safetensors  rows of one table, one tensor per field, stacked
    chunk-00001.safetensors  ...  (a new chunk every CHUNK_BYTES)

No pickle anywhere: metadata decodes into typed msgspec Structs (validated),
tensors load through safetensors. The directory is written under a temporary
name next to ``path`` and renamed into place, so a crash leaves either the
old snapshot or the new one, never half of one.

Restore replaces the buffer's contents and counters; it gives back the same
keys, tags, statuses, times_sampled and bytes. In-flight incomplete groups
are restored as they were (their missing members may still arrive).

Offline pairs filled from the run's offline store (:mod:`.offline_table`) are
not copied: their group records keep the metadata and, instead of a chunk,
the pair's position in the store (chunk ``-1``), and ``offline_store`` names
the store (its folder and content hash). A restore reads those rows back from
the store - the same bytes, since a stored pair never changes - and refuses
with the store's path when a referenced pair is gone. Samplers with a
position (the offline table's shuffled passes) save it too.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
import uuid
from typing import Any, Callable

import msgspec
import numpy as np
from safetensors.numpy import load_file, save_file

from omnirl_async.buffer.core import BufferCore
from omnirl_async.buffer.samplers import GroupInfo
from omnirl_async.buffer.schema import Schema
from omnirl_async.buffer.table import Group, Item, group_ticket
from omnirl_async.protocol import RefillRequest, SampleMeta

__all__ = ["write_snapshot", "read_snapshot", "FORMAT", "FORMAT_VERSION"]

FORMAT = "omnirl-async-buffer"
FORMAT_VERSION = 1
CHUNK_BYTES = 256 * 1024**2
META_FILE = "meta.msgpack"


class GroupRecord(msgspec.Struct, kw_only=True):
    uid: str
    size: int
    order: int
    times_sampled: int
    ready: bool
    priority: float
    version: int | None
    members: list[SampleMeta]
    chunks: list[int]          # per member: chunk index
    rows: list[int]            # per member: row in that chunk
    failed: list[SampleMeta]


class TableRecord(msgspec.Struct, kw_only=True):
    name: str
    schema: dict[str, tuple[str, list[int]]] | None
    next_order: int
    refill_rounds: dict[str, int]
    refills: list[RefillRequest]
    groups: list[GroupRecord]
    sampler_state: dict[str, Any] | None = None


class OfflineStoreRef(msgspec.Struct, kw_only=True):
    dir: str                   # absolute path of <run dir>/offline when written
    rel_dir: str               # the same, relative to the snapshot folder
    content_hash: str


class Snapshot(msgspec.Struct, kw_only=True):
    format: str
    format_version: int
    created_at: float
    learner_version: int | None
    limiter: dict[str, float]
    metrics: dict[str, Any]
    tables: list[TableRecord]
    chunks: list[str]          # file names
    offline_store: OfflineStoreRef | None = None


def write_snapshot(core: BufferCore, path: str, *, resolve: Callable[[Any], dict[str, np.ndarray]]) -> None:
    """Write ``core`` to directory ``path``; ``resolve(payload)`` returns the payload's arrays."""
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        with core.cond:  # a consistent cut: producers and learners wait while we write
            snap = _write_tables(core, tmp, resolve)
            if core.offline_store is not None and core.store_rows:
                snap.offline_store = OfflineStoreRef(dir=core.offline_store["dir"],
                                                     rel_dir=os.path.relpath(core.offline_store["dir"], path),
                                                     content_hash=core.offline_store["content_hash"])
        _write_bytes(os.path.join(tmp, META_FILE), msgspec.msgpack.encode(snap))
        _fsync_dir(tmp)
        old = None
        if os.path.exists(path):
            old = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(path, old)
        os.rename(tmp, path)
        _fsync_dir(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_tables(core: BufferCore, tmp: str, resolve) -> Snapshot:
    chunk_files: list[str] = []
    tables: list[TableRecord] = []
    cache: dict[int, dict[str, np.ndarray]] = {}

    for t in core.tables.values():
        rows: dict[str, list[np.ndarray]] = {}
        pending_bytes = 0
        records: list[GroupRecord] = []

        def flush() -> None:
            nonlocal rows, pending_bytes
            if not rows:
                return
            fname = f"chunk-{len(chunk_files):05d}.safetensors"
            arrays = {k: np.ascontiguousarray(np.stack(v)) for k, v in rows.items()}
            save_file(arrays, os.path.join(tmp, fname), metadata={"table": t.name})
            _fsync_file(os.path.join(tmp, fname))
            chunk_files.append(fname)
            rows, pending_bytes = {}, 0

        n_in_chunk = 0
        for g in sorted(t.groups.values(), key=lambda g: g.order):
            chunks, rws = [], []
            if g.uid in core.store_rows and g.ready:  # a pair of the offline store: refer to it
                items = g.items()
                records.append(GroupRecord(
                    uid=g.uid, size=g.size, order=g.order, times_sampled=g.times_sampled, ready=g.ready,
                    priority=g.priority, version=g.version, members=[it.meta for it in items],
                    chunks=[-1] * len(items), rows=[core.store_rows[g.uid]] * len(items), failed=[]))
                continue
            for it in g.items():
                arrays = cache.get(id(it.payload))
                if arrays is None:
                    arrays = cache[id(it.payload)] = resolve(it.payload)
                if pending_bytes and pending_bytes + it.nbytes > CHUNK_BYTES:
                    flush()
                    n_in_chunk = 0
                for k, v in arrays.items():
                    rows.setdefault(k, []).append(v[it.row])
                chunks.append(len(chunk_files))
                rws.append(n_in_chunk)
                n_in_chunk += 1
                pending_bytes += it.nbytes
            records.append(GroupRecord(
                uid=g.uid, size=g.size, order=g.order, times_sampled=g.times_sampled, ready=g.ready,
                priority=g.priority, version=g.version, members=[it.meta for it in g.items()], chunks=chunks,
                rows=rws, failed=[g.failed[i] for i in sorted(g.failed)]))
        flush()
        tables.append(TableRecord(name=t.name, schema=t.schema.to_dict(), next_order=t._order,
                                  refill_rounds=dict(t.refill_rounds), refills=list(t.refills), groups=records,
                                  sampler_state=t.sampler.state_dict()))
    return Snapshot(format=FORMAT, format_version=FORMAT_VERSION, created_at=time.time(),
                    learner_version=core.learner_version, limiter=core.limiter.state_dict(),
                    metrics=core.metrics.state_dict(), tables=tables, chunks=chunk_files)


def read_snapshot(core: BufferCore, path: str, *, wrap: Callable[[dict[str, np.ndarray]], Any]) -> None:
    """Replace ``core``'s contents with the snapshot at ``path``; ``wrap(arrays)`` makes a payload."""
    path = os.path.abspath(os.fspath(path))
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        raise ValueError(f"`path` = {path!r}: not a buffer snapshot (no {META_FILE}); pass a directory "
                         "written by ReplayBuffer.snapshot")
    with open(meta_path, "rb") as f:
        raw = f.read()
    head = msgspec.msgpack.decode(raw)
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise ValueError(f"`path` = {path!r}: {META_FILE} is not an {FORMAT} snapshot")
    if head.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"`path` = {path!r}: snapshot format version {head.get('format_version')!r}, this "
                         f"build reads version {FORMAT_VERSION}; restore with the version that wrote it")
    snap = msgspec.msgpack.decode(raw, type=Snapshot)
    payloads = [wrap(load_file(os.path.join(path, f))) for f in snap.chunks]
    from_store = _read_store_rows(snap, path, wrap)
    with core.cond:
        for t in core.tables.values():
            t.clear()
        core.store_rows = dict(from_store.positions)
        core.offline_store = (None if from_store.folder is None else
                              {"dir": from_store.folder, "content_hash": snap.offline_store.content_hash})
        for rec in snap.tables:
            t = core.tables[rec.name]
            t.schema = Schema.from_dict(rec.schema, table=t.name)
            t._order = rec.next_order
            t.refill_rounds = dict(rec.refill_rounds)
            t.refills = list(rec.refills)
            for gr in rec.groups:
                _restore_group(t, gr, payloads, from_store)
            if rec.sampler_state is not None:
                t.sampler.load_state_dict(rec.sampler_state)
        core.learner_version = snap.learner_version
        core.limiter.load_state_dict(snap.limiter)
        core.metrics.load_state_dict(snap.metrics)
        core.cond.notify_all()


@dataclasses.dataclass
class _StoreRows:
    """The offline-store pairs a snapshot refers to, read back: one payload, pair ``index[uid]`` in it."""

    payload: Any = None
    folder: str | None = None
    positions: dict[str, int] = dataclasses.field(default_factory=dict)  # group uid -> position in the store
    index: dict[str, int] = dataclasses.field(default_factory=dict)      # group uid -> pair index in ``payload``


def _read_store_rows(snap: Snapshot, path: str, wrap) -> _StoreRows:
    refs = [gr for rec in snap.tables for gr in rec.groups if gr.chunks and gr.chunks[0] == -1]
    if not refs:
        return _StoreRows()
    from omnirl_async.buffer.offline_store import OfflineStore
    from omnirl_async.buffer.offline_table import group_uid, pair_fields

    ref = snap.offline_store
    if ref is None:
        raise ValueError(f"`path` = {path!r}: the snapshot refers to offline-store pairs but names no store")
    candidates = [os.path.normpath(os.path.join(path, ref.rel_dir)), ref.dir]
    folder = next((c for c in candidates if os.path.isfile(os.path.join(c, "index.msgpack"))), None)
    if folder is None:
        raise ValueError(f"`path` = {path!r}: the buffer snapshot refers to {len(refs)} pairs of the offline store "
                         f"{ref.dir}, which is gone; put the run's `offline/` folder back (it lives beside the "
                         "checkpoints), or resume without the buffer")
    store = OfflineStore(os.path.dirname(folder))
    rows = store.rows()
    where = {r.id: i for i, r in enumerate(rows)}
    positions: dict[str, int] = {}
    for gr in refs:
        pos = gr.rows[0]
        if not (0 <= pos < len(rows) and group_uid(rows[pos].id) == gr.uid):
            row_id = gr.uid[len(group_uid("")):]
            if row_id not in where:
                raise ValueError(f"`path` = {path!r}: the buffer snapshot holds offline pair {row_id!r}, which the "
                                 f"offline store {store.dir} no longer has; restore that store, or resume without "
                                 "the buffer")
            pos = where[row_id]
        positions[gr.uid] = pos
    order = list(positions)
    payload = wrap(pair_fields(store, [positions[u] for u in order]))
    return _StoreRows(payload=payload, folder=str(store.dir), positions=positions,
                      index={u: j for j, u in enumerate(order)})


def _restore_group(t, gr: GroupRecord, payloads: list[Any], from_store: _StoreRows) -> None:
    g = Group(gr.uid, gr.size, gr.order)
    g.times_sampled, g.priority, g.version = gr.times_sampled, gr.priority, gr.version
    row_nbytes = t.schema.row_nbytes() if t.schema.known else 0
    for meta, c, r in zip(gr.members, gr.chunks, gr.rows):
        if c == -1:  # an offline-store pair: row 2j + member of the pairs read back
            it = Item(meta, from_store.payload, 2 * from_store.index[gr.uid] + meta.tags.sample_index, row_nbytes)
        else:
            it = Item(meta, payloads[c], r, row_nbytes)
        g.members[meta.tags.sample_index] = it
        t.items[meta.key] = it
        t.nbytes += row_nbytes
    for meta in gr.failed:
        g.failed[meta.tags.sample_index] = meta
    t.groups[g.uid] = g
    if gr.ready:
        g.ready = True
        t.ready_samples += len(g.members)
        t.sampler.insert(g.uid, GroupInfo(order=g.order, policy_version=g.version, size=len(g.members),
                                          priority=g.priority, ticket=group_ticket(g)))
        t.index_fresh(g)
        if g.times_sampled > 0:
            t.remover.insert(g.uid, g.order)


def _write_bytes(p: str, data: bytes) -> None:
    with open(p, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(p: str) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(p: str) -> None:
    try:
        _fsync_file(p)
    except OSError:  # some filesystems refuse fsync on directories
        pass
