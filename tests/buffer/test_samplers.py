"""Property tests for every sampler: draws are distinct, complete and honour each strategy's order."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnirl_async.buffer.samplers import (SAMPLERS, FifoSampler, FreshnessSampler, GroupInfo, PrioritizedSampler,
                                          Sampler, SumTree, TicketSampler, UniformSampler, load_custom_sampler,
                                          make_sampler)

ALL = [FifoSampler, UniformSampler, lambda: PrioritizedSampler(0.6), lambda: FreshnessSampler(0.5), TicketSampler]
IDS = ["fifo", "uniform", "prioritized", "freshness", "ticket"]

# ops: (True, priority, version) = insert a new id; (False, k) = remove the k-th live id
ops_st = st.lists(st.one_of(
    st.tuples(st.just(True), st.floats(0, 10), st.integers(0, 5)),
    st.tuples(st.just(False), st.integers(0, 1000))), max_size=60)


def _apply(sampler: Sampler, ops) -> list[str]:
    live: list[str] = []
    for i, op in enumerate(ops):
        if op[0]:
            gid = f"g{i}"
            sampler.insert(gid, GroupInfo(order=i, policy_version=op[2], size=1, priority=op[1]))
            live.append(gid)
        elif live:
            sampler.remove(live.pop(op[1] % len(live)))
    return live


@pytest.mark.parametrize("make", ALL, ids=IDS)
@settings(max_examples=40, deadline=None)
@given(ops=ops_st, seed=st.integers(0, 2**31), take=st.integers(0, 70))
def test_draw_is_distinct_and_exhaustive(make, ops, seed, take):
    s = make()
    live = _apply(s, ops)
    assert len(s) == len(live) and sorted(s.ids()) == sorted(live)
    rng = np.random.default_rng(seed)
    full = list(s.draw(rng, learner_version=5))
    assert sorted(full) == sorted(live)  # every live id exactly once
    gen = s.draw(rng, learner_version=5)
    part = [g for _, g in zip(range(take), gen)]
    gen.close()
    assert len(part) == len(set(part)) == min(take, len(live))
    # closing a partial draw leaves the sampler intact (prioritized restores its leaves)
    assert sorted(s.draw(rng, learner_version=5)) == sorted(live)


@settings(max_examples=40, deadline=None)
@given(ops=ops_st)
def test_fifo_yields_in_insertion_order(ops):
    s = FifoSampler()
    live = _apply(s, ops)
    order = {g: int(g[1:]) for g in live}
    drawn = list(s.draw(np.random.default_rng(0), learner_version=0))
    assert drawn == sorted(live, key=order.__getitem__)


@settings(max_examples=30, deadline=None)
@given(ops=ops_st)
def test_sum_tree_total_matches_leaves(ops):
    s = PrioritizedSampler(1.0)
    live = _apply(s, ops)
    leaves = [s._tree.get(s._slot[g]) for g in live]
    assert s._tree.total == pytest.approx(sum(leaves), rel=1e-9, abs=1e-12)


def test_prioritized_frequencies_follow_priority():
    s = PrioritizedSampler(exponent=1.0, min_priority=0.0)
    for i, p in enumerate([1.0, 2.0, 7.0]):
        s.insert(f"g{i}", GroupInfo(order=i, policy_version=0, size=1, priority=p))
    rng = np.random.default_rng(0)
    counts = {f"g{i}": 0 for i in range(3)}
    for _ in range(4000):
        gen = s.draw(rng, learner_version=0)
        counts[next(gen)] += 1
        gen.close()
    assert counts["g2"] / 4000 == pytest.approx(0.7, abs=0.03)
    assert counts["g0"] / 4000 == pytest.approx(0.1, abs=0.02)
    s.update_priority("g0", 7.0)
    assert s.probability("g0") == pytest.approx(7 / 16)


def test_prioritized_exponent_zero_is_uniform():
    s = PrioritizedSampler(exponent=0.0)
    for i, p in enumerate([0.01, 100.0]):
        s.insert(f"g{i}", GroupInfo(order=i, policy_version=0, size=1, priority=p))
    assert s.probability("g0") == pytest.approx(0.5)


def test_freshness_prefers_recent_versions():
    s = FreshnessSampler(decay=0.25)
    for i in range(200):
        s.insert(f"g{i}", GroupInfo(order=i, policy_version=i % 2 + 4, size=1))  # versions 4 and 5
    rng = np.random.default_rng(1)
    first = []
    for _ in range(2000):
        gen = s.draw(rng, learner_version=5)
        first.append(next(gen))
        gen.close()
    fresh = sum(int(g[1:]) % 2 == 1 for g in first) / len(first)
    assert fresh == pytest.approx(1 / 1.25, abs=0.03)  # weights 1 : 0.25


def test_uniform_first_draw_is_uniform():
    s = UniformSampler()
    for i in range(4):
        s.insert(f"g{i}", GroupInfo(order=i, policy_version=0, size=1))
    rng = np.random.default_rng(2)
    counts = np.zeros(4)
    for _ in range(4000):
        gen = s.draw(rng, learner_version=0)
        counts[int(next(gen)[1:])] += 1
        gen.close()
    assert np.all(np.abs(counts / 4000 - 0.25) < 0.03)


def test_sum_tree_grows():
    t = SumTree(2)
    s = PrioritizedSampler(1.0)
    s._tree = t
    for i in range(50):
        s.insert(f"g{i}", GroupInfo(order=i, policy_version=0, size=1, priority=1.0))
    assert s._tree.total == pytest.approx(50)


def test_bad_parameters_name_the_key():
    with pytest.raises(ValueError, match="`buffer.priority_exponent`"):
        PrioritizedSampler(-1)
    with pytest.raises(ValueError, match="`buffer.freshness_decay`"):
        FreshnessSampler(0)
    with pytest.raises(ValueError, match="`buffer.sampler` = 'lifo'"):
        make_sampler("lifo")
    with pytest.raises(ValueError, match="sampler_kwargs"):
        make_sampler("fifo", kwargs={"nope": 1})


def test_custom_sampler_from_file(tmp_path):
    f = tmp_path / "my_sampler.py"
    f.write_text(textwrap.dedent("""
        from omnirl_async.buffer.samplers import FifoSampler

        class NewestFirst(FifoSampler):
            def __init__(self, tag="x"):
                super().__init__()
                self.tag = tag

            def draw(self, rng, *, learner_version):
                yield from reversed(self.ids())

        class NotASampler:
            pass
    """))
    s = make_sampler("fifo", custom_path=str(f), custom_name="NewestFirst", kwargs={"tag": "y"})
    assert s.tag == "y"
    for i in range(3):
        s.insert(f"g{i}", GroupInfo(order=i, policy_version=0, size=1))
    assert list(s.draw(np.random.default_rng(0), learner_version=0)) == ["g2", "g1", "g0"]
    with pytest.raises(ValueError, match="missing.py.*does not exist"):
        load_custom_sampler(str(tmp_path / "missing.py"), "X")
    with pytest.raises(ValueError, match=r"defines no such class .*NewestFirst"):
        load_custom_sampler(str(f), "Missing")
    with pytest.raises(ValueError, match="must subclass"):
        load_custom_sampler(str(f), "NotASampler")
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match="raised while being executed: RuntimeError: boom"):
        load_custom_sampler(str(bad), "X")


def test_registry_complete():
    assert set(SAMPLERS) == {"fifo", "uniform", "prioritized", "freshness", "ticket"}


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 30), st.booleans()), min_size=1, max_size=40, unique_by=lambda x: x[0]))
def test_ticket_sampler_yields_lowest_ticket_first(entries):
    s = TicketSampler()
    live = {}
    for order, (ticket, keep) in enumerate(entries):
        s.insert(f"g{order}", GroupInfo(order=order, policy_version=0, size=1, ticket=ticket))
        live[f"g{order}"] = (ticket if ticket >= 0 else float("inf"), order)
        if not keep:
            s.remove(f"g{order}")
            del live[f"g{order}"]
    drawn = list(s.draw(np.random.default_rng(0), learner_version=0))
    assert drawn == sorted(live, key=live.get)  # by ticket; untickted groups last, by readiness
