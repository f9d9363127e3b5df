"""Replay-buffer transfer throughput beside plain Ray and TransferQueue (issue 18), and sampling cost.

    .venv/bin/python benchmarks/bench_buffer.py [--quick] [--sizes 4KB,1MB] [--producers 1,4] [--per-put 8]
                                                [--repeats 5]

Part 1 – put+get throughput, one run, the workload of issue 18. P producer
actors (1, 2, 4) and one consumer (the driver); samples of 4 KB, 1 MB and
16 MB; a producer puts one sample per put or a group of 8 per put; the
consumer reads batches of 8 samples. Every sample carries an id and the
consumer checks that each was received exactly once (column ``once``; a
miss or a duplicate prints the ids and makes the script exit 1). The same
samples cross four transports:

* ``raw``     – the object store's own speed: the producer ``ray.put`` s each put
                (one sample, or the group of 8 as one dict of numpy arrays) and
                hands the ``ObjectRef`` s to the consumer, a batch's worth per actor
                call (all calls queued up front), who ``ray.get`` s them. No metadata, no queue logic;
* ``tq``      – TransferQueue 0.1.11 (``pip install -e .[transferqueue]``), the
                way its tutorial streams: ``tq.init`` with ``polling_mode`` (its own
                controller and 2 SimpleStorage units, talking over ZMQ), producers
                ``client.put(TensorDict, partition_id)``, the consumer
                ``get_meta(task_name=...)`` + ``get_data`` (retried after 5 ms when
                empty) and ``clear_partition`` at the end of each round. Skipped
                with a message when the package is missing;
* ``buffer``  – this project's RayReplayBuffer, defaults: producer-owned payloads
                (one ``ray.put`` per put, its controller registration sent in the
                background and batched with others queued meanwhile; under 64 KB the
                bytes ride inside the controller call), one ``sample`` per batch,
                two requests in flight (``sample_async``); each producer keeps one
                client for the whole run, as a rollout worker (and TQ's producers) do;
* ``durable`` – the same with ``producer_owned_payloads=false``: a storage-unit
                actor copies each put into an object it owns (survives its producer).

Read it: samples/s per transport (higher is better) and the ratios buffer/raw,
buffer/tq, durable/raw. ``raw`` is the ceiling (the buffer adds metadata,
sampling, staleness and rate checks on top of the same object store). Each
cell is measured ``--repeats`` times (5); a repetition runs every transport
once, in an order rotated from one repetition to the next, and a ratio is
taken *within* a repetition, where the two transports ran back to back: the
table gives the median samples/s and, per ratio, the median [min-max] over
the repetitions. Below the table, issue 18's goals with the worst median
ratio over the producer counts and met / not met. Samples flow in rounds
(each producer makes k puts, the consumer drains them concurrently) so that
at most ~256 MB (at least one put per producer, 512 MB for 4 x 128 MB) is in
flight: the object store is 2 GB (in a 1 GB store the 512 MB of the 16 MB x 8
x 4-producer cell spilled to disk and every transport ran at the disk's
speed). Column ``cell``: repetitions x rounds x samples per round. Rates
are samples over the summed round times; actors start, and each transport
is warmed up, outside the timed regions. One repetition of a cell lasts
well under a second at 4 KB and 1 MB, and a loaded 2-core machine's speed
drifts 2x within minutes: single repetitions swing by ±50 %, which is what
the repetitions are for.

Part 2 – where a group of 8 goes (``costs``): each call of both paths alone,
one at a time on an otherwise idle cluster, median ms, for a 4 KB group (its
bytes ride inside the controller calls) and a 1 MB group (an ``ObjectRef``):
the producer's ``ray.put`` / buffer ``put`` / ``flush``, the consumer's call
and ``ray.get`` on each path, and an empty controller call as the floor.

Part 3 – sampling cost with 10^3 and 10^5 stored samples for every sampler
(in-process core; the controller runs the same code).

Part 4 – where the CPU goes (``cpu``, not in the default parts): CPU ms per group of 8 by process for
raw, tq and buffer, one producer, 4 KB and 1 MB, and an empty actor call's CPU on either side
(``buffer_cpu.py``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import os
import sys
import time

import numpy as np
import ray

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from omnirl_async.buffer import LocalReplayBuffer  # noqa: E402
from omnirl_async.buffer.base import assemble_fields  # noqa: E402
from omnirl_async.buffer.spec import BufferSpec, CapacitySpec, StalenessSpec, TableSpec, TransportSpec  # noqa: E402
from omnirl_async.buffer.rpc import request  # noqa: E402
from omnirl_async.buffer.transfer_queue import RayReplayBuffer  # noqa: E402
from omnirl_async.protocol import SampleMeta, SampleStatus, SampleTags  # noqa: E402

#: label, bytes per sample, samples per cell (full run)
SIZES = [("4KB", 4 * 1024, 1024), ("1MB", 1024**2, 512), ("16MB", 16 * 1024**2, 256)]  # 64 at 16 MB: ±0.3x noise
QUICK_SAMPLES = {"4KB": 128, "1MB": 32, "16MB": 16}
PRODUCERS = [1, 2, 4]
PER_PUT = [1, 8]
BATCH = 8  # samples per consumer read
ROUND_BYTES = 256 * 1024**2  # in flight per round (at least one put per producer)
TQ_POLL_S = 0.005
SAMPLES_IN_FLIGHT = 2  # the buffer's consumer keeps this many sample requests in flight (sample_async)
TQ_INSTALL = "pip install -e .[transferqueue]  (or .venv/bin/pip install transferqueue==0.1.11)"
TRANSPORTS = ["raw", "tq", "buffer", "durable"]
TQ_CPUS = 3  # TransferQueue 0.1.11's controller and each of its 2 storage units are num_cpus=1 actors
PARTS = ["throughput", "costs", "sampling", "cpu"]


def metas_for(prefix: str, g: int, n: int) -> list[SampleMeta]:
    gid = f"{prefix}-{g}"
    return [SampleMeta(key=f"{gid}/{i}", status=SampleStatus.SUCCESS, reward=1.0,
                       tags=SampleTags(uid=f"{gid}/{i}", group_uid=gid, sample_index=i, group_size=n,
                                       policy_version=0)) for i in range(n)]


@ray.remote(num_cpus=0)
class Producer:
    """Makes the payloads once per (size, per_put); each put carries fresh sample ids."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.x: np.ndarray | None = None
        self.tq = None
        self.buffers: dict[str, object] = {}

    def attach(self, name: str, buf) -> None:
        """Keep a client of ``buf`` for the rounds, as a rollout worker keeps its own (and TQ's producers theirs):
        a client passed with every call would be unpickled afresh each time (actor handles, a new sender thread)."""
        self.buffers[name] = buf

    def prepare(self, nbytes: int, per_put: int) -> None:
        self.x = np.ones((per_put, nbytes // 4), dtype=np.float32)

    def tq_attach(self) -> None:
        import transfer_queue as tq
        tq.init()  # a controller exists: attaches a client to it
        self.tq = tq.get_client()

    def _ids(self, base: int, k: int) -> np.ndarray:
        n = self.x.shape[0]
        return np.arange(base + k * n, base + (k + 1) * n, dtype=np.int64).reshape(n, 1)

    def raw(self, n_puts: int, base: int, first: int) -> list:
        """Puts ``first`` .. ``first + n_puts - 1``; returns their refs, wrapped (refs, not values)."""
        return [[ray.put({"x": self.x, "id": self._ids(base, k)}) for k in range(first, first + n_puts)]]

    def tq_put(self, partition: str, n_puts: int, base: int) -> int:
        import torch
        from tensordict import TensorDict
        x = torch.from_numpy(self.x)
        for k in range(n_puts):
            self.tq.put(TensorDict({"x": x, "id": torch.from_numpy(self._ids(base, k))},
                                   batch_size=(self.x.shape[0],)), partition_id=partition)
        return n_puts

    def hold(self, n: int) -> None:
        """Part 2: ``n`` groups put ahead, for :meth:`hand` to hand over one at a time."""
        self.held = [ray.put({"x": self.x, "id": self._ids(k * self.x.shape[0], 0)}) for k in range(n)]

    def hand(self) -> list:
        """Part 2: the raw path's handover alone – one call returning one ref put earlier (wrapped)."""
        return [[self.held.pop()]]

    def put_costs(self, buf, prefix: str, n: int) -> dict[str, list[float]]:
        """Part 2, one group at a time: a plain ``ray.put`` of it, the buffer's ``put`` (returns once the
        registration is queued), then ``flush`` (the controller's registration call). Seconds per call."""
        out: dict[str, list[float]] = {"ray.put": [], "buffer.put": [], "flush": []}
        for k in range(n):
            payload = {"x": self.x, "id": self._ids(k * self.x.shape[0], 0)}
            t = time.perf_counter()
            ref = ray.put(payload)
            out["ray.put"].append(time.perf_counter() - t)
            del ref
            t = time.perf_counter()
            buf.put(metas_for(prefix, k, self.x.shape[0]), payload, timeout=120, producer=f"p{self.index}")
            out["buffer.put"].append(time.perf_counter() - t)
            t = time.perf_counter()
            buf.flush(timeout=120)
            out["flush"].append(time.perf_counter() - t)
        return out

    def buffer(self, name: str, prefix: str, n_puts: int, base: int) -> int:
        buf = self.buffers[name]
        for k in range(n_puts):
            buf.put(metas_for(prefix, base + k, self.x.shape[0]), {"x": self.x, "id": self._ids(base, k)},
                    timeout=120, producer=f"p{self.index}")
        buf.flush(timeout=120)
        return n_puts


# ---------------------------------------------------------------- one round per transport: returns the ids read
def round_raw(producers, n_puts: int, bases: list[int], per_put: int) -> list[np.ndarray]:
    # refs are handed over one consumer batch at a time; all calls are queued up front, so each producer
    # keeps putting while the consumer reads (a streaming generator yielding refs trips Ray 2.60's ref counting)
    c = max(1, BATCH // per_put)
    calls = [[p.raw.remote(min(c, n_puts - j), b, j) for j in range(0, n_puts, c)] for p, b in zip(producers, bases)]
    got, pending = [], []
    for j in range(len(calls[0])):
        for per_producer in calls:
            pending.extend(ray.get(per_producer[j])[0])
            if len(pending) * per_put >= BATCH:
                got.extend(d["id"] for d in ray.get(pending))
                pending = []
    if pending:
        got.extend(d["id"] for d in ray.get(pending))
    return got


def round_tq(client, producers, n_puts: int, bases: list[int], per_put: int, partition: str) -> list[np.ndarray]:
    done = [p.tq_put.remote(partition, n_puts, b) for p, b in zip(producers, bases)]
    total, got, n = n_puts * per_put * len(producers), [], 0
    while n < total:
        meta = client.get_meta(data_fields=["x", "id"], batch_size=min(BATCH, total - n), partition_id=partition,
                               task_name="bench")
        if meta.size == 0:
            time.sleep(TQ_POLL_S)
            continue
        ids = client.get_data(meta)["id"]  # a nested (jagged) tensor when rows come from several puts
        got.extend(t.numpy() for t in ids.unbind())
        n += meta.size
    ray.get(done)
    client.clear_partition(partition_id=partition)
    return got


def round_buffer(buf, name: str, producers, n_puts: int, bases: list[int], per_put: int,
                 prefix: str) -> list[np.ndarray]:
    done = [p.buffer.remote(name, f"{prefix}-p{i}", n_puts, b) for i, (p, b) in enumerate(zip(producers, bases))]
    total, got, asked = n_puts * per_put * len(producers), [], 0
    requests: collections.deque = collections.deque()
    while asked < total or requests:
        while len(requests) < SAMPLES_IN_FLIGHT and asked < total:  # batches are whole groups: exact sizes
            requests.append(buf.sample_async(min(BATCH, total - asked), learner_version=0, timeout=120))
            asked += min(BATCH, total - asked)
        got.append(np.asarray(requests.popleft().result().fields["id"]))
    ray.get(done)
    return got


def check_once(got: list[np.ndarray], expected: np.ndarray, where: str) -> str | None:
    """None when every expected id came exactly once; else what went wrong."""
    ids = np.concatenate([np.asarray(g).reshape(-1) for g in got]) if got else np.zeros(0, np.int64)
    uniq, counts = np.unique(ids, return_counts=True)
    missing = np.setdiff1d(expected, uniq)
    extra = np.setdiff1d(uniq, expected)
    dup = uniq[counts > 1]
    if len(ids) == len(expected) and not len(missing) and not len(extra) and not len(dup):
        return None
    return (f"{where}: received {len(ids)} samples, expected {len(expected)}; missing {missing[:5].tolist()} "
            f"({len(missing)}), duplicated {dup[:5].tolist()} ({len(dup)}), unknown {extra[:5].tolist()}")


class Bench:
    def __init__(self, tq_client, clients: dict, producers: list) -> None:
        """``clients``: the buffer per transport name ("buffer", "durable"), attached to every producer."""
        self.tq_client, self.clients, self.producers = tq_client, clients, producers
        self.next_base = 0  # sample ids never repeat within the run
        self.failures: list[str] = []
        self.rounds = 0

    def run(self, transport: str, producers, n_puts: int, rounds: int, per_put: int, where: str) -> float:
        """``rounds`` rounds of ``n_puts`` puts per producer; returns samples/s (NaN if not exactly once)."""
        elapsed, ok = 0.0, True
        for _ in range(rounds):
            bases = []
            for _p in producers:
                bases.append(self.next_base)
                self.next_base += n_puts * per_put
            expected = np.concatenate([np.arange(b, b + n_puts * per_put) for b in bases])
            self.rounds += 1
            t = time.perf_counter()
            if transport == "raw":
                got = round_raw(producers, n_puts, bases, per_put)
            elif transport == "tq":
                got = round_tq(self.tq_client, producers, n_puts, bases, per_put, f"r{self.rounds}")
            else:
                got = round_buffer(self.clients[transport], transport, producers, n_puts, bases, per_put,
                                   f"r{self.rounds}")
            elapsed += time.perf_counter() - t
            err = check_once(got, expected, f"{transport} {where}")
            if err:
                print(f"EXACT-ONCE FAILED: {err}", file=sys.stderr, flush=True)
                self.failures.append(err)
                ok = False
        return rounds * n_puts * per_put * len(producers) / elapsed if ok else float("nan")


def plan(total: int, nbytes: int, per_put: int, n_prod: int) -> tuple[int, int]:
    """(puts per producer per round, rounds): ~``total`` samples, rounds within ROUND_BYTES, batches whole."""
    put_bytes = nbytes * per_put
    puts_each = max(1, total // (per_put * n_prod))
    k = min(puts_each, max(1, ROUND_BYTES // (put_bytes * n_prod)))
    step = BATCH // math.gcd(BATCH, per_put * n_prod)  # samples per round: a multiple of the batch
    k = max(step, k // step * step)
    return k, max(1, round(puts_each / k))


def fmt(x: float, w: int, d: int = 0) -> str:
    return f"{'-':>{w}}" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:>{w}.{d}f}"


RATIOS = {"buffer/raw": ("buffer", "raw"), "buffer/tq": ("buffer", "tq"), "durable/raw": ("durable", "raw")}


def summarise(reps: list[dict[str, float]]) -> dict:
    """One cell from its repetitions: the median samples/s per transport and, per ratio, the
    (median, min, max) over the repetitions of the ratio *within* a repetition – the two transports
    ran back to back there, so a machine that speeds up or slows down between repetitions (these
    2-core boxes drift by 2x within minutes) moves both. A repetition that failed exactly-once
    (NaN) makes the cell's figures NaN; a transport that did not run (no TransferQueue) is NaN."""
    out: dict = {}
    for t in TRANSPORTS:
        xs = [rep.get(t, float("nan")) for rep in reps]
        out[t] = float("nan") if not xs or any(math.isnan(x) for x in xs) else float(np.median(xs))
    for name, (num, den) in RATIOS.items():
        xs = [rep.get(num, float("nan")) / rep.get(den, float("nan")) for rep in reps]
        nan = not xs or any(math.isnan(x) for x in xs)
        out[name] = (float("nan"),) * 3 if nan else (float(np.median(xs)), min(xs), max(xs))
    return out


def fmt_ratio(r: tuple[float, float, float]) -> str:
    """``median [min-max]`` of a ratio over the repetitions."""
    med, lo, hi = r
    return f"{'-':>16}" if math.isnan(med) else f"{med:>5.2f} [{lo:.2f}-{hi:.2f}]"


def start_tq(producers) -> tuple:
    """(the ``transfer_queue`` module, a consumer client) with every producer attached; (None, None), said
    with the install command, when TransferQueue is not installed."""
    try:
        import logging

        os.environ.setdefault("TQ_NUM_THREADS", str(min(8, os.cpu_count() or 1)))  # TQ's own clamp, silenced

        import transfer_queue as tq
        from omegaconf import OmegaConf
    except ImportError as exc:
        print(f"tq skipped: TransferQueue is not installed ({exc}); install it with: {TQ_INSTALL}")
        return None, None
    cpus = ray.cluster_resources().get("CPU", 0)
    if cpus < TQ_CPUS:  # its actors would wait for resources forever
        print(f"tq skipped: TransferQueue's controller and 2 storage units ask Ray for {TQ_CPUS} CPUs and this "
              f"cluster has {cpus:g} (--num-cpus {TQ_CPUS} or more to include it)")
        return None, None
    logging.getLogger("transfer_queue").setLevel(logging.WARNING)
    tq.init(OmegaConf.create({"controller": {"polling_mode": True},
                              "backend": {"SimpleStorage": {"num_data_storage_units": 2}}}))
    client = tq.get_client()
    ray.get([p.tq_attach.remote() for p in producers])
    print(f"TransferQueue {tq.__version__}: controller + 2 SimpleStorage units, polling consumer")
    return tq, client


def throughput(args) -> list[str]:
    sizes = [s for s in SIZES if s[0] in args.sizes]
    n_max = max(args.producers)
    t_start = time.time()
    spec = BufferSpec(table=TableSpec(sampler="fifo", max_size=1 << 20), staleness=StalenessSpec(threshold=None),
                      capacity=CapacitySpec(memory_budget_bytes=768 * 1024**2))
    # actors are started outside the timed regions: starting one costs seconds on a loaded 2-core box
    buf = RayReplayBuffer.create(spec)
    durable = RayReplayBuffer.create(dataclasses.replace(spec, transport=TransportSpec(producer_owned_payloads=False)))
    producers = [Producer.remote(i) for i in range(n_max)]
    clients = {"buffer": buf, "durable": durable}
    ray.get([p.attach.remote(name, b) for p in producers for name, b in clients.items()])
    print(f"actors up in {time.time() - t_start:.0f} s")
    tq, tq_client = start_tq(producers)
    transports = [t for t in TRANSPORTS if t != "tq" or tq_client is not None]
    bench = Bench(tq_client, clients, producers)
    print(f"\nmedians over {args.repeats} repetitions (every transport once per repetition, rotated order); "
          "ratios: median [min-max] of the ratio within a repetition")
    print(f"{'size':>5} {'put':>3} {'prod':>4} {'cell':>9} | {'raw smp/s':>9} {'tq smp/s':>9} {'buffer smp/s':>12} "
          f"{'durable':>8} {'buf MB/s':>8} | {'buf/raw':>16} {'buf/tq':>16} {'dur/raw':>16} | once")
    rows = []
    try:
        for label, nbytes, total in sizes:
            total = QUICK_SAMPLES[label] if args.quick else total
            for per_put in args.per_put:
                ray.get([p.prepare.remote(nbytes, per_put) for p in producers])
                buf.clear()  # a new schema per sample size
                durable.clear()
                warm = producers[:1] if args.quick else producers
                for t in transports:  # warm-up, untimed: one round, one put (or one batch) per producer
                    bench.run(t, warm, plan(1, nbytes, per_put, len(warm))[0], 1, per_put, f"{label} warm-up")
                for n_prod in args.producers:
                    k, rounds = plan(total, nbytes, per_put, n_prod)
                    where = f"{label} x{per_put}/put, {n_prod} producers"
                    n_fail = len(bench.failures)
                    reps = []
                    for rep in range(args.repeats):  # each repetition runs every transport, in a rotated order
                        order = transports[rep % len(transports):] + transports[:rep % len(transports)]
                        reps.append({t: bench.run(t, producers[:n_prod], k, rounds, per_put, where) for t in order})
                    r = summarise(reps)
                    ok = len(bench.failures) == n_fail
                    rows.append((label, nbytes, per_put, n_prod, r))
                    cell = f"{args.repeats}x{rounds}x{k * per_put * n_prod}"
                    print(f"{label:>5} {per_put:>3} {n_prod:>4} {cell:>9} | "
                          f"{fmt(r['raw'], 9)} {fmt(r['tq'], 9)} {fmt(r['buffer'], 12)} {fmt(r['durable'], 8)} "
                          f"{fmt(r['buffer'] * nbytes / 1024**2, 8)} | {fmt_ratio(r['buffer/raw'])} "
                          f"{fmt_ratio(r['buffer/tq'])} {fmt_ratio(r['durable/raw'])} | "
                          f"{'ok' if ok else 'FAIL'}", flush=True)
    finally:
        if tq is not None:
            tq.close()
        buf.close()
        durable.close()
        for p in producers:
            ray.kill(p)
    goals(rows, tq_client is not None)
    return bench.failures


def goals(rows, have_tq: bool) -> None:
    """Issue 18's 'done when' figures: the worst median ratio over the producer counts measured."""
    print("\nissue 18 goals (worst median ratio over producer counts):")
    checks = [("buffer/raw >= 0.9 at >= 1 MB, groups of 8", lambda s, g: s >= 1024**2 and g == 8, "raw", 0.9),
              ("buffer/tq  >= 3   at >= 1 MB, groups of 8", lambda s, g: s >= 1024**2 and g == 8, "tq", 3.0),
              ("buffer/tq  >= 10  at 4 KB, groups of 8", lambda s, g: s < 64 * 1024 and g == 8, "tq", 10.0),
              ("buffer/tq  >= 2   at 1 MB, one sample per put", lambda s, g: s == 1024**2 and g == 1, "tq", 2.0)]
    for name, sel, ref, target in checks:
        ratios = [r[f"buffer/{ref}"][0] for _l, s, g, _p, r in rows if sel(s, g)]  # medians within repetitions
        if ref == "tq" and not have_tq:
            print(f"  {name}: n/a (TransferQueue not installed)")
        elif not ratios:
            print(f"  {name}: n/a (not measured in this run)")
        elif any(math.isnan(x) for x in ratios):
            print(f"  {name}: not met (a transport failed exactly-once)")
        else:
            worst = min(ratios)
            print(f"  {name}: {worst:.2f}x  {'met' if worst >= target else 'NOT MET'}")


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


#: Part 2's rows: (who, what, key in the measured dict, what it stands for)
COST_ROWS = [("producer", "ray.put of the group", "ray.put", "raw pays this too"),
             ("producer", "buffer.put (returns once queued)", "buffer.put", "1 MB: + the same ray.put; 4 KB: a copy"),
             ("producer", "flush: the registration call", "flush", "background in the throughput runs"),
             ("consumer", "raw: the call handing over a ref", "raw call", "an actor call returning one ref"),
             ("consumer", "raw: ray.get of that ref", "raw get", ""),
             ("consumer", "buffer: the controller's sample", "sample", "the metadata + the ref(s) as bytes"),
             ("consumer", "buffer: ray.get of the sampled group", "get", ""),
             ("consumer", "buffer: 8 one-sample groups -> 1 batch", "assemble",
              "one copy per field (a group sampled whole: none)"),
             ("either", "an empty controller call (size)", "size", "the floor of any actor call here")]


def call_costs(producer, n: int) -> dict[str, dict[str, float]]:
    """Part 2: where a group of 8 goes, each call alone and one at a time (nothing else runs): median ms
    per call, for a 4 KB group (its bytes ride inside the controller calls) and a 1 MB group (a ref)."""
    buf = RayReplayBuffer.create(BufferSpec(table=TableSpec(sampler="fifo", max_size=1 << 20),
                                            staleness=StalenessSpec(threshold=None),
                                            capacity=CapacitySpec(memory_budget_bytes=768 * 1024**2)))
    out, calls = {}, {}
    try:
        for label, nbytes in (("4 KB", 4 * 1024), ("1 MB", 1024**2)):
            ray.get(producer.prepare.remote(nbytes, 8))
            buf.clear()
            m = calls[label] = min(n, ROUND_BYTES // (8 * nbytes))  # all stay in the buffer until sampled below
            times = ray.get(producer.put_costs.remote(buf, f"cost{nbytes}", m))
            ray.get(producer.hold.remote(m))
            for key in ("raw call", "raw get", "sample", "get", "size", "assemble"):
                times[key] = []
            # a batch of 8 samples put one per group: its rows come from 8 payloads, the batch is one array
            singles = [({"x": np.ones((1, nbytes // 4), np.float32), "id": np.zeros((1, 1), np.int64)}, [0])
                       for _ in range(8)]
            for k in range(m):  # raw first, alone: a ref it drops is cleaned up with its owner in the background
                t = time.perf_counter()
                refs = ray.get(producer.hand.remote())[0]
                times["raw call"].append(time.perf_counter() - t)
                t = time.perf_counter()
                ray.get(refs)
                times["raw get"].append(time.perf_counter() - t)
                del refs
            time.sleep(0.5)
            for k in range(m):
                # the client's sample() in its two halves: the controller call, then the consumer's ray.get
                t = time.perf_counter()
                _metas, parts, _info, token = buf._wait(
                    buf._controller.sample.remote(request(8, 0, 120.0, None, buf._take_acks())), 120.0, "sample")
                times["sample"].append(time.perf_counter() - t)
                t = time.perf_counter()
                buf._fetch([], parts, {})
                times["get"].append(time.perf_counter() - t)
                buf._ack(token)  # read: acknowledged with the next sample call
                t = time.perf_counter()
                buf.size()
                times["size"].append(time.perf_counter() - t)
                t = time.perf_counter()
                assemble_fields(singles)
                times["assemble"].append(time.perf_counter() - t)
            out[label] = {key: 1e3 * float(np.median(v)) for key, v in times.items()}
    finally:
        buf.close()
    print(f"\nwhere a group of 8 goes: each call alone, one at a time, median ms of {calls['4 KB']} (4 KB) / "
          f"{calls['1 MB']} (1 MB)")
    print(f"{'':>8} {'call':<38} | {'4 KB':>5} | {'1 MB':>5} |")
    for who, what, key, note in COST_ROWS:
        print(f"{who:>8} {what:<38} | {out['4 KB'][key]:>5.2f} | {out['1 MB'][key]:>5.2f} | {note}")
    return out


def cpu_by_process(quick: bool) -> list[str]:
    """Part 4 (``buffer_cpu.py``): one producer, groups of 8, raw / tq (when installed) / buffer. Returns the
    exactly-once failures."""
    import buffer_cpu

    spec = BufferSpec(table=TableSpec(sampler="fifo", max_size=1 << 20), staleness=StalenessSpec(threshold=None),
                      capacity=CapacitySpec(memory_budget_bytes=768 * 1024**2))
    buf, producer = RayReplayBuffer.create(spec), Producer.remote(0)
    ray.get(producer.attach.remote("buffer", buf))
    tq, tq_client = start_tq([producer])
    try:
        bench = Bench(tq_client, {"buffer": buf}, [producer])
        cells = [("4KB", 4 * 1024, 32 if quick else 256), ("1MB", 1024**2, 8 if quick else 64)]
        transports = [t for t in ("raw", "tq", "buffer") if t != "tq" or tq is not None]
        buffer_cpu.cpu_part(bench, transports, producer, cells, plan, 500 if quick else 4000)
        return bench.failures
    finally:
        if tq is not None:
            tq.close()
        buf.close()
        ray.kill(producer)


def _list(kind, choices):
    def parse(text: str):
        out = [kind(v) for v in text.split(",") if v]
        bad = [v for v in out if v not in choices]
        if bad or not out:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {','.join(map(str, choices))}")
        return out
    return parse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="few samples per cell (smoke run, under 2 minutes)")
    ap.add_argument("--sizes", type=_list(str, [s[0] for s in SIZES]), default=[s[0] for s in SIZES],
                    help="comma list of 4KB,1MB,16MB")
    ap.add_argument("--producers", type=_list(int, PRODUCERS), default=PRODUCERS, help="comma list of 1,2,4")
    ap.add_argument("--per-put", type=_list(int, PER_PUT), default=PER_PUT, help="samples per put: 1,8")
    ap.add_argument("--repeats", type=int, default=None,
                    help="repetitions per cell, every transport once each, in a rotated order (default 5; "
                         "2 with --quick)")
    ap.add_argument("--parts", type=_list(str, PARTS), default=PARTS[:3],
                    help="comma list of throughput,costs,sampling,cpu (parts 1-4 of the docstring; default the "
                         "first three)")
    ap.add_argument("--num-cpus", type=int, default=8)
    args = ap.parse_args()
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: at least 1 repetition per cell")
    t0 = time.time()
    # 2 GB: the 16 MB x 8 x 4 cell has 512 MB in flight. Should anything spill, Ray refuses to once the disk is
    # 95 % full (on this machine's shared disk one run died of OutOfDiskError in a raw ray.put): allow up to 99 %
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, object_store_memory=2 * 1024**3,
             log_to_driver=False, configure_logging=False, _system_config={"local_fs_capacity_threshold": 0.99})
    failures = []
    try:
        print(f"ray {ray.__version__}, {os.cpu_count()} CPUs visible")
        if "throughput" in args.parts:
            failures = throughput(args)
        if "costs" in args.parts:
            call_costs(Producer.remote(0), 20 if args.quick else 100)
        if "cpu" in args.parts:
            failures += cpu_by_process(args.quick)
    finally:
        ray.shutdown()
    if "sampling" in args.parts:
        sampling_cost(args.quick)
    print(f"\ntotal {time.time() - t0:.0f} s")
    if failures:
        print(f"\n{len(failures)} exact-once failure(s):\n  " + "\n  ".join(failures), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
