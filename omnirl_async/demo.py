"""``make demo``: a short training run on the embedded default that visibly learns, then a summary.

    python -m omnirl_async.demo [key=value ...]

It scores a small held-out set with the base model (GenEval protocol: ODE
sampling, strict = every clause of the prompt met), runs ``omnirl-async train``
in separate_async with DiffusionNFT (:data:`NFT_RECIPE`) for a few minutes
(``trainer.total_time_minutes``), scores the same held-out prompts and seeds
with the last checkpoint, and prints steps, samples/s, staleness,
the training reward at the start and the end, held-out strict accuracy before
and after with a paired-bootstrap 95 % interval on the gain, and where the
before/after image grid, the TensorBoard logs and the checkpoints are. Extra
arguments are Hydra overrides, as for ``omnirl-async train``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

HELDOUT_SEED = 0

#: The recipe that moves held-out strict accuracy on the embedded model (README "The embedded world",
#: docs/shapes_model.md; benchmarks/bench_geneval_rl.py uses it too): 4 prompts x 16 samples,
#: coefficient-preserving SDE steps in the first 4 of 10 steps, lr 6e-4, a training score that also penalises
#: unasked-for objects; decoupled rollout correction with token-level IS (the proximal log-probs read off the update's
#: own forward, so no extra pass).
GENEVAL_RECIPE = [
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.rollout.n=16",
    "actor_rollout_ref.actor.optim.lr=6e-4",
    "actor_rollout_ref.rollout.algo.sde_type=cps",
    "actor_rollout_ref.rollout.algo.noise_level=0.8",
    "actor_rollout_ref.rollout.algo.sde_window_size=4",
    "actor_rollout_ref.rollout.algo.sde_window_range=[0,4]",
    # decoupled correction: the PPO ratio against the learner's weights at the update's start, staleness corrected
    # by token-level IS weights. Bypass mode clips stale samples away in separate_async (README, "Time to
    # accuracy"); with one epoch and one mini-batch the proximal log-probs cost no extra pass (learners/proximal.py)
    "algorithm.rollout_correction.rollout_is=token",
    "+reward.reward_kwargs.penalize_extras=true",
]

#: Policy-gradient settings (SDE exploration, rollout correction) that a direct-preference run must not carry.
PG_ONLY = ("actor_rollout_ref.rollout.algo.sde_type", "actor_rollout_ref.rollout.algo.noise_level",
           "actor_rollout_ref.rollout.algo.sde_window", "algorithm.rollout_correction")

#: What every direct-preference run here sets: the trainer type, ODE rollouts, the loss on half of the timesteps.
DIRECT_PREFERENCE = ["algorithm.trainer_type=direct_preference", "actor_rollout_ref.rollout.algo.noise_level=0.0",
                     "algorithm.timestep_fraction=0.5"]

#: DiffusionNFT's settings (docs/PREFERENCE.md): DIRECT_PREFERENCE, rollouts through the old adapter, the old
#: adapter's decay going linearly to 0.5.
NFT_OVERRIDES = [
    "actor_rollout_ref.model.algorithm=diffusion_nft", *DIRECT_PREFERENCE,
    "actor_rollout_ref.model.policy_state_adapters=[default,old]", "actor_rollout_ref.rollout.rollout_adapter=old",
    "actor_rollout_ref.actor.diffusion_loss.mix_beta=1.0", "algorithm.old_policy_decay_schedule=linear_to_0_5",
]

#: The demo's recipe: DiffusionNFT with GENEVAL_RECIPE's batch shape, lr and training score. It lifts held-out
#: strict accuracy fastest on the embedded model (separate_async, 3 minutes: +18.5 and +15.1 points with two
#: training seeds, README "Quick start"); FlowGRPO needs ~15 minutes for +11.6. Only for a few minutes: at this
#: learning rate and without a KL anchor NFT diverges after ~10 minutes; for longer runs add
#: ``actor_rollout_ref.actor.diffusion_loss.ref_kl_coef=0.01`` (+25.7 / +23.9 points in 12 minutes with two training
#: seeds, no collapse; README "Algorithms side by side").
NFT_RECIPE = [o for o in GENEVAL_RECIPE if not o.split("=", 1)[0].startswith(PG_ONLY)] + NFT_OVERRIDES

DEMO_OVERRIDES = [
    "trainer.v1.trainer_mode=separate_async",
    "actor_rollout_ref.rollout.num_workers=2",
    "learner.num_workers=1",
    "actor_rollout_ref.rollout.nice=10",  # on shared cores the learner, the critical path, keeps its core
    "trainer.experiment_name=demo",
    "trainer.total_time_minutes=3",
    "trainer.total_training_steps=400",
    "trainer.save_freq=20",
    "trainer.resume_mode=disable",
    *NFT_RECIPE,
    # the held-out set scored before and after: all 256 held-out prompts x 4 images (~30 s each way)
    "data.val_max_samples=256",
    "actor_rollout_ref.rollout.val_kwargs.n=4",
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


def _heldout(cfg, lora, prompts):
    """Score the held-out prompts with the base model (``lora`` None) or a checkpoint's adapter, GenEval's way."""
    import dataclasses

    from omnirl_async.models.evaluate import evaluate_policy, validation_settings
    from omnirl_async.models.setup import build_policy, pick_device
    from omnirl_async.rewards import RewardManager

    model_cfg = cfg.actor_rollout_ref.model
    if lora is not None:
        model_cfg = dataclasses.replace(model_cfg, lora_adapter_path=str(lora))
    policy = build_policy(model_cfg, pick_device(cfg.trainer.device), seed=cfg.data.seed)
    # held-out images are scored with GenEval's clauses, whatever variant the training score uses
    kwargs = {k: v for k, v in cfg.reward.reward_kwargs.items() if k != "penalize_extras"}
    reward = RewardManager.from_config(dataclasses.replace(cfg.reward, reward_kwargs=kwargs))
    return evaluate_policy(policy, reward, prompts, cfg.actor_rollout_ref.rollout.val_kwargs, seed=HELDOUT_SEED,
                           **validation_settings(cfg))


def _before_after_grid(before, after, path, *, prompts: int = 8) -> None:
    """First image of ``prompts`` held-out prompts: the base model's row above the trained model's."""
    import numpy as np

    from omnirl_async.models.evaluate import save_grid

    n = int(before.images.shape[0] // max(1, len(dict.fromkeys(before.prompts))))  # images per prompt
    idx = list(range(0, min(prompts * n, before.images.shape[0]), n))
    images = np.concatenate([before.images[idx], after.images[idx]])
    strict = lambda res: next(v for k, v in res.extra.items() if k.endswith("strict"))  # noqa: E731
    marks = np.concatenate([strict(before)[idx], strict(after)[idx]]) > 0.5
    captions = [f"before: {before.prompts[i]}" for i in idx] + [f"after: {after.prompts[i]}" for i in idx]
    save_grid(images, captions, path, cols=len(idx), marks=marks,
              title="top: base model   bottom: after the demo's training   (green: every clause met)")


def main(argv: list[str] | None = None) -> int:
    from omnirl_async.config import load_config
    from omnirl_async.data.prompts import load_val_prompts
    from omnirl_async.models.heldout import bootstrap_gain, overall_accuracy, per_prompt_strict
    from omnirl_async.trainer.checkpoint import CheckpointManager
    from omnirl_async.trainer.task_runner import TaskRunner

    overrides = DEMO_OVERRIDES + list(sys.argv[1:] if argv is None else argv)
    cfg = load_config(overrides)
    print(f"omnirl-async demo: {cfg.trainer.v1.trainer_mode} {cfg.actor_rollout_ref.model.algorithm} on "
          f"{cfg.actor_rollout_ref.model.path}, {cfg.actor_rollout_ref.rollout.num_workers} rollout worker(s), "
          f"{cfg.learner.num_workers} learner(s), for {cfg.trainer.total_time_minutes} min")
    every = load_val_prompts(cfg.data, None)  # the held-out file is sorted: take every k-th for all categories
    k = max(1, len(every) // max(1, cfg.data.val_max_samples or len(every)))
    prompts = every[::k][: cfg.data.val_max_samples or None]
    print(f"held-out set: {len(prompts)} prompts x {cfg.actor_rollout_ref.rollout.val_kwargs.n} images "
          "(GenEval protocol: ODE sampling, strict = every clause met)")
    t_score = time.perf_counter()
    before = _heldout(cfg, None, prompts)
    print(f"held-out set scored with the base model in {time.perf_counter() - t_score:.0f} s")
    t0, started = time.perf_counter(), time.time()
    summary = TaskRunner(cfg, printer=tqdm.write).run()
    wall = time.perf_counter() - t0
    ckpt = CheckpointManager(summary["checkpoint_dir"]).latest_verified()
    after = _heldout(cfg, ckpt / "lora", prompts) if ckpt is not None else None
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
        print(f"training reward:      {start:.3f} -> {end:.3f}  (mean of the first / last {k} steps)")
    names, acc0 = per_prompt_strict(before)
    if after is not None:
        names1, acc1 = per_prompt_strict(after)
        assert names1 == names
        gain, lo, hi = bootstrap_gain(names, acc0, acc1, seed=HELDOUT_SEED)
        print(f"held-out strict acc.: {100 * overall_accuracy(names, acc0):.1f} % -> "
              f"{100 * overall_accuracy(names, acc1):.1f} % overall ({gain:+.1f} points, 95 % CI "
              f"[{lo:+.1f}, {hi:+.1f}] by a paired bootstrap over the {len(names)} prompts; "
              f"{ckpt.name})")
        grid = Path(summary["checkpoint_dir"]) / "demo_before_after.png"
        _before_after_grid(before, after, grid)
        print(f"before/after images:  {grid}")
    else:
        print(f"held-out strict acc.: {100 * overall_accuracy(names, acc0):.1f} % overall before; no verified "
              "checkpoint was written, so nothing to score after")
    print(f"TensorBoard logs:     {summary['log_dir']}   (tensorboard --logdir {summary['log_dir']})")
    print(f"checkpoints:          {summary['checkpoint_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
