"""sync vs separate_async on the same hardware, seeds and model; prints ratios.

    python benchmarks/bench_async.py [--steps 24] [--scenarios plain,slow_scorer] [key=value ...]

Scenarios
  plain        rewards scored inline by ``tiny_geneval`` (fast, CPU)
  slow_scorer  rewards from an HTTP scorer on loopback that takes 200 ms per request

Modes: ``sync``; ``separate_async`` with ``max_off_policy_threshold`` 1 and 2
(strategy ``wait``). Each run trains the same number of steps with the same
seeds; figures come from the run's TensorBoard events (wall time of every
step), so start-up is excluded:

  samples/s        trained samples per second between the first and last step
  learner idle     share of the learner's wall time not spent in updates
  rollout idle     share of rollout workers' wall time spent waiting (admission / lock-step)
  reward/sample    mean reward of the samples trained (same number of samples in every mode)
  t->target        seconds until the 5-step running mean of the reward first reaches the
                   target (the midpoint between the sync run's first and best running mean)
  ideal x          the most any overlap could give on this many cores, from the sync run's
                   own timings: a sync step is gen time G (all rollout workers busy) plus
                   update time U (the learner alone); overlapped perfectly, a step needs
                   max(U, (workers*G*cpus_per_worker + U) / cores) seconds

Rollout workers run with ``actor_rollout_ref.rollout.nice=10`` in every mode, so that in
separate_async the learner (the critical path) is not slowed by workers sharing its cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = [("sync", ["trainer.v1.trainer_mode=sync"]),
         ("async T=1", ["trainer.v1.trainer_mode=separate_async", "trainer.v1.sampler.max_off_policy_threshold=1"]),
         ("async T=2", ["trainer.v1.trainer_mode=separate_async", "trainer.v1.sampler.max_off_policy_threshold=2"])]


def _events(log_dir: Path) -> dict[str, list[tuple[float, int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.wall_time, e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _running(values: np.ndarray, k: int = 5) -> np.ndarray:
    return np.array([values[max(0, i - k + 1):i + 1].mean() for i in range(len(values))])


def run_one(overrides: list[str], workdir: Path) -> dict:
    from omnirl_async.config import load_config
    from omnirl_async.trainer.task_runner import TaskRunner

    cfg = load_config(overrides + [f"trainer.default_local_dir={workdir / 'ckpt'}", f"trainer.log_dir={workdir / 'tb'}",
                                   "trainer.resume_mode=disable", "trainer.save_freq=-1", "trainer.progress_bar=false",
                                   "trainer.logger=[tensorboard]"])
    t0 = time.perf_counter()
    summary = TaskRunner(cfg, printer=lambda *a: None).run()
    ev = _events(workdir / "tb")
    rewards = ev["critic/rewards/mean"]
    times = np.array([w for w, _, _ in rewards])
    values = np.array([v for _, _, v in rewards])
    samples_per_step = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    span = times[-1] - times[0]
    upd = np.array([v for _, _, v in ev["timing_s/update_actor"]])
    step = np.array([v for _, _, v in ev["timing_s/step"]])
    ro = cfg.actor_rollout_ref.rollout
    cores = os.cpu_count() or 1
    # sync: workers generate (timing_s/gen), then the learner updates; async runs have no gen phase
    gen_s = sum(v for _, _, v in ev.get("timing_s/gen", [])) or step.sum() - upd.sum()
    ideal = step.sum() / max(upd.sum(), (ro.num_workers * ro.num_cpus_per_worker * gen_s + upd.sum()) / cores)
    if "perf/learner_idle_frac" in ev:
        learner_idle = ev["perf/learner_idle_frac"][-1][2]
        rollout_idle = ev["perf/rollout_idle_frac"][-1][2]
    else:  # sync: the learner waits while workers generate, workers wait while it trains
        learner_idle = 1.0 - upd.sum() / step.sum()
        gen = np.array([v for _, _, v in ev["timing_s/gen"]])
        rollout_idle = 1.0 - gen.sum() / step.sum()
    return {"samples_per_s": samples_per_step * (len(times) - 1) / span if span > 0 else float("nan"),
            "learner_idle": learner_idle, "rollout_idle": rollout_idle, "reward_mean": float(values.mean()),
            "times": times - times[0], "running": _running(values), "wall_total": time.perf_counter() - t0,
            "staleness_max": summary.get("staleness_max", 0.0), "ideal": ideal}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--scenarios", default="plain,slow_scorer")
    p.add_argument("--delay", type=float, default=0.2, help="seconds per request of the slow scorer")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    import ray

    from omnirl_async.config import load_config
    from omnirl_async.rewards.http_scorer import ScorerServer
    from omnirl_async.trainer.task_runner import init_ray

    base = [f"trainer.total_training_steps={args.steps}", "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.num_workers=2", "learner.num_workers=1", "actor_rollout_ref.rollout.seed=3",
            "actor_rollout_ref.rollout.nice=10", *args.overrides]
    # the same Ray the trainer would start for these settings (with rollout.nice > 0: workers at niceness 0)
    init_ray(load_config(base + ["ray_kwargs.num_cpus=4", "+ray_kwargs.ray_init.log_to_driver=false"]))
    results: dict[str, dict[str, dict]] = {}
    try:
        for scenario in args.scenarios.split(","):
            extra: list[str] = []
            server = None
            if scenario == "slow_scorer":
                server = ScorerServer("tiny_geneval", delay_s=args.delay)
                url = server.start()
                extra = [f"reward.reward_functions={{http: {{name: http_scorer, weight: 1.0, "
                         f"kwargs: {{url: '{url}'}}}}}}"]
            elif scenario != "plain":
                raise SystemExit(f"unknown scenario {scenario!r}; choose plain or slow_scorer")
            results[scenario] = {}
            try:
                for name, mode in MODES:
                    with tempfile.TemporaryDirectory() as d:
                        print(f"[{scenario}] {name} ...", flush=True)
                        results[scenario][name] = run_one(base + mode + extra, Path(d))
            finally:
                if server is not None:
                    server.stop()
    finally:
        ray.shutdown()

    print(f"\n{'scenario':<12} {'mode':<10} {'samples/s':>9} {'x sync':>7} {'learner idle':>12} {'rollout idle':>12} "
          f"{'reward/sample':>13} {'t->target s':>11} {'max lag':>7} {'ideal x':>7}")
    for scenario, runs in results.items():
        sync = runs["sync"]
        start, best = sync["running"][0], sync["running"].max()
        target = start + 0.5 * (best - start)
        for name, r in runs.items():
            hit = np.nonzero(r["running"] >= target)[0]
            t_hit = f"{r['times'][hit[0]]:.0f}" if len(hit) else "-"
            print(f"{scenario:<12} {name:<10} {r['samples_per_s']:9.2f} {r['samples_per_s'] / sync['samples_per_s']:7.2f} "
                  f"{100 * r['learner_idle']:11.0f}% {100 * r['rollout_idle']:11.0f}% {r['reward_mean']:13.3f} "
                  f"{t_hit:>11} {r['staleness_max']:7.0f} {sync['ideal'] if name == 'sync' else float('nan'):7.2f}")
    print(f"\n(target reward = midpoint of the sync run's first and best 5-step running mean; "
          f"{args.steps} steps per run, {os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
