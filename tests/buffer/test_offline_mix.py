"""The offline table: filled from an offline store, mixed into online batches at a ratio, snapshotted by reference."""

from __future__ import annotations

import numpy as np
import pytest

from omnirl_async.buffer import LocalReplayBuffer
from omnirl_async.buffer.samplers import ShuffledPassSampler
from omnirl_async.buffer.samplers.base import GroupInfo
from omnirl_async.protocol import SampleSource
from tests.data.offline_fixtures import synthetic_store

from conftest import buffer_cfg, make_group, sampler_cfg, spec, tq_cfg


def _online(b, step: int, groups: int, n: int = 4, failed=()):
    for g in range(groups):
        m, f = make_group(f"s{step}g{g}", n, version=step, failed=failed if g == 0 else ())
        f = {"x0": np.zeros((n, 2, 4, 4), np.float32), "rewards": np.arange(n, dtype=np.float32)}
        b.put(m, f)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    synthetic_store(d, 20)
    return d


# ---------------------------------------------------------------- the pass sampler
def test_shuffled_passes_visit_every_group_once_per_pass_and_resume_exactly():
    s = ShuffledPassSampler(seed=3)
    for i in range(7):
        s.insert(f"g{i}", GroupInfo(order=i, policy_version=None, size=2))
    seen = []
    for _ in range(7):  # 7 draws of 3 = 3 passes
        gen = s.draw(None, learner_version=0)
        seen += [next(gen) for _ in range(3)]
        gen.close()
    for p in range(3):  # each pass holds every group once (a draw crossing a pass end still yields distinct ids)
        assert sorted(seen[7 * p:7 * p + 7]) == [f"g{i}" for i in range(7)], seen
    assert seen[:7] != seen[7:14]  # a new order every pass
    copy = ShuffledPassSampler(seed=3)
    for i in range(7):
        copy.insert(f"g{i}", GroupInfo(order=i, policy_version=None, size=2))
    copy.load_state_dict(s.state_dict())
    assert list(s.draw(None, learner_version=0)) == list(copy.draw(None, learner_version=0))
    s.remove("g0")
    assert "g0" not in list(s.draw(None, learner_version=0)) and len(s) == 6


# ---------------------------------------------------------------- filling
def test_fill_is_idempotent_and_pairs_are_groups_of_two(store_dir):
    b = LocalReplayBuffer(spec(offline_mix_ratio=0.25), seed=0)
    info = b.load_offline(str(store_dir))
    assert (info["added"], info["pairs"]) == (20, 20)
    assert b.load_offline(str(store_dir))["added"] == 0
    keys = b.list_keys(source="offline")
    assert len(keys) == 40 and "offline/p0003/chosen" in keys
    got = b.get(["offline/p0003/chosen", "offline/p0003/rejected"])
    assert [m.reward for m in got.metas] == [1.0, 0.0] and {m.tags.policy_version for m in got.metas} == {None}
    assert got.metas[0].tags.group_uid == "offline/p0003" and got.metas[0].tags.source is SampleSource.OFFLINE
    m = b.metrics()
    assert m["buffer/offline_size"] == 40 and m["buffer/inserted"] == 0  # the pool is not a rollout insert
    assert b.num_ready_samples(0) == 0  # ready counts the online rollouts
    # more pairs ingested later: only they are added
    synthetic_store(store_dir, 3, start=20, seed=1)
    try:
        assert b.load_offline(str(store_dir))["added"] == 3
    finally:  # keep the module's store at 20 pairs
        import shutil
        shutil.rmtree(store_dir / "offline")
        synthetic_store(store_dir, 20)


def test_a_store_that_does_not_fit_is_refused_naming_the_key(tmp_path):
    synthetic_store(tmp_path, 6)
    with pytest.raises(ValueError, match=r"`buffer.max_size` = 10 samples; raise `buffer.max_size` to at least 12"):
        LocalReplayBuffer(spec(max_size=10)).load_offline(str(tmp_path))
    with pytest.raises(ValueError, match=r"`transfer_queue.total_storage_size` = 8 samples .* at least 12"):
        LocalReplayBuffer(spec(q=tq_cfg(total_storage_size=8))).load_offline(str(tmp_path))


def test_empty_offline_table_and_ratio_one_are_clear_errors():
    b = LocalReplayBuffer(spec(offline_mix_ratio=0.5))
    with pytest.raises(ValueError, match="offline table is empty.*omnirl-async ingest"):
        b.sample_offline(8, learner_version=0)
    with pytest.raises(ValueError, match="offline table is empty"):
        b.sample(4, learner_version=0, source="offline")
    assert len(b.sample_offline(0, learner_version=0)) == 0  # an empty step draws nothing
    with pytest.raises(ValueError, match="offline_mix_ratio` = 1 leaves no room"):
        LocalReplayBuffer(spec(offline_mix_ratio=1.0)).sample_offline(4, learner_version=0)


# ---------------------------------------------------------------- the drawn share
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.1])
@pytest.mark.parametrize("mode", ["sync", "separate_async"])
def test_drawn_offline_fraction_matches_the_ratio(store_dir, mode, ratio):
    """Over 1,000+ samples the offline share is the ratio within 2 %, with the modes' batch shapes.

    sync: all ready groups of a step at threshold 0; separate_async: the admitted tickets of an update
    (wait strategy), with failed groups making some batches smaller.
    """
    b = LocalReplayBuffer(spec(buffer_cfg(offline_mix_ratio=ratio),
                               sampler_cfg(max_off_policy_threshold=0 if mode == "sync" else 1)), seed=1)
    b.load_offline(str(store_dir))
    online = offline = 0
    step = 0
    while online + offline < 1000:
        if mode == "sync":
            _online(b, step, groups=3)
            batch = b.sample(b.num_ready_samples(step), learner_version=step, source="online")
        else:
            for g in range(3):
                m, f = make_group(f"t{step}g{g}", 4, version=max(0, step - 1), failed=(1, 2) if step % 5 == 0 else ())
                m = [_with_ticket(x, 3 * step + g) for x in m]
                f = {"x0": np.zeros((4, 2, 4, 4), np.float32), "rewards": np.arange(4, dtype=np.float32)}
                b.put(m, f)
            batch = b.sample_tickets(3 * (step + 1), learner_version=step)
        share = b.sample_offline(len(batch), learner_version=step)
        assert {m.tags.source for m in share.metas} <= {SampleSource.OFFLINE} and len(share) % 2 == 0
        online, offline, step = online + len(batch), offline + len(share), step + 1
    frac = offline / (online + offline)
    assert abs(frac - ratio) <= 0.02, (frac, ratio)
    assert b.metrics()["buffer/offline_frac"] == pytest.approx(frac)


@pytest.mark.parametrize("mode", ["sync", "separate_async"])
def test_a_per_call_ratio_tapers_the_share_and_the_carry_keeps_each_calls_share(store_dir, mode):
    """A share falling linearly from 0.5 to 0 over 200 updates of 12 online samples (sync: 3 fresh groups;
    separate_async: 3 admitted tickets): the drawn offline rows track the running sum of ratio/(1-ratio) x online
    within one pair, each half of the run draws its own share, and a ratio of 0 draws nothing."""
    b = LocalReplayBuffer(spec(buffer_cfg(offline_mix_ratio=0.5),
                               sampler_cfg(max_off_policy_threshold=0 if mode == "sync" else 1)), seed=2)
    b.load_offline(str(store_dir))
    steps, target, drawn = 200, 0.0, []
    for step in range(steps):
        ratio = 0.5 * (1 - step / (steps - 1))
        if mode == "sync":
            _online(b, step, groups=3)
            batch = b.sample(b.num_ready_samples(step), learner_version=step, source="online")
        else:
            for g in range(3):
                m, f = make_group(f"t{step}g{g}", 4, version=max(0, step - 1))
                b.put([_with_ticket(x, 3 * step + g) for x in m],
                      {"x0": np.zeros((4, 2, 4, 4), np.float32), "rewards": np.arange(4, dtype=np.float32)})
            batch = b.sample_tickets(3 * (step + 1), learner_version=step)
        assert len(batch) == 12
        share = b.sample_offline(len(batch), learner_version=step, ratio=ratio)
        target += ratio / (1 - ratio) * len(batch)
        drawn.append(len(share))
        assert abs(sum(drawn) - target) <= 2.0, (step, sum(drawn), target)  # within one pair
    first, last = sum(drawn[:100]), sum(drawn[100:])
    # the first half's ratios run 0.5 -> 0.25 (~2 offline rows per online one at first), the second's 0.25 -> 0
    assert first / (first + 1200) > 0.36 and last / (last + 1200) < 0.16, (first, last)
    assert drawn[-1] == 0 and drawn[0] == 12
    with pytest.raises(ValueError, match="`ratio` = 1.5: must be in"):
        b.sample_offline(12, learner_version=steps, ratio=1.5)


def test_the_carry_of_a_tapered_share_survives_a_snapshot(store_dir, tmp_path):
    a = LocalReplayBuffer(spec(offline_mix_ratio=0.5), seed=0)
    a.load_offline(str(store_dir))
    for step, ratio in enumerate((0.3, 0.2)):  # targets 6 x 3/7 + 6 x 1/4 = 4.07 rows: a fractional carry
        a.sample_offline(6, learner_version=step, ratio=ratio)
    a.snapshot(str(tmp_path / "snap"))
    b = LocalReplayBuffer(spec(offline_mix_ratio=0.5), seed=0)
    b.restore(str(tmp_path / "snap"))
    for step in range(2, 8):
        da, db = (buf.sample_offline(5, learner_version=step, ratio=0.1) for buf in (a, b))
        assert da.keys == db.keys


def _with_ticket(meta, ticket):
    import msgspec
    return msgspec.structs.replace(meta, tags=msgspec.structs.replace(meta.tags, ticket=ticket))


def test_online_staleness_metrics_are_unchanged_by_offline_rows(store_dir):
    """The same online puts and draws with and without a mixed offline share give the same staleness counts."""
    def run(ratio):
        b = LocalReplayBuffer(spec(buffer_cfg(offline_mix_ratio=ratio), sampler_cfg(max_off_policy_threshold=3)),
                              seed=0)
        if ratio:
            b.load_offline(str(store_dir))
        lags = []
        for step in range(12):
            _online(b, step, groups=2)
            batch = b.sample(4, learner_version=step + step % 3, source="online")
            lags.append(batch.info["staleness"].tolist())
            share = b.sample_offline(len(batch), learner_version=step)
            assert ratio == 0 or share.info["staleness"].tolist() == [0] * len(share)
        return lags, {k: v for k, v in b.metrics().items() if k.startswith("buffer/staleness/")
                      or k in ("buffer/sampled", "buffer/inserted", "buffer/dropped_stale")}
    plain, mixed = run(0.0), run(0.5)
    assert plain == mixed
    assert sum(plain[1][k] for k in plain[1] if "/lag_" in k) == 48  # online samples only


def test_offline_rows_are_never_evicted_and_never_stale(store_dir):
    b = LocalReplayBuffer(spec(buffer_cfg(max_times_sampled=2, offline_mix_ratio=0.5),
                               sampler_cfg(max_off_policy_threshold=0)), seed=0)
    b.load_offline(str(store_dir))
    for _ in range(5):
        b.sample(40, learner_version=100, source="offline")  # drawn many times, far beyond any threshold
    assert b.metrics()["buffer/offline_size"] == 40 and b.metrics()["buffer/dropped_stale"] == 0
    big = LocalReplayBuffer(spec(q=tq_cfg(total_storage_size=44)), seed=0)
    big.load_offline(str(store_dir))
    big.sample(40, learner_version=0, source="offline")
    with pytest.raises(TimeoutError, match="timed out waiting for room"):  # drawn offline rows are not evictable
        _online_put_timeout(big)
    assert big.metrics()["buffer/offline_size"] == 40


def _online_put_timeout(b):
    m, f = make_group("late", 8, version=0)
    b.put(m, {"x0": np.zeros((8, 2, 4, 4), np.float32), "rewards": np.zeros(8, np.float32)}, timeout=0.01)


# ---------------------------------------------------------------- snapshots
def test_snapshot_refers_to_the_store_and_restores_bit_exact(store_dir, tmp_path):
    a = LocalReplayBuffer(spec(offline_mix_ratio=0.25), seed=0)
    a.load_offline(str(store_dir))
    _online(a, 0, groups=2)
    a.sample_offline(len(a.sample(8, learner_version=0, source="online")), learner_version=0)
    _online(a, 1, groups=1)  # in the buffer at the snapshot
    snap = tmp_path / "snap"
    a.snapshot(str(snap))
    from safetensors import safe_open
    tables = [safe_open(str(p), "numpy").metadata()["table"] for p in snap.glob("chunk-*.safetensors")]
    assert tables == ["online"]  # the offline rows are referenced, not copied
    b = LocalReplayBuffer(spec(offline_mix_ratio=0.25), seed=0)
    b.restore(str(snap))
    keys = sorted(a.list_keys(source="offline"))
    x, y = a.get(keys), b.get(keys)
    assert [m.times_sampled for m in x.metas] == [m.times_sampled for m in y.metas]
    for name in x.fields:
        assert x.fields[name].tobytes() == y.fields[name].tobytes(), name
    # both continue with the same draws, and the share's carry-over was kept
    for step in range(3):
        da, db = (buf.sample_offline(6, learner_version=step) for buf in (a, b))
        assert da.keys == db.keys and da.fields["x0"].tobytes() == db.fields["x0"].tobytes()
    assert b.load_offline(str(store_dir))["added"] == 0
    assert a.metrics()["buffer/offline_frac"] == b.metrics()["buffer/offline_frac"]


def test_restore_names_a_missing_store(tmp_path):
    run = tmp_path / "run"
    synthetic_store(run, 4)
    a = LocalReplayBuffer(spec(offline_mix_ratio=0.5))
    a.load_offline(str(run))
    a.snapshot(str(run / "global_step_1" / "buffer"))
    (run / "offline").rename(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"refers to 4 pairs of the offline store .*offline, which is gone"):
        LocalReplayBuffer().restore(str(run / "global_step_1" / "buffer"))
