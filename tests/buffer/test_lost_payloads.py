"""Groups whose payload died with its producer: the buffer core drops them and has the untrained ones
generated again (no Ray: the same core runs in the transfer-queue controller)."""

from __future__ import annotations

from conftest import buffer_cfg, make_group, spec
from omnirl_async.buffer.core import BufferCore
from omnirl_async.buffer.local import prepare_put

REASON = "payload lost"


def put(core: BufferCore, gid: str, n: int = 4, **kw) -> None:
    metas, payload, fspec, row_nbytes = prepare_put(*make_group(gid, n, **kw), copy=True)
    core.put(metas, payload, fspec, row_nbytes, timeout=1)


def test_lost_groups_leave_and_only_untrained_ones_are_regenerated():
    core = BufferCore(spec(buffer_cfg(max_times_sampled=2)), seed=0)
    for gid in ("a", "b", "c"):
        put(core, gid)
    metas, _, _ = core.sample(4, learner_version=0, timeout=1)  # one group drawn once: trained, kept for reuse
    drawn = metas[0].tags.group_uid
    assert core.lose_groups(["a", "b", "c", "never-put"], REASON) == 2  # the two never drawn come back
    assert core.size == 0
    refills = core.take_refill_requests()
    assert sorted(r.group_uid for r in refills) == sorted({"a", "b", "c"} - {drawn})
    r = refills[0]
    assert (r.n, r.prompt, r.seed, r.reasons, r.failed_keys) == (4, f"p-{r.group_uid}", 7, [REASON], [])
    m = core.metrics_dict()
    assert m["buffer/regenerated_groups"] == 2 and m["buffer/ready_samples"] == 0


def test_rows_taken_but_unreadable_are_regenerated_once_per_group_on_their_first_draw():
    core = BufferCore(spec(buffer_cfg(max_times_sampled=2)), seed=0)
    put(core, "a")
    put(core, "b")
    first, _, _ = core.sample(8, learner_version=0, timeout=1)  # both drawn once (kept for reuse)
    again, _, _ = core.sample(4, learner_version=0, timeout=1)  # one drawn a second time: leaves after
    second = again[0].tags.group_uid
    other = ({"a", "b"} - {second}).pop()
    # the first batch could not be read: both groups lost before training; each regenerated once
    assert core.lose_taken(first, REASON) == 2
    assert sorted(r.group_uid for r in core.take_refill_requests()) == ["a", "b"]
    assert core.size == 0  # the one kept for reuse left too
    # rows on their second draw were trained already: they only leave
    put(core, other + "2")
    batch, _, _ = core.sample(4, learner_version=0, timeout=1)
    batch, _, _ = core.sample(4, learner_version=0, timeout=1)
    assert batch[0].times_sampled == 2
    assert core.lose_taken(batch, REASON) == 0 and core.take_refill_requests() == []


def test_offline_rows_are_never_regenerated():
    from omnirl_async.protocol import SampleSource

    core = BufferCore(spec(), seed=0)
    put(core, "off", 2, source=SampleSource.OFFLINE)
    metas, _, _ = core.sample(2, learner_version=0, timeout=1, source="offline")
    assert core.lose_taken(metas, REASON) == 0
    assert core.take_refill_requests() == [] and core.size == 2  # the offline pool keeps its pairs


def test_in_process_buffers_own_copies_and_lose_nothing():
    from omnirl_async.buffer.local import LocalReplayBuffer

    buf = LocalReplayBuffer(spec())
    buf.put(*make_group("g"), producer="w0")
    assert buf.drop_producer("w0") == 0 and buf.size() == 4
