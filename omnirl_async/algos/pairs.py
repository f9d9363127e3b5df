"""Online preference pairs for Diffusion-DPO, and pair-preserving batching.

:func:`select_online_pairs` makes one pair per group: the winner is the member
with the highest advantage, the loser the one with the lowest (the first such
row on ties). A group with a single member, or whose best and worst advantages
are equal (no preference), is skipped and counted in ``num_tie_groups``.

The DPO loss reads the *interleaved* layout (:func:`interleave`): row ``2i`` is
the winner and row ``2i+1`` the loser of pair ``i``. Batching must never separate
the two rows: shuffle *pairs* (:func:`pair_rows` of a permutation of pair
indices), cut mini-batches and micro-batches at even row offsets
(:func:`pair_chunks`) and give every rank whole pairs (:func:`rank_pair_rows`);
:func:`pair_minibatches` chains the three like the learner's sample batching.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["OnlinePairs", "select_online_pairs", "interleave", "pair_rows", "pair_chunks", "rank_pair_rows",
           "pair_minibatches"]


class OnlinePairs(NamedTuple):
    """Row indices of the winners and losers (``LongTensor [P]``, group order of first appearance)."""

    winners: torch.Tensor
    losers: torch.Tensor
    num_tie_groups: int
    num_groups: int


def select_online_pairs(advantages: torch.Tensor, group_ids: list[str]) -> OnlinePairs:
    """One (best, worst) pair per group with a preference; ties / singletons are skipped and counted."""
    adv = advantages.detach()
    if adv.ndim != 1 or adv.shape[0] != len(group_ids):
        raise ValueError(f"select_online_pairs: advantages shape {tuple(advantages.shape)} does not match "
                         f"{len(group_ids)} group ids; pass one advantage per sample, [B].")
    members: dict[str, list[int]] = {}
    for row, gid in enumerate(group_ids):
        members.setdefault(gid, []).append(row)
    values = adv.cpu().tolist()
    winners: list[int] = []
    losers: list[int] = []
    ties = 0
    for rows in members.values():
        best = worst = rows[0]
        for row in rows[1:]:
            if values[row] > values[best]:
                best = row
            if values[row] < values[worst]:
                worst = row
        if len(rows) < 2 or not values[best] > values[worst]:
            ties += 1
            continue
        winners.append(best)
        losers.append(worst)
    return OnlinePairs(torch.tensor(winners, dtype=torch.long), torch.tensor(losers, dtype=torch.long),
                       ties, len(members))


def interleave(winners: torch.Tensor, losers: torch.Tensor) -> torch.Tensor:
    """``[w0, l0, w1, l1, ...]`` as a ``LongTensor [2P]``."""
    if winners.shape != losers.shape or winners.ndim != 1:
        raise ValueError(f"interleave: winners shape {tuple(winners.shape)} and losers shape "
                         f"{tuple(losers.shape)} must be the same [P].")
    return torch.stack([winners, losers], dim=1).reshape(-1).long()


def pair_rows(pair_order: torch.Tensor) -> torch.Tensor:
    """Row indices of the interleaved batch for pairs in ``pair_order``: ``[2p0, 2p0+1, 2p1, 2p1+1, ...]``."""
    p = pair_order.long().reshape(-1)
    return torch.stack([2 * p, 2 * p + 1], dim=1).reshape(-1)


def pair_chunks(num_pairs: int, chunk_pairs: int) -> list[slice]:
    """Row slices cutting ``2*num_pairs`` interleaved rows into chunks of ``chunk_pairs`` whole pairs.

    Every slice starts and ends at an even row offset; the last chunk holds the remainder.
    """
    if num_pairs < 0:
        raise ValueError(f"pair_chunks: num_pairs = {num_pairs}: must be >= 0.")
    if chunk_pairs < 1:
        raise ValueError(f"pair_chunks: chunk_pairs = {chunk_pairs}: must be >= 1.")
    return [slice(2 * s, 2 * min(s + chunk_pairs, num_pairs)) for s in range(0, num_pairs, chunk_pairs)]


def rank_pair_rows(rows: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """This rank's whole pairs of an interleaved row list (``len(rows)`` even).

    Every rank gets ``(len(rows)//2) // world_size`` pairs, contiguous in ``rows``; the last
    ``(len(rows)//2) % world_size`` pairs are left out so all ranks do equal work (as the sample
    batching drops the rows that do not divide among the ranks).
    """
    if rows.ndim != 1 or rows.shape[0] % 2:
        raise ValueError(f"rank_pair_rows: rows shape {tuple(rows.shape)} must be [2P] (interleaved pairs).")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank_pair_rows: rank {rank} of world_size {world_size} is out of range.")
    per_rank = (rows.shape[0] // 2) // world_size
    return rows[2 * rank * per_rank:2 * (rank + 1) * per_rank]


def pair_minibatches(pair_order: torch.Tensor, mini_pairs: int, world_size: int = 1, rank: int = 0,
                     micro_pairs: int | None = None) -> list[list[torch.Tensor]]:
    """Mini-batches (``mini_pairs`` pairs over all ranks) of this rank's micro-batches of interleaved rows.

    ``pair_order`` is a permutation of pair indices (e.g. ``torch.randperm(P)``); each returned tensor
    holds row indices of the interleaved batch with every pair whole, winner first. A mini-batch
    with fewer pairs than ranks is skipped by every rank alike. ``micro_pairs`` (None = the rank's
    whole share) caps pairs per forward/backward.
    """
    rows = pair_rows(pair_order)
    out: list[list[torch.Tensor]] = []
    for mini in pair_chunks(len(pair_order), mini_pairs):
        mine = rank_pair_rows(rows[mini], world_size, rank)
        if mine.numel() == 0:
            continue
        n = mine.shape[0] // 2
        out.append([mine[sl] for sl in pair_chunks(n, micro_pairs or n)])
    return out
