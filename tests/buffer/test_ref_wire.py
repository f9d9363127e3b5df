"""Payload refs handed to readers as bytes (:mod:`omnirl_async.buffer.ref_wire`): what a reader gets, how long the
controller keeps the refs, and what a reader that comes too late gets."""

from __future__ import annotations

import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from conftest import buffer_cfg, check_rows, make_group, spec, tq_cfg  # noqa: E402
from omnirl_async.buffer.ref_wire import check_supported, from_wire, is_wire, to_wire  # noqa: E402
from omnirl_async.buffer.transfer_queue import (RayReplayBuffer, StorageUnit,  # noqa: E402
                                                TransferQueueController)

BIG = 64 * 1024 // 4  # floats per row: a group of 4 rows is 256 KB, over the inline limit (a ref, not inline bytes)


@ray.remote(num_cpus=0)
class Owner:
    def put(self, value: float) -> list:
        return [ray.put(np.full((256, 1024), value, np.float32))]  # 1 MB

    def put_groups(self, buf, prefix: str, n: int) -> int:
        for g in range(n):
            buf.put(*make_group(f"{prefix}{g}", 4, dim=BIG), timeout=60, producer="w0")
        buf.flush(timeout=60)
        return n


@ray.remote(num_cpus=0)
class Holder:
    def __init__(self):
        self.refs = {}

    def take(self, key: int, wrapped: list) -> None:
        self.refs[key] = wrapped[0]

    def wire(self, key: int):
        return to_wire(self.refs[key])

    def drop(self, key: int) -> None:
        del self.refs[key]


def test_check_supported_names_the_missing_calls_and_the_ray_version():
    check_supported()  # this Ray has both

    class Old:
        def serialize_object_ref(self):
            pass

    with pytest.raises(RuntimeError, match=rf"ray {ray.__version__} lacks CoreWorker.deserialize_and_register"):
        check_supported(Old)


@pytest.mark.slow  # 300 MB through the object store
def test_a_reader_gets_the_arrays_and_they_outlive_every_ref(ray_session):
    owner, holder = Owner.remote(), Holder.remote()
    ray.get(holder.take.remote(0, ray.get(owner.put.remote(7.0))))
    wire = ray.get(holder.wire.remote(0))
    assert is_wire(wire) and not is_wire(("x", b"", b"", b"")) and not is_wire({"x": 1})
    arr = ray.get(from_wire(wire), timeout=30)
    assert arr.shape == (256, 1024) and float(arr.min()) == float(arr.max()) == 7.0
    ray.get(holder.drop.remote(0))  # the last real ref goes: the owner frees the object ...
    for i in range(400):  # ... and 400 MB more pass through a 300 MB store
        ray.get(holder.take.remote(i + 1, ray.get(owner.put.remote(float(i)))))
        ray.get(holder.drop.remote(i + 1))
    assert float(arr.min()) == float(arr.max()) == 7.0  # the reader's arrays still hold their memory


@pytest.mark.slow  # waits for Ray to free a killed actor's objects
def test_a_dead_owner_makes_the_read_fail_as_lost(ray_session):
    owner, holder = Owner.remote(), Holder.remote()
    ray.get(holder.take.remote(0, ray.get(owner.put.remote(1.0))))
    wire = ray.get(holder.wire.remote(0))
    ray.kill(owner)
    deadline = time.monotonic() + 60
    with pytest.raises(ray.exceptions.ObjectLostError):
        while time.monotonic() < deadline:  # Ray frees a killed owner's objects a moment later
            ray.get(from_wire(wire), timeout=30)
            time.sleep(0.2)


@pytest.fixture
def make_buf(ray_session):
    """``make_buf(read_hold_s=None, groups=0, prefix="g")``: a new buffer (closed after the test) with ``groups``
    groups of 4 put by an actor that owns them."""
    made = []

    def make(read_hold_s: float | None = None, groups: int = 0, prefix: str = "g") -> RayReplayBuffer:
        s = spec(buffer_cfg(max_size=64), q=tq_cfg())
        units = [StorageUnit.remote(0)]
        args = (s, 0, units) if read_hold_s is None else (s, 0, units, read_hold_s)
        made.append(RayReplayBuffer(TransferQueueController.remote(*args), units, 60.0, owner=True))
        if groups:
            assert ray.get(Owner.remote().put_groups.remote(made[-1], prefix, groups), timeout=60) == groups
        return made[-1]

    yield make
    for buf in made:
        buf.close()


def _held(buf: RayReplayBuffer) -> int:
    return buf._wait(buf._controller.release.remote([]), 0.0)


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
    assert [r.group_uid for r in buf.take_refill_requests()] == ["late0"]  # never trained: generated again
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
