"""Scale simulation: the real control plane of separate_async with 8, 32 and 128 stand-in rollout workers.

    .venv/bin/python benchmarks/bench_scale.py --workers 8,32,128,32@0.25,128@0.25 --time-scale 20 --seconds 60

(``--quick``: one small setting in ~30 s, the smoke run of ``tests/test_bench_scale.py``.)

What is real and what stands in
  real         the prompt dispatcher and its admission control (``max_off_policy_threshold``, strategy
               ``wait``), the Ray transfer queue / replay buffer (controller + storage unit, producer-owned
               payloads), the weight store and the weight broadcast, the learner group's call path (one
               learner actor, ``LearnerGroup.update`` / ``publish``) and the whole learner loop of
               ``SeparateAsyncTrainer`` (``BaseTrainer.run_loop``: wait for tickets, sample, update,
               publish, settle, metrics, audit trail). Each simulated rollout worker runs the real
               ``RolloutWorker.run_loop``: lease -> newest weights -> generate -> score (in its pool) ->
               ``buffer.put(producer=...)`` -> ``complete``, with its own worker id, version and leases.
  stand-in     generation (``SimWorker._sample_group``) sleeps a modelled time and returns a payload of the
               modelled size; the reward sleeps a long-tailed modelled latency; the learner's update sleeps a
               modelled time (``SimLearner``) and publishes LoRA-sized weights. Several simulated workers share
               one Ray actor (``SimHost``, one thread each), so that 128 of them fit on a small machine.

Time and bytes
  Every modelled time is divided by ``--time-scale`` S; results are printed in model seconds (real x S).
  Payloads and weights are scaled by ``--payload-scale`` (default 1/S): copy costs then take the same share
  of a compressed step as the full-size copies take of a real one. Fixed per-call costs (an actor call's
  round trip) do NOT shrink with S, so their share of a compressed step is S times their share of a real
  step: the control-plane figures here are an upper bound (and this machine's few cores host every
  simulated worker's client side too).

Per setting it prints throughput against the ideal overlap bound of the same time model
(min(rollout capacity, learner demand)), the learner's idle fraction and where its time goes, the
staleness histogram of the trained samples, and the control plane's own cost: the learner loop's time
outside updates and waits, each simulated worker's loop time outside generation and admission waits, every
control-plane call timed on the real objects (client round trips), and the CPU the central actors burnt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ray.cloudpickle  # noqa: E402
import scale_model  # noqa: E402
from scale_model import SimSpec, TimeModel  # noqa: E402
from scale_report import (analyse, machine_busy, print_model, print_setting, print_summary,  # noqa: E402
                          process_cpu)

from omnirl_async.actors.prompt_dispatcher import sample_seeds  # noqa: E402
from omnirl_async.actors.rollout_worker import RolloutWorker  # noqa: E402
from omnirl_async.learners.learner_group import LearnerGroup, LearnerWorker  # noqa: E402
from omnirl_async.models.sde_window import SDEWindow  # noqa: E402
from omnirl_async.rewards.base import RewardResult  # noqa: E402
from omnirl_async.trainer.separate_async import SeparateAsyncTrainer  # noqa: E402

#: the simulated workers' actors unpickle SimSpec without importing benchmarks/ (their sys.path need not hold it)
ray.cloudpickle.register_pickle_by_value(scale_model)


# ----------------------------------------------------------------------------------------------- timing proxies
class CallClock:
    """Count, total and max seconds of named calls; thread-safe; a plain dict out."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            c = self._calls[name]
            c[0] += 1
            c[1] += seconds
            c[2] = max(c[2], seconds)

    def snapshot(self) -> dict[str, list[float]]:
        with self._lock:
            return {k: list(v) for k, v in self._calls.items()}


class _TimedMethod:
    """``handle.method.remote(...)`` that returns once the reply is here, timing the round trip."""

    def __init__(self, method, name: str, clock: CallClock):
        self._method, self._name, self._clock = method, name, clock

    def remote(self, *args, **kwargs):
        import ray

        t0 = time.perf_counter()
        ref = self._method.remote(*args, **kwargs)
        value = ray.get(ref)
        dt = time.perf_counter() - t0
        name = self._name
        if name == "dispatcher.lease":  # a granted lease is on the worker's critical path, a refused one is waiting
            waited = max((lease.admission_wait_s for lease in value), default=0.0)
            if waited > 0:  # granted after waiting for admission: the wait (up to the change that admitted it)
                self._clock.add(name + " (admission wait, then granted)", waited)  # is not control-plane cost
                dt -= waited
            name += " (granted)" if value else " (refused)"
        self._clock.add(name, dt)
        return ref  # the caller's ray.get finds the value already here


class TimedHandle:
    """An actor handle whose method calls are timed (the real actor answers every call)."""

    def __init__(self, handle, prefix: str, clock: CallClock):
        self._handle, self._prefix, self._clock = handle, prefix, clock

    def __getattr__(self, name: str) -> _TimedMethod:
        return _TimedMethod(getattr(self._handle, name), f"{self._prefix}.{name}", self._clock)


class TimedObject:
    """An object whose method calls are timed; pickles to the wrapped object (Ray actors get the plain client)."""

    def __init__(self, obj, prefix: str, clock: CallClock):
        self._obj, self._prefix, self._clock = obj, prefix, clock

    def __getattr__(self, name: str):
        attr = getattr(self._obj, name)
        if not callable(attr):
            return attr
        clock, label = self._clock, f"{self._prefix}.{name}"

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                clock.add(label, time.perf_counter() - t0)

        return timed

    def __reduce__(self):
        return self._obj.__reduce__()


# ----------------------------------------------------------------------------------------------- rollout stand-ins
class SimReward:
    """A remote scorer's latency (long-tailed), no scoring work; thread-safe (the worker's pool calls it)."""

    def __init__(self, spec: SimSpec, seed: list[int]):
        self.spec = spec
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()

    def __call__(self, images, prompts, rows=None) -> RewardResult:
        n = len(prompts)
        with self._lock:
            delay = self.spec.real(self.spec.time.draw_reward(self._rng))
            scores = self._rng.random(n).astype(np.float32)
        time.sleep(delay)
        return RewardResult(scores=scores, extra={}, failed=np.zeros(n, bool), reasons=[None] * n)


class SimWorker(RolloutWorker):
    """The real rollout worker's protocol (``run_loop``, ``_finish_group``, ``_score_group``, ``set_weights``)
    with generation and scoring replaced by the time model. No policy and no reward model are built."""

    def __init__(self, config, spec: SimSpec, *, worker_index: int):  # noqa: D107 - no super(): no model to load
        self.config, self.spec, self.worker_index = config, spec, worker_index
        aro = config.actor_rollout_ref
        self.rollout_cfg, self.model_cfg = aro.rollout, aro.model
        algo = self.rollout_cfg.algo
        self.window = SDEWindow(num_steps=self.rollout_cfg.pipeline.num_inference_steps,
                                window_size=algo.sde_window_size, window_range=algo.sde_window_range,
                                strategy=algo.sample_strategy, iters_per_group=algo.iters_per_group,
                                seed=algo.sde_window_seed)
        self.keep_trajectory = True
        self.version = 0
        self.max_inflight_scores = spec.time.scoring_threads
        self._pool = ThreadPoolExecutor(max_workers=self.max_inflight_scores, thread_name_prefix="score")
        self._count_lock = threading.Lock()
        self._weights_lock = threading.Lock()
        self.counters = dict(RolloutWorker.COUNTERS, overrun_s=0.0, install_s=0.0)
        self._rng = np.random.default_rng([spec.seed, worker_index, 1])
        self._payload: dict[str, np.ndarray] | None = None
        self.reward = SimReward(spec, [spec.seed, worker_index, 2])

    def _sample_group(self, lease, window) -> dict[str, Any]:
        """Stage 1 stand-in: the modelled generation time, ending with a payload of the modelled size."""
        t0 = time.perf_counter()
        target = self.spec.real(self.spec.time.draw_gen(self._rng))
        if self._payload is None or len(self._payload["images"]) != lease.n:
            self._payload = self.spec.group_payload(lease.n, self.worker_index)
        fields = dict(self._payload)  # the same bytes every time: buffer.put copies them into the object store
        left = target - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        else:
            self.counters["overrun_s"] += -left  # making the payload took longer than the modelled generation
        return {"lease": lease, "fields": fields, "seeds": sample_seeds(lease), "version": self.version,
                "gen_s": time.perf_counter() - t0}

    def set_weights(self, version: int, weights: dict[str, Any], *, if_newer: bool = False) -> int:
        """Install a version as the real worker does, minus the model: the tensor copy, then the version."""
        from omnirl_async.actors.rollout_worker import _to_tensor_dict

        t0 = time.perf_counter()
        with self._weights_lock:
            if version < self.version and not if_newer:
                raise ValueError(f"weights version {version} is older than the installed {self.version}")
            if version > self.version:
                _to_tensor_dict(weights)  # the copy the real worker makes before loading the LoRA
                self.version = version
        self.counters["install_s"] += time.perf_counter() - t0
        return self.version


class SimHost:
    """One Ray actor standing for several simulated rollout workers, one thread each, each with its own
    worker id (``<id>.s<j>``), version, leases and payloads. The trainer sees one worker per host."""

    def __init__(self, config, spec: SimSpec, *, host_index: int, num_sims: int, first_index: int):
        self.spec, self.host_index = spec, host_index
        self.sims = [SimWorker(config, spec, worker_index=first_index + j) for j in range(num_sims)]
        self.clock = CallClock()
        self.threads = ThreadPoolExecutor(max_workers=max(1, num_sims), thread_name_prefix="sim")

    def assert_healthy(self) -> dict[str, Any]:
        return {"host": self.host_index, "pid": os.getpid(), "sims": len(self.sims)}

    def get_version(self) -> int:
        return min(s.version for s in self.sims)

    def run_loop(self, dispatcher, store, buffer, *, worker_id: str, poll_s: float | None = None,
                 lease_wait_s: float | None = None, put_timeout: float = 600.0,
                 slowdown_s: float = 0.0) -> dict[str, Any]:
        """Every simulated worker runs the real ``RolloutWorker.run_loop`` over timed handles; the first
        error of any of them is raised at once (the trainer re-raises it)."""
        d = TimedHandle(dispatcher, "dispatcher", self.clock)
        s = TimedHandle(store, "weight_store", self.clock)
        b = TimedObject(buffer, "buffer", self.clock)
        poll = self.spec.poll_s if poll_s is None else poll_s
        wait_s = self.spec.lease_wait_s if lease_wait_s is None else lease_wait_s
        futures = [self.threads.submit(sim.run_loop, d, s, b, worker_id=f"{worker_id}.s{j}", poll_s=poll,
                                       lease_wait_s=wait_s, put_timeout=put_timeout, slowdown_s=slowdown_s)
                   for j, sim in enumerate(self.sims)]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in done:
            f.result()
        return self.stats()

    def stats(self) -> dict[str, Any]:
        """The counters of all simulated workers summed (``version``: the oldest), plus the timed calls."""
        out: dict[str, Any] = defaultdict(float)
        for sim in self.sims:
            for k, v in sim.counters.items():
                out[k] += v
        out = dict(out)
        out.update(version=self.get_version(), worker_index=self.host_index, sims=len(self.sims),
                   calls=self.clock.snapshot())
        return out


# ----------------------------------------------------------------------------------------------- learner stand-in
class SimLearner:
    """What ``LearnerWorker`` calls on a learner: the update only takes the modelled time; the weights are a
    LoRA-sized state that changes every update."""

    def __init__(self, spec: SimSpec, rank: int):
        import torch

        self.spec, self.global_step = spec, 0
        self._rng = np.random.default_rng([spec.seed, 10_000 + rank])
        self._weights = {k: torch.from_numpy(v) for k, v in spec.weights(0).items()}

    def update(self, fields: dict[str, np.ndarray], group_ids: list[str],
               run_progress: float | None = None) -> dict[str, float]:
        """A simulated update (``run_progress``, the learning-rate schedule's input, changes nothing here)."""
        t0 = time.perf_counter()
        target = self.spec.real(self.spec.time.draw_update(self._rng))
        rows = len(group_ids)
        self.global_step += 1
        for w in self._weights.values():
            w.fill_(float(self.global_step))
        left = target - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        return {"sim/update_s": time.perf_counter() - t0, "sim/update_target_s": target, "sim/rows": float(rows)}

    def get_weights(self):
        return self._weights

    def adapter_versions(self) -> dict[str, int]:
        return {"default": self.global_step}

    def get_state(self) -> dict[str, Any]:
        return {"global_step": self.global_step}

    def set_state(self, state: dict[str, Any]) -> None:
        self.global_step = int(state["global_step"])

    def save_lora(self, folder) -> None:
        raise NotImplementedError("the scale benchmark writes no checkpoints")


class SimLearnerWorker(LearnerWorker):
    """The real learner actor body around :class:`SimLearner` (``spec`` is set by :func:`learner_group_class`)."""

    spec: SimSpec

    def setup(self, master) -> bool:
        self.learner = SimLearner(self.spec, self.rank)
        return True


def learner_group_class(spec: SimSpec) -> type[LearnerGroup]:
    """The real ``LearnerGroup`` whose actors run :class:`SimLearnerWorker` with ``spec``."""
    worker = type("SimLearnerWorker", (SimLearnerWorker,), {"spec": spec})
    return type("SimLearnerGroup", (LearnerGroup,), {"worker_class": worker})


# ----------------------------------------------------------------------------------------------- the trainer
@dataclass
class StepRecord:
    end: float                      # perf_counter when the step's bookkeeping ended
    samples: int
    times: dict[str, float]         # the loop's Timer: gen (waiting for samples), sample, update_actor, ...
    compute_s: float                # the learner's modelled update (real seconds slept)
    bookkeeping_s: float            # step_metrics: buffer metrics, rollout stats, audit trail, settle
    lags: np.ndarray


class SimTrainer(SeparateAsyncTrainer):
    """``SeparateAsyncTrainer`` with stand-in workers (``make_worker``) and learner (``make_learners``); the
    buffer and the driver's dispatcher calls are timed; no checkpoints."""

    def __init__(self, config, prompts, *, spec: SimSpec, layout: list[int], printer=print, on_step=None):
        self.spec, self.layout = spec, list(layout)
        self.clock = CallClock()
        self.records: list[StepRecord] = []
        self.on_step = on_step
        self.sample_ahead_enabled = spec.sample_ahead
        self.back_to_back_enabled = spec.sample_ahead and spec.back_to_back
        if spec.land:
            self.land_every_s = 0.1
        super().__init__(config, prompts, printer=printer)

    def make_buffer(self):
        return TimedObject(super().make_buffer(), "buffer", self.clock)

    def lease_waiters(self) -> int:
        return sum(self.layout)  # every simulated worker may wait in the dispatcher

    def make_learners(self):
        return learner_group_class(self.spec)(self.config, use_ray=True, num_threads=1)

    def make_worker(self, index: int, **options):
        import ray

        placed = self.placements.options("rollout", index)
        cls = ray.remote(**placed, max_concurrency=2)(SimHost)  # stats() answers while run_loop runs
        return cls.remote(self.config, self.spec, host_index=index, num_sims=self.layout[index],
                          first_index=sum(self.layout[:index]))

    def dcall(self, method: str, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return super().dcall(method, *args, **kwargs)
        finally:
            self.clock.add(f"dispatcher.{method}", time.perf_counter() - t0)

    def _recover_leases(self, worker_id: str) -> None:
        """A dead host: the leases of each of its simulated workers."""
        host = next(i for i, w in self.worker_ids.items() if w == worker_id)
        for j in range(self.layout[host]):
            super()._recover_leases(f"{worker_id}.s{j}")

    def should_save(self, done: bool, step: int | None = None) -> bool:
        return False

    def step_metrics(self, metrics, batch, timer, run_s):
        t0 = time.perf_counter()
        out = super().step_metrics(metrics, batch, timer, run_s)
        end = time.perf_counter()
        lags = np.asarray(batch.info.get("staleness", np.zeros(len(batch))), dtype=np.int64)
        self.records.append(StepRecord(end=end, samples=len(batch), times=dict(timer.times),
                                       compute_s=float(metrics.get("sim/update_s", 0.0)),
                                       bookkeeping_s=end - t0, lags=lags))
        if self.on_step is not None:
            self.on_step(len(self.records))
        return out


# ----------------------------------------------------------------------------------------------- one setting
def host_layout(workers: int, actors: int) -> list[int]:
    """Simulated workers per Ray actor, as even as possible."""
    hosts = max(1, min(actors, workers))
    return [workers // hosts + (1 if i < workers % hosts else 0) for i in range(hosts)]


def config_overrides(spec: SimSpec, *, hosts: int, threshold: int, seconds: float, workdir: Path) -> list[str]:
    t, p = spec.time, spec.payload
    group_bytes = p.sample_bytes() * t.group_size * spec.payload_scale
    alive = (threshold + 4) * t.batch_groups  # admitted groups the buffer may hold, with room to spare
    return [
        "trainer.v1.trainer_mode=separate_async", f"trainer.v1.sampler.max_off_policy_threshold={threshold}",
        "trainer.v1.sampler.max_off_policy_strategy=wait",
        f"actor_rollout_ref.rollout.n={t.group_size}", f"data.train_batch_size={t.batch_groups}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={t.batch_groups}",
        f"actor_rollout_ref.rollout.num_workers={hosts}", "actor_rollout_ref.rollout.num_cpus_per_worker=1",
        "actor_rollout_ref.rollout.pipeline.num_inference_steps=10",
        f"actor_rollout_ref.rollout.algo.sde_window_size={p.trained_steps}",
        "learner.num_workers=1", "learner.num_cpus_per_worker=1", "data.shuffle=false",
        "transfer_queue.num_data_storage_units=1",
        f"transfer_queue.memory_budget_bytes={int(max(2 * 1024**3, 2 * alive * group_bytes))}",
        f"buffer.max_size={max(4096, alive * t.group_size)}", "buffer.snapshot_with_checkpoint=false",
        "trainer.logger=[]", "trainer.progress_bar=false", "trainer.resume_mode=disable", "trainer.save_freq=-1",
        "trainer.test_freq=-1", f"trainer.total_time_minutes={seconds / 60.0}", "trainer.total_epochs=1",
        "trainer.wait_timeout_s=300", f"trainer.default_local_dir={workdir / 'ckpt'}",
        f"trainer.log_dir={workdir / 'logs'}",
    ]


def num_prompts(spec: SimSpec, workers: int, seconds: float) -> int:
    """Enough distinct prompts that one epoch outlasts the run (so every trained prompt is new)."""
    groups_per_s = workers / spec.real(spec.time.worker_group_s())
    return int(groups_per_s * seconds * 1.5 + 8 * spec.time.batch_groups)


def run_setting(workers: int, args, spec: SimSpec, printer=print) -> dict[str, Any]:
    """Start Ray, run the real separate_async loop with ``workers`` simulated rollout workers, analyse."""
    import ray

    from omnirl_async.config import load_config

    layout = host_layout(workers, args.actors)
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
        cfg = load_config(config_overrides(spec, hosts=len(layout), threshold=args.threshold,
                                           seconds=args.seconds, workdir=Path(tmp)))
        prompts = [f"simulated prompt {i}" for i in range(num_prompts(spec, workers, args.seconds))]
        ray.init(address="local", num_cpus=len(layout) + 2, include_dashboard=False, log_to_driver=False,
                 object_store_memory=args.object_store_gb * 1024**3,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        try:
            return _run(cfg, prompts, spec, layout, args, printer)
        finally:
            ray.shutdown()


def _run(cfg, prompts, spec, layout, args, printer) -> dict[str, Any]:
    import ray

    marks: dict[str, Any] = {}

    def on_step(k: int) -> None:  # the measured window starts after the warm-up steps
        if k == args.warmup_steps:
            marks["cpu0"], marks["busy0"], marks["t0"] = process_cpu(), machine_busy(), time.perf_counter()
            marks["calls0"] = trainer.clock.snapshot()

    t_build = time.perf_counter()
    trainer = SimTrainer(cfg, prompts, spec=spec, layout=layout, printer=printer, on_step=on_step)
    try:
        trainer.dcall("tickets_issued")
        ray.get(trainer.store.latest_version.remote())
        build_s = time.perf_counter() - t_build
        t0 = time.perf_counter()
        trainer.fit()
        marks["cpu1"], marks["busy1"], marks["t1"] = process_cpu(), machine_busy(), time.perf_counter()
        wall = time.perf_counter() - t0
        hosts = list(trainer.final_worker_stats)
        if len(hosts) != len(layout):
            raise RuntimeError(f"{len(layout) - len(hosts)} of {len(layout)} simulated-worker actors did not stop "
                               "cleanly; their counters are missing (see the message above)")
        return analyse(trainer, hosts, spec, workers=sum(layout), layout=layout, args=args, marks=marks,
                       wall=wall, build_s=build_s)
    finally:
        trainer.stop()


# ----------------------------------------------------------------------------------------------- CLI
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Goals (issue 17): >= 90 %% of the ideal bound at 32 and 128 workers; learner "
                                       "idle < 5 %% when rollout capacity exceeds learner demand; staleness bound "
                                       "held; control plane < 1 %% of a step.")
    p.add_argument("--workers", default="8,32,128",
                   help="comma list of simulated rollout worker counts; N@S polls every S real seconds after a "
                        "refused lease instead of --poll-s (e.g. 128@0.25); N:serial runs the learner loop without "
                        "sampling the next batch during the update (e.g. 128:serial), N:land takes the next batch's groups as "
                        "they land, N:gap starts each update after the loop's publish and bookkeeping (not back to "
                        "back)")
    p.add_argument("--time-scale", type=float, default=20.0, help="divide every modelled time by this")
    p.add_argument("--payload-scale", type=float, default=None,
                   help="fraction of the modelled payload and weight bytes actually sent (default 1/time-scale)")
    p.add_argument("--seconds", type=float, default=60.0, help="real seconds of training per setting")
    p.add_argument("--threshold", type=int, default=1, help="trainer.v1.sampler.max_off_policy_threshold")
    p.add_argument("--actors", type=int, default=4, help="Ray actors hosting the simulated workers (<= 8)")
    p.add_argument("--warmup-steps", type=int, default=3, help="learner steps left out of the measured window")
    p.add_argument("--poll-s", type=float, default=0.02,
                   help="a worker's sleep after a refused lease when --lease-wait-s is 0 (real seconds; "
                        "RolloutWorker.run_loop's default)")
    p.add_argument("--lease-wait-s", type=float, default=2.0,
                   help="how long a refused lease waits in the dispatcher for a learner update or a lease given "
                        "back (real seconds; RolloutWorker.run_loop's default); 0 = poll every --poll-s")
    p.add_argument("--batch-groups", type=int, default=None, help="prompt groups per learner step (default 32)")
    p.add_argument("--group-size", type=int, default=None, help="images per prompt group (default 16)")
    p.add_argument("--object-store-gb", type=float, default=4.0, help="Ray object store size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write every setting's figures to this JSON file")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 6 workers on 2 actors, 8 groups of 16 per step, 12 s at time scale 40")
    args = p.parse_args(argv)
    if args.quick:
        args.workers, args.seconds, args.time_scale, args.actors = "6", 12.0, 40.0, 2
        args.batch_groups, args.warmup_steps = args.batch_groups or 8, 2
    return args


def build_spec(args) -> SimSpec:
    t = TimeModel()
    t = replace(t, batch_groups=args.batch_groups or t.batch_groups, group_size=args.group_size or t.group_size)
    scale = args.payload_scale if args.payload_scale is not None else 1.0 / args.time_scale
    return SimSpec(time=t, time_scale=args.time_scale, payload_scale=scale, poll_s=args.poll_s,
                   lease_wait_s=args.lease_wait_s, seed=args.seed)


#: the learner loop before sampling ahead; sampling ahead with groups taken as they land; sampling ahead with each
#: update started after the loop's publish and bookkeeping of the one before
LOOPS = ("serial", "land", "gap")


def parse_settings(text: str) -> list[tuple[int, float | None, str]]:
    """``--workers``: ``8,32,128``, with a poll interval per setting, ``128@0.25``, and/or ``:serial`` (the learner
    loop without sampling ahead), ``:land`` (sampling ahead, the next batch's groups taken as they land) or ``:gap``
    (sampling ahead, updates not back to back)
    -> [(workers, poll_s, loop)], loop "" for today's loop; poll_s None: the setting uses
    ``--lease-wait-s`` / ``--poll-s``."""
    out = []
    for item in (w.strip() for w in str(text).split(",")):
        if not item:
            continue
        item, colon, mode = item.partition(":")
        if colon and mode not in LOOPS:
            raise SystemExit(f"--workers {text!r}: the suffixes are ':serial', ':land' and ':gap' "
                             f"(got {item + colon + mode!r})")
        count, _, poll = item.partition("@")
        try:
            n, p = int(count), float(poll) if poll else None
        except ValueError:
            raise SystemExit(f"--workers {text!r}: give a comma list of counts, each optionally with @<poll "
                             "seconds> and/or :serial, :land or :gap, e.g. 8,32,128,128@0.25,128:serial") from None
        if n < 1 or (p is not None and p <= 0):
            raise SystemExit(f"--workers {text!r}: counts must be >= 1 and poll intervals > 0 ({item!r})")
        out.append((n, p, mode))
    if not out:
        raise SystemExit(f"--workers {text!r}: no setting given")
    return out


def check_args(args) -> list[tuple[int, float | None, str]]:
    settings = parse_settings(args.workers)
    if not 1 <= args.actors <= 8:
        raise SystemExit(f"--actors {args.actors}: between 1 and 8 (each is a Ray actor process)")
    if args.time_scale <= 0 or args.seconds <= 0:
        raise SystemExit("--time-scale and --seconds must be > 0")
    if args.threshold < 0:
        raise SystemExit(f"--threshold {args.threshold}: an integer >= 0")
    return settings


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = check_args(args)
    spec = build_spec(args)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    t0 = time.perf_counter()
    print(f"bench_scale {started}: {' '.join(sys.argv[1:]) or '(defaults)'}")
    print_model(spec)
    results = []
    for n, poll_s, loop in settings:
        # N@S: poll every S seconds after a refused lease (no wait in the dispatcher), the loop before long-polls;
        # N:serial: the learner loop before it sampled the next batch during the update; N:gap: sampling ahead, each
        # update started after the loop's publish and bookkeeping of the one before; N:land: sampling ahead,
        # with the next batch's groups taken as they land
        setting = spec if poll_s is None else replace(spec, poll_s=poll_s, lease_wait_s=0.0)
        setting = replace(setting, sample_ahead=loop != "serial", land=loop == "land", back_to_back=loop != "gap")
        r = run_setting(n, args, setting, printer=lambda *a: None)
        print_setting(r, setting)
        results.append(r)
    print_summary(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"started": started, "argv": sys.argv[1:], "results": results},
                                              indent=1, default=float))
    print(f"\nwall time {time.perf_counter() - t0:.0f} s (finished "
          f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
