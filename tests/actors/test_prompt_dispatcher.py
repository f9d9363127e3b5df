"""Exactly-once prompt leases, also across releases, epochs and restore."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnirl_async.actors.prompt_dispatcher import PromptDispatcher, sample_seeds

PROMPTS = [f"p{i}" for i in range(10)]


def test_each_prompt_once_per_epoch_and_batches_cross_epochs():
    d = PromptDispatcher(PROMPTS, n=2, shuffle=True, data_seed=3, total_epochs=3)
    seen = Counter()
    while True:
        leases = d.lease(4, global_step=1)
        if not leases:
            break
        d.complete([x.lease_id for x in leases])
        seen.update((x.epoch, x.prompt) for x in leases)
    assert d.exhausted()
    assert set(seen.values()) == {1}
    assert len(seen) == 30  # 10 prompts x 3 epochs, each exactly once


def test_released_leases_come_back_in_their_epoch():
    d = PromptDispatcher(PROMPTS, n=2, shuffle=False, total_epochs=2)
    first = d.lease(4, global_step=1, worker_id="w0")
    other = d.lease(6, global_step=1, worker_id="w1")
    assert d.release_worker("w0") == 4  # w0 died
    d.complete([x.lease_id for x in other])
    again = d.lease(4, global_step=2, worker_id="w2")
    assert [x.prompt for x in again] == [x.prompt for x in first]
    assert all(x.epoch == 0 for x in again)
    d.complete([x.lease_id for x in again])
    with pytest.raises(KeyError, match="not outstanding"):
        d.complete([again[0].lease_id])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5), st.booleans()), min_size=1, max_size=40))
def test_property_leases_complete_exactly_once(ops):
    d = PromptDispatcher(PROMPTS, n=1, shuffle=True, total_epochs=2)
    done = Counter()
    for num, fail in ops:
        leases = d.lease(num, global_step=1)
        if fail:
            d.release([x.lease_id for x in leases])
        else:
            d.complete([x.lease_id for x in leases])
            done.update((x.epoch, x.index) for x in leases)
    assert all(v == 1 for v in done.values())


def test_state_round_trip_returns_outstanding_leases():
    d = PromptDispatcher(PROMPTS, n=2, shuffle=True, data_seed=5, total_epochs=1)
    a = d.lease(3, global_step=1)
    d.complete([x.lease_id for x in a])
    b = d.lease(3, global_step=2)  # in flight at the "crash"
    state = d.get_state()
    d2 = PromptDispatcher(PROMPTS, n=2, shuffle=True, data_seed=5, total_epochs=1)
    d2.set_state(state)
    rest = []
    while leases := d2.lease(4, global_step=3):
        d2.complete([x.lease_id for x in leases])
        rest.extend(leases)
    got = sorted([x.index for x in a] + [x.index for x in rest])
    assert got == list(range(10))
    assert {x.index for x in b} <= {x.index for x in rest}


def test_seeds_follow_base_seed_plus_step_and_null_disables():
    d = PromptDispatcher(PROMPTS, n=3, shuffle=False, rollout_seed=42)
    lease = d.lease(1, global_step=5)[0]
    assert lease.seed == 42 + 5 - 1
    s1 = sample_seeds(lease)
    assert len(set(s1)) == 3 and s1 == sample_seeds(lease)
    d0 = PromptDispatcher(PROMPTS, n=3, shuffle=False, rollout_seed=None)
    assert sample_seeds(d0.lease(1, global_step=1)[0]) == [None, None, None]


def test_empty_prompt_set_is_an_error():
    with pytest.raises(ValueError, match="data.train_files"):
        PromptDispatcher([], n=2)


def test_requeue_keeps_the_group_uid_and_takes_a_new_ticket():
    d = PromptDispatcher(PROMPTS, n=2, shuffle=False, batch_groups=2)
    first = d.lease(2, global_step=1)
    d.complete([x.lease_id for x in first])
    d.requeue(first[1].group_uid, first[1].prompt, 2, global_step=1)
    again = d.lease(1, global_step=1)[0]
    assert again.group_uid == first[1].group_uid and again.prompt == first[1].prompt
    assert again.ticket == 2 and again.seed != first[1].seed  # fresh noise for the retry


def test_completed_untrained_groups_are_leased_again_when_their_samples_are_not_restored():
    d = PromptDispatcher([f"p{i}" for i in range(6)], n=2, shuffle=False, total_epochs=1, batch_groups=2)
    leases = d.lease(5, global_step=None)
    d.complete([x.lease_id for x in leases])
    d.mark_trained([0, 1])  # step 1 trained tickets 0 and 1; tickets 2-4 wait in the buffer
    assert d.num_untrained() == 3
    state = d.get_state()

    kept = PromptDispatcher([f"p{i}" for i in range(6)], n=2, shuffle=False, total_epochs=1, batch_groups=2)
    assert kept.set_state(state, samples_restored=True) == 0  # the buffer snapshot holds them
    assert kept.tickets_done() == 5 and [x.prompt for x in kept.lease(5, global_step=None)] == ["p5"]

    redo = PromptDispatcher([f"p{i}" for i in range(6)], n=2, shuffle=False, total_epochs=1, batch_groups=2)
    assert redo.set_state(state, samples_restored=False) == 3
    assert redo.tickets_done() == 2  # tickets 2-4 are not done any more
    again = redo.lease(5, global_step=None)
    assert [(x.prompt, x.ticket) for x in again] == [("p2", 2), ("p3", 3), ("p4", 4), ("p5", 5)]
    assert [x.group_uid for x in again[:3]] == [x.group_uid for x in leases[2:]]
    redo.complete([x.lease_id for x in again])
    assert redo.tickets_done() == 6 and redo.exhausted()


def test_groups_the_trainer_held_at_a_checkpoint_are_leased_again_even_with_the_buffer_restored():
    """separate_async samples the next batch while an update runs: a checkpoint taken then lists those tickets
    as ``held`` (no snapshot has them), and only they are generated again."""
    d = PromptDispatcher([f"p{i}" for i in range(6)], n=2, shuffle=False, total_epochs=1, batch_groups=2)
    leases = d.lease(6, global_step=None)
    d.complete([x.lease_id for x in leases])
    d.mark_trained([0, 1])  # tickets 2, 3 sampled ahead (held by the trainer), 4, 5 still in the buffer
    state = {**d.get_state(), "held": [2, 3]}

    resumed = PromptDispatcher([f"p{i}" for i in range(6)], n=2, shuffle=False, total_epochs=1, batch_groups=2)
    assert resumed.set_state(state, samples_restored=True) == 2
    assert resumed.tickets_done() == 2 and resumed.num_untrained() == 2  # 4 and 5: in the restored snapshot
    again = resumed.lease(6, global_step=None)
    assert [(x.prompt, x.ticket, x.group_uid) for x in again] == [(x.prompt, x.ticket, x.group_uid)
                                                                  for x in leases[2:4]]
    resumed.complete([x.lease_id for x in again])
    assert resumed.tickets_done() == 6 and resumed.exhausted()
    # without the snapshot every untrained group comes back, held or not
    redo = PromptDispatcher([f"p{i}" for i in range(6)], n=2, shuffle=False, total_epochs=1, batch_groups=2)
    assert redo.set_state(state, samples_restored=False) == 4


def test_settle_below_forgets_failed_and_trained_tickets():
    d = PromptDispatcher([f"p{i}" for i in range(4)], n=1, shuffle=False, total_epochs=1, batch_groups=2)
    d.complete([x.lease_id for x in d.lease(4, global_step=None)])
    d.settle_below(2)
    assert d.num_untrained() == 2 and [p["ticket"] for p in d.get_state()["untrained"]] == [2, 3]


def _refusing_dispatcher() -> PromptDispatcher:
    """Threshold 0, one group per update: after one lease, the next waits for the learner's update."""
    from omnirl_async.actors.staleness import AdmissionController

    d = PromptDispatcher([f"p{i}" for i in range(8)], n=2, shuffle=False,
                         admission=AdmissionController(threshold=0, batch_groups=1))
    assert len(d.lease(1, global_step=None, worker_version=0)) == 1
    assert d.lease(1, global_step=None, worker_version=0) == []  # refused at once without wait_s
    return d


@pytest.mark.parametrize("wake", ["release", "requeue", "stop", "nothing"])
def test_a_refused_lease_waits_until_something_changes(wake):
    import threading
    import time

    d = _refusing_dispatcher()
    held = d.outstanding()[0]
    actions = {"release": lambda: d.release([held.lease_id]), "stop": d.stop, "nothing": lambda: None,
               "requeue": lambda: d.requeue("g-again", "p0", 2)}
    timer = threading.Timer(0.3, actions[wake])
    timer.start()
    t = time.monotonic()
    got = d.lease(1, global_step=None, worker_version=0, wait_s=2.0)
    waited = time.monotonic() - t
    timer.join()
    if wake == "release":  # the given-back lease is admitted again at once
        assert [x.ticket for x in got] == [held.ticket] and 0.25 < waited < 1.5
    elif wake == "requeue":  # a requeued group takes a new ticket: admission still says wait
        assert got == [] and waited > 1.9
    elif wake == "stop":
        assert got == [] and 0.25 < waited < 1.5
    else:
        assert got == [] and 1.9 < waited < 3.0


def test_an_update_that_publishes_a_version_grants_a_waiting_lease_at_that_version():
    """The trainer announces the published version with the update: a waiting lease is admitted at it at once
    (no round trip to learn the version first) and asks its worker to install it."""
    import threading
    import time

    d = _refusing_dispatcher()
    held = d.outstanding()[0]
    assert held.weights_version == 0  # nothing announced yet: the worker's own version
    threading.Timer(0.3, lambda: d.on_update(1, published_version=1)).start()
    t = time.monotonic()
    got = d.lease(1, global_step=None, worker_version=0, wait_s=5.0)
    assert 0.25 < time.monotonic() - t < 1.5
    assert [(x.ticket, x.weights_version) for x in got] == [(1, 1)]
    assert 0.25 < got[0].admission_wait_s < 0.6 and held.admission_wait_s == 0.0  # waited for the update
    # a worker already past the announced version keeps its own
    d.on_update(2, published_version=2)
    assert [x.weights_version for x in d.lease(1, global_step=None, worker_version=5)] == [5]
    assert d.published_version() == 2


def test_an_update_without_a_new_version_leaves_a_refused_lease_waiting():
    """``parameter_sync_step`` > 1: an update that publishes nothing does not admit a worker whose version is too
    old; the lease keeps waiting (no early return to re-ask) and comes back empty at its deadline."""
    import threading
    import time

    d = _refusing_dispatcher()
    threading.Timer(0.3, d.on_update, args=(1,)).start()
    t = time.monotonic()
    assert d.lease(1, global_step=None, worker_version=0, wait_s=1.5) == []
    assert time.monotonic() - t > 1.4


def test_a_published_version_only_grows():
    d = PromptDispatcher(["a", "b"], n=2)
    d.on_update(0, published_version=3)
    with pytest.raises(ValueError, match="`published_version` 2 is older than the announced 3"):
        d.on_update(1, published_version=2)
    assert d.published_version() == 3
    assert d.lease(1, global_step=1, worker_version=None)[0].weights_version == 3
