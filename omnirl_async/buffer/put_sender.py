"""Puts that do not wait for the transfer-queue controller: one background sender per client process.

A producer's :meth:`RayReplayBuffer.put <omnirl_async.buffer.transfer_queue.RayReplayBuffer.put>`
does its own work (validation, the object-store put of the payload) and hands
the small registration (metadata + the payload's ref, as bytes) to a
:class:`PutSender`, which sends it to the controller from a background thread
and returns at once. The sender waits ``linger_s``
(``transfer_queue.put_linger_s``, 20 ms) after a registration arrives for
others to share its call, and while one call is in flight the registrations
that arrive queue up for the next: one controller call per *batch* of groups
when the producer is fast (a worker putting the groups of a batch of prompts
back to back), one per group when it is slow. A full window or closing cuts
the wait short, and so does a :meth:`PutSender.flush` unless it is a sharing
flush (``share=True``): that one waits for the linger to run out, so puts of
other threads of the process that arrive meanwhile share the call (a rollout
worker's pool threads finishing groups together, the sync trainer's shards).

What a producer may rely on:

* at most ``transfer_queue.max_pending_puts`` registrations are queued or in
  flight per client process; a put beyond that waits (with the put's timeout)
  for room – so a full buffer still holds producers back;
* an error the controller raises for a put (schema mismatch, duplicate key,
  a full buffer's timeout) is raised by the client's next call – ``put``,
  :meth:`flush` or any other buffer call – with a note naming the group;
* :meth:`flush` returns when everything sent is admitted (or raises);
  every other call of the same client flushes first, so a client reads its
  own writes (a ``sample`` after a ``put`` sees the put);
* puts of one client are admitted in the order they were made.

A rollout worker flushes before it reports its lease complete, so a worker
that dies with registrations still queued has not completed those leases:
the dispatcher leases them again and nothing is lost.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

__all__ = ["PendingPut", "PutSender"]


@dataclass
class PendingPut:
    """One registration: the controller ``put`` arguments and the group it is for (for error notes)."""

    args: tuple
    group_uid: str
    timeout: float


class PutSender:
    """Sends :class:`PendingPut` s through ``send(list_of_args) -> list_of_results`` from a daemon thread.

    ``send`` performs the (blocking) controller call for a batch and returns
    one ``("ok", value)`` / ``("err", exception)`` per entry; an exception from
    ``send`` itself (the controller died, the call timed out) fails the whole
    batch. ``window`` bounds the entries queued or in flight.
    """

    def __init__(self, send: Callable[[list[tuple], float], list[tuple]], window: int, linger_s: float = 0.0) -> None:
        if window < 1:
            raise ValueError(f"PutSender needs window >= 1, got {window}")
        if not linger_s >= 0:
            raise ValueError(f"PutSender needs linger_s >= 0, got {linger_s}")
        self._send = send
        self._window = int(window)
        self._linger_s = float(linger_s)
        self._flushing = 0  # flush() calls waiting: the linger ends at once
        self._cond = threading.Condition()
        self._queue: list[PendingPut] = []
        self._sending = 0
        self._errors: list[BaseException] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        #: calls made and entries sent (how well registrations were batched)
        self.calls = 0
        self.sent = 0

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + self._sending

    def submit(self, entry: PendingPut, timeout: float) -> None:
        """Queue ``entry``; waits up to ``timeout`` s for room in the window. Raises an earlier put's error."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._raise_error()
            if self._closed:
                raise RuntimeError("put rejected: the buffer client is closed")
            while len(self._queue) + self._sending >= self._window:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"put of group `{entry.group_uid}` waited {timeout:.0f} s for room among the "
                        f"{len(self._queue) + self._sending} puts this process already handed to the transfer-queue "
                        f"controller (`transfer_queue.max_pending_puts` = {self._window}): the controller did not "
                        "admit them – the buffer is full and nobody samples, or the controller is overloaded or "
                        "dead")
                self._cond.wait(min(left, 1.0))
                self._raise_error()
            self._queue.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="omnirl-put-sender", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout: float, *, share: bool = False) -> None:
        """Wait until every queued put is admitted; raises the first error met (a note counts the others).

        ``share=False`` ends a linger at once; ``share=True`` lets it run out (up to ``linger_s`` more), so that
        puts arriving meanwhile go in the same call."""
        deadline = time.monotonic() + timeout
        with self._cond:
            cut = 0 if share else 1
            self._flushing += cut
            self._cond.notify_all()  # a lingering sender sends now (unless sharing)
            try:
                while self._queue or self._sending:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(
                            f"flush waited {timeout:.0f} s for {len(self._queue) + self._sending} puts to be admitted "
                            "by the transfer-queue controller: the buffer is full and nobody samples, or the "
                            "controller is overloaded or dead")
                    self._cond.wait(min(left, 1.0))
                self._raise_error()
            finally:
                self._flushing -= cut

    def close(self) -> None:
        """Stop the thread after what is queued has been sent (no wait here); later submits are refused."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ------------------------------------------------------------------ internals
    def _raise_error(self) -> None:
        if self._errors:
            first, more = self._errors[0], len(self._errors) - 1
            self._errors = []
            if more:
                first.add_note(f"{more} more put(s) of this process failed in the same way or otherwise")
            raise first

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                end = time.monotonic() + self._linger_s  # others may share this call
                while (len(self._queue) < self._window and not (self._closed or self._flushing)
                       and time.monotonic() < end):
                    self._cond.wait(end - time.monotonic())
                batch, self._queue = self._queue, []
                self._sending = len(batch)
            failed: list[tuple[str, BaseException]] = []
            try:
                results = self._send([e.args for e in batch], sum(e.timeout for e in batch))
                failed = [(e.group_uid, value) for e, (status, value) in zip(batch, results) if status == "err"]
            except Exception as exc:  # the call itself failed: every entry of the batch failed with it
                failed = [(", ".join(e.group_uid for e in batch[:5]) + (" ..." if len(batch) > 5 else ""), exc)]
            for groups, exc in failed:
                exc.add_note(f"raised for the put of group(s) `{groups}`, sent in the background "
                             "(`transfer_queue.max_pending_puts` > 0) and reported at this later call")
            n, batch, results = len(batch), None, None  # the entries' payload refs go now, not at the next batch
            with self._cond:
                self.calls += 1
                self.sent += n
                self._errors.extend(exc for _g, exc in failed)
                self._sending = 0
                self._cond.notify_all()
