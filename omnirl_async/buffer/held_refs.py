"""The refs a producer process registered with a controller as bytes, kept alive until it lets them go.

A producer-owned payload is registered as its ref's bytes (:mod:`.ref_wire`;
why: :mod:`.wire_ledger`), so the controller holds no reference and the object
lives as long as the producing process keeps its ``ObjectRef``. This module
keeps them: one :class:`RefKeeper` per (process, controller), shared by every
client instance of that process – a client is unpickled afresh for each actor
call that takes one, and a copy that dies must not free groups still in the
buffer. The controller names the payloads nobody needs any more in the reply
of each registration call; a process that holds refs and has not heard from
the controller for ``POLL_S`` asks it (one small call), so a producer that
stops putting still frees what was consumed.

A process that dies takes its refs with it: its groups not yet trained read
as lost and are generated again (the module docstring of
:mod:`.transfer_queue`), exactly as before this module.
"""

from __future__ import annotations

import logging
import threading
import time

import ray

from omnirl_async.buffer.ref_wire import Wire, to_wire

__all__ = ["RefKeeper", "forget", "holder_name", "keeper_for"]

log = logging.getLogger(__name__)

POLL_S = 1.0  # a keeper that holds refs and heard nothing this long asks the controller
POLL_TIMEOUT_S = 60.0

_KEEPERS: dict[str, "RefKeeper"] = {}
_LOCK = threading.Lock()


def holder_name() -> str:
    """This process, as the controller knows it (its Ray worker id)."""
    return ray.get_runtime_context().get_worker_id()


class RefKeeper:
    """Refs of one process registered with one controller; see the module docstring."""

    def __init__(self, controller, holder: str) -> None:
        self.controller = controller
        self.holder = holder
        self._refs: dict[bytes, ray.ObjectRef] = {}
        self._lock = threading.Lock()
        self._heard = time.monotonic()
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        #: polls made (tests)
        self.polls = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._refs)

    def keep(self, ref: ray.ObjectRef) -> Wire:
        """Keep ``ref`` alive until the controller releases it; returns its bytes for the registration."""
        wire = to_wire(ref)
        with self._lock:
            self._refs[wire[1]] = ref
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(target=self._run, name="omnirl-ref-keeper", daemon=True)
                self._thread.start()
        return wire

    def drop(self, oids) -> None:
        """Let these payloads go (released by the controller, or their registration failed)."""
        with self._lock:
            for oid in oids:
                self._refs.pop(oid, None)

    def delivered(self, oids) -> None:
        """The controller's answer to a call of this process: ``oids`` may go."""
        self._heard = time.monotonic()
        self.drop(oids)

    def close(self) -> None:
        """The controller is gone: every ref goes, the poller stops."""
        self._closed.set()
        with self._lock:
            self._refs.clear()

    def _run(self) -> None:
        # runs while this process holds refs; a later keep() starts it again
        while not self._closed.wait(POLL_S / 4):
            with self._lock:
                if not self._refs:
                    self._thread = None
                    return
            if time.monotonic() - self._heard < POLL_S:
                continue
            try:
                status, value = ray.get(self.controller.released.remote(self.holder), timeout=POLL_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                log.warning("the transfer-queue controller did not answer which payload refs this process may drop "
                            "within %.0f s (overloaded?); %d refs held, asking again", POLL_TIMEOUT_S, len(self))
                continue
            except Exception as exc:  # the controller died, or Ray shut down: nothing left to keep them for
                log.info("payload refs of this process released: the transfer-queue controller is gone (%s)",
                         type(exc).__name__)
                self.close()
                with self._lock:
                    self._thread = None
                return
            self.polls += 1
            if status == "err":
                log.warning("the transfer-queue controller failed to say which payload refs this process may "
                            "drop: %r; asking again", value)
                self._heard = time.monotonic()
                continue
            self.delivered(value)


def keeper_for(controller) -> RefKeeper:
    """This process's keeper for ``controller`` (an actor handle), made on first use."""
    key = controller._actor_id.hex()
    with _LOCK:
        k = _KEEPERS.get(key)
        if k is None or k._closed.is_set():
            k = _KEEPERS[key] = RefKeeper(controller, holder_name())
        return k


def forget(controller) -> None:
    """``controller`` was killed by this process: its keeper lets every ref go."""
    with _LOCK:
        k = _KEEPERS.pop(controller._actor_id.hex(), None)
    if k is not None:
        k.close()
