"""LearnerGroup: 2 learners under gloo give the update of 1; bypass equals decoupled at lag 0; non-finite
steps are skipped on every rank alike; a dead learner or a silent one is one clear error, raised at once."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import ray
import torch

from omnirl_async.config import load_config
from omnirl_async.learners.learner import Learner
from omnirl_async.learners.learner_group import LearnerDiedError, LearnerGroup, wait_for_learners
from omnirl_async.waits import bounded_get
from tests.ray_kill import kill_and_wait_until_dead


@pytest.mark.slow  # two gloo learners on Ray; the timeout and death tests below stay in `make test`
@pytest.mark.parametrize("epochs", [2, 1], ids=["separate-proximal-pass", "proximal-from-the-update"])
def test_two_gloo_learners_match_one(ray_cluster, small_overrides, batch, epochs):
    fields, gids = batch
    results = {}
    for workers in (1, 2):
        cfg = load_config(small_overrides + [f"learner.num_workers={workers}",
                                             f"actor_rollout_ref.actor.ppo_epochs={epochs}",
                                             "algorithm.rollout_correction.rollout_is=token"])
        group = LearnerGroup(cfg, use_ray=True, num_threads=1)
        try:
            metrics = group.update(fields, gids)
            results[workers] = (group.get_weights(), metrics)
        finally:
            group.stop()
    w1, w2 = results[1][0], results[2][0]
    assert set(w1) == set(w2)
    moved = 0
    for k in w1:
        np.testing.assert_allclose(w2[k], w1[k], rtol=0, atol=1e-6, err_msg=k)
        moved += int(np.abs(w1[k]).max() > 0 and "lora_B" in k)
    assert moved > 0
    assert results[2][1]["actor/num_updates"] == results[1][1]["actor/num_updates"] == epochs
    for k in ("rollout_corr/logprob_abs_diff_mean", "rollout_corr/is_weight_mean"):  # every rank saw every row
        assert results[2][1][k] == pytest.approx(results[1][1][k], rel=1e-4, abs=1e-7), k


@pytest.mark.slow  # 15-20 s of Ray learner actors each; `make test` keeps the loop's use of it (test_one_loop)
def test_an_update_started_on_staged_fields_equals_a_blocking_one(ray_cluster, small_overrides, batch):
    """separate_async stages the next batch ahead and starts the update without waiting; a call made before
    ``result()`` runs after the update (the actor serves calls in order)."""
    fields, gids = batch
    cfg = load_config(small_overrides)
    got = {}
    for how in ("blocking", "started"):
        group = LearnerGroup(cfg, use_ray=True, num_threads=1)
        try:
            if how == "blocking":
                metrics = group.update(fields, gids)
                weights = group.get_weights()
            else:
                pending = group.start_update(group.stage(fields), gids)
                weights = group.get_weights()
                metrics = pending.result()
                assert pending.result() is metrics  # answered once, kept
            got[how] = (weights, metrics)
        finally:
            group.stop()
    (w_block, m_block), (w_start, m_start) = got["blocking"], got["started"]
    assert any(np.abs(v).max() > 0 for k, v in w_start.items() if "lora_B" in k)  # the update is in the weights
    for k in w_block:
        np.testing.assert_allclose(w_start[k], w_block[k], rtol=0, atol=1e-6, err_msg=k)
    assert set(m_start) == set(m_block)
    same = sorted(k for k in m_block if "timing" not in k)  # everything but how long it took
    np.testing.assert_allclose([m_start[k] for k in same], [m_block[k] for k in same], rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # 15-20 s of Ray learner actors each; `make test` keeps the loop's use of it (test_one_loop)
def test_a_publish_started_between_two_started_updates_holds_the_first_updates_weights(ray_cluster,
                                                                                        small_overrides, batch):
    """separate_async starts update u+1 right after update u, with rank 0's publish of u's weights between them and
    nothing waited for: the store gets exactly the weights after u, and u+1 trains on from them."""
    from omnirl_async.learners.weight_store import WeightStore

    fields, gids = batch
    cfg = load_config(small_overrides)
    group = LearnerGroup(cfg, use_ray=True, num_threads=1)
    try:
        group.update(fields, gids)
        after_one = group.get_weights()
        group.update(fields, gids)
        after_two = group.get_weights()
    finally:
        group.stop()
    assert any(not np.array_equal(after_one[k], after_two[k]) for k in after_one)  # the second update moved them

    store = ray_cluster.remote(num_cpus=0)(WeightStore).remote(keep=2)
    group = LearnerGroup(cfg, use_ray=True, num_threads=1)
    try:
        first = group.start_update(group.stage(fields), gids)
        publishing = group.start_publish(store, 1)
        second = group.start_update(group.stage(fields), gids)  # submitted before anything was waited for
        info = publishing.result()
        assert (info.version, info.adapter_versions) == (1, {"default": 1})
        first.result(), second.result()
        published = ray_cluster.get(ray_cluster.get(store.get.remote(1))[1][0])
        for k in after_one:
            np.testing.assert_allclose(published[k], after_one[k], rtol=0, atol=1e-6, err_msg=k)
            np.testing.assert_allclose(group.get_weights()[k], after_two[k], rtol=0, atol=1e-6, err_msg=k)
        assert group.adapter_versions() == {"default": 2}
    finally:
        group.stop()


def test_fetching_weights_after_reading_the_latest_version_gets_that_version_or_a_newer_one(ray_cluster):
    """A rollout worker reads the store's newest version, leases with it and only then fetches
    (``fetch_weights_if_newer(..., latest=)``): it installs that version or one published meanwhile, never older."""
    from omnirl_async.learners.weight_store import WeightStore, fetch_weights_if_newer, publish_weights

    store = ray_cluster.remote(num_cpus=0)(WeightStore).remote(keep=2)
    for v in (0, 1):
        publish_weights(store, v, {"w": np.full(3, float(v), np.float32)}, is_lora=True)
    latest = ray_cluster.get(store.latest_version.remote())
    assert latest == 1
    assert fetch_weights_if_newer(store, 1, latest=latest) is None  # already current: nothing fetched
    publish_weights(store, 2, {"w": np.full(3, 2.0, np.float32)}, is_lora=True)  # between the read and the fetch
    info, weights = fetch_weights_if_newer(store, 0, latest=latest)
    assert info.version == 2 and weights["w"].tolist() == [2.0, 2.0, 2.0]
    assert fetch_weights_if_newer(store, 2) is None
    info, _ = fetch_weights_if_newer(store, 1)  # without `latest` it reads it itself
    assert info.version == 2


def test_bypass_equals_decoupled_when_lag_is_zero(small_overrides, batch):
    fields, gids = batch
    weights = {}
    for bypass in (False, True):
        cfg = load_config(small_overrides + [f"algorithm.rollout_correction.bypass_mode={str(bypass).lower()}",
                                             "algorithm.rollout_correction.rollout_is=token"])
        learner = Learner(cfg)
        m = learner.update(fields, gids)
        assert m["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
        weights[bypass] = learner.get_weights()
    for k in weights[False]:
        torch.testing.assert_close(weights[True][k], weights[False][k], rtol=0, atol=1e-6)


# ---------------------------------------------------------------------- bounded waits and dead learners
@pytest.fixture(scope="module")
def sleepers(ray_cluster):
    """Two stand-in actors (rank 0, rank 1) that answer after a given time: cheap to start and to kill."""
    @ray_cluster.remote(num_cpus=0)
    class Sleeper:
        def nap(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    actors = [Sleeper.remote() for _ in range(2)]
    yield actors
    for a in actors:
        ray_cluster.kill(a)


class _Rank:
    """A stand-in learner rank: naps, or fails with ``message``."""

    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def fail(self, message: str) -> None:
        raise RuntimeError(message)


def test_bounded_get_answers_in_time_and_names_what_did_not(ray_cluster):
    # max_concurrency: a nap left running does not hold up the next call
    actor = ray_cluster.remote(num_cpus=0)(_Rank).options(max_concurrency=4).remote()
    try:
        assert bounded_get(actor.nap.remote(0.0), 30, "a nap", "why") == 0.0
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as err:
            bounded_get(actor.nap.remote(5.0), 0.5, "the dispatcher's `lease`", "It may be stuck.")
        assert time.monotonic() - t0 < 3
        assert str(err.value) == ("the dispatcher's `lease` got no answer within `trainer.wait_timeout_s` = 0.5 s. "
                                  "It may be stuck.") and err.value.__cause__ is None
        with pytest.raises(TimeoutError, match=r"^replay buffer: x got no answer within 0.25 s\. y$"):
            bounded_get(actor.nap.remote(5.0), 0.25, "replay buffer: x", "y", key=None)
        with pytest.raises(RuntimeError, match="bad input 7"):  # the call's own error passes through
            bounded_get(actor.fail.remote("bad input 7"), 30, "a call", "why")
    finally:
        ray_cluster.kill(actor)


def test_a_pending_update_is_answerable_as_soon_as_one_rank_failed(ray_cluster):
    """The loop polls ``wait`` while it samples ahead: a rank that failed ends that at once (the others may be
    blocked in a collective for ever); one still working does not."""
    from omnirl_async.learners.learner_group import PendingUpdate

    rank = ray_cluster.remote(num_cpus=0)(_Rank)
    working, failing = rank.remote(), rank.remote()
    try:
        healthy = PendingUpdate(lambda: None, [working.nap.remote(0.0), failing.nap.remote(1.0)])
        assert not healthy.wait(0.2)  # one answered (a value), one still working
        refs = [working.nap.remote(20.0), failing.fail.remote("Connection closed by peer")]
        t0 = time.monotonic()
        assert PendingUpdate(lambda: None, refs).wait(15.0) and time.monotonic() - t0 < 5
        assert healthy.wait(10.0)
    finally:
        ray.kill(working)
        ray.kill(failing)


def test_wait_for_learners_returns_replies_by_rank(sleepers):
    refs = {0: sleepers[0].nap.remote(0.2), 1: sleepers[1].nap.remote(0.0)}
    assert wait_for_learners(refs, "update", 30) == {0: 0.2, 1: 0.0}


def test_a_silent_rank_is_a_timeout_naming_the_call_and_rank(sleepers):
    refs = {0: sleepers[0].nap.remote(0.0), 1: sleepers[1].nap.remote(3.0)}
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        wait_for_learners(refs, "publish", 0.5)
    assert time.monotonic() - t0 < 2.5
    msg = str(info.value)
    assert "`publish`" in msg and "rank(s) [1]" in msg and "`trainer.wait_timeout_s` = 0.5" in msg
    ray.get(refs[1])  # let the nap end before the next test uses the actor


def test_a_dead_rank_is_reported_at_once_while_another_still_works(ray_cluster):
    @ray_cluster.remote(num_cpus=0)
    class Sleeper:
        def nap(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    alive, doomed = Sleeper.remote(), Sleeper.remote()
    ray.get([alive.nap.remote(0), doomed.nap.remote(0)])
    kill_and_wait_until_dead(doomed, timeout_s=30)  # dead within 30 s, as this test has always required
    t0 = time.monotonic()
    with pytest.raises(LearnerDiedError) as info:
        wait_for_learners({0: alive.nap.remote(20.0), 1: doomed.nap.remote(0.0)}, "get_state", 60)
    assert time.monotonic() - t0 < 10
    err = info.value
    assert (err.rank, err.call) == (1, "get_state") and "ActorDiedError" in err.cause and "\n" not in err.cause
    assert str(err).startswith("learner rank 1 died during `get_state`")
    assert err.__cause__ is None and err.__suppress_context__
    extended = err.extended("the last complete checkpoint is X")
    assert (extended.rank, extended.call) == (1, "get_state")
    assert str(extended) == f"{err}\nthe last complete checkpoint is X"
    ray.kill(alive)


def test_a_death_is_reported_rather_than_the_collective_error_it_caused(ray_cluster):
    """Rank 0 fails first (as a survivor's broken all-reduce does); rank 1's death just after is the cause shown."""
    @ray_cluster.remote(num_cpus=0)
    class Peer:
        def fail_after(self, seconds: float) -> None:
            time.sleep(seconds)
            raise RuntimeError("Connection closed by peer")

        def nap(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    survivor, doomed = Peer.remote(), Peer.remote()
    ray.get([survivor.nap.remote(0), doomed.nap.remote(0)])
    refs = {0: survivor.fail_after.remote(0.2), 1: doomed.nap.remote(30.0)}
    killer = threading.Timer(1.0, ray.kill, args=(doomed,))
    killer.start()
    try:
        with pytest.raises(LearnerDiedError) as info:
            wait_for_learners(refs, "update", 60)
    finally:
        killer.join()
        ray.kill(survivor)
    assert (info.value.rank, info.value.call) == (1, "update")


@pytest.fixture(scope="module")
def two_learners(ray_cluster, small_overrides):
    """2 gloo learners, one mini-batch per update split by rank (rank 0: group 0, rank 1: group 1)."""
    cfg = load_config(small_overrides + ["learner.num_workers=2", "actor_rollout_ref.actor.shuffle=false",
                                         "algorithm.global_std=false", "trainer.wait_timeout_s=120"])
    group = LearnerGroup(cfg, use_ray=True, num_threads=1)
    yield group
    group.stop()


@pytest.mark.slow  # two gloo learners on Ray; the timeout and death tests below stay in `make test`
def test_two_learners_skip_the_same_nonfinite_step(two_learners, batch):
    fields, gids = batch
    before = two_learners._all("get_weights")
    rewards = np.array(fields["rewards"], copy=True)
    rewards[4:] = np.nan  # only rank 1's rows have a NaN loss; rank 0 sees NaN only in the averaged gradient
    m = two_learners.update({**fields, "rewards": rewards}, gids)
    # metrics are rank means: 1.0 means both ranks skipped
    assert m["training/skipped_nonfinite"] == 1.0 and m["training/nonfinite_steps"] == 1.0
    after = two_learners._all("get_weights")
    for rank in (0, 1):
        for k in before[rank]:
            np.testing.assert_array_equal(after[rank][k], before[rank][k], err_msg=f"rank {rank} {k}")
    m = two_learners.update(fields, gids)  # a finite step: both apply it and stay identical
    assert m["training/skipped_nonfinite"] == 0.0 and m["training/nonfinite_steps"] == 1.0
    w0, w1 = two_learners._all("get_weights")
    assert any(not np.array_equal(w0[k], before[0][k]) for k in w0)
    for k in w0:
        np.testing.assert_array_equal(w0[k], w1[k], err_msg=k)


@pytest.mark.slow  # two gloo learners on Ray; the timeout and death tests below stay in `make test`
def test_a_killed_learner_is_one_clear_error(two_learners, batch):
    """Runs last on the shared group: rank 1 dies, `update` names it at once though rank 0 waits in gloo."""
    fields, gids = batch
    kill_and_wait_until_dead(two_learners.actors[1])
    t0 = time.monotonic()
    with pytest.raises(LearnerDiedError) as info:
        two_learners.update(fields, gids)
    assert time.monotonic() - t0 < 30  # far below `trainer.wait_timeout_s` = 120
    err = info.value
    assert (err.rank, err.call) == (1, "update")
    assert str(err).startswith("learner rank 1 died during `update`") and "ActorDiedError" in str(err)
    assert err.__cause__ is None and err.__suppress_context__
    with pytest.raises(LearnerDiedError, match="rank 1 died earlier, during `update`"):
        two_learners.get_weights()  # the group is unusable: fail at once, not after a timeout
    t0 = time.monotonic()
    two_learners.stop()  # kills rank 0, which is stuck in the collective, without waiting for it
    assert time.monotonic() - t0 < 10
