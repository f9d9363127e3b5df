"""Removers: which groups leave a table, and when (one file per strategy)."""

from __future__ import annotations

from omnirl_async.buffer.removers.base import Remover
from omnirl_async.buffer.removers.fifo import FifoRemover
from omnirl_async.buffer.removers.max_times_sampled import MaxTimesSampled

__all__ = ["Remover", "FifoRemover", "MaxTimesSampled", "REMOVERS", "make_remover"]

REMOVERS: dict[str, type[Remover]] = {"fifo": FifoRemover}


def make_remover(name: str) -> Remover:
    if name not in REMOVERS:
        raise ValueError(f"`buffer.remover` = {name!r}: unknown remover; choose one of {sorted(REMOVERS)}")
    return REMOVERS[name]()
