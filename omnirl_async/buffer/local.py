"""In-process replay buffer: the same semantics as the Ray buffer, without Ray.

Used by unit tests, by the sync trainer when everything lives in one process,
and as the reference the Ray buffer is tested against. Thread-safe: producers
and consumers in different threads block on one condition variable.

A put copies the successful rows out of the caller's arrays (one copy), so the
producer may reuse its buffers; a batch read back as one whole stored put is
returned without a copy (read-only).

Examples:
    >>> import numpy as np
    >>> from omnirl_async.protocol import SampleMeta, SampleTags, SampleStatus
    >>> buf = LocalReplayBuffer(seed=0)
    >>> metas = [SampleMeta(key=f"g0/{i}", status=SampleStatus.SUCCESS, reward=float(i),
    ...                     tags=SampleTags(uid=f"g0/{i}", group_uid="g0", sample_index=i, group_size=2,
    ...                                     policy_version=0)) for i in range(2)]
    >>> buf.put(metas, {"x": np.zeros((2, 3), np.float32)})
    >>> batch = buf.sample(2, learner_version=0)
    >>> batch.keys, batch.fields["x"].shape, batch.info["staleness"].tolist()
    (['g0/0', 'g0/1'], (2, 3), [0, 0])
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from omnirl_async.buffer.base import ReplayBuffer, SampledBatch, assemble_fields
from omnirl_async.buffer.core import BufferCore
from omnirl_async.buffer.schema import describe_fields, spec_of
from omnirl_async.buffer.spec import BufferSpec
from omnirl_async.protocol import RefillRequest, SampleMeta, SampleSource, SampleStatus

__all__ = ["LocalReplayBuffer", "prepare_put"]


def prepare_put(metas: Sequence[SampleMeta], fields: dict[str, Any], *, copy: bool):
    """Validate array shapes and keep the successful rows.

    Returns ``(metas, payload, spec, row_nbytes)``: ``payload`` holds one row per
    SUCCESS meta, in order. Shared by the local and the Ray client.
    """
    metas = list(metas)
    if not metas:
        return metas, {}, {}, 0
    arrays = describe_fields(fields or {}, len(metas), first_key=getattr(metas[0], "key", "?"))
    ok = [i for i, m in enumerate(metas) if getattr(m, "status", None) is SampleStatus.SUCCESS]
    if len(ok) == len(metas):
        payload = {k: (np.array(v, copy=True) if copy else np.ascontiguousarray(v)) for k, v in arrays.items()}
    else:
        idx = np.asarray(ok, dtype=np.int64)
        payload = {k: np.ascontiguousarray(v[idx]) for k, v in arrays.items()}
    spec = spec_of(arrays)
    row_nbytes = sum(int(v.dtype.itemsize * int(np.prod(v.shape[1:], dtype=np.int64))) for v in arrays.values())
    return metas, payload, spec, row_nbytes


def check_field_names(parts, names: Sequence[str] | None) -> None:
    if names is None or not parts:
        return
    have = set(parts[0][0].keys())
    for n in names:
        if n not in have:
            raise KeyError(f"`fields`: no field `{n}` in the buffer; stored fields are {sorted(have)}")


class LocalReplayBuffer(ReplayBuffer):
    """See the module docstring. ``spec`` None = :class:`BufferSpec` defaults (``transport`` is unused here)."""

    def __init__(self, spec: BufferSpec | None = None, *, seed: int | None = None) -> None:
        self._core = BufferCore(BufferSpec() if spec is None else spec, seed=seed)

    @property
    def core(self) -> BufferCore:
        return self._core

    def put(self, metas: Sequence[SampleMeta], fields: dict[str, Any], *, timeout: float | None = None,
            producer: str | None = None) -> None:
        metas, payload, spec, row_nbytes = prepare_put(metas, fields, copy=True)
        self._core.put(metas, payload, spec, row_nbytes, timeout=timeout)

    def sample(self, batch_size: int, *, learner_version: int, timeout: float | None = None,
               source: SampleSource | str | None = None) -> SampledBatch:
        metas, parts, info = self._core.sample(batch_size, learner_version=learner_version, timeout=timeout,
                                               source=source)
        return SampledBatch(metas=metas, fields=assemble_fields(parts), info=info)

    def sample_tickets(self, below: int, *, learner_version: int) -> SampledBatch:
        metas, parts, info = self._core.sample_tickets(below, learner_version=learner_version)
        return SampledBatch(metas=metas, fields=assemble_fields(parts), info=info)

    def sample_offline(self, num_online: int, *, learner_version: int, ratio: float | None = None) -> SampledBatch:
        metas, parts, info = self._core.sample_offline(num_online, learner_version=learner_version, ratio=ratio)
        return SampledBatch(metas=metas, fields=assemble_fields(parts), info=info)

    def load_offline(self, run_dir: str) -> dict[str, Any]:
        from omnirl_async.buffer.offline_table import fill_from_store
        return fill_from_store(self._core, run_dir, wrap=lambda arrays: {k: np.array(v) for k, v in arrays.items()})

    def size(self) -> int:
        with self._core.cond:
            return self._core.size

    def num_ready_samples(self, learner_version: int | None = None) -> int:
        return self._core.ready(learner_version)[1]

    def ready_groups(self, learner_version: int | None = None) -> int:
        return self._core.ready(learner_version)[0]

    def take_refill_requests(self) -> list[RefillRequest]:
        return self._core.take_refill_requests()

    def update_priorities(self, group_uids: Sequence[str], priorities: Sequence[float]) -> None:
        self._core.update_priorities(group_uids, priorities)

    def get(self, keys: Sequence[str], fields: Sequence[str] | None = None) -> SampledBatch:
        metas, parts = self._core.get(keys)
        check_field_names(parts, fields)
        return SampledBatch(metas=metas, fields=assemble_fields(parts, fields))

    def list_keys(self, *, partition: str | None = None, source: SampleSource | str | None = None,
                  **tag_filter: Any) -> list[str]:
        return self._core.list_keys(partition, source, tag_filter)

    def clear(self) -> None:
        self._core.clear()

    def metrics(self) -> dict[str, float]:
        return self._core.metrics_dict()

    def snapshot(self, path: str) -> None:
        from omnirl_async.buffer.persistence import write_snapshot
        write_snapshot(self._core, path, resolve=lambda p: p)

    def restore(self, path: str) -> None:
        from omnirl_async.buffer.persistence import read_snapshot
        read_snapshot(self._core, path, wrap=lambda arrays: arrays)

    def close(self) -> None:
        self._core.clear()
