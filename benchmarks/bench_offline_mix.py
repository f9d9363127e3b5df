"""Offline preference data mixed into asynchronous training: online only vs offline only vs mixed, same wall-clock.

    python benchmarks/bench_offline_mix.py [--minutes 10] [--algo diffusion_nft] [--mode separate_async]
                                           [--ratios 0.25,0.5] [--pairs 256] [--pairs-from renders|model]
                                           [--model-samples 8] [--pairs-lora DIR] [--offline-advantage A] [--store DIR]
                                           [--taper-to F [--taper-end E]] [--runs online,mix_0.5,...]
                                           [--num-prompts 256]
                                           [--images-per-prompt 4] [--eval-every 40] [--out bench_out/offline_mix]
    python benchmarks/bench_offline_mix.py --quick      # a < 1 minute smoke of the whole pipeline

Builds a preference dataset from the embedded shapes world with
``scripts/make_preference_dataset.py`` (per training prompt: a render that
meets every clause vs one that breaks one clause; with ``--pairs-from model``
the best vs the worst of ``--model-samples`` samples of the base model, ranked
by the reward, drawn with the runs' config; with ``--pairs-lora DIR`` the
samples are those of an earlier run instead: the base model with that run's
LoRA, ``<run>/ckpt/global_step_N/lora``), ingests it once
(``omnirl-async ingest``'s :func:`~omnirl_async.trainer.ingest.ingest_dataset`)
and gives every run that reads offline data a copy of that store. Then trains
the same direct-preference loss (``--algo``, settings of
``bench_algorithms.ALGOS``) on the embedded shapes model with the
``tiny_geneval`` reward, the same seeds and the same wall-clock
(``trainer.total_time_minutes``) in ``--mode`` (separate_async by default):

* ``online``: rollouts only (``buffer.offline_mix_ratio=0``);
* ``offline``: the offline store alone (``algorithm.sample_source=offline``, no rollout workers);
* ``mix_<r>``: rollouts plus offline pairs at ``buffer.offline_mix_ratio=r`` for each of ``--ratios`` (the pairs
  take the place of ``round(r * data.train_batch_size)`` online groups of every update); with ``--taper-to F``
  the mixed runs are ``mix_<r>_to_<F>``: the offline share moves linearly from r to F over the run's minutes
  (``buffer.offline_mix_ratio_final=F``), with ``--taper-end E`` over the first E of them and F after
  (``buffer.offline_mix_taper_end=E``; runs ``mix_<r>_to_<F>_by_<E>``).

``--runs`` picks some of these by name (e.g. ``online,mix_0.5_to_0``).

Each run checkpoints every ``--eval-every`` steps; the base model and every
checkpoint are scored on the held-out prompts (GenEval protocol: ODE
sampling, fixed seeds, strict = all clauses met, ``overall`` = mean over the
four prompt categories). Prints per run: updates, offline share drawn,
overall strict accuracy before and after, the gain with a paired 95 %
bootstrap interval over prompts, and the best checkpoint; writes
``<out>/results.json`` and ``<out>/curves.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_algorithms import (ALGOS, base_overrides, bootstrap_gain, checkpoint_steps, overall,  # noqa: E402
                              per_prompt_strict, plot)
from bench_geneval_rl import RL_DEFAULTS, _scalars, evaluate  # noqa: E402

#: --quick: a small world so that the whole pipeline runs in well under a minute on 2 cores
QUICK = dict(minutes=0.05, pairs=16, num_prompts=8, images_per_prompt=1, eval_every=10**6, ratios="0.5")
QUICK_OVERRIDES = ["data.train_batch_size=2", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                   "actor_rollout_ref.rollout.num_workers=1", "learner.num_workers=1",
                   "actor_rollout_ref.rollout.pipeline.num_inference_steps=4",
                   "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps=4"]


def variants(ratios: list[float], offline_advantage: float | None = None,
             taper_to: float | None = None, taper_end: float | None = None) -> dict[str, list[str]]:
    """Each run's own overrides; ``offline_advantage`` goes to the runs that read offline pairs (the config refuses
    it where no offline pair is trained), ``taper_to`` and ``taper_end`` to the mixed runs."""
    if taper_end is not None and taper_to is None:
        raise ValueError("--taper-end needs --taper-to (a share that tapers)")
    strength = [] if offline_advantage is None else [f"algorithm.offline_advantage={offline_advantage:g}"]
    out = {"online": [], "offline": ["algorithm.sample_source=offline", *strength]}
    for r in ratios:
        if taper_to is None:
            out[f"mix_{r:g}"] = [f"buffer.offline_mix_ratio={r:g}", *strength]
        else:
            end = [] if taper_end is None else [f"buffer.offline_mix_taper_end={taper_end:g}"]
            name = f"mix_{r:g}_to_{taper_to:g}" + ("" if taper_end is None else f"_by_{taper_end:g}")
            out[name] = [f"buffer.offline_mix_ratio={r:g}", f"buffer.offline_mix_ratio_final={taper_to:g}", *end,
                         *strength]
    return out


def pair_source(args, config_overrides: list[str]) -> list[str]:
    """``make_preference_dataset.py``'s arguments for the pairs' source: renders (none), or ``--model-samples`` samples
    drawn with the runs' config, of the base model or, with ``--pairs-lora``, of an earlier run's LoRA on it."""
    if args.pairs_from != "model":
        if args.pairs_lora:
            raise SystemExit("--pairs-lora picks the model whose samples are ranked: it needs --pairs-from model")
        return []
    lora = []
    if args.pairs_lora:
        from omnirl_async.preflight import InputError, check_lora_adapter

        try:  # the check the config runs on actor_rollout_ref.model.lora_adapter_path, named by this flag
            check_lora_adapter(args.pairs_lora, key="--pairs-lora")
        except InputError as err:
            raise SystemExit(str(err)) from None
        lora = [f"actor_rollout_ref.model.lora_adapter_path={Path(args.pairs_lora).resolve()}"]
    return ["--model-samples", str(args.model_samples), *config_overrides, *lora]


def build_store(args, out: Path, cfg, config_overrides: list[str]) -> Path:
    """The preference dataset (:func:`pair_source`), ingested once; every run that reads offline data gets a copy of
    the store."""
    import importlib.util

    from omnirl_async.trainer.ingest import ingest_dataset

    spec = importlib.util.spec_from_file_location("make_preference_dataset",
                                                  Path(__file__).resolve().parents[1] / "scripts" /
                                                  "make_preference_dataset.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    data = out / "pref_data"
    if data.exists():
        shutil.rmtree(data)
    source = pair_source(args, config_overrides)
    if script.main(["--out", str(data), "--num-prompts", str(args.pairs), "--seed", str(args.seed), *source]):
        raise SystemExit(f"make_preference_dataset.py made no pair from {args.pairs} prompts (--pairs-from {args.pairs_from})")
    store = out / "store"
    if store.exists():
        shutil.rmtree(store)
    summary = ingest_dataset(data / "data.jsonl", store, cfg, printer=lambda line: None, progress=False)
    print(f"offline store: {summary.store_rows} pairs from {data / 'data.jsonl'}", flush=True)
    return store / "offline"


def run_variant(name: str, extra: list[str], args, out: Path, store: Path, prompts, base) -> dict:
    from omnirl_async.config import load_config
    from omnirl_async.trainer.task_runner import TaskRunner

    run = out / name
    if run.exists():
        shutil.rmtree(run)
    (run / "ckpt").mkdir(parents=True)
    if extra:  # offline data: the run's own copy of the store (the buffer snapshots refer to it)
        shutil.copytree(store, run / "ckpt" / "offline")
    cfg = load_config(base_overrides(args.algo) + ALGOS[args.algo] + [
        f"trainer.v1.trainer_mode={args.mode}", f"trainer.total_time_minutes={args.minutes}",
        "trainer.total_training_steps=100000", "trainer.total_epochs=100000", f"trainer.save_freq={args.eval_every}",
        "trainer.test_freq=-1", f"trainer.default_local_dir={run / 'ckpt'}", f"trainer.log_dir={run / 'tb'}",
        f"actor_rollout_ref.rollout.val_kwargs.n={args.images_per_prompt}", f"data.seed={args.seed}",
        "trainer.progress_bar=false", *args.shared, *extra, *args.overrides])
    t0 = time.time()
    summary = TaskRunner(cfg, printer=lambda *a: None).run()
    minutes = (time.time() - t0) / 60
    losses = _scalars(run / "tb", "actor/loss")  # logged by every variant (offline-only runs have no rewards)
    t_first = losses[0][0] if losses else t0
    step_minute = {s: (w - t_first) / 60 for w, s, _ in losses}
    frac = _scalars(run / "tb", "buffer/offline_frac")
    names, before = per_prompt_strict(base)
    curve, last, best = [(0.0, overall(names, before))], before, (0, overall(names, before))
    for step, path in checkpoint_steps(run / "ckpt"):
        res = evaluate(cfg, path / "lora", prompts, args.seed)
        p2, acc = per_prompt_strict(res)
        assert p2 == names
        curve.append((step_minute.get(step, minutes), overall(names, acc)))
        best = max(best, (step, curve[-1][1]), key=lambda x: x[1])
        last = acc
        print(f"  {name:<10} step {step:>5} {curve[-1][0]:5.2f} min  overall {curve[-1][1]:.3f}", flush=True)
    gain, lo, hi = bootstrap_gain(names, before, last, seed=args.seed)
    return {"steps": summary["global_step"], "minutes": minutes, "offline_frac": frac[-1][2] if frac else 0.0,
            "before": curve[0][1], "after": curve[-1][1], "gain": gain, "ci": [lo, hi], "best": list(best),
            "curve": curve}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK} and a small batch")
    ap.add_argument("--minutes", type=float, default=10.0, help="training wall-clock per run")
    ap.add_argument("--algo", default="diffusion_nft", choices=("diffusion_nft", "dpo", "awm"))
    ap.add_argument("--mode", default="separate_async", choices=("sync", "separate_async"))
    ap.add_argument("--ratios", default="0.25,0.5", help="offline_mix_ratio values of the mixed runs")
    ap.add_argument("--pairs", type=int, default=256, help="training prompts of the preference dataset (one pair each)")
    ap.add_argument("--pairs-from", choices=("renders", "model"), default="renders",
                    help="renders: a render meeting every clause vs one breaking one; model: best vs worst of "
                         "--model-samples samples of the base model, ranked by the reward")
    ap.add_argument("--model-samples", type=int, default=8, metavar="K", help="with --pairs-from model")
    ap.add_argument("--pairs-lora", default=None, metavar="DIR",
                    help="with --pairs-from model: rank the samples of the base model with this LoRA (the `lora` "
                         "folder of an earlier run's checkpoint) instead of the base model's")
    ap.add_argument("--offline-advantage", type=float, default=None, metavar="A",
                    help="algorithm.offline_advantage for the runs that read offline pairs (default: adv_clip_max, "
                         "NFT's r = 1 / 0)")
    ap.add_argument("--store", default=None, metavar="DIR",
                    help="an offline store an earlier run of this benchmark built (<out>/store/offline): reuse it "
                         "instead of building the preference dataset again")
    ap.add_argument("--taper-to", type=float, default=None, metavar="F",
                    help="the mixed runs taper their offline share from r to F over the run "
                         "(buffer.offline_mix_ratio_final)")
    ap.add_argument("--taper-end", type=float, default=None, metavar="E",
                    help="with --taper-to: the share reaches F at this fraction of the run and stays there "
                         "(buffer.offline_mix_taper_end; the runs are named mix_<r>_to_<F>_by_<E>)")
    ap.add_argument("--runs", default=None, help="comma list of run names to do (default: all)")
    ap.add_argument("--eval-every", type=int, default=40, help="checkpoint (and evaluate) every N updates")
    ap.add_argument("--num-prompts", type=int, default=256, help="held-out prompts")
    ap.add_argument("--images-per-prompt", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_out/offline_mix")
    ap.add_argument("overrides", nargs="*", help="overrides for every run")
    args = ap.parse_args(argv)
    if args.store and args.pairs_lora:
        raise SystemExit("--pairs-lora picks the samples of a store to build; --store reuses a built one: "
                         "pass one of them")
    args.shared = []
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
        args.shared = list(QUICK_OVERRIDES)
    ratios = [float(r) for r in args.ratios.split(",") if r]

    import ray
    import torch

    from omnirl_async.config import load_config
    from omnirl_async.data.prompts import heldout_prompts
    from omnirl_async.trainer.task_runner import init_ray

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    prompts = heldout_prompts()[: args.num_prompts]
    overrides0 = base_overrides(args.algo) + ALGOS[args.algo] + args.shared + [
        f"actor_rollout_ref.rollout.val_kwargs.n={args.images_per_prompt}", *args.overrides]
    cfg0 = load_config(overrides0)
    if args.store:
        from omnirl_async.buffer.offline_store import OfflineStore

        store = Path(args.store)
        print(f"offline store: {len(OfflineStore(store.parent))} pairs reused from {store}", flush=True)
    else:
        store = build_store(args, out, cfg0, overrides0)
    base = evaluate(load_config(RL_DEFAULTS + [f"actor_rollout_ref.rollout.val_kwargs.n={args.images_per_prompt}"]
                                + args.shared), None, prompts, args.seed)
    started = init_ray(cfg0)  # one Ray for every run (TaskRunner joins it)
    results = {}
    try:
        todo = variants(ratios, args.offline_advantage, args.taper_to, args.taper_end)
        if args.runs:
            picked = [r for r in args.runs.split(",") if r]
            unknown = [r for r in picked if r not in todo]
            if unknown:
                raise SystemExit(f"--runs: no run named {unknown}; the runs are {list(todo)}")
            todo = {name: todo[name] for name in picked}
        for name, extra in todo.items():
            results[name] = run_variant(name, extra, args, out, store, prompts, base)
            (out / "results.json").write_text(json.dumps(results, indent=2))
    finally:
        if started:
            ray.shutdown()
    plot(results, out / "curves.png")
    print(f"\nheld-out strict accuracy, GenEval overall ({len(prompts)} prompts x {args.images_per_prompt} images, "
          f"seed {args.seed}); {args.algo}, {args.mode}, {args.minutes:g} min of training each, offline store "
          f"{args.store or f'{args.pairs} prompts, pairs from {args.pairs_from}'}"
          f"{f' ({args.pairs_lora})' if args.pairs_lora else ''}, offline advantage "
          f"{'adv_clip_max' if args.offline_advantage is None else f'{args.offline_advantage:g}'}:")
    print("| run | updates | offline share | before | after | gain (95 % CI) | best (step: overall) |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['steps']} | {r['offline_frac']:.2f} | {100 * r['before']:.1f} % | "
              f"{100 * r['after']:.1f} % | {r['gain']:+.1f} ({r['ci'][0]:+.1f}, {r['ci'][1]:+.1f}) | "
              f"{r['best'][0]}: {100 * r['best'][1]:.1f} % |")
    print(f"curves: {out / 'curves.png'}; command: python benchmarks/bench_offline_mix.py {' '.join(argv or sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
