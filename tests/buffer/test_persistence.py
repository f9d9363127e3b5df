"""Snapshot/restore: bit-exact, atomic, versioned, no pickle."""

from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest

from conftest import buffer_cfg, make_group, sampler_cfg, spec
from omnirl_async.buffer import LocalReplayBuffer
from omnirl_async.buffer import persistence
from omnirl_async.protocol import SampleSource


def filled(sampler="uniform"):
    b = LocalReplayBuffer(spec(buffer_cfg(sampler=sampler, max_times_sampled=2),
                               sampler_cfg(max_off_policy_threshold=5)), seed=0)
    rng = np.random.default_rng(0)
    for g in range(6):
        metas, fields = make_group(f"g{g}", 3, version=g, failed=(1,) if g == 2 else ())
        fields["x"] = rng.standard_normal((3, 5)).astype(np.float32)  # arbitrary bits, incl. signs/denormals
        fields["img"] = rng.integers(0, 255, (3, 4, 4, 3), dtype=np.uint8)
        b.put(metas, fields)
    m, f = make_group("half", 4, members=[0, 1])  # incomplete group: restored as in flight
    f["x"] = rng.standard_normal((2, 5)).astype(np.float32)
    f["img"] = rng.integers(0, 255, (2, 4, 4, 3), dtype=np.uint8)
    b.put(m, f)
    m, f = make_group("off", 2, source=SampleSource.OFFLINE, dim=7)
    b.put(m, f)
    b.sample(3, learner_version=5)  # some times_sampled > 0
    return b


def assert_same(a, b):
    ka, kb = a.list_keys(), b.list_keys()
    assert sorted(ka) == sorted(kb)
    for src in ("online", "offline"):
        keys = sorted(a.list_keys(source=src))
        if not keys:
            continue
        x, y = a.get(keys), b.get(keys)
        assert [msgspec.msgpack.encode(m) for m in x.metas] == [msgspec.msgpack.encode(m) for m in y.metas]
        for name in x.fields:
            assert x.fields[name].dtype == y.fields[name].dtype
            assert x.fields[name].tobytes() == y.fields[name].tobytes()


@pytest.mark.parametrize("sampler", ["fifo", "prioritized"])
def test_round_trip_bit_exact(tmp_path, sampler):
    a = filled(sampler)
    a.snapshot(tmp_path / "snap")
    b = LocalReplayBuffer(spec(buffer_cfg(sampler=sampler, max_times_sampled=2),
                               sampler_cfg(max_off_policy_threshold=5)), seed=0)
    b.put(*make_group("junk", 2))  # restore replaces contents
    b.restore(tmp_path / "snap")
    assert_same(a, b)
    ma, mb = a.metrics(), b.metrics()
    for k in ["buffer/size", "buffer/dropped_failed", "buffer/inserted", "buffer/sampled", "buffer/ready_samples",
              "buffer/incomplete_groups", "buffer/bytes"]:
        assert ma[k] == mb[k], k
    # both continue identically: the incomplete group completes, everything is drawn the same number of times
    m, f = make_group("half", 4, members=[2, 3])
    f["x"] = np.zeros((2, 5), np.float32)
    f["img"] = np.zeros((2, 4, 4, 3), np.uint8)
    for buf in (a, b):
        buf.put(m, f)
    assert a.num_ready_samples(5) == b.num_ready_samples(5)


def test_snapshot_is_atomic_and_replaces(tmp_path, monkeypatch):
    a = filled()
    path = tmp_path / "snap"
    a.snapshot(path)
    first = sorted(os.listdir(path))
    assert first == ["chunk-00000.safetensors", "chunk-00001.safetensors", "meta.msgpack"]  # one per table

    def boom(*args, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(persistence, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        a.snapshot(path)
    monkeypatch.undo()
    assert sorted(os.listdir(path)) == first  # old snapshot intact
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []  # no temp left
    a.snapshot(path)  # overwrite works
    b = LocalReplayBuffer(seed=0)
    b.restore(path)
    assert sorted(b.list_keys()) == sorted(a.list_keys())


def test_chunking(tmp_path, monkeypatch):
    monkeypatch.setattr(persistence, "CHUNK_BYTES", 64)
    a = filled()
    a.snapshot(tmp_path / "s")
    assert len([f for f in os.listdir(tmp_path / "s") if f.endswith(".safetensors")]) > 3
    b = LocalReplayBuffer(seed=0)
    b.restore(tmp_path / "s")
    assert_same(a, b)


def test_restore_refuses_foreign_or_newer(tmp_path):
    b = LocalReplayBuffer(seed=0)
    with pytest.raises(ValueError, match="not a buffer snapshot"):
        b.restore(tmp_path)
    a = filled()
    a.snapshot(tmp_path / "s")
    meta = msgspec.msgpack.decode((tmp_path / "s" / "meta.msgpack").read_bytes())
    meta["format_version"] = 99
    (tmp_path / "s" / "meta.msgpack").write_bytes(msgspec.msgpack.encode(meta))
    with pytest.raises(ValueError, match="format version 99"):
        b.restore(tmp_path / "s")
    (tmp_path / "s" / "meta.msgpack").write_bytes(b"\x80\x04garbage")  # a pickle header is just bad msgpack
    with pytest.raises(Exception):
        b.restore(tmp_path / "s")
