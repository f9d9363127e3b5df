"""The controller's count of who still needs each payload a producer registered as bytes.

A producer-owned payload is registered with the controller as its ref's bytes
(:mod:`.ref_wire`), not as an ``ObjectRef``: an ``ObjectRef`` in a call's
arguments makes Ray run its borrower protocol for it (the callee registers
with the owner, the owner later asks when the borrow ends: two more RPCs per
group), and the registration runs once per group. Bytes carry no lifetime,
so the *producer* keeps the real ref (:mod:`.held_refs`) until this ledger
says nobody needs it any more:

* each stored row that points at the payload counts one (a group's rows leave
  through :meth:`Table._remove <omnirl_async.buffer.table.Table._remove>`,
  whatever the reason: trained, evicted, stale, lost, cleared, refilled);
* each batch handed to a reader and not yet acknowledged counts one (the
  reader ``ray.get`` s the payload between the reply and its acknowledgement).

At zero the payload's id is queued for its holder (the registering process),
which learns it in the reply of its next registration or of its idle poll
(:meth:`take`). Everything here runs under the buffer core's lock, the same
lock under which rows are removed and batches handed out, so a payload
cannot be released between a group's last row leaving (a draw that exhausts
it) and the batch carrying it being held for its reader.
"""

from __future__ import annotations

import threading

from omnirl_async.buffer.ref_wire import is_wire
from omnirl_async.buffer.table import Group

__all__ = ["ReadHolds", "WireLedger"]


class WireLedger:
    """Not thread-safe: the controller calls it with ``core.cond`` held. ``forget_after_s``: a holder that has not
    asked for its releases in that long is taken for dead and its queue dropped."""

    def __init__(self, forget_after_s: float) -> None:
        self.forget_after_s = float(forget_after_s)
        self.count: dict[bytes, int] = {}  # object id -> rows + unacknowledged batches needing it
        self.holder_of: dict[bytes, str] = {}
        self._zero: set[bytes] = set()  # ids whose count reached 0 since the last take
        self._out: dict[str, list[bytes]] = {}  # holder -> ids it may drop
        self._seen: dict[str, float] = {}  # holder -> when it last registered or asked

    def __len__(self) -> int:
        return len(self.count)

    def add(self, wire, rows: int, holder: str, now: float) -> None:
        """``rows`` rows about to be stored point at ``wire``'s payload, kept alive by ``holder``."""
        oid = wire[1]
        self.count[oid] = self.count.get(oid, 0) + rows
        self.holder_of[oid] = holder
        self._seen[holder] = now

    def discard(self, wire, rows: int) -> None:
        """The put of those rows was refused: nothing stored; the holder drops the ref itself."""
        oid = wire[1]
        left = self.count.get(oid, 0) - rows
        if left > 0:
            self.count[oid] = left
        else:
            self.count.pop(oid, None)
            self.holder_of.pop(oid, None)
            self._zero.discard(oid)

    def on_remove(self, group: Group) -> None:
        """Hook of :meth:`Table._remove`: the group's rows leave the table."""
        for it in group.members.values():
            if is_wire(it.payload):
                self._sub(it.payload[1], 1)

    def hold(self, oids: list[bytes]) -> None:
        """A batch naming these payloads goes to a reader (one entry per part of the batch)."""
        for oid in oids:
            self.count[oid] = self.count.get(oid, 0) + 1

    def unhold(self, oids: list[bytes]) -> None:
        """The reader acknowledged that batch (or it expired)."""
        for oid in oids:
            self._sub(oid, 1)

    def _sub(self, oid: bytes, n: int) -> None:
        left = self.count.get(oid, 0) - n
        self.count[oid] = left
        if left <= 0:
            self._zero.add(oid)

    def take(self, holder: str, now: float) -> list[bytes]:
        """The ids ``holder`` may drop now (each once); queues the others' releases, forgets silent holders."""
        for oid in self._zero:
            if self.count.get(oid, 1) <= 0:
                del self.count[oid]
                h = self.holder_of.pop(oid)
                if h in self._seen:  # else a holder taken for dead: nobody to tell
                    self._out.setdefault(h, []).append(oid)
        self._zero.clear()
        self._seen[holder] = now
        for h in [h for h, t in self._seen.items() if now - t > self.forget_after_s]:
            del self._seen[h]
            self._out.pop(h, None)
        return self._out.pop(holder, [])

    def pending(self) -> dict[str, int]:
        """Releases queued per holder and not yet taken (for tests and metrics)."""
        return {h: len(v) for h, v in self._out.items()}


class ReadHolds:
    """Batches handed to readers and not yet acknowledged: token -> (when, the refs kept alive for the reader, the
    ledger ids held for it). A batch never acknowledged is let go after ``hold_s`` (a reader that died, a request
    never resolved); reading it later fails as lost. Thread-safe."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = float(hold_s)
        self._open: dict[int, tuple[float, list, list[bytes]]] = {}
        self._lock = threading.Lock()
        self._next = 0

    def __len__(self) -> int:
        return len(self._open)

    def open(self, refs: list, oids: list[bytes], now: float) -> int:
        """Hold a batch; returns its token for the reader to acknowledge."""
        with self._lock:
            token, self._next = self._next, self._next + 1
            self._open[token] = (now, refs, oids)
            return token

    def close(self, acks, now: float) -> list[bytes]:
        """Let go of the acknowledged batches and of those held past ``hold_s``; returns their ledger ids."""
        gone = []
        with self._lock:
            for token in acks or ():
                gone.append(self._open.pop(token, None))
            if self._open and now - next(iter(self._open.values()))[0] > self.hold_s:  # oldest first
                gone.extend(v for v in self._open.values() if now - v[0] > self.hold_s)
                self._open = {t: v for t, v in self._open.items() if now - v[0] <= self.hold_s}
        return [oid for v in gone if v is not None for oid in v[2]]
