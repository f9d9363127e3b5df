"""Payload refs handed to readers as bytes (:mod:`omnirl_async.buffer.ref_wire`): what a reader gets, and what it gets
when the owner died (how long the controller keeps a read batch's refs: ``test_ray.py``)."""

from __future__ import annotations

import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from omnirl_async.buffer.ref_wire import check_supported, from_wire, is_wire, to_wire  # noqa: E402


@ray.remote(num_cpus=0)
class Owner:
    def put(self, value: float) -> list:
        return [ray.put(np.full((256, 1024), value, np.float32))]  # 1 MB


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
