"""Data parallelism for the pretraining script (one process per core, gloo), and the
gradient averaging and port lookup the learner group shares with it.

On a 2-core machine one training process with 2 intra-op threads is a poor
fit for this model's small matrices: a batch-32 step of the shapes model took
251 ms with 2 threads, while two single-thread processes with 16 samples each
took ~180 ms side by side (``docs/shapes_model.md``). :func:`launch` starts
``world`` processes; each draws its own share of every batch, gradients are
averaged with one ``all_reduce`` per step, and control decisions (how many
steps fit the budget, when to stop) are taken by rank 0 and shared, so every
rank runs the same number of steps.

:class:`Group` is the handle the training code uses; :data:`SINGLE` is the
one-process group whose collectives are no-ops, so the same code runs with
and without workers.
"""

from __future__ import annotations

import os
import socket
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

__all__ = ["Group", "SINGLE", "launch", "free_port"]


class Group:
    """Rank, world size and the few collectives the pretraining loop needs."""

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank, self.world = int(rank), int(world)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def average_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Replace every gradient by its mean over ranks (one flat ``all_reduce``)."""
        if not self.active:
            return
        params = [p for p in params if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n

    def share(self, values: Sequence[float]) -> list[float]:
        """Rank 0's ``values`` on every rank (float64, so step counts stay exact)."""
        if not self.active:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        dist.broadcast(t, src=0)
        return t.tolist()

    def parameters_agree(self, modules: Iterable[torch.nn.Module]) -> bool:
        """True when every rank holds bit-identical parameters (checked via a checksum on all ranks)."""
        if not self.active:
            return True
        flat = torch.cat([p.detach().reshape(-1).double() for m in modules for p in m.parameters()])
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64).remainder_(9973).add_(1)
        mine = torch.stack([flat.sum(), (flat * weights).sum()])
        lo, hi = mine.clone(), mine.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        return bool(torch.equal(lo, hi))


#: The one-process group: collectives do nothing.
SINGLE = Group()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, fn: Callable, world: int, port: int, threads: int, args: tuple) -> None:
    torch.set_num_threads(int(threads))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(Group(rank, world), *args)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable, world: int, *, threads: int = 1, args: tuple = ()) -> None:
    """Run ``fn(group, *args)`` in ``world`` processes joined by gloo; returns when all finish.

    An exception in any process is raised here (``torch.multiprocessing.spawn``).
    ``world == 1`` runs ``fn(SINGLE, *args)`` in this process.
    """
    if world < 1:
        raise ValueError(f"`processes` must be >= 1, got {world}")
    if world == 1:
        torch.set_num_threads(int(threads))
        fn(SINGLE, *args)
        return
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    torch.multiprocessing.spawn(_entry, args=(fn, world, free_port(), threads, args), nprocs=world, join=True)
