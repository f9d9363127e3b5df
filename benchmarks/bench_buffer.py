"""Transfer-queue throughput against raw ``ray.put``/``ray.get`` and ``ray.util.queue.Queue``.

    .venv/bin/python benchmarks/bench_buffer.py [--quick]

Part 1 – put+get throughput. For 4 KB, 1 MB and 16 MB samples and 1, 2, 4
producer actors with one consumer (the driver), the same samples cross:

* ``raw``    – each producer ``ray.put`` s its payloads and hands the refs over;
               the consumer ``ray.get`` s them (the object store's own speed,
               no queue, no metadata);
* ``queue``  – ``ray.util.queue.Queue``: one ``put``/``get`` per sample, its
               idiomatic use;
* ``buffer`` – this project's RayReplayBuffer: one put per group, one sample
               call per group (``SampleMeta`` + fields, rate and staleness
               checks included); payloads owned by the storage units
               (durable: two copies);
* ``fast``   – the same with ``transfer_queue.producer_owned_payloads=true``
               (one copy; unconsumed data dies with its producer).

Groups: 8 samples at 4 KB, 4 at 1 MB, 1 at 16 MB. Consumers do not touch the
bytes (all three return zero-copy views). Printed: samples/s, MB/s and the
ratios buffer/raw and buffer/queue.

Part 2 – sampling cost with 10^3 and 10^5 stored samples for every sampler
(in-process core; the controller runs the same code).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np
import ray
from ray.util.queue import Queue

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from omnirl_async.buffer import LocalReplayBuffer  # noqa: E402
from omnirl_async.buffer.spec import BufferSpec, CapacitySpec, StalenessSpec, TableSpec, TransportSpec  # noqa: E402
from omnirl_async.buffer.transfer_queue import RayReplayBuffer  # noqa: E402
from omnirl_async.protocol import SampleMeta, SampleStatus, SampleTags  # noqa: E402

SIZES = [("4KB", 4 * 1024, 8, 2048), ("1MB", 1024**2, 4, 256), ("16MB", 16 * 1024**2, 1, 48)]
PRODUCERS = [1, 2, 4]


def metas_for(prefix: str, g: int, n: int) -> list[SampleMeta]:
    gid = f"{prefix}-{g}"
    return [SampleMeta(key=f"{gid}/{i}", status=SampleStatus.SUCCESS, reward=1.0,
                       tags=SampleTags(uid=f"{gid}/{i}", group_uid=gid, sample_index=i, group_size=n,
                                       policy_version=0)) for i in range(n)]


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self, nbytes: int, group: int) -> None:
        self.group = group
        self.payload = {"x": np.ones((group, nbytes // 4), dtype=np.float32)}
        self.sample = {"x": np.ones((nbytes // 4,), dtype=np.float32)}

    def raw(self, n_groups: int) -> list:
        return [[ray.put(self.payload) for _ in range(n_groups)]]  # wrapped: refs, not values

    def queue(self, q, n_groups: int) -> int:
        for _ in range(n_groups * self.group):
            q.put(self.sample, timeout=120)
        return 0

    def buffer(self, buf, prefix: str, n_groups: int) -> int:
        for g in range(n_groups):
            buf.put(metas_for(prefix, g, self.group), self.payload, timeout=120)
        return 0


def run_raw(producers, n_groups_each: int) -> None:
    lists = ray.get([p.raw.remote(n_groups_each) for p in producers])
    for wrapped in lists:
        for ref in wrapped[0]:
            ray.get(ref)


def run_queue(q, producers, n_groups_each: int, group: int) -> None:
    done = [p.queue.remote(q, n_groups_each) for p in producers]
    for _ in range(n_groups_each * group * len(producers)):
        q.get(timeout=120)
    ray.get(done)


def run_buffer(buf, producers, n_groups_each: int, group: int, tag: str) -> None:
    done = [p.buffer.remote(buf, f"{tag}-{i}", n_groups_each) for i, p in enumerate(producers)]
    for _ in range(n_groups_each * len(producers)):
        buf.sample(group, learner_version=0, timeout=120)
    ray.get(done)


def throughput(quick: bool) -> None:
    print(f"{'size':>5} {'prod':>4} | {'raw smp/s':>10} {'MB/s':>7} | {'queue smp/s':>11} {'MB/s':>7} | "
          f"{'buffer smp/s':>12} {'MB/s':>7} | {'fast smp/s':>10} {'MB/s':>7} | {'buf/raw':>7} "
          f"{'buf/queue':>9} {'fast/raw':>8} {'fast/queue':>10}")
    # actors are started outside the timed regions: starting one costs seconds on a loaded 2-core box
    spec = BufferSpec(table=TableSpec(sampler="fifo", max_size=1 << 20), staleness=StalenessSpec(threshold=None),
                      capacity=CapacitySpec(memory_budget_bytes=256 * 1024**2),
                      transport=TransportSpec(num_data_storage_units=2))
    buf = RayReplayBuffer.create(spec)
    fast = RayReplayBuffer.create(dataclasses.replace(
        spec, transport=TransportSpec(num_data_storage_units=2, producer_owned_payloads=True)))
    q = Queue(maxsize=64)
    for label, nbytes, group, total in SIZES:
        if quick:
            total //= 4
        for n_prod in PRODUCERS:
            producers = [Producer.remote(nbytes, group) for _ in range(n_prod)]
            ray.get([p.__ray_ready__.remote() for p in producers])
            buf.clear()  # a new schema per sample size
            fast.clear()
            n_groups_each = max(1, total // group // n_prod)
            n = n_groups_each * group * n_prod
            rates = {}
            for name, fn in [("raw", lambda: run_raw(producers, n_groups_each)),
                             ("queue", lambda: run_queue(q, producers, n_groups_each, group)),
                             ("buffer", lambda: run_buffer(buf, producers, n_groups_each, group,
                                                           f"{label}-{n_prod}")),
                             ("fast", lambda: run_buffer(fast, producers, n_groups_each, group,
                                                         f"{label}-{n_prod}"))]:
                t = time.perf_counter()
                fn()
                rates[name] = n / (time.perf_counter() - t)
            mb = nbytes / 1024**2
            print(f"{label:>5} {n_prod:>4} | {rates['raw']:>10.0f} {rates['raw'] * mb:>7.0f} | "
                  f"{rates['queue']:>11.0f} {rates['queue'] * mb:>7.0f} | {rates['buffer']:>12.0f} "
                  f"{rates['buffer'] * mb:>7.0f} | {rates['fast']:>10.0f} {rates['fast'] * mb:>7.0f} | "
                  f"{rates['buffer'] / rates['raw']:>7.2f} {rates['buffer'] / rates['queue']:>9.2f} "
                  f"{rates['fast'] / rates['raw']:>8.2f} {rates['fast'] / rates['queue']:>10.2f}", flush=True)
            for p in producers:
                ray.kill(p)
    buf.close()
    fast.close()


def sampling_cost(quick: bool) -> None:
    print("\nsampling cost (in-process core, batch of 32 = 8 groups of 4), µs per sample() call:")
    print(f"{'sampler':>12} | {'10^3 items':>10} | {'10^5 items':>10} | ratio")
    for sampler in ["fifo", "uniform", "prioritized", "freshness"]:
        cost = {}
        for n_items in (1_000, 100_000):
            b = LocalReplayBuffer(BufferSpec(table=TableSpec(sampler=sampler, max_size=n_items,
                                                             max_times_sampled=1 << 30),
                                             staleness=StalenessSpec(threshold=8),
                                             capacity=CapacitySpec(memory_budget_bytes=1 << 40)), seed=0)
            x = {"x": np.zeros((4, 1), np.float32)}
            for g in range(n_items // 4):
                b.put(metas_for("s", g, 4), x)
            reps = 100 if quick else 300
            b.sample(32, learner_version=3)
            t = time.perf_counter()
            for _ in range(reps):
                b.sample(32, learner_version=3)
            cost[n_items] = (time.perf_counter() - t) / reps * 1e6
        print(f"{sampler:>12} | {cost[1_000]:>10.0f} | {cost[100_000]:>10.0f} | {cost[100_000] / cost[1_000]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a quarter of the samples (smoke run)")
    ap.add_argument("--num-cpus", type=int, default=8)
    args = ap.parse_args()
    t0 = time.time()
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, object_store_memory=1024 * 1024**2,
             log_to_driver=False, configure_logging=False)
    try:
        print(f"ray {ray.__version__}, {os.cpu_count()} CPUs visible\n")
        throughput(args.quick)
    finally:
        ray.shutdown()
    sampling_cost(args.quick)
    print(f"\ntotal {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
