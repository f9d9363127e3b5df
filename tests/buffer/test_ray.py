"""The Ray transfer queue: many producers and consumers, producer death (data kept or regenerated), snapshots,
remote errors."""

from __future__ import annotations

import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from conftest import buffer_cfg, check_rows, make_group, sampler_cfg, spec, tq_cfg  # noqa: E402
from omnirl_async.buffer import make_replay_buffer  # noqa: E402
from omnirl_async.buffer.spec import TransportSpec  # noqa: E402
from omnirl_async.buffer.transfer_queue import (LOST_REASON, RayReplayBuffer, StorageUnit,  # noqa: E402
                                                TransferQueueController)

INLINE_BYTES = TransportSpec().inline_max_bytes


@pytest.fixture(scope="module")
def shared_buf(ray_session):
    b = make_replay_buffer(buffer_cfg(max_size=64), sampler_cfg(), tq_cfg(num_data_storage_units=2),
                           use_ray=True, seed=0)
    yield b
    b.close()


@pytest.fixture
def rbuf(shared_buf):
    shared_buf.clear()  # one set of actors per module: starting actors costs seconds on 2 cores
    yield shared_buf


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self, buf):
        self.buf = buf

    def run(self, prefix: str, n_groups: int, dim: int = 3, producer: str | None = None) -> int:
        for g in range(n_groups):
            self.buf.put(*make_group(f"{prefix}g{g}", 4, dim=dim), timeout=60, producer=producer)
        self.buf.flush(timeout=60)  # as a rollout worker does before it reports the groups done
        return n_groups

    def probe(self) -> list:
        """An object this producer owns (wrapped: not resolved), to see when its death has freed its objects."""
        return [ray.put(np.zeros(16))]


def kill_and_wait_until_its_objects_are_gone(producer) -> None:
    """Kill ``producer``; Ray frees the objects it owned a moment later (until then they still read)."""
    [probe] = ray.get(producer.probe.remote(), timeout=60)
    ray.kill(producer)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(probe, timeout=10)
        except ray.exceptions.ObjectLostError:
            return
        time.sleep(0.2)
    raise AssertionError("the killed producer's objects were still readable after 60 s")


@ray.remote(num_cpus=0)
class Consumer:
    def __init__(self, buf):
        self.buf = buf

    def run(self, n_batches: int) -> list[str]:
        keys = []
        for _ in range(n_batches):
            batch = self.buf.sample(8, learner_version=0, timeout=60)
            check_rows(batch)
            keys.extend(batch.keys)
        return keys


def test_four_producers_two_consumers_lose_and_duplicate_nothing(rbuf):
    # max_size 64 < 160 samples: producers block on back-pressure along the way
    before = rbuf.metrics()
    producers = [Producer.remote(rbuf) for _ in range(4)]
    consumers = [Consumer.remote(rbuf) for _ in range(2)]
    put_refs = [p.run.remote(f"p{i}", 10) for i, p in enumerate(producers)]
    got_refs = [c.run.remote(10) for c in consumers]
    assert ray.get(put_refs, timeout=120) == [10] * 4
    got = [k for keys in ray.get(got_refs, timeout=120) for k in keys]
    want = {f"p{p}g{g}/{i}" for p in range(4) for g in range(10) for i in range(4)}
    assert len(got) == len(want) and set(got) == want
    assert rbuf.size() == 0
    m = rbuf.metrics()
    assert m["buffer/inserted"] - before["buffer/inserted"] == m["buffer/sampled"] - before["buffer/sampled"] == 160


@pytest.fixture(scope="module")
def unit_buf(ray_session):
    """Storage units own the payloads (``transfer_queue.producer_owned_payloads=false``)."""
    b = make_replay_buffer(buffer_cfg(max_size=64), sampler_cfg(), tq_cfg(producer_owned_payloads=False),
                           use_ray=True, seed=0)
    yield b
    b.close()


@pytest.mark.parametrize("owned_by", ["controller", "unit"], ids=["inline", "storage-unit"])
def test_data_outlives_its_producer(rbuf, unit_buf, owned_by):
    buf = unit_buf if owned_by == "unit" else rbuf
    buf.clear()
    dim = INLINE_BYTES // 4 if owned_by == "unit" else 3
    p = Producer.remote(buf)
    assert ray.get(p.run.remote("dead", 2, dim, "w0"), timeout=60) == 2
    kill_and_wait_until_its_objects_are_gone(p)
    assert buf.drop_producer("w0") == 0  # nothing of it is lost
    batch = buf.sample(8, learner_version=0, timeout=30)
    assert sorted(batch.keys) == sorted(f"deadg{g}/{i}" for g in range(2) for i in range(4))
    check_rows(batch)
    assert batch.fields["x"].shape == (8, dim)
    assert buf.take_refill_requests() == []


def _dead_producer_groups(buf, n_groups: int = 2) -> None:
    """A producer puts ``n_groups`` object-store-sized groups it owns (the default), a live one puts one; the
    first dies."""
    dim = INLINE_BYTES // 4
    dead, live = Producer.remote(buf), Producer.remote(buf)
    assert ray.get(dead.run.remote("dead", n_groups, dim, "w0"), timeout=60) == n_groups
    assert ray.get(live.run.remote("live", 1, dim, "w1"), timeout=60) == 1
    kill_and_wait_until_its_objects_are_gone(dead)
    return live


@pytest.mark.slow  # waits for Ray to free a killed actor's objects (~5 s)
def test_a_dead_producers_groups_are_regenerated_when_the_trainer_reports_the_death(rbuf):
    keep = _dead_producer_groups(rbuf)
    before = rbuf.metrics()["buffer/regenerated_groups"]
    assert rbuf.drop_producer("w0") == 2
    assert sorted(rbuf.list_keys()) == [f"liveg0/{i}" for i in range(4)]
    refills = rbuf.take_refill_requests()
    assert sorted(r.group_uid for r in refills) == ["deadg0", "deadg1"]
    assert all(r.n == 4 and r.reasons == [LOST_REASON] and r.prompt == f"p-{r.group_uid}" for r in refills)
    assert rbuf.metrics()["buffer/regenerated_groups"] - before == 2
    assert rbuf.drop_producer("w0") == 0  # reported twice: nothing more
    batch = rbuf.sample(4, learner_version=0, timeout=30)
    assert batch.keys == [f"liveg0/{i}" for i in range(4)]
    del keep


@pytest.mark.slow  # waits for Ray to free a killed actor's objects (~5 s)
def test_a_read_that_meets_a_dead_owner_leaves_those_rows_out_and_regenerates_them(rbuf):
    keep = _dead_producer_groups(rbuf)
    batch = rbuf.sample(12, learner_version=0, timeout=30)  # all three groups are drawn, two cannot be read
    assert batch.keys == [f"liveg0/{i}" for i in range(4)]
    assert batch.fields["x"].shape == (4, INLINE_BYTES // 4) and len(batch.info["staleness"]) == 4
    check_rows(batch)
    assert sorted(r.group_uid for r in rbuf.take_refill_requests()) == ["deadg0", "deadg1"]
    assert rbuf.size() == 0
    del keep


@pytest.mark.slow  # waits for Ray to free a killed actor's objects (~5 s)
def test_a_lost_group_already_trained_once_just_leaves(ray_session):
    buf = make_replay_buffer(buffer_cfg(max_size=64, max_times_sampled=2), sampler_cfg(), tq_cfg(),
                             use_ray=True, seed=0)
    try:
        keep = _dead_producer_groups(buf, n_groups=1)
        assert buf.drop_producer("w0") == 1  # never drawn: generated again
        buf.take_refill_requests()
        p = Producer.remote(buf)
        assert ray.get(p.run.remote("again", 1, INLINE_BYTES // 4, "w2"), timeout=60) == 1
        got = buf.sample(8, learner_version=0, timeout=30)  # both live groups, drawn once (kept for reuse)
        assert len(got) == 8
        kill_and_wait_until_its_objects_are_gone(p)
        assert buf.drop_producer("w2") == 0  # trained once already: it leaves, nothing to generate again
        assert buf.take_refill_requests() == [] and sorted(buf.list_keys()) == [f"liveg0/{i}" for i in range(4)]
        del keep
    finally:
        buf.close()


@pytest.mark.slow  # waits for Ray to free a killed actor's objects (~5 s)
def test_a_snapshot_skips_a_dead_producers_groups_and_regenerates_them(rbuf, tmp_path):
    keep = _dead_producer_groups(rbuf)
    rbuf.snapshot(str(tmp_path / "snap"))
    assert sorted(rbuf.list_keys()) == [f"liveg0/{i}" for i in range(4)]
    assert sorted(r.group_uid for r in rbuf.take_refill_requests()) == ["deadg0", "deadg1"]
    other = make_replay_buffer(buffer_cfg(max_size=64), sampler_cfg(), tq_cfg(), use_ray=True)
    try:
        other.restore(str(tmp_path / "snap"))
        assert sorted(other.list_keys()) == [f"liveg0/{i}" for i in range(4)]
    finally:
        other.close()
    del keep


def test_errors_come_back_with_their_type(rbuf):
    rbuf.put(*make_group("g", 2))
    rbuf.put(*make_group("g", 2))  # sent in the background: the controller's error comes back at the next call
    with pytest.raises(ValueError, match="key `g/0` is already in the buffer") as err:
        rbuf.flush()
    assert "put of group(s) `g`" in " ".join(err.value.__notes__)
    metas, fields = make_group("h", 2)
    fields["x"] = fields["x"].astype(np.float64)
    rbuf.put(metas, fields)
    with pytest.raises(ValueError, match="sample `h/0` field `x`"):
        rbuf.size()  # any later call of this client reports it, once
    with pytest.raises(TimeoutError, match=r"need 4 from online"):
        rbuf.sample(4, learner_version=0, timeout=0.2)
    with pytest.raises(KeyError, match="sample `nope`"):
        rbuf.get(["nope"])
    assert rbuf.size() == 2


def test_queries_and_snapshot_round_trip(rbuf, tmp_path):
    dim = 6000  # 24 KB rows: a pair travels inline, four rows go through a storage unit
    rbuf.put(*make_group("small", 2, dim=dim))
    rbuf.put(*make_group("large", 4, dim=dim))
    rbuf.put(*make_group("x", 4, dim=dim, failed=(1,)))
    assert rbuf.num_ready_samples(0) == 9 and rbuf.ready_groups(0) == 3
    assert rbuf.list_keys(group_uid="small") == ["small/0", "small/1"]
    rbuf.update_priorities(["small"], [2.0])
    assert rbuf.take_refill_requests() == []
    rbuf.snapshot(str(tmp_path / "snap"))
    other = make_replay_buffer(buffer_cfg(max_size=64), sampler_cfg(), tq_cfg(), use_ray=True)
    try:
        other.restore(str(tmp_path / "snap"))
        keys = sorted(rbuf.list_keys())
        assert sorted(other.list_keys()) == keys
        a, b = rbuf.get(keys), other.get(keys)
        # groups of mixed widths: compare key by key
        for k in keys:
            x, y = rbuf.get([k]), other.get([k])
            assert x.metas == y.metas and x.fields["x"].tobytes() == y.fields["x"].tobytes()
        assert len(a) == len(b) == 9
    finally:
        other.close()
    rbuf.clear()
    assert rbuf.size() == 0


def test_client_pickles_to_handles(rbuf):
    import pickle
    clone = pickle.loads(pickle.dumps(rbuf))
    assert isinstance(clone, RayReplayBuffer)
    clone.put(*make_group("c", 2))
    clone.close()  # not the owner: the actors live on
    assert rbuf.size() == 2


@pytest.mark.parametrize("inline_max_bytes, regenerated", [(64 * 1024, 0), (0, 1)])
def test_inline_max_bytes_decides_whether_a_small_group_depends_on_its_producer(ray_session, inline_max_bytes,
                                                                                 regenerated):
    # inline, the controller keeps its own copy; through the object store, the producer owns it
    buf = make_replay_buffer(buffer_cfg(max_size=64), sampler_cfg(), tq_cfg(inline_max_bytes=inline_max_bytes),
                             use_ray=True, seed=0)
    try:
        buf.put(*make_group("small", 2), producer="w0")
        assert buf.drop_producer("w0") == regenerated
        assert buf.size() == 2 - 2 * regenerated
    finally:
        buf.close()


def test_puts_go_out_in_batches_in_order_and_a_sample_sees_them(rbuf):
    rbuf.put(*make_group("first", 2))
    rbuf.flush()
    sender = rbuf._sender
    calls, sent = sender.calls, sender.sent
    for g in range(30):  # inline groups: a put costs far less than a controller call, so they queue up
        rbuf.put(*make_group(f"b{g:02d}", 2))
    assert rbuf.pending_puts <= TransportSpec().max_pending_puts
    rbuf.sample(2, learner_version=0, timeout=30)  # "first"
    batch = rbuf.sample(60, learner_version=0, timeout=30)  # flushes this client's puts first
    assert [m.key for m in batch.metas] == [f"b{g:02d}/{i}" for g in range(30) for i in range(2)]  # fifo = put order
    assert rbuf.pending_puts == 0
    assert sender.sent - sent == 30 and sender.calls - calls < 30  # several registrations per controller call


@pytest.mark.slow  # two buffers of their own, timeouts waited out (~5 s)
@pytest.mark.parametrize("max_pending_puts", [0, 1])
def test_max_pending_puts_decides_where_a_full_buffer_holds_a_producer(ray_session, max_pending_puts):
    # capacity for 2 groups, nobody samples: with 0 the third put itself times out in the controller; with 1
    # the third put returns (handed to the sender, which waits in the controller) and the fourth waits for room
    buf = make_replay_buffer(buffer_cfg(max_size=64), sampler_cfg(),
                             tq_cfg(total_storage_size=4, put_timeout_s=1.0, max_pending_puts=max_pending_puts,
                                    put_linger_s=0.005 if max_pending_puts else 0.0),
                             use_ray=True, seed=0)
    try:
        buf.put(*make_group("a", 2))
        buf.put(*make_group("b", 2))
        if max_pending_puts == 0:
            with pytest.raises(TimeoutError, match="timed out waiting for room"):
                buf.put(*make_group("c", 2))
            assert buf.pending_puts == 0
        else:
            buf.put(*make_group("c", 2))
            assert buf.pending_puts == 1
            with pytest.raises(TimeoutError, match=r"`transfer_queue.max_pending_puts` = 1"):
                buf.put(*make_group("d", 2), timeout=0.5)
            with pytest.raises(TimeoutError, match="timed out waiting for room") as err:  # the third put's own error, at the next call
                buf.flush()
            assert "put of group(s) `c`" in " ".join(err.value.__notes__)
        assert sorted(buf.list_keys()) == ["a/0", "a/1", "b/0", "b/1"]
    finally:
        buf.close()


def test_sample_requests_in_flight_are_each_served_whole_groups_once(rbuf):
    first = rbuf.sample_async(4, learner_version=0, timeout=30)  # asked before anything is there
    second = rbuf.sample_async(4, learner_version=0, timeout=30)
    rbuf.put(*make_group("s0", 4))
    rbuf.put(*make_group("s1", 4))
    got = sorted([first.result().keys, second.result().keys])  # in flight together: either order
    assert got == [[f"s0/{i}" for i in range(4)], [f"s1/{i}" for i in range(4)]]
    with pytest.raises(TimeoutError, match="need 4 from online"):
        rbuf.sample_async(4, learner_version=0, timeout=0.2).result()


# ------------------------------------------------ reads hand out refs as bytes (buffer/ref_wire.py)
@pytest.fixture
def make_buf(ray_session):
    """``make_buf(read_hold_s=None, groups=0, prefix="g")``: a new buffer (closed after the test) with ``groups``
    groups of 4 put by a producer actor that owns them."""
    made = []

    def make(read_hold_s: float | None = None, groups: int = 0, prefix: str = "g") -> RayReplayBuffer:
        s = spec(buffer_cfg(max_size=64), q=tq_cfg())
        units = [StorageUnit.remote(0)]
        args = (s, 0, units) if read_hold_s is None else (s, 0, units, read_hold_s)
        made.append(RayReplayBuffer(TransferQueueController.remote(*args), units, 60.0, owner=True))
        if groups:  # over the inline limit: the producer owns them, the controller holds refs
            assert ray.get(Producer.remote(made[-1]).run.remote(prefix, groups, INLINE_BYTES // 4, "w0"),
                           timeout=60) == groups
        return made[-1]

    yield make
    for buf in made:
        buf.close()


def _held(buf: RayReplayBuffer) -> int:
    return buf._wait(buf._controller.release.remote([]), 0.0, "release")


def test_the_controller_keeps_a_batchs_refs_until_the_reader_has_read_it(make_buf):
    buf = make_buf(groups=3)
    assert _held(buf) == 0
    check_rows(buf.sample(4, learner_version=0, timeout=30))
    assert _held(buf) == 1  # read, acknowledged with the next sample call
    request = buf.sample_async(4, learner_version=0, timeout=30)  # acknowledges the first
    time.sleep(0.5)
    assert _held(buf) == 1  # the second: handed out, not read yet
    check_rows(request.result())
    check_rows(buf.sample_async(4, learner_version=0, timeout=30).result())
    assert _held(buf) == 1
    copy = RayReplayBuffer(buf._controller, buf._units, 60.0)  # a reader that is not the owner ...
    copy._acks = buf._take_acks()
    copy.close()  # ... acknowledges what it read when it closes
    assert _held(buf) == 0


@pytest.mark.slow  # waits for the hold to expire and Ray to free the group (~5 s)
def test_a_batch_read_after_its_hold_expired_is_lost_and_generated_again(make_buf):
    buf = make_buf(read_hold_s=0.5, groups=1, prefix="late")
    request = buf.sample_async(4, learner_version=0, timeout=30)
    deadline = time.monotonic() + 30
    while _held(buf) == 0 and time.monotonic() < deadline:  # the reply is on its way
        time.sleep(0.1)
    time.sleep(1.0)
    assert _held(buf) == 0  # expired: the controller let the refs go, the owner frees the group
    time.sleep(1.0)
    batch = request.result()
    assert len(batch) == 0  # the rows could not be read: left out, not an error
    assert [r.group_uid for r in buf.take_refill_requests()] == ["lateg0"]  # never trained: generated again
    assert buf.size() == 0


def test_read_arguments_travel_as_one_blob_numpy_scalars_included_and_bad_ones_are_refused(make_buf):
    buf = make_buf(groups=2)
    check_rows(buf.sample(np.int64(4), learner_version=np.int32(0), timeout=np.float32(30)))
    with pytest.raises(ValueError, match=r"`batch_size` = '<object object at"):
        buf.sample(object(), learner_version=0, timeout=5)
    with pytest.raises(ValueError, match=r"`below` = -1"):
        buf.sample_tickets(-1, learner_version=0)
    check_rows(buf.sample(4, learner_version=0, timeout=30))  # the other group: nothing was taken by them


def test_a_read_that_times_out_still_acknowledges_the_batches_read_before(make_buf):
    buf = make_buf(groups=1)
    check_rows(buf.sample(4, learner_version=0, timeout=30))
    assert _held(buf) == 1
    with pytest.raises(TimeoutError):
        buf.sample(4, learner_version=0, timeout=0.2)  # nothing left: times out ...
    assert _held(buf) == 0  # ... and the batch read before is released all the same


@pytest.mark.slow  # its own controller and units (seconds on 2 cores)
@pytest.mark.parametrize("linger_s, calls", [(0.0, 2), (0.5, 1)])
def test_put_linger_s_reaches_every_copy_of_the_client_and_batches_registrations(ray_session, linger_s, calls):
    import pickle
    buf = make_replay_buffer(buffer_cfg(max_size=64), sampler_cfg(), tq_cfg(put_linger_s=linger_s), use_ray=True)
    try:
        copy = pickle.loads(pickle.dumps(buf))  # what a rollout worker holds
        copy.put(*make_group("a", 2, dim=INLINE_BYTES // 4))
        time.sleep(0.1)
        copy.put(*make_group("b", 2, dim=INLINE_BYTES // 4))
        copy.flush(timeout=30)
        assert (copy._sender.calls, copy._sender.sent) == (calls, 2)
        assert buf.metrics()["buffer/put_calls"] == calls  # the controller counts the same calls
        check_rows(buf.sample(4, learner_version=0, timeout=30))
    finally:
        buf.close()
