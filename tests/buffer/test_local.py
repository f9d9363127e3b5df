"""Semantics of the in-process buffer (the Ray buffer shares the same core)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import buffer_cfg, check_rows, make_group, sampler_cfg, spec, tq_cfg
from omnirl_async.buffer import LocalReplayBuffer, make_replay_buffer
from omnirl_async.protocol import SampleSource, SampleStatus


def buf(b=None, s=None, q=None, **kw):
    return LocalReplayBuffer(spec(b, s, q, **kw), seed=0)


def test_groups_returned_whole_and_in_order():
    b = buf()
    for g in range(3):
        b.put(*make_group(f"g{g}", 4))
    out = b.sample(8, learner_version=0)
    assert out.keys == [f"g{g}/{i}" for g in range(2) for i in range(4)]
    assert [u for u, _ in out.group_slices()] == ["g0", "g1"]
    check_rows(out)
    assert out.info["staleness"].tolist() == [0] * 8 and out.info["times_sampled"].tolist() == [1] * 8
    assert b.size() == 4


def test_incomplete_group_waits_members_may_arrive_separately():
    b = buf()
    metas, fields = make_group("g", 4)
    b.put(metas[:2], {k: v[:2] for k, v in fields.items()})
    assert b.num_ready_samples(0) == 0 and b.size() == 2
    with pytest.raises(TimeoutError, match=r"need 2 from online; have online table: 0 ready samples .* "
                                           r"1 incomplete groups holding 2 samples"):
        b.sample(2, learner_version=0, timeout=0.05)
    b.put(metas[2:], {k: v[2:] for k, v in fields.items()})
    out = b.sample(2, learner_version=0)
    assert len(out) == 4
    check_rows(out)


def test_failed_members_excluded_and_counted():
    b = buf()
    b.put(*make_group("g", 4, failed=(1, 3)))
    out = b.sample(2, learner_version=0)
    assert out.keys == ["g/0", "g/2"]
    check_rows(out)
    assert b.metrics()["buffer/dropped_failed"] == 2
    b.put(*make_group("h", 2, failed=(0, 1)))  # all failed: nothing stored, fields not needed
    b.put(*make_group("k", 2, failed=(0, 1))[:1], {})
    assert b.size() == 0 and b.metrics()["buffer/dropped_failed"] == 6


def test_drop_incomplete_groups_refills_then_gives_up():
    b = buf(s=sampler_cfg(drop_incomplete_groups=True, max_incomplete_group_refill_rounds=2))
    for r in range(3):
        b.put(*make_group("g", 4, failed=(2,)))
        assert b.size() == 0
        reqs = b.take_refill_requests()
        if r < 2:
            assert len(reqs) == 1 and reqs[0].round == r + 1 and reqs[0].n == 4
            assert reqs[0].group_uid == "g" and reqs[0].failed_keys == ["g/2"] and reqs[0].prompt == "p-g"
        else:
            assert reqs == []
    m = b.metrics()
    assert m["buffer/dropped_incomplete_groups"] == 1 and m["buffer/refill_requests"] == 2
    b.put(*make_group("g", 4))
    assert b.num_ready_samples(0) == 4


@pytest.mark.parametrize("strategy", ["drop", "wait"])
def test_stale_groups_never_returned(strategy):
    b = buf(s=sampler_cfg(max_off_policy_threshold=1, max_off_policy_strategy=strategy))
    for v in range(4):
        b.put(*make_group(f"v{v}", 2, version=v))
    assert b.num_ready_samples(3) == 4
    out = b.sample(4, learner_version=3)
    assert sorted(m.tags.policy_version for m in out.metas) == [2, 2, 3, 3]
    assert b.metrics()["buffer/dropped_stale"] == 4
    assert b.size() == 0
    b.put(*make_group("late", 2, version=1))  # stale on arrival: counted, not stored
    assert b.size() == 0 and b.metrics()["buffer/dropped_stale"] == 6
    with pytest.raises(TimeoutError, match="6 samples dropped stale"):
        b.sample(2, learner_version=3, timeout=0.01)


def test_staleness_histogram_and_metric_names():
    b = buf(s=sampler_cfg(max_off_policy_threshold=3))
    for v in range(3):
        b.put(*make_group(f"v{v}", 2, version=v))
    b.sample(6, learner_version=2)
    m = b.metrics()
    for name in ["buffer/size", "buffer/insert_rate", "buffer/sample_rate", "buffer/dropped_stale",
                 "buffer/dropped_failed"]:
        assert name in m
    assert (m["buffer/staleness/lag_0"], m["buffer/staleness/lag_1"], m["buffer/staleness/lag_2"]) == (2, 2, 2)
    assert m["buffer/insert_rate"] > 0 and m["buffer/sample_rate"] > 0


def test_max_times_sampled_reuse_then_removed():
    b = buf(max_times_sampled=2, sampler="fifo")
    b.put(*make_group("g", 2))
    assert b.sample(2, learner_version=0).info["times_sampled"].tolist() == [1, 1]
    out = b.sample(2, learner_version=0)
    assert out.info["times_sampled"].tolist() == [2, 2] and [m.times_sampled for m in out.metas] == [2, 2]
    assert b.size() == 0


def test_full_buffer_blocks_never_drops_unsampled():
    b = buf(max_size=4)
    b.put(*make_group("a", 4))
    with pytest.raises(TimeoutError, match=r"put of 2 samples .* online table 4/4 samples \(`buffer.max_size`\)"):
        b.put(*make_group("b", 2), timeout=0.05)
    assert b.list_keys() == [f"a/{i}" for i in range(4)]
    with pytest.raises(ValueError, match="can never fit"):
        b.put(*make_group("c", 5))
    # a consumer frees room and the blocked producer proceeds
    t = threading.Thread(target=lambda: (time.sleep(0.1), b.sample(4, learner_version=0)))
    t.start()
    b.put(*make_group("b", 2), timeout=5)
    t.join()
    assert sorted(b.list_keys()) == ["b/0", "b/1"]


def test_full_buffer_evicts_only_already_sampled():
    b = buf(max_size=4, max_times_sampled=3)
    b.put(*make_group("a", 4))
    b.sample(4, learner_version=0)
    b.put(*make_group("b", 4), timeout=0.1)  # "a" was trained on: evictable
    assert sorted(b.list_keys()) == [f"b/{i}" for i in range(4)]
    assert b.metrics()["buffer/evicted"] == 4


def test_memory_budget_and_total_storage_size():
    b = buf(q=tq_cfg(total_storage_size=None, memory_budget_bytes=4 * (3 * 4 + 8)))
    b.put(*make_group("a", 4))
    with pytest.raises(TimeoutError, match="memory 80/80 bytes"):
        b.put(*make_group("b", 1), timeout=0.01)
    b = buf(q=tq_cfg(total_storage_size=3))
    with pytest.raises(ValueError, match="total_storage_size"):
        b.put(*make_group("a", 4))


def test_offline_mix_and_source():
    b = buf(offline_mix_ratio=0.5)
    for g in range(2):
        b.put(*make_group(f"on{g}", 2))
        b.put(*make_group(f"off{g}", 2, source=SampleSource.OFFLINE))
    out = b.sample(4, learner_version=1, timeout=5)
    assert [m.tags.source for m in out.metas] == [SampleSource.ONLINE] * 2 + [SampleSource.OFFLINE] * 2
    assert out.info["staleness"].tolist() == [1, 1, 0, 0]  # offline data has no policy version: lag 0
    only = b.sample(2, learner_version=1, source="online", timeout=5)
    assert {m.tags.source for m in only.metas} == {SampleSource.ONLINE}
    b.sample(2, learner_version=50, timeout=5, source="offline")  # ... and never goes stale


@pytest.mark.parametrize("bad,match", [
    (lambda f: f.pop("idx"), "is missing field `idx`"),
    (lambda f: f.update(x=f["x"].astype(np.float64)), "field `x` has dtype/shape float64\\[3\\]"),
    (lambda f: f.update(x=np.zeros((4, 5), np.float32)), "field `x` has dtype/shape float32\\[5\\]"),
    (lambda f: f.update(extra=np.zeros(4)), "has field `extra` which is not in"),
    (lambda f: f.update(x=np.zeros((3, 3), np.float32)), "batch dimension must equal len\\(metas\\) = 4"),
    (lambda f: f.update(s=np.array(["a"] * 4)), "only native bool/int/uint/float"),
])
def test_schema_violations_rejected_whole(bad, match):
    b = buf()
    b.put(*make_group("ok", 4))
    metas, fields = make_group("bad", 4)
    bad(fields)
    with pytest.raises(ValueError, match=match) as e:
        b.put(metas, fields)
    assert "`bad/" in str(e.value) or "first key" in str(e.value)
    assert b.size() == 4 and not b.list_keys(group_uid="bad")


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), None])
def test_non_finite_reward_rejected_whole(reward):
    import msgspec
    b = buf()
    metas, fields = make_group("g", 4)
    metas[2] = msgspec.structs.replace(metas[2], reward=reward)
    with pytest.raises(ValueError, match=r"sample `g/2` field `reward`"):
        b.put(metas, fields)
    assert b.size() == 0


def test_bad_metas_rejected():
    import msgspec
    b = buf()
    metas, fields = make_group("g", 2)
    b.put(metas, fields)
    with pytest.raises(ValueError, match="key `g/0` is already in the buffer"):
        b.put(metas, fields)
    m2, f2 = make_group("h", 2)
    m2[1] = msgspec.structs.replace(m2[1], status=SampleStatus.RUNNING)
    with pytest.raises(ValueError, match="sample `h/1` has status 'running'"):
        b.put(m2, f2)
    m3, f3 = make_group("p", 2, version=None)
    with pytest.raises(ValueError, match="sample `p/0` field `tags.policy_version`"):
        b.put(m3, f3)
    with pytest.raises(ValueError, match="`batch_size`"):
        b.sample(0, learner_version=0)


def test_get_list_keys_clear():
    b = buf()
    b.put(*make_group("g", 3))
    got = b.get(["g/2", "g/0"], fields=["x"])
    assert list(got.fields) == ["x"] and got.keys == ["g/2", "g/0"]
    check_rows(type(got)(got.metas, {"x": got.fields["x"], "idx": np.array([2, 0])}))
    assert b.list_keys(sample_index=1) == ["g/1"] and b.list_keys(partition="eval") == []
    with pytest.raises(KeyError, match="sample `nope`"):
        b.get(["nope"])
    with pytest.raises(KeyError, match="no field `y`"):
        b.get(["g/0"], fields=["y"])
    with pytest.raises(ValueError, match="`colour` is not a sample tag"):
        b.list_keys(colour="red")
    b.clear()
    assert b.size() == 0


def test_rate_limiter_ratio_one_is_lock_step():
    b = buf(samples_per_insert=1.0, min_size_to_sample=4, samples_per_insert_error_buffer=None)
    b.put(*make_group("a", 4))
    b.sample(4, learner_version=0)
    b.put(*make_group("b", 4))
    b.put(*make_group("c", 4))
    b.put(*make_group("d", 4))  # auto window: one put + one batch = 8 above the target of 4
    with pytest.raises(TimeoutError, match=r"rate limiter SampleToInsertRatio.*diff=12"):
        b.put(*make_group("e", 4), timeout=0.05)
    b.sample(4, learner_version=0)
    b.put(*make_group("e", 4), timeout=1)
    with pytest.raises(ValueError, match="`buffer.samples_per_insert` = 2.0 must deadlock"):
        buf(samples_per_insert=2.0)
    with pytest.raises(ValueError, match="`buffer.min_size_to_sample` = 9 must deadlock"):
        buf(max_size=8, min_size_to_sample=9)


@settings(max_examples=25, deadline=None)
@given(sampler=st.sampled_from(["fifo", "uniform", "prioritized", "freshness"]),
       sizes=st.lists(st.integers(1, 4), min_size=1, max_size=12), batch=st.integers(1, 8),
       mts=st.integers(1, 3))
def test_every_sample_consumed_exactly_max_times(sampler, sizes, batch, mts):
    """Whatever the sampler: groups come whole, at most once per batch, and nothing is lost or duplicated."""
    b = buf(sampler=sampler, max_times_sampled=mts)
    for g, n in enumerate(sizes):
        b.put(*make_group(f"g{g}", n))
    seen: dict[str, int] = {}
    while b.num_ready_samples(0) >= batch:
        out = b.sample(batch, learner_version=0)
        assert len(out) >= batch
        uids = [u for u, _ in out.group_slices()]
        assert len(uids) == len(set(uids))
        for u, sl in out.group_slices():
            assert [m.tags.sample_index for m in out.metas[sl]] == list(range(sizes[int(u[1:])]))
        check_rows(out)
        for k in out.keys:
            seen[k] = seen.get(k, 0) + 1
    assert all(c <= mts for c in seen.values())
    left = b.list_keys()
    assert all(seen.get(k, 0) < mts for k in left)
    assert set(seen) | set(left) == {f"g{g}/{i}" for g, n in enumerate(sizes) for i in range(n)}


def test_threads_producers_consumers_lose_nothing():
    b = buf(max_size=16)
    n_groups, errors, got = 40, [], []

    def produce(p):
        try:
            for g in range(n_groups // 4):
                b.put(*make_group(f"p{p}g{g}", 4), timeout=10)
        except Exception as e:  # pragma: no cover - surfaced below
            errors.append(e)

    def consume():
        try:
            for _ in range(n_groups // 2):
                got.extend(b.sample(4, learner_version=0, timeout=10).keys)
        except Exception as e:  # pragma: no cover
            errors.append(e)

    ts = [threading.Thread(target=produce, args=(p,)) for p in range(4)] + \
         [threading.Thread(target=consume) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    assert len(got) == len(set(got)) == n_groups * 4


def test_factory_local():
    b = make_replay_buffer(buffer_cfg(), sampler_cfg(), tq_cfg(), use_ray=False)  # the schema's defaults
    assert isinstance(b, LocalReplayBuffer)
    b.put(*make_group("g", 2))
    assert b.size() == 2
    with pytest.raises(ValueError, match=r"`buffer`: no config section given"):
        make_replay_buffer(None, sampler_cfg(), tq_cfg(), use_ray=False)


def test_sample_async_draws_at_result_with_the_version_it_was_asked_at():
    buf = LocalReplayBuffer(spec(s=sampler_cfg(max_off_policy_threshold=1)), seed=0)
    req = buf.sample_async(4, learner_version=3, timeout=0.1)  # in-process: nothing drawn yet
    buf.put(*make_group("v0", 4, version=0))
    buf.put(*make_group("v3", 4, version=3))
    assert buf.size() == 8
    batch = req.result()
    assert batch.keys == [f"v3/{i}" for i in range(4)]  # judged at version 3: v0, 3 behind, is stale
    assert req.result() is batch  # drawn once


def _batch_of(*groups):
    """A SampledBatch holding ``groups`` (as ``make_group`` returns them) in order, with per-row info."""
    from omnirl_async.buffer.base import SampledBatch

    metas = [m for ms, _ in groups for m in ms]
    fields = {k: np.concatenate([f[k] for _, f in groups]) for k in groups[0][1]}
    return SampledBatch(metas=metas, fields=fields,
                        info={"staleness": np.asarray([m.tags.sample_index for m in metas], dtype=np.int64)})


def test_concat_batches_keeps_groups_whole_and_sorts_them_by_the_given_key():
    """Groups taken in several calls (as they landed) come out as one batch, each group whole, in key order."""
    from omnirl_async.buffer.base import SampledBatch, concat_batches

    g = {name: make_group(name, n) for name, n in [("g0", 2), ("g1", 3), ("g2", 2), ("g3", 3)]}
    a, b = _batch_of(g["g3"], g["g1"]), _batch_of(g["g0"], g["g2"])
    out = concat_batches([a, b], order=lambda m: m.tags.group_uid)
    assert [u for u, _ in out.group_slices()] == ["g0", "g1", "g2", "g3"]
    assert out.keys == [f"{name}/{i}" for name, n in [("g0", 2), ("g1", 3), ("g2", 2), ("g3", 3)] for i in range(n)]
    check_rows(out)
    assert out.info["staleness"].tolist() == [0, 1, 0, 1, 2, 0, 1, 0, 1, 2]
    # without an order: the batches' groups one after the other; empty batches are skipped; one batch is itself
    empty = SampledBatch(metas=[], fields={}, info={})
    kept = concat_batches([a, empty, b])
    assert [u for u, _ in kept.group_slices()] == ["g3", "g1", "g0", "g2"]
    check_rows(kept)
    assert concat_batches([a]) is a and len(concat_batches([])) == 0


def test_concat_batches_refuses_batches_with_different_fields():
    from omnirl_async.buffer.base import SampledBatch, concat_batches

    a = _batch_of(make_group("g0", 2))
    b = SampledBatch(metas=a.metas, fields={"x": a.fields["x"]}, info=a.info)
    with pytest.raises(ValueError, match=r"batch 1 has fields \['x'\]"):
        concat_batches([a, b])
