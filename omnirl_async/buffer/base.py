"""The replay buffer contract shared by the in-process and the Ray buffer.

Vocabulary (see also :mod:`omnirl_async.protocol`):

* a **sample** is one trajectory: a :class:`SampleMeta` plus one row of every
  tensor field;
* a **group** is the ``group_size`` samples of one prompt. It is *complete*
  when every member has been reported (success or failure). The buffer only
  ever hands out complete groups, whole: GRPO normalises rewards within a
  group, so half a group is worse than none;
* a **table** holds the samples of one source (online rollouts, offline data)
  and composes a sampler, a remover, a size bound, a rate limiter and a
  staleness policy (:mod:`omnirl_async.buffer.table`).

Two implementations share one core (:class:`omnirl_async.buffer.core.BufferCore`):
:class:`~omnirl_async.buffer.local.LocalReplayBuffer` (no Ray; unit tests, sync
runs) and :class:`~omnirl_async.buffer.transfer_queue.RayReplayBuffer` (a
client that pickles to actor handles, usable from any Ray process).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from omnirl_async.protocol import RefillRequest, SampleMeta, SampleSource

__all__ = ["ReplayBuffer", "SampledBatch", "SampleRequest", "assemble_fields", "concat_batches"]


@dataclass
class SampledBatch:
    """What :meth:`ReplayBuffer.sample` returns.

    ``metas[i]`` describes row ``i`` of every array in ``fields``; members of a
    group are adjacent and in ``sample_index`` order. ``info`` holds per-sample
    arrays computed at sampling time: ``staleness`` (learner version minus the
    sample's policy version, 0 for offline data) and ``times_sampled``
    (including this draw). Arrays may be read-only views of shared memory;
    copy before writing in place.
    """

    metas: list[SampleMeta]
    fields: dict[str, np.ndarray]
    info: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.metas)

    @property
    def keys(self) -> list[str]:
        return [m.key for m in self.metas]

    def group_slices(self) -> list[tuple[str, slice]]:
        """``(group_uid, slice)`` for every group in the batch, in order."""
        out: list[tuple[str, slice]] = []
        start = 0
        for i in range(1, len(self.metas) + 1):
            if i == len(self.metas) or self.metas[i].tags.group_uid != self.metas[start].tags.group_uid:
                out.append((self.metas[start].tags.group_uid, slice(start, i)))
                start = i
        return out


class SampleRequest:
    """A batch asked for ahead of use (:meth:`ReplayBuffer.sample_async`); :meth:`result` returns it once drawn."""

    def __init__(self, resolve: Callable[[], SampledBatch]) -> None:
        self._resolve: Callable[[], SampledBatch] | None = resolve
        self._batch: SampledBatch | None = None

    def result(self) -> SampledBatch:
        """The batch (waiting for it); raises what :meth:`ReplayBuffer.sample` would have raised."""
        if self._resolve is not None:
            resolve, self._resolve = self._resolve, None
            self._batch = resolve()
        return self._batch


class ReplayBuffer(ABC):
    """Version-aware, group-aware replay buffer.

    Every blocking call takes ``timeout`` in seconds; ``None`` means the
    configured default (``transfer_queue.put_timeout_s``). A timeout raises
    ``TimeoutError`` that says what the call waited for.
    """

    @abstractmethod
    def put(self, metas: Sequence[SampleMeta], fields: dict[str, Any], *, timeout: float | None = None,
            producer: str | None = None) -> None:
        """Insert a batch of samples (typically a whole group) with one call.

        ``producer`` names the process putting (a rollout worker id): with
        producer-owned payloads (the Ray buffer's default) :meth:`drop_producer`
        finds its groups when it dies. In-process buffers copy the data and ignore it.

        ``fields`` are batch-dimension-first arrays aligned with ``metas``.
        ``metas[i].status`` must be SUCCESS or FAILURE (with ``reason``); a
        SUCCESS sample needs a finite ``reward``; online samples need
        ``tags.policy_version``. A batch that breaks any rule (schema, duplicate
        key, bad group tags) raises ``ValueError`` naming the key and field and
        stores nothing. Blocks while the buffer is full or the rate limiter
        holds inserts back; never drops data to make room.
        """

    def flush(self, timeout: float | None = None, *, share: bool = False) -> None:
        """Wait until this process's puts are in the buffer; raises the error of one that failed.

        The Ray buffer sends puts in the background (``transfer_queue.max_pending_puts``):
        its ``put`` returns before the controller has admitted the group, and
        an error the controller raises comes back at this process's next call.
        Call ``flush`` before acting on a put (e.g. reporting the group's prompt
        done). Every other call of a client flushes first. ``share=True`` waits
        out ``transfer_queue.put_linger_s`` instead of sending at once, so that
        puts other threads of this process make meanwhile share the controller
        call (what the rollout workers and the sync trainer do). In-process
        buffers put synchronously: nothing to do.
        """

    def drop_producer(self, producer: str) -> int:
        """``producer`` died: drop its groups whose payload it owned; those never trained are generated again
        (refill requests, ``buffer/regenerated_groups``). Returns how many. In-process buffers own copies: 0."""
        return 0

    @abstractmethod
    def sample(self, batch_size: int, *, learner_version: int, timeout: float | None = None,
               source: SampleSource | str | None = None) -> SampledBatch:
        """Return whole complete groups holding at least ``batch_size`` samples.

        Exactly ``batch_size`` when groups are full and ``batch_size`` is a
        multiple of the group size; otherwise the last group may overshoot.
        ``source`` restricts sampling to one table; by default the batch mixes
        the tables by ``buffer.offline_mix_ratio`` (``round(batch_size * ratio)``
        offline samples; the trainers draw the online batch with
        ``source="online"`` and add :meth:`sample_offline`). Stale groups (lag above
        ``max_off_policy_threshold``) are never returned; they are evicted and
        counted in ``buffer/dropped_stale``.
        """

    def sample_async(self, batch_size: int, *, learner_version: int, timeout: float | None = None,
                     source: SampleSource | str | None = None) -> SampleRequest:
        """:meth:`sample`, asked for now and collected later with ``.result()``: a consumer keeps a request or
        two in flight so that the buffer's round trip overlaps its own work (Reverb's samples in flight).

        The Ray buffer sends the request at once (the controller draws the batch
        as soon as it can; requests in flight together may be served in either
        order); in-process buffers draw at ``.result()``. Staleness is judged at
        ``learner_version``: a learner that asks ahead for its next update passes
        the version that update will train at.
        """
        return SampleRequest(lambda: self.sample(batch_size, learner_version=learner_version, timeout=timeout,
                                                 source=source))

    @abstractmethod
    def sample_tickets(self, below: int, *, learner_version: int) -> SampledBatch:
        """Take every ready online group whose admission ticket is below ``below``; never blocks.

        The ``wait`` strategy's learner update ``u`` calls it with
        ``below = (u+1)*B`` once every ticket below that is done; the batch is
        smaller than ``B`` groups when some of them failed, and may be empty.
        """

    @abstractmethod
    def sample_offline(self, num_online: int, *, learner_version: int, ratio: float | None = None) -> SampledBatch:
        """The offline share to go with an online batch of ``num_online`` samples; never blocks.

        Whole pairs from the offline table, so that offline rows make up
        ``buffer.offline_mix_ratio`` of every row drawn (the rounding carries
        over from call to call; ``buffer/offline_frac`` reports the share so
        far). ``ratio`` (in (0, 1)) replaces the configured share for this
        call (a tapered share: ``buffer.offline_mix_ratio_final``); the carry
        then keeps each call's share. Empty when the ratio is 0 or
        ``num_online`` is 0; ``ValueError`` when the ratio is 1 (use
        ``sample(..., source="offline")``) or the offline table is empty.
        """

    @abstractmethod
    def load_offline(self, run_dir: str) -> dict[str, Any]:
        """Fill the offline table from ``<run_dir>/offline/`` (pairs not in it yet); see :mod:`.offline_table`.

        Returns ``{"added", "pairs", "dir", "content_hash"}``. Offline rows stay when drawn,
        are never evicted, and are snapshotted by reference to the store.
        """

    @abstractmethod
    def size(self) -> int:
        """Samples stored (successful members of complete and incomplete groups)."""

    @abstractmethod
    def num_ready_samples(self, learner_version: int | None = None) -> int:
        """Online samples in complete, non-stale groups (what an online sample call could take now).

        The offline table is a fixed pool, always there to draw from (``buffer/offline_size``)."""

    @abstractmethod
    def ready_groups(self, learner_version: int | None = None) -> int:
        """Number of complete, non-stale online groups."""

    @abstractmethod
    def take_refill_requests(self) -> list[RefillRequest]:
        """Groups evicted for a failed member that should be generated again (clears the list)."""

    @abstractmethod
    def update_priorities(self, group_uids: Sequence[str], priorities: Sequence[float]) -> None:
        """Set the priority of groups (prioritized sampler; ignored by the others)."""

    @abstractmethod
    def get(self, keys: Sequence[str], fields: Sequence[str] | None = None) -> SampledBatch:
        """Read samples by key without sampling them (no counters change). ``KeyError`` if absent."""

    @abstractmethod
    def list_keys(self, *, partition: str | None = None, source: SampleSource | str | None = None,
                  **tag_filter: Any) -> list[str]:
        """Keys of stored samples whose partition/source/tags equal the given values."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every sample; counters are kept, the field schema is inferred again."""

    @abstractmethod
    def metrics(self) -> dict[str, float]:
        """``buffer/size``, ``buffer/insert_rate``, ``buffer/sample_rate``, ``buffer/dropped_stale``,
        ``buffer/dropped_failed``, ``buffer/staleness/lag_<k>`` (histogram of sampled lags) and more."""

    @abstractmethod
    def snapshot(self, path: str) -> None:
        """Write the whole buffer to directory ``path`` atomically (msgpack + safetensors, no pickle)."""

    @abstractmethod
    def restore(self, path: str) -> None:
        """Replace the buffer's contents with a snapshot written by :meth:`snapshot`."""

    @abstractmethod
    def close(self) -> None:
        """Release resources (Ray actors). The buffer is unusable afterwards."""

    def __enter__(self) -> "ReplayBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def assemble_fields(parts: Sequence[tuple[dict[str, np.ndarray], Sequence[int]]],
                    names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Stack rows taken from several stored payloads into one batch.

    ``parts`` is a list of ``(payload, rows)``. A single payload read whole is
    returned without a copy; otherwise one copy per field.
    """
    if not parts:
        return {}
    if names is None:
        names = list(parts[0][0].keys())
    out: dict[str, np.ndarray] = {}
    for name in names:
        chunks = []
        for payload, rows in parts:
            arr = payload[name]
            n = len(rows)
            if n == arr.shape[0] and (n == 0 or (rows[0] == 0 and rows[-1] == n - 1 and _contiguous(rows))):
                chunks.append(arr)
            elif n and _contiguous(rows):
                chunks.append(arr[rows[0]:rows[-1] + 1])
            else:
                chunks.append(arr[np.asarray(rows, dtype=np.int64)])
        out[name] = chunks[0] if len(chunks) == 1 else np.concatenate(chunks, axis=0)
    return out


def _contiguous(rows: Sequence[int]) -> bool:
    return all(rows[i + 1] == rows[i] + 1 for i in range(len(rows) - 1))


def concat_batches(batches: Sequence[SampledBatch], order: Callable[[SampleMeta], Any] | None = None) -> SampledBatch:
    """One batch of the groups of ``batches`` (each group stays whole and in ``sample_index`` order), one copy per
    field; ``order(meta of a group's first row)`` sorts the groups (stable) - e.g. by admission ticket, so that
    groups taken in several calls as they landed come out as one call would have returned them."""
    batches = [b for b in batches if len(b)]
    if len(batches) == 1 and order is None:
        return batches[0]
    if not batches:
        return SampledBatch(metas=[], fields={})
    spans = [(bi, sl) for bi, b in enumerate(batches) for _, sl in b.group_slices()]
    if order is not None:
        spans.sort(key=lambda s: order(batches[s[0]].metas[s[1].start]))
    names = list(batches[0].fields)
    for bi, b in enumerate(batches[1:], 1):
        if set(b.fields) != set(names) or set(b.info) != set(batches[0].info):
            raise ValueError(f"concat_batches: batch {bi} has fields {sorted(b.fields)} and info "
                             f"{sorted(b.info)}, batch 0 has {sorted(names)} and {sorted(batches[0].info)}")

    def join(get: Callable[[SampledBatch], dict[str, np.ndarray]], name: str) -> np.ndarray:
        return np.concatenate([get(batches[bi])[name][sl] for bi, sl in spans], axis=0)

    return SampledBatch(metas=[m for bi, sl in spans for m in batches[bi].metas[sl]],
                        fields={n: join(lambda b: b.fields, n) for n in names},
                        info={n: join(lambda b: b.info, n) for n in batches[0].info})
