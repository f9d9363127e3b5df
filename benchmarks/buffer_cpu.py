"""Part 4 of ``bench_buffer.py`` (``--parts cpu``): where the CPU goes, per group of 8, by process.

On a 2-core machine a transport's rate is bounded by the CPU all its processes spend per group: at
2 cores busy, wall time per group >= CPU per group / 2. This part runs one cell of the throughput
workload per transport (one producer, groups of 8, 4 KB and 1 MB) and reads every process of this
Ray cluster's CPU time (user + system, ``psutil``) before and after: CPU ms per group for the
consumer (the driver), each actor class (the buffer's ``_Controller`` and ``_StorageUnit``, the
``Producer``, TransferQueue's actors), ``raylet`` + ``gcs_server``, and the rest of Ray's processes.
Then the floor under any actor call: a pipelined empty call's CPU on the caller's side and the callee's.

Read it: the ``sum`` row over the ``wall`` row is how many cores the transport kept busy; a row that
is mostly the empty-call floor times the calls per group cannot be cut by this project's code.
"""

from __future__ import annotations

import collections
import os
import time

import psutil
import ray

ROLES_FIRST = ["consumer (driver)"]
OTHER = "other Ray processes"
SYSTEM = "raylet + gcs_server"


def role(proc: psutil.Process, driver: int) -> str:
    """A process's row: the driver, an actor's class (``ray::Name`` in its title, ``ray::Name.method()`` while
    it runs one), Ray's daemons, or other."""
    if proc.pid == driver:
        return ROLES_FIRST[0]
    cmd = proc.cmdline()
    first = cmd[0] if cmd else proc.name()
    if first.startswith("ray::"):
        name = first.split()[0][len("ray::"):].split(".")[0]
        return OTHER if name in ("IDLE", "") else name
    return SYSTEM if os.path.basename(first) in ("raylet", "gcs_server") else OTHER


def cpu_snapshot() -> dict[int, tuple[str, float]]:
    """pid -> (row, CPU seconds) for the driver and every process under it (a local cluster's all are)."""
    me = psutil.Process()
    out = {}
    for proc in [me] + me.children(recursive=True):
        try:
            with proc.oneshot():
                t = proc.cpu_times()
                out[proc.pid] = (role(proc, me.pid), t.user + t.system)
        except psutil.Error:  # exited meanwhile: its CPU is not counted (none of the measured ones do)
            continue
    return out


def cpu_between(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds per row spent between two snapshots (a process started meanwhile counts from 0)."""
    rows: dict[str, float] = collections.Counter()
    for pid, (name, t) in after.items():
        rows[name] += max(0.0, t - before.get(pid, (name, 0.0))[1])
    return dict(rows)


@ray.remote(num_cpus=0)
class Echo:
    def call(self) -> None:
        return None

    def pid(self) -> int:
        return os.getpid()


def empty_call_floor(n: int, in_flight: int = 8) -> tuple[float, float, float]:
    """(wall, caller CPU, callee CPU) ms per call of ``n`` empty actor calls, ``in_flight`` at a time."""
    actor = Echo.remote()
    callee, me = psutil.Process(ray.get(actor.pid.remote())), psutil.Process()
    ray.get([actor.call.remote() for _ in range(100)])  # warm
    c0, m0, t0 = sum(callee.cpu_times()[:2]), sum(me.cpu_times()[:2]), time.perf_counter()
    pending: collections.deque = collections.deque()
    for _ in range(n):
        pending.append(actor.call.remote())
        if len(pending) >= in_flight:
            ray.get(pending.popleft(), timeout=60)
    ray.get(list(pending), timeout=60)
    wall = time.perf_counter() - t0
    out = (wall, sum(me.cpu_times()[:2]) - m0, sum(callee.cpu_times()[:2]) - c0)
    ray.kill(actor)
    return tuple(1e3 * x / n for x in out)


def cpu_part(bench, transports: list[str], producer, cells: list[tuple[str, int, int]], plan,
             calls: int) -> dict:
    """CPU ms per group by row, per (transport, cell label). ``cells``: (label, bytes per sample, groups).
    ``bench``: a ``bench_buffer.Bench`` whose clients the producer is attached to; ``plan`` its planner."""
    table: dict[tuple[str, str], dict[str, float]] = {}
    for label, nbytes, groups in cells:
        ray.get(producer.prepare.remote(nbytes, 8))
        for c in bench.clients.values():
            c.clear()
        k, rounds = plan(groups * 8, nbytes, 8, 1)
        for t in transports:
            bench.run(t, [producer], k, 1, 8, f"{label} cpu warm-up")
            before, t0 = cpu_snapshot(), time.perf_counter()
            rate = bench.run(t, [producer], k, rounds, 8, f"{label} cpu")
            wall, after = time.perf_counter() - t0, cpu_snapshot()
            n = k * rounds
            row = {name: 1e3 * s / n for name, s in cpu_between(before, after).items()}
            row["wall"], row["samples/s"] = 1e3 * wall / n, rate
            table[(t, label)] = row
    wall, caller, callee = empty_call_floor(calls)
    print_table(table, transports, [c[0] for c in cells], (wall, caller, callee))
    return table


def print_table(table: dict, transports: list[str], labels: list[str], floor: tuple[float, float, float]) -> None:
    cols = [(t, label) for label in labels for t in transports]
    # rows that spent nothing measurable anywhere (Ray's idle agents) are left out
    names = sorted({k for row in table.values() for k, v in row.items() if k not in ("wall", "samples/s")
                    and any(r.get(k, 0.0) >= 0.0005 for r in table.values())},
                   key=lambda k: (k not in ROLES_FIRST, k in (SYSTEM, OTHER), k == OTHER, k))
    print("\nwhere the CPU goes: ms of CPU per group of 8 by process, one producer (each column one cell)")
    print(f"{'':>24} | " + " | ".join(f"{t + ' ' + label:>13}" for t, label in cols))
    for name in names:
        print(f"{name[:24]:>24} | " + " | ".join(f"{table[c].get(name, 0.0):>13.3f}" for c in cols))
    print(f"{'sum':>24} | " + " | ".join(f"{sum(v for k, v in table[c].items() if k in names):>13.3f}"
                                         for c in cols))
    print(f"{'wall ms per group':>24} | " + " | ".join(f"{table[c]['wall']:>13.3f}" for c in cols))
    print(f"{'samples/s':>24} | " + " | ".join(f"{table[c]['samples/s']:>13.0f}" for c in cols))
    wall, caller, callee = floor
    print(f"an empty actor call, 8 in flight: {wall:.3f} ms wall, CPU {caller:.3f} ms in the caller + "
          f"{callee:.3f} ms in the actor – the floor of every call above")
