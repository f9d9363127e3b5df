"""Sharded transfer queue on Ray: one controller actor, K storage-unit actors.

Who holds what:

* the **controller** (:class:`TransferQueueController`) runs the
  :class:`~omnirl_async.buffer.core.BufferCore`: metadata (``SampleMeta``
  with status, reason, tags, timestamps, times_sampled), tables, sampling,
  staleness, rate limiting, blocking. It never touches tensor bytes;
* the **payloads** live in the object store, owned by the producer (the
  default) or by a **storage unit** (below); the controller keeps references
  and metadata only;
* a consumer gets the payloads' refs from the controller and reads them with
  ``ray.get``: numpy arrays come back zero-copy (read-only views). The refs
  travel as bytes (:mod:`.ref_wire`): the controller keeps each batch's refs
  under a token until the reader acknowledges it (in its next read call, or
  :meth:`RayReplayBuffer.close`; ``READ_HOLD_S`` for a reader that never
  does), which spares Ray's borrower protocol – ~1 ms per 8-ref reply on
  2 cores. A read's arguments and its reply go as one msgpack blob each, and
  so do registrations (:mod:`.rpc`; ~0.2 ms less per call than Ray's
  pickling of tuples, dicts and small arrays).

So one put is two actor calls (unit, controller) and one sample is one actor
call plus one ``ray.get`` – per *group* and per *batch*, never per sample.
The controller call of a put does not hold the producer up: it goes to a
background sender (:mod:`.put_sender`, ``transfer_queue.max_pending_puts``
per process) which batches the registrations that queue up while one call is
in flight; errors come back at the producer's next call, and every other
call of a client (``sample``, ``size``, ...) first waits for its own puts.
Small payloads (under ``transfer_queue.inline_max_bytes``, 64 KB: e.g. a group of 4 KB samples) skip
the unit: they travel inside the controller call, live in the controller's
heap and come back inside the sample reply – one call each way, since at
that size a call costs more than the bytes.

Two ways to own a payload (``transfer_queue.producer_owned_payloads``):

* **producer-owned** (the default): the producer ``ray.put`` s its group
  itself – one object-store put, raw object-store speed – and registers the
  ref *as bytes* and the metadata with the controller in one call, naming
  itself (``producer``, the rollout worker id); the producing process keeps
  the ``ObjectRef`` until the controller says no stored row and no batch
  being read needs it (:mod:`.held_refs`, :mod:`.wire_ledger`: a ref in the
  call's arguments would cost Ray's borrower protocol, two more RPCs per
  group). Ray frees an object when its
  owner dies, so the groups of a rollout worker that dies are lost unless
  consumed; nothing is lost *for training* because they are generated again:
  when the trainer learns of the death it calls :meth:`RayReplayBuffer.
  drop_producer`, and a read that meets a dead owner (``ObjectLostError``)
  leaves those rows out of the batch; either way the controller removes the
  groups and queues a :class:`~omnirl_async.protocol.RefillRequest` for each
  group never trained, which the trainer hands back to the prompt dispatcher
  (same group uid and epoch, a new ticket), counted in
  ``buffer/regenerated_groups``. A group already trained once (kept for reuse)
  just leaves. Snapshots skip lost groups the same way.
* **storage-unit-owned** (``false``): the producer sends its group to one of
  the K units, which copies it into an object *it* owns – a second copy
  (~7 ms per MB-sized put on 2 cores) – so the data outlives its producer.
  For producers that may vanish between put and consume with no dispatcher to
  lease their prompts again. Ray removed ``ray.put(..., _owner=unit)`` in 2.56,
  which would have saved that copy. Placement is by *group* uid so that a
  group, which is always read whole, is one object.

:class:`RayReplayBuffer` is the client. It pickles to the actor handles
(Reverb ``Client`` pickles to its address), so the same object works in the
driver, in rollout workers and in learners. Errors raised in the controller
come back as values and are re-raised here with their original type.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import msgspec
import numpy as np
import ray

from omnirl_async.buffer import held_refs
from omnirl_async.buffer.base import ReplayBuffer, SampledBatch, SampleRequest, assemble_fields
from omnirl_async.buffer.core import BufferCore
from omnirl_async.buffer.controller import (LOST_REASON, READ_HOLD_S, StorageUnit, TransferQueueController,
                                            unit_for)
from omnirl_async.buffer.local import check_field_names, prepare_put
from omnirl_async.buffer.put_sender import PendingPut, PutSender
from omnirl_async.buffer.ref_wire import from_wire, is_wire
from omnirl_async.buffer.rpc import answer, pack, request
from omnirl_async.buffer.spec import BufferSpec
from omnirl_async.protocol import RefillRequest, SampleMeta, SampleSource, SampleStatus
from omnirl_async.waits import bounded_get

__all__ = ["LOST_REASON", "READ_HOLD_S", "StorageUnit", "TransferQueueController", "RayReplayBuffer", "unit_for"]

_METAS = msgspec.msgpack.Decoder(list[SampleMeta])
_ENC = msgspec.msgpack.Encoder()
RPC_GRACE_S = 30.0  # extra wait for the remote call itself beyond the buffer's own timeout
_WHY = ("The actor may be overloaded (a large snapshot or batch) or stuck, or its node lost (see `ray status` and "
        "`ray list actors`); the limit is the call's own timeout plus {grace:g} s.").format(grace=RPC_GRACE_S)


def _get(refs, timeout_s: float, what: str):
    """``ray.get`` on the buffer's actors within ``timeout_s``, or a TimeoutError naming ``what`` was awaited."""
    return bounded_get(refs, timeout_s, f"replay buffer: {what}", _WHY, key=None)



class RayReplayBuffer(ReplayBuffer):
    """Client of the transfer queue; see the module docstring. Build with :meth:`create`."""

    def __init__(self, controller, units: list, default_timeout: float, producer_owned: bool = True,
                 inline_max_bytes: int = 64 * 1024, max_pending_puts: int = 8, put_linger_s: float = 0.0, *,
                 owner: bool = False) -> None:
        self._controller = controller
        self._units = list(units)
        self._default_timeout = default_timeout
        self._producer_owned = producer_owned
        self._inline_max_bytes = int(inline_max_bytes)
        self._max_pending_puts = int(max_pending_puts)
        self._put_linger_s = float(put_linger_s)
        self._sender: PutSender | None = None  # made by the first put of this process (it is not pickled)
        self._sender_lock = threading.Lock()
        self._owner = owner
        #: batches this process has read, to acknowledge in its next sample call (see :mod:`.ref_wire`)
        self._acks: list[int] = []
        self._acks_lock = threading.Lock()

    @classmethod
    def create(cls, spec: BufferSpec | None = None, *, seed: int | None = None,
               unit_options: Any = None, controller_options: dict | None = None) -> "RayReplayBuffer":
        """Start the controller and ``spec.transport.num_data_storage_units`` storage units; None = defaults.

        ``unit_options(i)``: extra Ray actor options of storage unit ``i`` (its placement);
        ``controller_options``: those of the controller (the trainer keeps it on the driver's node, where
        it writes and reads snapshots).
        """
        if not ray.is_initialized():
            raise RuntimeError("make_replay_buffer(use_ray=True) needs Ray: call ray.init() first")
        spec = BufferSpec() if spec is None else spec
        BufferCore(spec)  # build it here too: sampler / remover errors surface in the caller, not in an actor
        units = [StorageUnit.options(**(unit_options(i) if unit_options else {})).remote(i)
                 for i in range(spec.transport.num_data_storage_units)]
        controller = TransferQueueController.options(**(controller_options or {})).remote(spec, seed, units)
        buf = cls(controller, units, float(spec.capacity.put_timeout_s), spec.transport.producer_owned_payloads,
                  spec.transport.inline_max_bytes, spec.transport.max_pending_puts, spec.transport.put_linger_s,
                  owner=True)
        _get(controller.assert_healthy.remote(), 120.0, "the new controller and storage units (starting)")
        return buf

    def __reduce__(self):
        # Pickles to handles: a copy in another process is a client, never the owner (it won't kill actors).
        return (RayReplayBuffer, (self._controller, self._units, self._default_timeout, self._producer_owned,
                                  self._inline_max_bytes, self._max_pending_puts, self._put_linger_s))

    # ------------------------------------------------------------------ calls
    def _wait(self, ref, timeout: float | None, call: str):
        t = self._default_timeout if timeout is None else float(timeout)
        return answer(_get(ref, t + RPC_GRACE_S, f"the controller's `{call}`"))

    def _call(self, name: str, *args):
        self.flush()
        return self._wait(self._controller.call.remote(name, *args), 0.0, name)

    def _send_puts(self, items: list[tuple], timeout: float) -> list[tuple]:
        """The sender's controller call: a batch of registrations; raises if the call itself fails. The payloads
        this process registered as bytes and nobody needs any more come back with it (:mod:`.held_refs`); those
        of refused registrations go at once."""
        keeper = held_refs.keeper_for(self._controller)
        try:
            if any(isinstance(item[1][0], ray.ObjectRef) for item in items):  # a storage unit's ref: pickled
                call = self._controller.put_many.remote(items, keeper.holder)
            else:  # ref bytes, inline arrays, nothing: one blob
                call = self._controller.put_packed.remote(pack([items, keeper.holder]))
            results, released = answer(_get(call, timeout + RPC_GRACE_S, f"the controller's `put` of {len(items)} "
                                                                         "group(s)"))
        except BaseException:  # stored or not, this process will not hear of them again: a read finds them lost
            self._unregistered(items)
            raise
        results = [("ok", r) if isinstance(r, int) else r for r in results]
        keeper.delivered(released)
        self._unregistered([item for item, (st, _) in zip(items, results) if st == "err"])
        return results

    def _unregistered(self, items: list[tuple]) -> None:
        """These registrations were refused or never made: their payload refs (if registered as bytes) go now."""
        oids = [item[1][0][1] for item in items if is_wire(item[1][0])]
        if oids:
            held_refs.keeper_for(self._controller).drop(oids)

    def flush(self, timeout: float | None = None, *, share: bool = False) -> None:
        """Wait until this process's puts are admitted by the controller; raises a failed put's error.
        ``share``: let ``put_linger_s`` run out first (puts of other threads meanwhile share the call)."""
        if self._sender is not None:
            self._sender.flush(self._default_timeout + RPC_GRACE_S if timeout is None else float(timeout),
                               share=share)

    @property
    def pending_puts(self) -> int:
        """Puts of this process handed to the background sender and not yet admitted."""
        return 0 if self._sender is None else self._sender.pending

    # -------------------------------------------------------------------- API
    def put(self, metas: Sequence[SampleMeta], fields: dict[str, Any], *, timeout: float | None = None,
            producer: str | None = None) -> None:
        metas, payload, spec, row_nbytes = prepare_put(metas, fields, copy=False)
        if not metas:
            return
        if not all(isinstance(m, SampleMeta) for m in metas):
            raise ValueError("put rejected: `metas` must hold SampleMeta")
        ref, owner = None, None
        if any(m.status is SampleStatus.SUCCESS for m in metas) and payload:
            if sum(v.nbytes for v in payload.values()) < self._inline_max_bytes:
                # a copy: the caller may reuse its arrays before the background sender serialises them
                ref = {k: np.array(v, copy=True) for k, v in payload.items()} if self._max_pending_puts else payload
            elif self._producer_owned:  # one copy; dies with this process (then regenerated, see above)
                # registered as bytes: this process keeps the ref until the controller releases it
                ref, owner = held_refs.keeper_for(self._controller).keep(ray.put(payload)), producer
            else:
                unit = self._units[unit_for(metas[0].tags.group_uid, len(self._units))]
                ref = _get(unit.store.remote(payload), self._default_timeout + RPC_GRACE_S,
                           f"storage unit {unit_for(metas[0].tags.group_uid, len(self._units))}'s `store`")[0]
        args = (_ENC.encode(metas), [ref], {k: v.to_list() for k, v in spec.items()}, row_nbytes, timeout, owner)
        if self._max_pending_puts == 0:  # each put waits for the controller
            status, value = self._send_puts([args], self._default_timeout if timeout is None else float(timeout))[0]
            if status == "err":
                raise value
            return
        if self._sender is None:
            with self._sender_lock:
                if self._sender is None:
                    self._sender = PutSender(self._send_puts, self._max_pending_puts, self._put_linger_s)
        t = self._default_timeout if timeout is None else float(timeout)
        try:
            self._sender.submit(PendingPut(args, metas[0].tags.group_uid, t), t)
        except BaseException:  # not registered (no room, or an earlier put's error)
            self._unregistered([args])
            raise

    def drop_producer(self, producer: str) -> int:
        self.flush()  # this client's own puts first
        return self._wait(self._controller.drop_producer.remote(str(producer)), 0.0, "drop_producer")

    def sample(self, batch_size: int, *, learner_version: int, timeout: float | None = None,
               source: SampleSource | str | None = None) -> SampledBatch:
        return self.sample_async(batch_size, learner_version=learner_version, timeout=timeout,
                                 source=source).result()

    def sample_async(self, batch_size: int, *, learner_version: int, timeout: float | None = None,
                     source: SampleSource | str | None = None) -> SampleRequest:
        self.flush()  # this client's own puts first
        ref = self._controller.sample.remote(request(
            batch_size, learner_version, timeout, None if source is None else SampleSource(source).value,
            self._take_acks()))
        return SampleRequest(lambda: self._batch(*self._wait(ref, timeout, "sample")))

    def sample_tickets(self, below: int, *, learner_version: int) -> SampledBatch:
        self.flush()  # this client's own puts first
        return self._batch(*self._wait(self._controller.sample_tickets.remote(
            request(below, learner_version, self._take_acks())), 0.0, "sample_tickets"))

    def sample_offline(self, num_online: int, *, learner_version: int, ratio: float | None = None) -> SampledBatch:
        self.flush()  # this client's own puts first
        return self._batch(*self._wait(self._controller.sample_offline.remote(
            request(num_online, learner_version, ratio, self._take_acks())), 0.0, "sample_offline"))

    def load_offline(self, run_dir: str) -> dict[str, Any]:
        self.flush()  # this client's own puts first
        return self._wait(self._controller.load_offline.remote(str(run_dir)), 600.0, "load_offline")

    def _take_acks(self) -> list[int]:
        with self._acks_lock:
            acks, self._acks = self._acks, []
        return acks

    def _ack(self, token: int | None) -> None:
        """Batch ``token`` was read (or found lost): acknowledged in this client's next read call."""
        if token is not None:
            with self._acks_lock:
                self._acks.append(token)

    def _batch(self, raw: bytes, parts, info, token: int | None) -> SampledBatch:
        try:
            metas, local, info = self._fetch(_METAS.decode(raw), parts, info)
        finally:  # read (or found lost): the controller may let the refs go
            self._ack(token)
        return SampledBatch(metas=metas, fields=assemble_fields(local), info=info)

    def _fetch(self, metas: list[SampleMeta], parts, info: dict):
        """Replace ObjectRefs by their arrays (one ``ray.get`` for all); inline payloads pass through.

        Rows whose payload died with its producer (``ObjectLostError``) are left
        out of ``(metas, parts, info)`` and reported to the controller, which
        drops their groups and has those never trained generated again.
        """
        parts = [(from_wire(tuple(p)) if isinstance(p, list) else p, rows) for p, rows in parts]  # lists: ref bytes
        refs = [p for p, _ in parts if not isinstance(p, dict)]
        try:
            got = iter(_get(refs, self._default_timeout + RPC_GRACE_S, f"the payloads of {len(refs)} group(s) "
                                                                          "(their producers' object stores)")
                       if refs else [])
            return metas, [(p if isinstance(p, dict) else next(got), rows) for p, rows in parts], info
        except ray.exceptions.ObjectLostError:
            pass
        local, keep, lost, start = [], [], [], 0
        for p, rows in parts:
            try:
                arrays = p if isinstance(p, dict) else _get(p, self._default_timeout + RPC_GRACE_S,
                                                            "a group's payload (its producer's object store)")
            except ray.exceptions.ObjectLostError:
                arrays = None
            span = range(start, start + len(rows))
            start += len(rows)
            if arrays is None:
                lost.extend(metas[i] for i in span)
            else:
                local.append((arrays, rows))
                keep.extend(span)
        self._wait(self._controller.lose_taken.remote(_ENC.encode(lost)), 0.0, "lose_taken")
        return [metas[i] for i in keep], local, {k: np.asarray(v)[keep] for k, v in info.items()}

    def get(self, keys: Sequence[str], fields: Sequence[str] | None = None) -> SampledBatch:
        self.flush()  # this client's own puts first
        raw, parts, _, token = self._wait(self._controller.get.remote(request(list(keys), self._take_acks())), 0.0,
                                          "get")
        metas = _METAS.decode(raw)
        try:
            kept, local, _ = self._fetch(metas, parts, {})
        finally:
            self._ack(token)
        if len(kept) < len(metas):
            gone = sorted({m.key for m in metas} - {m.key for m in kept})
            raise KeyError(f"`keys`: the payload of {gone[:5]} died with its producer; their groups left the "
                           "buffer (and are generated again if never trained)")
        check_field_names(local, fields)
        return SampledBatch(metas=metas, fields=assemble_fields(local, fields))

    def size(self) -> int:
        return self._call("size")

    def num_ready_samples(self, learner_version: int | None = None) -> int:
        return self._call("ready", learner_version)[1]

    def ready_groups(self, learner_version: int | None = None) -> int:
        return self._call("ready", learner_version)[0]

    def take_refill_requests(self) -> list[RefillRequest]:
        return msgspec.msgpack.decode(self._call("take_refill_requests"), type=list[RefillRequest])

    def update_priorities(self, group_uids: Sequence[str], priorities: Sequence[float]) -> None:
        self._call("update_priorities", list(group_uids), [float(p) for p in priorities])

    def list_keys(self, *, partition: str | None = None, source: SampleSource | str | None = None,
                  **tag_filter: Any) -> list[str]:
        return self._call("list_keys", partition, None if source is None else SampleSource(source).value,
                          tag_filter)

    def clear(self) -> None:
        self._call("clear")

    def metrics(self) -> dict[str, float]:
        return self._call("metrics")

    def snapshot(self, path: str) -> None:
        self.flush()  # this client's own puts first
        self._wait(self._controller.snapshot.remote(str(path)), 600.0, "snapshot")  # lost groups: regenerated

    def restore(self, path: str) -> None:
        self.flush()  # this client's own puts first
        self._wait(self._controller.restore.remote(str(path)), 600.0, "restore")

    def assert_healthy(self) -> None:
        _get(self._controller.assert_healthy.remote(), 60.0, "the controller's `assert_healthy`")

    def close(self) -> None:
        """Send this process's pending puts, then kill the actors if this client created them (other copies
        just drop their handles)."""
        try:
            if self._sender is not None and self._controller is not None:
                self._sender.close()
                self.flush()
            acks = self._take_acks()
            if acks and self._controller is not None and not self._owner:  # the owner kills the controller
                self._wait(self._controller.release.remote(acks), 0.0, "release")
        finally:
            self._close_actors()

    def _close_actors(self) -> None:
        if self._owner and self._controller is not None:
            held_refs.forget(self._controller)
            for a in [self._controller, *self._units]:
                try:
                    ray.kill(a)
                except Exception:  # already gone
                    pass
        self._controller, self._units = None, []
