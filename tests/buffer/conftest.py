"""Helpers shared by the buffer tests: configs as namespaces, groups of samples."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from omnirl_async.protocol import SampleMeta, SampleSource, SampleStatus, SampleTags


def buffer_cfg(**kw):
    base = dict(sampler="fifo", remover="fifo", max_size=4096, max_times_sampled=1, min_size_to_sample=None,
                samples_per_insert=None, samples_per_insert_error_buffer=None, priority_exponent=0.6,
                freshness_decay=0.5, offline_mix_ratio=0.0, snapshot_with_checkpoint=True)
    base.update(kw)
    return SimpleNamespace(**base)


def sampler_cfg(**kw):
    base = dict(max_off_policy_threshold=1, max_off_policy_strategy="wait", drop_incomplete_groups=False,
                max_incomplete_group_refill_rounds=3, custom_sampler=SimpleNamespace(path=None, name=None),
                sampler_kwargs={})
    base.update(kw)
    return SimpleNamespace(**base)


def tq_cfg(**kw):
    base = dict(num_data_storage_units=2, total_storage_size=None, memory_budget_bytes=2 * 1024**3,
                put_timeout_s=600.0)
    base.update(kw)
    return SimpleNamespace(**base)


def make_group(gid: str, n: int = 4, version: int | None = 0, *, failed=(), dim: int = 3,
               source=SampleSource.ONLINE, members=None, dtype=np.float32):
    """Metas and fields of group ``gid``; row ``i`` of ``x`` is filled with a value derived from its key."""
    members = range(n) if members is None else members
    metas, xs = [], []
    for i in members:
        ok = i not in failed
        metas.append(SampleMeta(
            key=f"{gid}/{i}", status=SampleStatus.SUCCESS if ok else SampleStatus.FAILURE,
            reason=None if ok else "reward server down", reward=float(i) if ok else None,
            tags=SampleTags(uid=f"{gid}/{i}", group_uid=gid, sample_index=i, group_size=n,
                            policy_version=None if source is SampleSource.OFFLINE else version, prompt=f"p-{gid}",
                            source=source, seed=7)))
        xs.append(np.full((dim,), key_value(f"{gid}/{i}"), dtype=dtype))
    return metas, {"x": np.stack(xs), "idx": np.asarray(list(members), dtype=np.int64)}


def key_value(key: str) -> float:
    import zlib
    return float(zlib.crc32(key.encode()) % 100003)


def check_rows(batch) -> None:
    """Every returned row carries the data that was put under its key."""
    for i, m in enumerate(batch.metas):
        assert batch.fields["x"][i][0] == np.float32(key_value(m.key)), m.key
        assert batch.fields["idx"][i] == m.tags.sample_index


@pytest.fixture
def cfgs():
    return buffer_cfg, sampler_cfg, tq_cfg
