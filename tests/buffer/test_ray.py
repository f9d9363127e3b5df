"""The Ray transfer queue: many producers and consumers, producer death, snapshots, remote errors."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from conftest import buffer_cfg, check_rows, make_group, sampler_cfg, tq_cfg  # noqa: E402
from omnirl_async.buffer import make_replay_buffer  # noqa: E402
from omnirl_async.buffer.transfer_queue import INLINE_BYTES, RayReplayBuffer  # noqa: E402


@pytest.fixture(scope="module")
def ray_session():
    # workers inherit the environment of the local cluster: let them import this folder's helpers
    here = os.path.dirname(os.path.abspath(__file__))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = here + (os.pathsep + old if old else "")
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=300 * 1024**2, log_to_driver=False,
             configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


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

    def run(self, prefix: str, n_groups: int, dim: int = 3) -> int:
        for g in range(n_groups):
            self.buf.put(*make_group(f"{prefix}g{g}", 4, dim=dim), timeout=60)
        return n_groups


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


@pytest.mark.parametrize("dim", [3, INLINE_BYTES // 4], ids=["inline", "storage-unit"])
def test_data_outlives_its_producer(rbuf, dim):
    p = Producer.remote(rbuf)
    assert ray.get(p.run.remote("dead", 2, dim), timeout=60) == 2
    ray.kill(p)
    time.sleep(0.5)
    batch = rbuf.sample(8, learner_version=0, timeout=30)
    assert sorted(batch.keys) == sorted(f"deadg{g}/{i}" for g in range(2) for i in range(4))
    check_rows(batch)
    assert batch.fields["x"].shape == (8, dim)


def test_errors_come_back_with_their_type(rbuf):
    rbuf.put(*make_group("g", 2))
    with pytest.raises(ValueError, match="key `g/0` is already in the buffer"):
        rbuf.put(*make_group("g", 2))
    metas, fields = make_group("h", 2)
    fields["x"] = fields["x"].astype(np.float64)
    with pytest.raises(ValueError, match="sample `h/0` field `x`"):
        rbuf.put(metas, fields)
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
