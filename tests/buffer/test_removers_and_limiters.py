"""Property tests for removers and rate limiters."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnirl_async.buffer.rate_limiters import MinSize, SampleToInsertRatio
from omnirl_async.buffer.removers import FifoRemover, MaxTimesSampled, make_remover


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 30)), max_size=80))
def test_fifo_remover_victim_is_oldest_live(ops):
    r = FifoRemover()
    live: dict[str, int] = {}
    for i, (ins, k) in enumerate(ops):
        if ins:
            gid = f"g{k}"
            order = live.get(gid, i)
            r.insert(gid, order)  # re-insert of a live id keeps its order
            live[gid] = order
        else:
            r.remove(f"g{k}")
            live.pop(f"g{k}", None)
        v = r.victim()
        assert len(r) == len(live)
        if live:
            assert v == min(live, key=live.__getitem__)
        else:
            assert v is None


@given(m=st.integers(1, 10), t=st.integers(0, 30))
def test_max_times_sampled(m, t):
    assert MaxTimesSampled(m).exhausted(t) == (t >= m)


def test_remover_errors():
    with pytest.raises(ValueError, match="`buffer.max_times_sampled`"):
        MaxTimesSampled(0)
    with pytest.raises(ValueError, match="`buffer.remover` = 'lifo'"):
        make_remover("lifo")


@settings(max_examples=60, deadline=None)
@given(min_size=st.integers(0, 20), size=st.integers(0, 40))
def test_min_size(min_size, size):
    lim = MinSize(min_size)
    assert lim.can_insert(5)
    assert lim.can_sample(1, size=size) == (size >= min_size)


@settings(max_examples=150, deadline=None)
@given(spi=st.sampled_from([0.25, 0.5, 1.0, 2.0, 4.0]), min_size=st.integers(0, 16),
       n=st.integers(1, 8), m=st.integers(1, 32), extra=st.one_of(st.none(), st.floats(0, 64)),
       steps=st.lists(st.booleans(), min_size=1, max_size=200))
def test_ratio_window_holds_and_never_deadlocks(spi, min_size, n, m, extra, steps):
    """Producers put n, the learner samples m; only allowed ops run.

    Invariants: an allowed insert keeps diff <= target + window, an allowed sample keeps
    diff >= target - window, and at every step one side can move (given enough stored samples).
    """
    eb = None if extra is None else SampleToInsertRatio(spi, min_size).min_error_buffer(n, m) + extra
    lim = SampleToInsertRatio(spi, min_size, eb)
    lim.observe(insert_size=n, sample_size=m)
    mts = max(1, math.ceil(spi))  # the buffer refuses samples_per_insert > max_times_sampled
    draws = 0  # draws the stored samples can still give
    stock = 0
    for want_insert in steps:
        can_i = lim.can_insert(n)
        can_s = lim.can_sample(m, size=stock) and draws >= m
        assert can_i or can_s, lim.describe()
        if (want_insert and can_i) or not can_s:
            lim.on_insert(n)
            stock += n
            draws += n * mts
            assert lim.diff <= lim.target + lim.window + 1e-9
        else:
            lim.on_sample(m)
            draws -= m
            assert lim.diff >= lim.target - lim.window - 1e-9


def test_ratio_must_deadlock_raises_might_warns(caplog):
    lim = SampleToInsertRatio(1.0, 0, error_buffer=2.0)
    with pytest.raises(ValueError, match=r"`buffer.samples_per_insert_error_buffer` = 2 can deadlock.*>= 24"):
        lim.observe(insert_size=8, sample_size=16)
    lim = SampleToInsertRatio(1.0, 0, error_buffer=30.0)
    with caplog.at_level("WARNING"):
        lim.observe(insert_size=8, sample_size=16)
    assert "tight" in caplog.text
    with pytest.raises(ValueError, match="`buffer.samples_per_insert` = 0"):
        SampleToInsertRatio(0)
    with pytest.raises(ValueError, match="error_buffer"):
        SampleToInsertRatio(1.0, 0, -1.0)


def test_ratio_drop_credits_owed_samples():
    lim = SampleToInsertRatio(2.0, 0, 100.0)
    lim.on_insert(4)
    lim.on_drop(4, times_sampled=1)
    assert lim.diff == pytest.approx(4.0)  # 8 owed, 4 credited for the dropped samples
    s = lim.state_dict()
    lim2 = SampleToInsertRatio(2.0, 0, 100.0)
    lim2.load_state_dict(s)
    assert lim2.diff == lim.diff


def test_error_buffer_floor_lets_min_size_fill_with_whole_puts():
    """spi 0.5, min_size 6, puts of 5: sampling needs 2 puts (diff 5), so the window must reach 5 - 3 = 2."""
    lim = SampleToInsertRatio(0.5, 6)
    assert lim.min_error_buffer(5, 1) == 2.0
    lim = SampleToInsertRatio(0.5, 6, lim.min_error_buffer(5, 1))
    lim.observe(insert_size=5, sample_size=1)
    lim.on_insert(5)
    assert lim.can_insert(5)  # the second put that reaches min_size is allowed
    lim.on_insert(5)
    assert lim.can_sample(1, size=10)
