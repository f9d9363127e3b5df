"""Every algorithm on the embedded world, same wall-clock, same seeds: held-out strict accuracy side by side.

    python benchmarks/bench_algorithms.py [--minutes 20] [--eval-every 60] [--algos flow_grpo,diffusion_nft,...]
                                          [--num-prompts 256] [--images-per-prompt 4] [--final-images-per-prompt 64]
                                          [--out bench_out/algorithms]

For each algorithm (FlowGRPO, GRPO-Guard, Flow-DPPO, DanceGRPO, DiffusionNFT,
Diffusion-DPO, AWM) trains sync on the embedded shapes model with the
``tiny_geneval`` reward for ``--minutes`` (the shared settings are
``bench_geneval_rl.RL_DEFAULTS``: 4 prompts x 16 samples, two learner processes;
the per-algorithm settings are :data:`ALGOS`), checkpointing every
``--eval-every`` steps. Then scores the base model and every checkpoint on the
held-out prompts (GenEval protocol: ODE sampling, fixed seeds, strict = all
clauses met; ``overall`` = mean over the four prompt categories) and prints,
per algorithm: overall strict accuracy before and after, the gain with a 95 %
bootstrap confidence interval over prompts (paired: the same prompts and seeds
before and after; stratified by prompt category), and the wall-clock minutes to
+10 points. The curve uses ``--images-per-prompt``; with
``--final-images-per-prompt N`` the base model and the last checkpoint are
scored again with N images per prompt (same seeds) for before, after and the
gain's interval (64 images bring the interval under +-3 points).
Writes ``<out>/curves.png`` (held-out overall accuracy vs minutes, one line per
algorithm) and ``<out>/results.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_geneval_rl import RL_DEFAULTS, _scalars, evaluate  # noqa: E402

from omnirl_async.demo import DIRECT_PREFERENCE as _DP  # noqa: E402
from omnirl_async.demo import NFT_OVERRIDES, PG_ONLY  # noqa: E402
from omnirl_async.models.heldout import bootstrap_gain, per_prompt_strict  # noqa: E402
from omnirl_async.models.heldout import overall_accuracy as overall  # noqa: E402

#: Per-algorithm overrides on top of RL_DEFAULTS (the documented defaults of each method, ALGORITHMS.md).
ALGOS: dict[str, list[str]] = {
    "flow_grpo": [],
    "grpo_guard": ["actor_rollout_ref.model.algorithm=grpo_guard", "actor_rollout_ref.actor.diffusion_loss.clip_ratio=2e-6",
                   "algorithm.global_std=false"],
    "flow_dppo": ["actor_rollout_ref.model.algorithm=flow_dppo"],
    "dance_grpo": ["actor_rollout_ref.model.algorithm=dance_grpo", "actor_rollout_ref.rollout.algo.sde_type=dance",
                   "actor_rollout_ref.rollout.algo.noise_level=0.3", "algorithm.global_std=false"],
    "diffusion_nft": NFT_OVERRIDES,  # the demo's recipe (omnirl_async/demo.py)
    "dpo": ["actor_rollout_ref.model.algorithm=dpo", *_DP, "algorithm.paired_preference=true",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.optim.lr=1e-4"],
    "awm": ["actor_rollout_ref.model.algorithm=awm", *_DP],
}


def base_overrides(algo: str) -> list[str]:
    dp = any(o == "algorithm.trainer_type=direct_preference" for o in ALGOS[algo])
    return [o for o in RL_DEFAULTS if not (dp and o.split("=", 1)[0].startswith(PG_ONLY))]


class CpuMeter:
    """The machine's CPU use sampled every ``every_s`` in a thread; :meth:`busy` is the share of all cores' time
    spent busy between two wall-clock times (None with fewer than two samples between them)."""

    def __init__(self, every_s: float = 0.5) -> None:
        import threading

        self.every_s = every_s
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def read() -> tuple[float, float]:
        """(busy, total) CPU seconds of the whole machine so far; idle and iowait count as not busy."""
        import psutil

        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0), sum(t)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), *self.read()))
            self._stop.wait(self.every_s)

    def __enter__(self) -> "CpuMeter":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def busy(self, t0: float, t1: float) -> float | None:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2 or inside[-1][2] == inside[0][2]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][2] - inside[0][2])


def minutes_to(curve: list, points: float, hold: int = 1) -> float | None:
    """The first checkpoint's minute at or above the curve's start + ``points`` (None when never reached).

    ``hold`` > 1 asks for the mean of that checkpoint and the ``hold - 1`` before it (all after the start) to be
    at or above the line: one lucky checkpoint of a curve that swings by several points between neighbours then no
    longer counts as reaching the target."""
    if hold < 1:
        raise ValueError(f"hold = {hold!r}: the number of checkpoints averaged must be >= 1")
    start, after = curve[0][1], curve[1:]
    for i in range(hold - 1, len(after)):
        window = [v for _m, v in after[i - hold + 1:i + 1]]
        if 100 * (sum(window) / hold - start) >= points - 1e-9:
            return after[i][0]
    return None


def checkpoint_steps(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``global_step_<N>`` checkpoint of a run, oldest first (the trainer's own lookup,
    :meth:`~omnirl_async.trainer.checkpoint.CheckpointManager.step_folders`)."""
    from omnirl_async.trainer.checkpoint import CheckpointManager

    return CheckpointManager(ckpt_dir).step_folders()[::-1]


def run_one(algo: str, args, out: Path, prompts, base) -> dict:
    return run_setting(algo, base_overrides(algo) + ALGOS[algo], args, out, prompts, base)


def run_setting(label: str, overrides: list[str], args, out: Path, prompts, base,
                train_overrides: Sequence[str] = ()) -> dict:
    """Train ``overrides`` for ``args.minutes``, checkpointing every ``args.eval_every`` steps, and score every
    checkpoint on ``prompts``: steps, minutes, before/after, gain with its CI, minutes to +10, the curve.
    ``train_overrides`` apply to training only, not to the held-out scoring (e.g. a remote training reward).
    ``benchmarks/bench_staleness.py`` runs its settings through here too."""
    from omnirl_async.config import load_config
    from omnirl_async.trainer.task_runner import TaskRunner

    run = out / label
    common = overrides + [
        f"trainer.total_time_minutes={args.minutes}", "trainer.total_training_steps=100000",
        f"trainer.save_freq={args.eval_every}", f"trainer.default_local_dir={run / 'ckpt'}",
        f"trainer.log_dir={run / 'tb'}", f"actor_rollout_ref.rollout.val_kwargs.n={args.images_per_prompt}",
        f"data.seed={args.seed}", *args.overrides]
    cfg = load_config(common)  # what the held-out scoring reads: the model, the local reward, val_kwargs, seed
    t0 = time.time()
    with CpuMeter() as cpu:
        summary = TaskRunner(load_config(common + list(train_overrides)) if train_overrides else cfg,
                             printer=lambda *a: None).run()
    minutes = (time.time() - t0) / 60
    rewards = _scalars(run / "tb", "critic/rewards/mean")
    t_first = rewards[0][0] if rewards else t0
    cpu_busy = cpu.busy(t_first, rewards[-1][0]) if rewards else None  # first to last step: training only
    step_minute = {s: (w - t_first) / 60 for w, s, _ in rewards}
    names, before = per_prompt_strict(base)
    curve, curve_steps = [(0.0, overall(names, before))], [0]
    last, last_path = before, None
    for step, path in checkpoint_steps(run / "ckpt"):
        res = evaluate(cfg, path / "lora", prompts, args.seed)
        p2, acc = per_prompt_strict(res)
        assert p2 == names
        minute = step_minute.get(step, minutes)
        curve.append((minute, overall(names, acc)))
        curve_steps.append(step)
        last, last_path = acc, path
        print(f"  {label:<14} step {step:>5} {minute:5.1f} min  overall {curve[-1][1]:.3f}", flush=True)
    final_n = getattr(args, "final_images_per_prompt", None)
    images = args.images_per_prompt
    if final_n and final_n != images and last_path is not None:  # the end point again, with more images
        images = final_n
        before = per_prompt_strict(base_at(final_n, prompts, args.seed))[1]
        cfg_n = load_config(overrides + [f"actor_rollout_ref.rollout.val_kwargs.n={final_n}", f"data.seed={args.seed}",
                                         *args.overrides])
        p2, last = per_prompt_strict(evaluate(cfg_n, last_path / "lora", prompts, args.seed))
        assert p2 == names
        print(f"  {label:<14} step {summary['global_step']:>5} rescored with {final_n} images per prompt: overall "
              f"{overall(names, before):.3f} -> {overall(names, last):.3f}", flush=True)
    gain, lo, hi = bootstrap_gain(names, before, last, seed=args.seed)
    return {"steps": summary["global_step"], "minutes": minutes, "before": overall(names, before),
            "after": overall(names, last), "images_per_prompt": images,
            "gain": gain, "ci": [lo, hi], "minutes_to_plus10": minutes_to(curve, 10), "curve": curve,
            "curve_steps": curve_steps, "run_dir": str(run),
            "cpu_busy": cpu_busy,
            "summary": {k: v for k, v in summary.items() if isinstance(v, (int, float, str))}}


def plot(results: dict, path: Path, title: str = "held-out strict accuracy (GenEval overall) vs training "
         "wall-clock", target: float | None = None) -> None:
    """One line per setting; with ``target`` (points), a dashed gray line at the base's accuracy + target points."""
    from PIL import Image, ImageDraw, ImageFont

    colours = ["blue", "red", "green", "orange", "purple", "brown", "black", "gray", "cyan", "magenta", "olive"]
    w, h, pad, legend_w = 870, 400, 52, 150  # the legend in a column of its own, right of the curves
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    xmax = max([m for r in results.values() for m, _ in r["curve"]] + [1e-6])
    bases = [r["before"] for r in results.values() if r.get("before") is not None]
    goal = max(bases) + target / 100 if target is not None and bases else None
    ymax = max([v for r in results.values() for _, v in r["curve"]] + [0.1] + ([] if goal is None else [goal])) * 1.1

    def xy(m, v):
        return pad + (w - 2 * pad - legend_w) * m / xmax, h - pad - (h - 2 * pad) * v / ymax

    d.line([xy(0, 0), xy(xmax, 0)], fill="black")
    d.line([xy(0, 0), xy(0, ymax)], fill="black")
    for k in range(5):
        v = ymax * k / 4
        x, y = xy(0, v)
        d.text((x - 40, y - 6), f"{v:.2f}", fill="black", font=font)
    d.text(((w - legend_w) / 2 - 60, h - pad + 16), f"training minutes (0 - {xmax:.1f})", fill="black", font=font)
    if goal is not None:
        (x0, y), (x1, _) = xy(0, goal), xy(xmax, goal)
        for x in np.arange(x0, x1, 12.0):
            d.line([(x, y), (min(x + 6, x1), y)], fill="gray", width=1)
        d.text((x0 + 4, y - 12), f"base + {target:g} points", fill="gray", font=font)
    for i, (algo, r) in enumerate(results.items()):
        c = colours[i % len(colours)]
        if len(r["curve"]) > 1:
            d.line([xy(m, v) for m, v in r["curve"]], fill=c, width=2)
        d.text((w - pad - legend_w + 16, pad + 14 * i), algo, fill=c, font=font)
    d.text((pad + 8, 8), title, fill="black", font=font)
    img.save(path)


def add_heldout_args(ap, out_default: str) -> None:
    """The held-out scoring and output options every time-to-accuracy benchmark shares."""
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--images-per-prompt", type=int, default=4, help="images per held-out prompt on the curve")
    ap.add_argument("--final-images-per-prompt", type=int, default=None, metavar="N",
                    help="score the base model and each run's last checkpoint again with N images per prompt for "
                         "before / after / gain (64: an interval under +-3 points)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=out_default)
    ap.add_argument("overrides", nargs="*", help="overrides for every run")


def heldout_setup(args):
    """(output folder, held-out prompts, the base model's scores on them)."""
    import torch

    from omnirl_async.data.prompts import heldout_prompts

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    prompts = heldout_prompts()[: args.num_prompts]
    return out, prompts, base_at(args.images_per_prompt, prompts, args.seed)


_BASE: dict[tuple, object] = {}


def base_at(images_per_prompt: int, prompts, seed: int):
    """The base model's held-out scores with ``images_per_prompt`` images per prompt (scored once per process)."""
    from omnirl_async.config import load_config

    key = (images_per_prompt, tuple(prompts), seed)
    if key not in _BASE:
        cfg = load_config(RL_DEFAULTS + [f"actor_rollout_ref.rollout.val_kwargs.n={images_per_prompt}"])
        _BASE[key] = evaluate(cfg, None, prompts, seed)
    return _BASE[key]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0, help="training wall-clock per algorithm")
    ap.add_argument("--eval-every", type=int, default=60, help="checkpoint (and evaluate) every N steps")
    ap.add_argument("--algos", default=",".join(ALGOS), help=f"comma list from {list(ALGOS)}")
    add_heldout_args(ap, "bench_out/algorithms")
    args = ap.parse_args(argv)
    algos = [a for a in args.algos.split(",") if a]
    unknown = [a for a in algos if a not in ALGOS]
    if unknown:
        ap.error(f"--algos: unknown {unknown}; choose from {list(ALGOS)}")
    out, prompts, base = heldout_setup(args)
    results = {}
    for algo in algos:
        results[algo] = run_one(algo, args, out, prompts, base)
        (out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "curves.png")
    shown = args.final_images_per_prompt or args.images_per_prompt
    print(f"\nheld-out strict accuracy, GenEval overall ({len(prompts)} prompts x {shown} images, "
          f"seed {args.seed}), {args.minutes:g} min of sync training each:")
    print(f"| algorithm | steps | before | after | gain (95 % CI) | min to +10 |\n|---|---|---|---|---|---|")
    for algo, r in results.items():
        t = f"{r['minutes_to_plus10']:.1f}" if r["minutes_to_plus10"] is not None else "not reached"
        print(f"| {algo} | {r['steps']} | {100 * r['before']:.1f} % | {100 * r['after']:.1f} % | "
              f"{r['gain']:+.1f} ({r['ci'][0]:+.1f}, {r['ci'][1]:+.1f}) | {t} |")
    print(f"curves: {out / 'curves.png'}; command: python benchmarks/bench_algorithms.py {' '.join(argv or sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
