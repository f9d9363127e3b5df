"""Helpers shared by the buffer tests: config sections and specs, groups of samples."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from omnirl_async.buffer.spec import BufferSpec
from omnirl_async.config.buffer import BufferConfig, TransferQueueConfig
from omnirl_async.config.trainer import CustomSamplerConfig, V1SamplerConfig
from omnirl_async.protocol import SampleMeta, SampleSource, SampleStatus, SampleTags


def buffer_cfg(**kw) -> BufferConfig:
    """The ``buffer`` section: the schema's defaults, ``kw`` overriding (not checked: the spec checks)."""
    return dataclasses.replace(BufferConfig(), **kw)


def sampler_cfg(**kw) -> V1SamplerConfig:
    """The ``trainer.v1.sampler`` section; ``custom_sampler`` may be given as a dict of path / name."""
    if isinstance(kw.get("custom_sampler"), dict):
        kw["custom_sampler"] = CustomSamplerConfig(**kw["custom_sampler"])
    return dataclasses.replace(V1SamplerConfig(), **kw)


def tq_cfg(**kw) -> TransferQueueConfig:
    """The ``transfer_queue`` section."""
    return dataclasses.replace(TransferQueueConfig(), **kw)


def spec(b=None, s=None, q=None, **buffer_kw) -> BufferSpec:
    """The spec of these sections (None = defaults; ``buffer_kw`` override ``buffer.*`` keys when ``b`` is None)."""
    return BufferSpec.from_sections(b or buffer_cfg(**buffer_kw), s or sampler_cfg(), q or tq_cfg())


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


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray cluster per test module (4 CPUs, 300 MB object store); workers import this folder's helpers."""
    ray = pytest.importorskip("ray")
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
