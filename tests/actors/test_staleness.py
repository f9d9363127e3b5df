"""Admission control: rule (1) of actors/staleness.py, and tickets through releases."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnirl_async.actors.prompt_dispatcher import PromptDispatcher
from omnirl_async.actors.staleness import AdmissionController


def test_ticket_limit_formula():
    ac = AdmissionController(threshold=1, batch_groups=4, updates_per_version=2)
    assert ac.ticket_limit(0) == (1 + 0 + 1) * 2 * 4
    assert ac.ticket_limit(3) == (1 + 3 + 1) * 2 * 4
    assert ac.trained_version(15) == 1 and ac.trained_version(16) == 2
    drop = AdmissionController(threshold=1, batch_groups=4, strategy="drop", max_ahead_batches=3)
    assert drop.ticket_limit(0) == 12
    drop.on_update(5)
    assert drop.ticket_limit(0) == 32
    with pytest.raises(ValueError, match="max_off_policy_strategy"):
        AdmissionController(threshold=1, batch_groups=4, strategy="later")


@settings(max_examples=60, deadline=None)
@given(threshold=st.integers(0, 3), batch=st.integers(1, 4), sync_step=st.integers(1, 3),
       ops=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 5), st.booleans()), min_size=1, max_size=60))
def test_every_admitted_ticket_keeps_the_bound(threshold, batch, sync_step, ops):
    """Whatever versions workers hold and whatever leases come back, lag <= threshold for every lease."""
    ac = AdmissionController(threshold=threshold, batch_groups=batch, updates_per_version=sync_step)
    d = PromptDispatcher([f"p{i}" for i in range(7)], n=2, admission=ac)
    for version, num, release in ops:
        leases = d.lease(num, global_step=1, worker_version=version)
        for lease in leases:
            assert ac.trained_version(lease.ticket) - version <= threshold
        if release:
            d.release([x.lease_id for x in leases])
        else:
            d.complete([x.lease_id for x in leases])
    issued = d.tickets_issued()
    assert d.tickets_done() <= issued


def test_released_ticket_goes_only_to_a_fresh_enough_worker():
    ac = AdmissionController(threshold=0, batch_groups=2)
    d = PromptDispatcher([f"p{i}" for i in range(8)], n=1, shuffle=False, admission=ac)
    first = d.lease(5, global_step=1, worker_version=0)
    assert [x.ticket for x in first] == [0, 1]  # version 0 may only fill batch 0
    later = d.lease(5, global_step=1, worker_version=2)
    assert [x.ticket for x in later] == [2, 3, 4, 5]
    d.release([later[0].lease_id])  # ticket 2 (trained at version 1) comes back
    assert d.lease(1, global_step=1, worker_version=0) == []  # too old for it
    again = d.lease(1, global_step=1, worker_version=1)
    assert again[0].ticket == 2 and again[0].group_uid == later[0].group_uid
    d.complete([x.lease_id for x in first + again])
    assert d.tickets_done() == 3


def test_pause_and_stop():
    d = PromptDispatcher(["a", "b"], n=1)
    d.pause()
    assert d.lease(2, global_step=1) == []
    d.pause(False)
    assert len(d.lease(1, global_step=1)) == 1
    d.stop()
    assert d.should_stop() and d.lease(1, global_step=1) == []
