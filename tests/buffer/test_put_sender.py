"""The background put sender on its own: order, batching, the window, errors at the next call, timeouts."""

from __future__ import annotations

import threading
import time

import pytest

from omnirl_async.buffer.put_sender import PendingPut, PutSender


class Controller:
    """Admits integers in the order received; ``gate`` holds a call until set; odd items > ``fail_from`` fail."""

    def __init__(self, fail_from: int | None = None) -> None:
        self.admitted: list[int] = []
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_from = fail_from

    def send(self, items: list[tuple], timeout: float) -> list[tuple]:
        assert self.gate.wait(timeout)
        self.batches.append([i for (i,) in items])
        out = []
        for (i,) in items:
            if self.fail_from is not None and i >= self.fail_from and i % 2:
                out.append(("err", ValueError(f"item {i} rejected")))
            else:
                self.admitted.append(i)
                out.append(("ok", 1))
        return out


def entry(i: int) -> PendingPut:
    return PendingPut((i,), f"g{i}", 5.0)


def test_everything_arrives_in_order_and_queued_puts_share_a_call():
    ctl = Controller()
    ctl.gate.clear()  # the first call hangs: what comes meanwhile queues up
    s = PutSender(ctl.send, window=16)
    for i in range(10):
        s.submit(entry(i), 5.0)
    assert s.pending == 10
    ctl.gate.set()
    s.flush(5.0)
    assert ctl.admitted == list(range(10)) and s.pending == 0
    # the thread took 0 alone (or, if it started late, everything): at most 2 calls for 10 puts
    assert sum(ctl.batches, []) == list(range(10)) and len(ctl.batches) <= 2
    assert (s.calls, s.sent) == (len(ctl.batches), 10)


def test_the_window_holds_a_producer_and_times_out_naming_the_key():
    ctl = Controller()
    ctl.gate.clear()
    s = PutSender(ctl.send, window=3)
    for i in range(3):
        s.submit(entry(i), 5.0)
    t = time.monotonic()
    with pytest.raises(TimeoutError, match=r"waited 0 s for room among the 3 puts .*`transfer_queue.max_pending_puts` = 3"):
        s.submit(entry(3), 0.3)
    assert 0.25 < time.monotonic() - t < 3.0
    threading.Timer(0.2, ctl.gate.set).start()
    s.submit(entry(3), 5.0)  # room comes when the call returns
    s.flush(5.0)
    assert ctl.admitted == [0, 1, 2, 3]


def test_an_error_comes_back_once_at_the_next_call_with_the_group_named():
    ctl = Controller(fail_from=3)
    s = PutSender(ctl.send, window=1)  # one per call: each submit waits for the previous call's answer
    for i in range(4):
        s.submit(entry(i), 5.0)
    with pytest.raises(ValueError, match="item 3 rejected") as err:
        s.submit(entry(4), 5.0)
    assert "put of group(s) `g3`" in " ".join(err.value.__notes__)
    s.submit(entry(4), 5.0)  # raised once: the sender goes on
    s.flush(5.0)
    assert ctl.admitted == [0, 1, 2, 4]


def test_several_errors_raise_the_first_and_count_the_others():
    ctl = Controller(fail_from=5)
    ctl.gate.clear()
    s = PutSender(ctl.send, window=8)
    for i in range(5, 10):  # calls [5], [6..9]: 5, 7 and 9 fail
        s.submit(entry(i), 5.0)
    ctl.gate.set()
    with pytest.raises(ValueError, match="item 5 rejected") as err:
        s.flush(5.0)
    assert "2 more put(s)" in " ".join(err.value.__notes__)
    assert ctl.admitted == [6, 8]
    s.flush(5.0)


def test_a_failed_call_fails_its_whole_batch():
    def dead(items, timeout):
        raise ConnectionError("controller died")

    s = PutSender(dead, window=4)
    s.submit(entry(0), 5.0)
    with pytest.raises(ConnectionError, match="controller died") as err:
        s.flush(5.0)
    assert "`g0`" in " ".join(err.value.__notes__)


def test_flush_times_out_saying_what_it_waited_for():
    ctl = Controller()
    ctl.gate.clear()
    s = PutSender(ctl.send, window=4)
    s.submit(entry(0), 5.0)
    with pytest.raises(TimeoutError, match="flush waited 0 s for 1 puts to be admitted"):
        s.flush(0.2)
    ctl.gate.set()
    s.flush(5.0)


def test_close_sends_what_is_queued_then_refuses_new_puts():
    ctl = Controller()
    ctl.gate.clear()
    s = PutSender(ctl.send, window=8)
    for i in range(4):
        s.submit(entry(i), 5.0)
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.submit(entry(9), 5.0)
    ctl.gate.set()
    s.flush(5.0)
    assert ctl.admitted == [0, 1, 2, 3]


def test_window_below_one_is_refused():
    with pytest.raises(ValueError, match="window >= 1"):
        PutSender(Controller().send, window=0)


@pytest.mark.parametrize("linger_s, batches", [(0.0, [[0], [1], [2]]), (0.5, [[0, 1, 2]])])
def test_the_linger_lets_puts_made_meanwhile_share_one_call(linger_s, batches):
    c = Controller()
    s = PutSender(c.send, window=8, linger_s=linger_s)
    for i in range(3):
        s.submit(entry(i), 5.0)
        time.sleep(0.05)  # a producer putting every 50 ms: alone without a linger, together within 0.5 s
    s.flush(5.0)
    assert c.batches == batches and c.admitted == [0, 1, 2]


def test_a_flush_or_a_full_window_ends_the_linger_at_once():
    c = Controller()
    s = PutSender(c.send, window=2, linger_s=30.0)
    s.submit(entry(0), 5.0)
    t = time.monotonic()
    s.flush(5.0)  # what a rollout worker does before it reports its groups: no 30 s wait
    assert time.monotonic() - t < 2.0 and c.batches == [[0]]
    s.submit(entry(1), 5.0)
    s.submit(entry(2), 5.0)  # the window (2) is full: sent without waiting for the linger
    t = time.monotonic()
    while len(c.admitted) < 3 and time.monotonic() - t < 5.0:
        time.sleep(0.01)
    assert c.batches == [[0], [1, 2]] and time.monotonic() - t < 2.0


def test_a_sharing_flush_waits_out_the_linger_so_other_threads_puts_share_the_call():
    """What a rollout worker's pool threads and the sync trainer do: the flush after a put lets the linger run out,
    and a put another thread makes meanwhile goes in the same call; a plain flush would have sent the first alone."""
    c = Controller()
    s = PutSender(c.send, window=8, linger_s=0.5)
    s.submit(entry(0), 5.0)
    other = threading.Timer(0.2, lambda: s.submit(entry(1), 5.0))  # another thread's put, 0.2 s later
    other.start()
    t = time.monotonic()
    s.flush(5.0, share=True)
    waited = time.monotonic() - t
    other.join()
    s.flush(5.0)
    assert c.batches == [[0, 1]] and 0.4 < waited < 2.0
    s.submit(entry(2), 5.0)
    threading.Timer(0.2, lambda: s.submit(entry(3), 5.0)).start()
    t = time.monotonic()
    s.flush(5.0)  # not sharing: sends at once
    assert time.monotonic() - t < 0.3 and c.batches[1] == [2]
    time.sleep(0.3)
    s.flush(5.0)
    assert c.batches[2:] == [[3]] and c.admitted == [0, 1, 2, 3]


def test_a_negative_linger_is_refused():
    with pytest.raises(ValueError, match="linger_s >= 0"):
        PutSender(Controller().send, window=1, linger_s=-1.0)
