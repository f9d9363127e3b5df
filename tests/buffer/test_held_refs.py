"""Producer-owned payloads registered as ref bytes: the controller's ledger (buffer/wire_ledger.py) and the
producer's keeper (buffer/held_refs.py) – a producer keeps each ref exactly until nobody needs it."""

from __future__ import annotations

import time

import pytest

from omnirl_async.buffer.table import Group, Item
from omnirl_async.buffer.wire_ledger import WireLedger


def wire(oid: bytes):
    return ("omnirl-ref", oid, b"owner", b"status")


def group_of(w, rows: int) -> Group:
    g = Group("g", rows, 0)
    for i in range(rows):
        g.members[i] = Item(None, w, i, 1)
    return g


# ----------------------------------------------------------------------------------------- the ledger alone
def test_a_payload_goes_back_to_its_holder_when_its_last_row_leaves():
    led, a = WireLedger(60), wire(b"a")
    led.add(a, 4, "h1", 0.0)
    assert led.take("h1", 1.0) == []
    led.on_remove(group_of(a, 3))  # rows of one payload may leave in several groups
    assert led.take("h1", 1.0) == [] and led.count[b"a"] == 1
    led.on_remove(group_of(a, 1))
    assert led.take("h2", 1.0) == []  # another holder's payloads are not its business
    assert led.take("h1", 1.0) == [b"a"]
    assert led.take("h1", 1.0) == [] and len(led) == 0  # once


def test_a_batch_handed_out_keeps_the_payload_after_the_draw_removed_its_group():
    led, a = WireLedger(60), wire(b"a")
    led.add(a, 2, "h1", 0.0)
    led.on_remove(group_of(a, 2))  # a draw that exhausted the group ...
    led.hold([b"a"])  # ... and the batch carrying it, under the same lock
    assert led.take("h1", 1.0) == []
    led.unhold([b"a"])  # the reader acknowledged
    assert led.take("h1", 1.0) == [b"a"]


def test_a_refused_put_leaves_nothing_counted_and_nothing_to_release():
    led, a = WireLedger(60), wire(b"a")
    led.add(a, 4, "h1", 0.0)
    led.discard(a, 4)
    assert len(led) == 0 and led.take("h1", 1.0) == []


def test_the_releases_of_a_silent_holder_are_dropped():
    led, a, b = WireLedger(10), wire(b"a"), wire(b"b")
    led.add(a, 1, "gone", 0.0)
    led.add(b, 1, "alive", 0.0)
    led.on_remove(group_of(a, 1))
    led.on_remove(group_of(b, 1))
    assert led.take("alive", 100.0) == [b"b"]
    assert led.pending() == {} and led.take("gone", 101.0) == []


# ---------------------------------------------------------------------------------------- through Ray
ray = pytest.importorskip("ray")

from conftest import buffer_cfg, check_rows, make_group, spec, tq_cfg  # noqa: E402
from omnirl_async.buffer import held_refs  # noqa: E402
from omnirl_async.buffer.transfer_queue import RayReplayBuffer, StorageUnit, TransferQueueController  # noqa: E402

DIM = 64 * 1024 // 4  # a group of 4 rows of 64 KB: over the inline limit, the producer owns it


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self, buf):
        self.buf = buf

    def put(self, prefix: str, n_groups: int, first: int = 0) -> None:
        for g in range(first, first + n_groups):
            self.buf.put(*make_group(f"{prefix}{g}", 4, dim=DIM), timeout=60, producer="w0")
        self.buf.flush(timeout=60)

    def put_after_a_refused_one(self) -> str:
        """a0 again (refused in the background), then a1, whose put raises that earlier error unregistered."""
        self.buf.put(*make_group("a0", 4, dim=DIM), timeout=60, producer="w0")
        time.sleep(1.0)  # the sender has sent it and holds the controller's error
        try:
            self.buf.put(*make_group("a1", 4, dim=DIM), timeout=60, producer="w0")
        except ValueError as exc:
            return str(exc)
        return "no error"

    def no_polls(self) -> None:
        held_refs.POLL_S = 3600.0  # this process then hears of releases only in registration replies

    def held(self) -> tuple[int, int]:
        """(refs this process keeps for the controller, idle polls made)."""
        k = held_refs.keeper_for(self.buf._controller)
        return len(k), k.polls


@pytest.fixture
def made(ray_session):
    """A buffer (closed after the test) and a producer actor putting into it."""
    s = spec(buffer_cfg(max_size=64), q=tq_cfg())
    units = [StorageUnit.remote(0)]
    buf = RayReplayBuffer(TransferQueueController.remote(s, 0, units), units, 60.0, owner=True)
    try:
        yield buf, Producer.remote(buf)
    finally:
        buf.close()


def wait_held(producer, want: int, within: float = 15.0) -> tuple[int, int]:
    deadline = time.monotonic() + within
    while True:
        held, polls = ray.get(producer.held.remote(), timeout=60)
        if held == want or time.monotonic() > deadline:
            assert held == want, f"the producer holds {held} refs, expected {want}"
            return held, polls
        time.sleep(0.1)


def ack(buf: RayReplayBuffer) -> None:
    """What the reader's next read call does first: acknowledge the batches it has read."""
    buf._wait(buf._controller.release.remote(buf._take_acks()), 0.0, "release")


@pytest.mark.slow  # a Ray session, producer actors, seconds of polling
def test_a_producer_keeps_each_ref_until_its_group_was_read_and_acknowledged(made):
    buf, p = made
    ray.get(p.put.remote("a", 3), timeout=60)
    assert ray.get(p.held.remote()) == (3, 0)
    check_rows(buf.sample(4, learner_version=0, timeout=30))  # drawn, out of the table; read, not acknowledged
    time.sleep(2.5)  # the producer's idle polls hear of nothing to drop
    assert ray.get(p.held.remote())[0] == 3
    m = buf.metrics()
    assert (m["buffer/payloads_held_by_producers"], m["buffer/reads_unacknowledged"]) == (3, 1)
    check_rows(buf.sample(4, learner_version=0, timeout=30))  # acknowledges the first
    _, polls = wait_held(p, 2)
    assert polls >= 1  # the producer stopped putting: it learnt by asking
    ack(buf)
    wait_held(p, 1)  # the third group is still in the buffer
    check_rows(buf.sample(4, learner_version=0, timeout=30))
    ack(buf)
    wait_held(p, 0)
    m = buf.metrics()
    assert (m["buffer/payloads_held_by_producers"], m["buffer/reads_unacknowledged"]) == (0, 0)


@pytest.mark.slow  # a Ray session, producer actors, seconds of polling
def test_the_reply_to_a_registration_carries_the_releases(made):
    buf, p = made
    ray.get(p.no_polls.remote(), timeout=60)
    ray.get(p.put.remote("a", 1), timeout=60)
    check_rows(buf.sample(4, learner_version=0, timeout=30))
    ack(buf)
    time.sleep(0.5)
    assert ray.get(p.held.remote()) == (1, 0)
    ray.get(p.put.remote("a", 1, first=1), timeout=60)  # its reply names group a0's payload
    assert ray.get(p.held.remote()) == (1, 0)


@pytest.mark.slow  # a Ray session, producer actors, seconds of polling
def test_a_refused_registration_and_groups_cleared_or_gone_let_their_refs_go(made):
    buf, p = made
    ray.get(p.put.remote("a", 2), timeout=60)
    with pytest.raises(ValueError, match="already in the buffer"):
        ray.get(p.put.remote("a", 1), timeout=60)  # a0 again: refused, its new ref dropped at once
    assert ray.get(p.held.remote())[0] == 2
    batch = buf.get(["a1/0", "a1/3"])  # a read by key holds the payload like a sample does
    check_rows(batch)
    buf.clear()
    time.sleep(2.5)
    assert ray.get(p.held.remote())[0] == 1  # a0 went with the clear; a1 waits for get's acknowledgement
    ack(buf)
    wait_held(p, 0)


@pytest.mark.slow  # a Ray session, producer actors, seconds of polling
def test_a_producer_lets_its_refs_go_when_the_controller_is_gone(made):
    buf, p = made
    ray.get(p.put.remote("a", 2), timeout=60)
    ray.kill(buf._controller)
    wait_held(p, 0)


@pytest.mark.slow  # a Ray session, producer actors, seconds of polling
def test_a_put_that_raises_an_earlier_puts_error_lets_its_own_ref_go(made):
    buf, p = made
    ray.get(p.put.remote("a", 1), timeout=60)
    assert "key `a0/0` is already in the buffer" in ray.get(p.put_after_a_refused_one.remote(), timeout=60)
    assert ray.get(p.held.remote())[0] == 1  # a0's: neither the refused copy's nor a1's (never registered)
    assert buf.list_keys() == [f"a0/{i}" for i in range(4)]
