"""Hand an ``ObjectRef`` to a reader as plain bytes, its lifetime kept by whoever sends it.

Why: an ``ObjectRef`` inside an actor call's reply makes Ray run its borrower
protocol – the caller registers as a borrower with the object's owner and the
callee reports the borrow back – which on a 2-core machine costs ~1 ms per
reply, more than an empty call (measured A/B; README, "Replay buffer").
The replay-buffer controller already *holds* every payload ref until the
group is read, so it can keep that ref until the reader says it has the
arrays and send only the ref's id, owner address and status (a few hundred
bytes of ``bytes``) in between. The reader registers the ref with its
owner's address – what Ray itself does when it deserialises a ref – and
``ray.get`` s it as usual; the numpy arrays it gets keep the object's memory
alive after every ref is dropped, like any ``ray.get`` result.

The contract, for the sender: keep a real reference (the ``ObjectRef`` object)
until the reader acknowledges – if the sender lets go first, the owner frees
the object and the reader's ``ray.get`` fails. For the reader: acknowledge only
after ``ray.get`` returned. An owner that dies makes the reader's ``ray.get``
raise ``OwnerDiedError`` (an ``ObjectLostError``), as with a plain ref.

Uses two core-worker calls that Ray's own serializer uses
(``serialize_object_ref``, ``deserialize_and_register_object_ref``); their
absence (a Ray release that renamed them) is reported at import of the
controller, naming the Ray version, rather than as a failure mid-run.
"""

from __future__ import annotations

import ray

__all__ = ["Wire", "check_supported", "from_wire", "is_wire", "to_wire"]

#: (tag, object id, owner address, object status): the tag marks it; the rest is what Ray's own serializer sends
Wire = tuple

_TAG = "omnirl-ref"


def _core_worker():
    return ray._private.worker.global_worker.core_worker


def check_supported(core_worker_class: type | None = None) -> None:
    """Raise ``RuntimeError`` naming the Ray version if this Ray lacks the two core-worker calls used here."""
    if core_worker_class is None:
        from ray import _raylet
        core_worker_class = _raylet.CoreWorker
    missing = [n for n in ("serialize_object_ref", "deserialize_and_register_object_ref")
               if not hasattr(core_worker_class, n)]
    if missing:
        raise RuntimeError(f"ray {ray.__version__} lacks CoreWorker.{', '.join(missing)}, which the replay buffer "
                           "uses to hand payload refs to readers without the borrower protocol; use Ray 2.60 "
                           "(constraints-cpu.txt)")


def to_wire(ref: ray.ObjectRef) -> Wire:
    """The bytes a reader needs to read ``ref``; the caller keeps ``ref`` alive until the reader acknowledges."""
    _, owner, status = _core_worker().serialize_object_ref(ref)
    return (_TAG, ref.binary(), owner, status)


def is_wire(value) -> bool:
    return isinstance(value, tuple) and len(value) == 4 and value[0] == _TAG


def from_wire(wire: Wire) -> ray.ObjectRef:
    """A readable ``ObjectRef`` from :func:`to_wire`'s bytes (registered with its owner's address)."""
    _, binary, owner, status = wire
    ref = ray.ObjectRef(binary, owner, "")  # a local reference first, as Ray's deserializer does
    _core_worker().deserialize_and_register_object_ref(binary, ray.ObjectRef.nil(), owner, status)
    return ref
