"""Ticket layouts whose updates differ in size (a tapered offline share handing rows back to online groups)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnirl_async.actors.prompt_dispatcher import PromptDispatcher
from omnirl_async.actors.staleness import AdmissionController
from omnirl_async.actors.ticket_layout import GroupSchedule, TicketLayout, run_progress


def _sizes_by_hand(groups, share, final, warmup, total, updates, time_progress=0.0):
    out = []
    for u in range(updates):
        p = min(1.0, max(0.0, (u - warmup) / max(1, total - warmup), time_progress))
        r = share + (final - share) * p
        out.append(groups if not 0 < r < 1 else max(1, math.floor((1 - r) * groups + 0.5)))
    return out


def test_a_fixed_layout_is_u_times_b():
    layout = TicketLayout.fixed(3)
    assert [layout.start(u) for u in range(5)] == [0, 3, 6, 9, 12]
    assert layout.tickets(2) == range(6, 9) and layout.size(7) == 3
    assert [layout.update_of(k) for k in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    assert layout.state_dict() == {}
    assert GroupSchedule(groups=4, share=0.5, share_final=0.5).fixed


@pytest.mark.parametrize("groups,share,final,warmup,total", [(4, 0.5, 0.0, 0, 8), (8, 0.5, 0.1, 2, 10),
                                                             (2, 0.5, 0.0, 0, 6), (4, 0.1, 0.6, 0, 5)])
def test_a_tapered_layout_hands_the_freed_rows_back_to_online_groups(groups, share, final, warmup, total):
    layout = TicketLayout(GroupSchedule(groups=groups, share=share, share_final=final, warmup=warmup,
                                        total_steps=total))
    sizes = _sizes_by_hand(groups, share, final, warmup, total, total + 3)
    assert [layout.size(u) for u in range(total + 3)] == sizes
    starts = [0]
    for b in sizes:
        starts.append(starts[-1] + b)
    assert [layout.start(u) for u in range(total + 3)] == starts[:-1]
    # every ticket belongs to exactly the update whose range holds it
    for u in range(total + 2):
        assert all(layout.update_of(k) == u for k in layout.tickets(u))
    if final == 0.0:
        assert sizes[-1] == groups  # the last updates train whole online batches
        assert sizes[0] == max(1, math.floor((1 - share) * groups + 0.5))


def test_the_time_budget_sizes_updates_laid_out_after_it_is_known_and_never_resizes_earlier_ones():
    schedule = GroupSchedule(groups=4, share=0.5, share_final=0.0, total_steps=1000)
    layout = TicketLayout(schedule)
    early = [layout.size(u) for u in range(3)]
    assert early == [2, 2, 2]  # 3 of 1000 updates: the share is still ~0.5
    layout.set_time_progress(0.9)  # 90 % of the time budget is used up
    assert [layout.size(u) for u in range(3)] == early  # fixed once laid out
    assert layout.size(3) == 4 == schedule.at(3, 0.9)  # share 0.05: round(3.8) = 4
    layout.set_time_progress(0.2)  # progress never goes back
    assert layout.time_progress == 0.9
    assert run_progress(5, warmup=0, total_steps=10, time_progress=0.2) == 0.5
    assert run_progress(1, warmup=2, total_steps=10, time_progress=0.0) == 0.0


def test_the_layout_survives_a_checkpoint_and_refuses_a_run_that_does_not_taper():
    schedule = GroupSchedule(groups=4, share=0.5, share_final=0.0, total_steps=1000)
    layout = TicketLayout(schedule)
    layout.set_time_progress(0.6)
    sizes = [layout.size(u) for u in range(6)]
    state = layout.state_dict()
    again = TicketLayout(schedule)  # a resumed process: its time progress starts at 0 until the trainer says
    again.load_state_dict(state)
    assert [again.size(u) for u in range(6)] == sizes and again.time_progress == 0.6
    with pytest.raises(ValueError, match="offline_mix_ratio_final"):
        TicketLayout.fixed(4).load_state_dict(state)
    with pytest.raises(ValueError, match="must be > 0"):
        TicketLayout(schedule).load_state_dict({"sizes": [2, 0]})
    ac = AdmissionController(threshold=1, layout=TicketLayout(schedule))
    ac.on_update(3, time_progress=0.6)
    ac.ticket_limit(0)
    restored = AdmissionController(threshold=1, layout=TicketLayout(schedule))
    restored.load_state_dict(ac.state_dict())
    assert restored.learner_updates == 3 and [restored.update_tickets(u) for u in range(4)] == \
        [ac.update_tickets(u) for u in range(4)]


@pytest.mark.parametrize("bad", [{"groups": 0}, {"groups": 4, "share": 1.0}, {"groups": 4, "share_final": -0.1}])
def test_a_schedule_refuses_bad_values(bad):
    with pytest.raises(ValueError, match="must be"):
        GroupSchedule(**bad)


@settings(max_examples=60, deadline=None)
@given(threshold=st.integers(0, 3), sync_step=st.integers(1, 3), total=st.integers(1, 12),
       share=st.sampled_from([0.25, 0.5, 0.75]), final=st.sampled_from([0.0, 0.1, 0.9]),
       ops=st.lists(st.tuples(st.integers(0, 8), st.integers(1, 5), st.booleans(), st.floats(0, 1)),
                    min_size=1, max_size=60))
def test_every_admitted_ticket_keeps_the_bound_when_updates_differ_in_size(threshold, sync_step, total, share, final,
                                                                           ops):
    """Rule (1) with C(u) in place of u*B: whatever versions workers hold, whatever leases come back and however
    the time progress moves, lag <= threshold for every lease, and the limit is tight."""
    layout = TicketLayout(GroupSchedule(groups=4, share=share, share_final=final, total_steps=total))
    ac = AdmissionController(threshold=threshold, layout=layout, updates_per_version=sync_step)
    d = PromptDispatcher([f"p{i}" for i in range(9)], n=2, admission=ac)
    for version, num, release, time_progress in ops:
        ac.on_update(0, time_progress=time_progress)
        leases = d.lease(num, global_step=None, worker_version=version)
        for lease in leases:
            assert ac.trained_version(lease.ticket) - version <= threshold
            assert lease.global_step == layout.update_of(lease.ticket) + 1  # seeded by the update that trains it
        limit = ac.ticket_limit(version)
        assert ac.trained_version(limit) - version == threshold + 1  # the first ticket refused would be too stale
        if release:
            d.release([x.lease_id for x in leases])
        else:
            d.complete([x.lease_id for x in leases])
    assert d.tickets_done() <= d.tickets_issued()


def test_a_taper_that_ends_early_holds_the_final_share_after_it():
    whole = GroupSchedule(groups=4, share=0.5, share_final=0.0, total_steps=8)
    early = GroupSchedule(groups=4, share=0.5, share_final=0.0, total_steps=8, taper_end=0.25)
    assert [early.share_at(p) for p in (0.0, 0.125, 0.25, 0.6, 1.0)] == [0.5, 0.25, 0.0, 0.0, 0.0]
    assert [whole.at(u) for u in range(8)] == [2, 2, 3, 3, 3, 3, 4, 4]
    assert [early.at(u) for u in range(8)] == [2, 3, 4, 4, 4, 4, 4, 4]
    assert TicketLayout(early).start(8) == sum(early.at(u) for u in range(8))
    # the mean over the run: half-way groups for the taper's quarter, whole batches for the rest
    assert early.mean_groups() == pytest.approx(0.25 * 3 + 0.75 * 4)
    with pytest.raises(ValueError, match="offline_mix_taper_end"):
        GroupSchedule(groups=4, share=0.5, share_final=0.0, taper_end=0.0)
