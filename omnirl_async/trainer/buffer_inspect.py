"""``omnirl-async buffer inspect DIR``: what a run's replay buffer and offline store hold, without loading tensors.

``DIR`` is a run directory (``trainer.default_local_dir``: its newest verified
checkpoint's buffer snapshot is read), a checkpoint folder (``global_step_N``)
or a snapshot folder itself (``.../buffer``). The report reads only the
snapshot's ``meta.msgpack`` and the offline store's ``index.msgpack``:

* size per table (online, offline): groups, samples, failed members, bytes;
  the offline rows by their dataset ``source``;
* the online rows' policy versions, and their staleness at the learner
  version (lag = learner version - policy version): the policy version the
  checkpoint saved (``trainer.msgpack``), else the snapshot's own;
* what was drawn so far: online samples by lag, offline samples, the offline
  share (``buffer/offline_frac``);
* a few offline pairs: id, source, scores, times drawn, prompt.

A folder holding neither a snapshot nor an offline store is an
:class:`~omnirl_async.preflight.InputError` naming what was looked for.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from omnirl_async.buffer.offline_store import INDEX_FILE, OFFLINE_DIR, OfflineStore
from omnirl_async.buffer.persistence import FORMAT, META_FILE, Snapshot
from omnirl_async.preflight import InputError
from omnirl_async.trainer.ingest import human_size

__all__ = ["inspect_buffer", "find_snapshot"]


def find_snapshot(path: Path) -> Path | None:
    """The buffer snapshot folder ``path`` means (itself, its ``buffer/``, or its newest verified checkpoint's)."""
    if (path / META_FILE).is_file():
        return path
    if (path / "buffer" / META_FILE).is_file():
        return path / "buffer"
    from omnirl_async.trainer.checkpoint import CheckpointError, CheckpointManager

    try:
        latest = CheckpointManager(path).latest_verified() if any(path.glob("global_step_*")) else None
    except CheckpointError:
        latest = None
    if latest is not None and (latest / "buffer" / META_FILE).is_file():
        return latest / "buffer"
    return None


def _read_snapshot(folder: Path) -> Snapshot:
    raw = (folder / META_FILE).read_bytes()
    head = msgspec.msgpack.decode(raw)
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise InputError(f"{folder / META_FILE} is not a buffer snapshot ({FORMAT})")
    return msgspec.msgpack.decode(raw, type=Snapshot)


def _store_for(path: Path, snapshot: Path | None, snap: Snapshot | None) -> OfflineStore | None:
    candidates = []
    if snap is not None and snap.offline_store is not None:
        candidates += [Path(os.path.normpath(snapshot / snap.offline_store.rel_dir)), Path(snap.offline_store.dir)]
    candidates += [path / OFFLINE_DIR, path.parent / OFFLINE_DIR, path.parent.parent / OFFLINE_DIR]
    for c in candidates:
        if (c / INDEX_FILE).is_file():
            return OfflineStore(c.parent)
    return None


def _row_nbytes(schema: dict[str, Any] | None) -> int:
    return sum(int(np.dtype(d).itemsize * int(np.prod(s, dtype=np.int64))) for d, s in (schema or {}).values())


def _histogram(counts: Counter, label: str) -> str:
    return ", ".join(f"{label}{k}: {v}" for k, v in sorted(counts.items())) or "none"


def _checkpoint_version(snapshot: Path) -> int | None:
    """The policy version the checkpoint holding ``snapshot`` (``global_step_N/buffer``) saved, from its
    ``trainer.msgpack``; None for a snapshot outside a checkpoint or an unreadable file.

    The snapshot's own ``learner_version`` is the version the buffer was last asked to sample at: the update
    before the checkpoint's last publication (sync: always; separate_async: when no next update had asked ahead
    yet, as at a run's final checkpoint), so it can be one behind the version the checkpoint resumes at."""
    from omnirl_async.trainer.checkpoint import CheckpointError, _load_skeleton

    if snapshot.name != "buffer" or not (snapshot.parent / "trainer.msgpack").is_file():
        return None
    try:
        state = _load_skeleton(snapshot.parent / "trainer.msgpack")
    except CheckpointError:
        return None
    version = state.get("version") if isinstance(state, dict) else None
    return version if isinstance(version, int) and not isinstance(version, bool) else None


def _snapshot_lines(folder: Path, snap: Snapshot) -> tuple[list[str], dict[str, int]]:
    lv = _checkpoint_version(folder)
    lv = snap.learner_version if lv is None else lv
    written = time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(snap.created_at))
    lines = [f"buffer snapshot {folder}", f"  written {written}, learner version {'-' if lv is None else lv}"]
    lines.append(f"  {'table':<8} {'groups':>7} {'samples':>8} {'failed':>7} {'bytes':>10}")
    versions: Counter = Counter()
    drawn: dict[str, int] = {}
    for t in snap.tables:
        samples = sum(len(g.members) for g in t.groups)
        failed = sum(len(g.failed) for g in t.groups)
        ref = sum(len(g.members) for g in t.groups if g.chunks and g.chunks[0] == -1)
        nbytes = human_size(samples * _row_nbytes(t.schema)) + (" (in the offline store)" if ref else "")
        lines.append(f"  {t.name:<8} {len(t.groups):>7} {samples:>8} {failed:>7} {nbytes:>10}")
        for g in t.groups:
            if t.name == "online":
                for m in g.members:
                    versions[m.tags.policy_version] += 1
            else:
                drawn[g.uid] = g.times_sampled
    lines.append(f"  online rows by policy version: {_histogram(versions, 'v')}")
    if lv is not None and versions:
        lags = Counter({lv - v: c for v, c in versions.items() if v is not None})
        lines.append(f"  online staleness at learner version {lv}: {_histogram(lags, 'lag ')}")
    m = snap.metrics
    hist = {f"lag {k}" + ("+" if k == len(m['lag_hist']) - 1 else ""): int(c) for k, c in enumerate(m["lag_hist"]) if c}
    online, offline = int(m["sampled"]), int(m["counters"].get("offline_sampled", 0))
    share = offline / (online + offline) if online + offline else 0.0
    lines.append(f"  drawn so far: {online} online samples ({', '.join(f'{k}: {v}' for k, v in hist.items()) or '-'}), "
                 f"{offline} offline samples; offline share {share:.3f}")
    return lines, drawn


def _store_lines(store: OfflineStore, drawn: dict[str, int], rows: int) -> list[str]:
    all_rows = store.rows()
    sources = Counter(r.source or "(none)" for r in all_rows)
    lines = [f"offline store {store.dir}", f"  {len(all_rows)} pairs, {human_size(store.nbytes)}, by source: "
             f"{', '.join(f'{k}: {v}' for k, v in sorted(sources.items()))}"]
    if all_rows:
        lines.append(f"  {'id':<16} {'source':<12} {'chosen':>7} {'rejected':>8} {'drawn':>5}  prompt")
    for r in all_rows[:rows]:
        score = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
        times = drawn.get(f"offline/{r.id}")
        lines.append(f"  {r.id:<16} {(r.source or '-'):<12} {score(r.chosen_score):>7} {score(r.rejected_score):>8} "
                     f"{'-' if times is None else times:>5}  {r.prompt}")
    if len(all_rows) > rows:
        lines.append(f"  ... {len(all_rows) - rows} more")
    return lines


def inspect_buffer(path: str | os.PathLike, *, rows: int = 5) -> str:
    """The report for ``path`` (see the module docstring)."""
    path = Path(os.path.expanduser(os.fspath(path))).resolve()
    if not path.is_dir():
        raise InputError(f"`omnirl-async buffer inspect {path}`: no such directory; pass a run dir "
                         "(trainer.default_local_dir) or one of its global_step_N checkpoints")
    folder = find_snapshot(path)
    snap = _read_snapshot(folder) if folder is not None else None
    try:
        store = _store_for(path, folder, snap)
    except ValueError as err:
        raise InputError(f"`omnirl-async buffer inspect {path}`: {err}") from None
    if snap is None and store is None:
        raise InputError(f"`omnirl-async buffer inspect {path}`: nothing to inspect: no buffer snapshot "
                         f"(DIR/{META_FILE}, DIR/buffer/{META_FILE} or a verified checkpoint "
                         f"DIR/global_step_N/buffer/) and no offline store (DIR/{OFFLINE_DIR}/{INDEX_FILE}); pass a "
                         "run dir (trainer.default_local_dir) or one of its global_step_N checkpoints")
    lines: list[str] = []
    drawn: dict[str, int] = {}
    if snap is not None:
        part, drawn = _snapshot_lines(folder, snap)
        lines += part
    else:
        lines.append(f"no buffer snapshot under {path} (no checkpoint yet); the offline table is filled from the "
                     "store below when `train` starts")
    if store is not None:
        lines += _store_lines(store, drawn, rows)
    return "\n".join(lines)
