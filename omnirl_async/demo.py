"""``make demo``: a short training run on the embedded default, then a summary.

    python -m omnirl_async.demo [key=value ...]

It runs ``omnirl-async train`` with the embedded model for a couple of minutes
(``trainer.total_time_minutes``), then prints steps, samples/s, the reward at
the start and the end, and where the TensorBoard logs and checkpoints are.
Extra arguments are Hydra overrides, as for ``omnirl-async train``.
"""

from __future__ import annotations

import sys
import time

from tqdm.auto import tqdm

DEMO_OVERRIDES = [
    "trainer.v1.trainer_mode=separate_async",
    "actor_rollout_ref.rollout.num_workers=2",
    "learner.num_workers=1",
    "actor_rollout_ref.rollout.nice=10",  # on shared cores the learner, the critical path, keeps its core
    "trainer.experiment_name=demo",
    "trainer.total_time_minutes=2",
    "trainer.total_training_steps=400",
    "trainer.save_freq=10",
    "trainer.resume_mode=disable",
]


def _reward_curve(log_dir: str, since: float = 0.0) -> list[tuple[int, float]]:
    """``(step, critic/rewards/mean)`` of the runs whose event files were written at or after ``since``.

    Every demo logs into the same folder, so older runs' event files sit next to
    this run's; reading the whole folder would mix their curves into this one.
    """
    import os

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(os.path.join(log_dir, f) for f in os.listdir(log_dir) if "tfevents" in f) \
        if os.path.isdir(log_dir) else []
    curve: list[tuple[int, float]] = []
    for path in files:
        if os.path.getmtime(path) < since:
            continue
        acc = EventAccumulator(path)
        acc.Reload()
        if "critic/rewards/mean" in acc.Tags().get("scalars", []):
            curve += [(e.step, e.value) for e in acc.Scalars("critic/rewards/mean")]
    return sorted(curve)


def main(argv: list[str] | None = None) -> int:
    from omnirl_async.config import load_config
    from omnirl_async.trainer.task_runner import TaskRunner

    overrides = DEMO_OVERRIDES + list(sys.argv[1:] if argv is None else argv)
    cfg = load_config(overrides)
    print(f"omnirl-async demo: {cfg.trainer.v1.trainer_mode} {cfg.actor_rollout_ref.model.algorithm} on "
          f"{cfg.actor_rollout_ref.model.path}, {cfg.actor_rollout_ref.rollout.num_workers} rollout worker(s), "
          f"{cfg.learner.num_workers} learner(s), for {cfg.trainer.total_time_minutes} min")
    t0, started = time.perf_counter(), time.time()
    summary = TaskRunner(cfg, printer=tqdm.write).run()
    wall = time.perf_counter() - t0
    curve = _reward_curve(summary["log_dir"], since=started)
    steps = summary["global_step"]
    samples = steps * cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    print("\n=== demo summary ===")
    print(f"mode:                 {cfg.trainer.v1.trainer_mode} (max_off_policy_threshold="
          f"{cfg.trainer.v1.sampler.max_off_policy_threshold}, {cfg.trainer.v1.sampler.max_off_policy_strategy})")
    print(f"steps trained:        {steps} (policy version {summary['version']})")
    print(f"samples trained:      {samples}  ({samples / wall:.1f} samples/s over {wall:.0f} s incl. start-up)")
    if "staleness_max" in summary:
        print(f"staleness seen:       mean {summary['staleness_mean']:.2f}, max {summary['staleness_max']:.0f} "
              f"versions; {summary['dropped_samples']:.0f} samples dropped; learner idle "
              f"{100 * summary['learner_idle_frac']:.0f}%")
    if curve:
        k = max(1, len(curve) // 5)
        start = sum(v for _, v in curve[:k]) / k
        end = sum(v for _, v in curve[-k:]) / k
        print(f"reward (mean of first/last {k} steps): {start:.3f} -> {end:.3f}")
    print(f"TensorBoard logs:     {summary['log_dir']}   (tensorboard --logdir {summary['log_dir']})")
    print(f"checkpoints:          {summary['checkpoint_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
