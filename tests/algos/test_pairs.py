"""Online preference pairs and pair-preserving batching."""

from __future__ import annotations

import random

import pytest
import torch

from omnirl_async.algos import (
    OnlinePairs,
    interleave,
    pair_chunks,
    pair_minibatches,
    pair_rows,
    rank_pair_rows,
    select_online_pairs,
)


def test_best_and_worst_per_group():
    adv = torch.tensor([0.1, 0.9, -0.5, 0.3,    2.0, 2.0, -1.0, -1.0,    0.0, 0.0,    4.0,    -0.2, 0.2])
    gid = ["a", "a", "a", "a", "b", "b", "b", "b", "c", "c", "d", "e", "e"]
    out = select_online_pairs(adv, gid)
    assert isinstance(out, OnlinePairs)
    # a: best 1, worst 2; b: ties -> first index (4, 6); c: all equal -> tie; d: single -> tie; e: 12 / 11
    assert out.winners.tolist() == [1, 4, 12]
    assert out.losers.tolist() == [2, 6, 11]
    assert out.winners.dtype == torch.long and out.losers.dtype == torch.long
    assert out.num_tie_groups == 2 and out.num_groups == 5


def test_groups_in_order_of_first_appearance_even_when_interleaved():
    adv = torch.tensor([1.0, 5.0, 2.0, -5.0, 3.0, 0.0])
    gid = ["y", "x", "y", "x", "y", "x"]
    out = select_online_pairs(adv, gid)
    assert out.winners.tolist() == [4, 1] and out.losers.tolist() == [0, 3]
    assert out.num_tie_groups == 0 and out.num_groups == 2


def test_against_brute_force_random():
    rng = random.Random(0)
    for _ in range(50):
        n_groups = rng.randint(1, 6)
        gid, vals = [], []
        for g in range(n_groups):
            for _ in range(rng.randint(1, 5)):
                gid.append(f"g{g}")
                vals.append(float(rng.choice([-1, 0, 1, 2])))
        order = list(range(len(gid)))
        rng.shuffle(order)
        gid = [gid[i] for i in order]
        vals = [vals[i] for i in order]
        out = select_online_pairs(torch.tensor(vals, dtype=torch.float64), gid)
        seen, exp_w, exp_l, ties = [], [], [], 0
        for g in gid:
            if g not in seen:
                seen.append(g)
        for g in seen:
            rows = [i for i, x in enumerate(gid) if x == g]
            hi = max(vals[i] for i in rows)
            lo = min(vals[i] for i in rows)
            if len(rows) < 2 or hi == lo:
                ties += 1
                continue
            exp_w.append(next(i for i in rows if vals[i] == hi))
            exp_l.append(next(i for i in rows if vals[i] == lo))
        assert out.winners.tolist() == exp_w and out.losers.tolist() == exp_l
        assert out.num_tie_groups == ties and out.num_groups == len(seen)


def test_empty_and_length_mismatch():
    out = select_online_pairs(torch.tensor([1.0]), ["a"])
    assert out.winners.numel() == 0 and out.losers.numel() == 0 and out.num_tie_groups == 1
    assert interleave(out.winners, out.losers).numel() == 0
    with pytest.raises(ValueError, match="group ids"):
        select_online_pairs(torch.zeros(3), ["a", "b"])


def test_interleave():
    rows = interleave(torch.tensor([5, 1, 7]), torch.tensor([0, 2, 3]))
    assert rows.tolist() == [5, 0, 1, 2, 7, 3] and rows.dtype == torch.long
    with pytest.raises(ValueError):
        interleave(torch.tensor([1, 2]), torch.tensor([3]))


def test_pair_rows_and_chunks():
    assert pair_rows(torch.tensor([2, 0, 1])).tolist() == [4, 5, 0, 1, 2, 3]
    assert pair_chunks(5, 2) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert pair_chunks(4, 4) == [slice(0, 8)]
    assert pair_chunks(0, 3) == []
    with pytest.raises(ValueError):
        pair_chunks(3, 0)
    assert rank_pair_rows(torch.arange(10), 2, 1).tolist() == [4, 5, 6, 7]  # 5 pairs, 2 each, last dropped
    with pytest.raises(ValueError):
        rank_pair_rows(torch.arange(5), 1, 0)
    with pytest.raises(ValueError):
        rank_pair_rows(torch.arange(4), 2, 2)


def _whole_pairs(rows: list[int]) -> list[int]:
    """Pair ids of an interleaved row list, asserting every pair is whole and winner-first."""
    assert len(rows) % 2 == 0
    pairs = []
    for j in range(0, len(rows), 2):
        w, l = rows[j], rows[j + 1]
        assert w % 2 == 0 and l == w + 1, rows
        pairs.append(w // 2)
    return pairs


def test_property_chunks_never_split_a_pair():
    rng = random.Random(1)
    for _ in range(300):
        num_pairs = rng.randint(0, 40)
        chunk = rng.randint(1, 12)
        perm = torch.randperm(num_pairs, generator=torch.Generator().manual_seed(rng.randint(0, 10**6)))
        rows = pair_rows(perm)
        seen = []
        for sl in pair_chunks(num_pairs, chunk):
            assert sl.start % 2 == 0 and sl.stop % 2 == 0 and sl.stop - sl.start <= 2 * chunk
            seen += _whole_pairs(rows[sl].tolist())
        assert sorted(seen) == list(range(num_pairs))  # every pair whole in exactly one chunk
        assert seen == perm.tolist()


def test_property_minibatches_over_ranks():
    rng = random.Random(2)
    for _ in range(300):
        num_pairs = rng.randint(0, 40)
        mini = rng.randint(1, 12)
        world = rng.randint(1, 4)
        micro = rng.choice([None, 1, 2, 3])
        perm = torch.randperm(num_pairs, generator=torch.Generator().manual_seed(rng.randint(0, 10**6)))
        per_rank = [pair_minibatches(perm, mini, world, r, micro) for r in range(world)]
        # every rank does the same number of mini-batches with the same number of pairs
        assert len({len(m) for m in per_rank}) == 1
        seen = []
        for r in range(world):
            for mb in per_rank[r]:
                for micro_rows in mb:
                    ids = _whole_pairs(micro_rows.tolist())
                    if micro is not None:
                        assert len(ids) <= micro
                    seen += ids
        assert len(seen) == len(set(seen))  # a pair lands (whole) at most once
        # exactly the pairs that divide evenly among the ranks of each mini-batch are trained
        expect = []
        for s in range(0, num_pairs, mini):
            n = min(mini, num_pairs - s)
            expect += perm[s:s + (n // world) * world].tolist()
        assert sorted(seen) == sorted(expect)
        if all(min(mini, num_pairs - s) % world == 0 for s in range(0, num_pairs, mini)):
            assert sorted(seen) == list(range(num_pairs))  # then every pair lands in exactly one chunk


def test_end_to_end_pairs_feed_the_dpo_layout():
    adv = torch.tensor([0.5, -1.0, 2.0, 0.0, 3.0, -2.0])
    gid = ["a", "a", "a", "b", "b", "b"]
    pairs = select_online_pairs(adv, gid)
    rows = interleave(pairs.winners, pairs.losers)
    assert rows.tolist() == [2, 1, 4, 5]
    batch = adv[rows]
    assert (batch[0::2] > batch[1::2]).all()
    [[micro]] = pair_minibatches(torch.tensor([1, 0]), mini_pairs=2)
    assert rows[micro].tolist() == [4, 5, 2, 1]
