"""Time to accuracy: sync vs separate_async at several staleness thresholds, same seeds and wall-clock (issue 17).

    python benchmarks/bench_staleness.py [--minutes 4] [--eval-every 15] [--thresholds 0,1,2,4]
                                         [--strategies wait,drop] [--no-auto] [--no-sync]
                                         [--recipe nft|geneval]
                                         [--correction decoupled,bypass]
                                         [--target 10] [--hold 3] [--table-from RESULTS_JSON ... [--plot PNG]]
                                         [--reward-latency SECONDS]
                                         [--num-prompts 256] [--images-per-prompt 4] [--out bench_out/staleness]

Trains the embedded shapes model with one recipe (``nft``: the demo's
DiffusionNFT recipe, the fastest learner in ``bench_algorithms.py``; ``geneval``:
FlowGRPO's GENEVAL_RECIPE) for ``--minutes`` of wall-clock per setting:

* ``sync`` – generate, then train, in turn (2 rollout workers, 2 learner processes);
* ``async t=K (wait|drop)`` – ``trainer.v1.trainer_mode=separate_async``
  with ``max_off_policy_threshold=K`` and that strategy (2 rollout workers at
  nice 10 beside 1 learner, the demo's layout on 2 cores);
* ``async auto`` – ``max_off_policy_threshold: auto`` (``trainer.v1.sampler.auto``
  defaults; docs/AUTO_THRESHOLD.md), strategy ``wait``; ``geneval`` only (it
  steers by the rollout/learner mismatch, which DiffusionNFT never measures).
* ``--correction bypass`` (``geneval``) adds every separate_async setting again with
  bypass-mode rollout correction (label suffix ``bypass``): the PPO ratio against
  the behaviour policy, so stale samples' steps fall outside FlowGRPO's clip
  range (the ``clipped %`` column: ``actor/pg_clipfrac``).

``--reward-latency S`` scores the training reward on a reward server
(``python -m omnirl_async.rewards.http_scorer``, the recipe's reward and
kwargs, a process of its own on loopback) that answers each batch ``S``
seconds late: a remote reward service (a VLM judge on other machines) whose
latency, not its capacity, is modelled (it scores up to 8 batches at once:
every group the 2 workers can have in flight). The held-out scoring stays
local.

Every setting checkpoints every ``--eval-every`` steps; each checkpoint is
scored on the held-out prompts (GenEval protocol: ODE sampling, fixed seeds,
strict = all clauses met, overall = mean over the categories). Printed per
setting: steps, samples consumed, samples/s (``perf/throughput``), the
machine's CPU busy share while it trained (first to last step:
what is left for an overlap to use is 1 minus it), learner
idle (``perf/learner_idle_frac``, the whole run's share), ``rollout_corr/kl`` and ``rollout_corr/ess``
(means over the run; "-" where the loss applies no rollout correction, e.g.
DiffusionNFT), held-out accuracy before / after with a paired bootstrap 95 %
interval on the gain, and **wall-clock minutes to +10 points** (``--target``;
first checkpoint at or above; interpolating would flatter coarse curves), with
the speed-up over sync, and again with the mean of ``--hold`` (3) checkpoints in
a row at or above (the time is the last of them: a curve that swings by
several points between neighbouring checkpoints no longer reaches the target on
one lucky point); ``--table-from <out>/results.json --target 5`` prints
an earlier run's table for another target without training again (give it
several runs' results.json, e.g. one per ``--seed``, and it prints their times
side by side, then the runs pooled per setting: the time to the target on the
mean of their curves and each setting's mean gain over the run, against the
best fixed threshold, with 95 % intervals from resampling the runs; with one,
``--plot PNG`` redraws its curves). ``--no-sync`` leaves sync out (more seeds
of the async settings alone; the runs pooled are then compared on the
settings every run has). Writes
``<out>/curves.png`` (accuracy vs minutes, one line per setting, a dashed line
at the base + ``--target`` points) and ``<out>/results.json``. On 2 shared cores expect a
minute or two of noise in the time to +10: run it twice (``--seed``) before
believing a ranking.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_algorithms import (add_heldout_args, checkpoint_steps, heldout_setup, minutes_to, plot,  # noqa: E402
                              run_setting)
from bench_geneval_rl import RL_DEFAULTS, _scalars  # noqa: E402

from omnirl_async.demo import NFT_OVERRIDES, PG_ONLY  # noqa: E402

#: separate_async on 2 cores: the demo's layout (rollouts niced so that the learner, the critical path, keeps a core)
ASYNC = ["trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.rollout.num_workers=2",
         "learner.num_workers=1", "actor_rollout_ref.rollout.nice=10"]
RECIPES = {
    "nft": [o for o in RL_DEFAULTS if not o.split("=", 1)[0].startswith(PG_ONLY)] + NFT_OVERRIDES,
    "geneval": list(RL_DEFAULTS),
}
#: recipes ``auto`` can steer: it reads the rollout/learner mismatch, which direct-preference losses never measure
#: (config validation refuses ``auto`` with them)
AUTO_RECIPES = ("geneval",)
#: checkpoints in a row whose mean must clear the target for the table's "held" time-to column
HOLD = 3
METRICS = ["perf/throughput", "perf/learner_idle_frac", "rollout_corr/kl", "rollout_corr/ess", "actor/pg_clipfrac"]
#: title of ``curves.png`` (a run's and ``--plot``'s redraw of one)
PLOT_TITLE = "held-out strict accuracy vs training wall-clock: sync and separate_async thresholds"
#: ``--correction`` values: the recipe's decoupled rollout correction, or bypass mode (old := behaviour)
CORRECTIONS = {"decoupled": [], "bypass": ["algorithm.rollout_correction.bypass_mode=true",
                                           "algorithm.rollout_correction.rollout_is=null"]}


def settings(args) -> list[tuple[str, list[str]]]:
    """(label, overrides) of every setting, sync first."""
    base = RECIPES[args.recipe]
    # sync trains on-policy: both corrections give it the same updates
    out = [("sync", base)] if args.sync else []
    pg = args.recipe in AUTO_RECIPES  # direct-preference recipes carry no rollout correction
    for correction in args.corrections if pg else ["decoupled"]:
        extra, tag = CORRECTIONS[correction], "" if correction == "decoupled" else f" {correction}"
        for strategy in args.strategies:
            for k in args.thresholds:
                out.append((f"async t={k} {strategy}{tag}", base + ASYNC + extra + [
                    f"trainer.v1.sampler.max_off_policy_threshold={k}",
                    f"trainer.v1.sampler.max_off_policy_strategy={strategy}"]))
        if args.auto and pg:
            out.append((f"async auto{tag}", base + ASYNC + extra + [
                "trainer.v1.sampler.max_off_policy_threshold=auto", "trainer.v1.sampler.max_off_policy_strategy=wait"]))
    return out


def training_order(args) -> list[tuple[str, list[str]]]:
    """:func:`settings` in the order they train: one after the other, so a machine whose speed drifts
    favours whichever comes at its fast hour; ``--reverse`` on every other seed cancels that in pooled
    figures (tables keep :func:`settings` ' order)."""
    out = settings(args)
    return out[::-1] if getattr(args, "reverse", False) else out


#: metrics the trainer logs as a running figure of the whole run so far: the run's value is the last one
RUN_SO_FAR = ("perf/learner_idle_frac",)


def run_metrics(run_dir: Path) -> dict[str, float | None]:
    """:data:`METRICS` over the run (None when never logged): the mean of per-step figures, the last value of
    :data:`RUN_SO_FAR` ones."""
    out = {}
    for tag in METRICS:
        vals = [v for _w, _s, v in _scalars(run_dir / "tb", tag)]
        out[tag] = None if not vals else float(vals[-1]) if tag in RUN_SO_FAR else float(np.mean(vals))
    return out


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


#: batches the ``--reward-latency`` server scores at once: rollout.num_workers (2) x the groups a worker keeps in
#: flight while it samples the next (RolloutWorker.max_inflight_scores, 4)
REMOTE_CONCURRENCY = 8


@contextlib.contextmanager
def remote_reward(recipe: list[str], latency_s: float, log_path: Path, start_timeout_s: float = 60.0):
    """Yield the training-only overrides that score the recipe's reward on a reward server in its own process (a
    service: its own interpreter and GIL), ``latency_s`` late per batch; none for 0 (the reward runs in the
    rollout workers as usual). The server's output goes to ``log_path``; it is stopped on exit."""
    if not latency_s:
        yield []
        return
    import subprocess

    from omnirl_async.config import load_config

    reward = load_config(recipe).reward
    if reward.reward_functions or reward.custom_reward_function.path is not None:
        raise SystemExit("--reward-latency serves the recipe's `reward.reward_fn_name`; this recipe combines "
                         "several reward functions or a custom one")
    cmd = [sys.executable, "-m", "omnirl_async.rewards.http_scorer", "--reward", reward.reward_fn_name,
           "--kwargs", json.dumps(dict(reward.reward_kwargs)), "--port", "0", "--delay", str(latency_s),
           "--concurrency", str(REMOTE_CONCURRENCY)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline, url = time.monotonic() + start_timeout_s, None
        while url is None:
            text = log_path.read_text()
            url = next((ln.split(" at ", 1)[1].split()[0] for ln in text.splitlines()
                        if ln.startswith("serving reward")), None)
            if url is None and (proc.poll() is not None or time.monotonic() > deadline):
                raise SystemExit(f"the reward server (process {proc.pid}) did not start within {start_timeout_s:g} "
                                 f"s (exit code {proc.poll()}; `{' '.join(cmd)}`); its output ({log_path}):\n"
                                 f"{text[-2000:]}")
            time.sleep(0.1)
        print(f"training reward {reward.reward_fn_name!r} served at {url} by process {proc.pid}, "
              f"{latency_s:g} s per batch (log: {log_path})", flush=True)
        yield ["reward.reward_fn_name=http_scorer", f"+reward.reward_kwargs.url={url}"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _speedup(label: str, sync_key: str, base: float | None, t: float | None, has_sync: bool = True) -> str:
    """``t`` against sync's ``base``: a ratio, ``sync: never`` (sync did not get there), or ``-`` (this is sync,
    this never got there, or the run has no sync: ``--no-sync``)."""
    if t and base:
        return f"{base / t:.2f}x"
    return "-" if label == sync_key or t is None or not has_sync else "sync: never"


def table(results: dict, sync_key: str = "sync", target: float = 10.0, hold: int = HOLD) -> list[str]:
    """One row per setting; the time to ``+target`` both at the first checkpoint over the line and with the mean of
    ``hold`` checkpoints in a row over it (``minutes_to(..., hold=...)``)."""
    lines = ["| setting | steps | samples/s | CPU busy % | learner idle % | rollout_corr/kl | IS ESS | clipped % | "
             f"before | after | gain (95 % CI) | min to +{target:g} | vs sync | "
             f"min to +{target:g}, {hold}-ckpt mean | vs sync |", "|" + "---|" * 15]
    has_sync = sync_key in results
    sync_curve = results[sync_key]["curve"] if has_sync else None
    base, base_held = ((minutes_to(sync_curve, target), minutes_to(sync_curve, target, hold))
                       if sync_curve else (None, None))
    for label, r in results.items():
        m = r["metrics"]
        t, held = minutes_to(r["curve"], target), minutes_to(r["curve"], target, hold)
        lines.append(
            f"| {label} | {r['steps']} | {fmt(m['perf/throughput'], '.1f')} | "
            f"{fmt(None if r.get('cpu_busy') is None else 100 * r['cpu_busy'], '.0f')} | "
            f"{fmt(None if m['perf/learner_idle_frac'] is None else 100 * m['perf/learner_idle_frac'], '.0f')} | "
            f"{fmt(m['rollout_corr/kl'], '.2g')} | {fmt(m['rollout_corr/ess'], '.2f')} | "
            f"{fmt(None if m.get('actor/pg_clipfrac') is None else 100 * m['actor/pg_clipfrac'], '.0f')} | "
            f"{100 * r['before']:.1f} % | "
            f"{100 * r['after']:.1f} % | {r['gain']:+.1f} ({r['ci'][0]:+.1f}, {r['ci'][1]:+.1f}) | "
            f"{'not reached' if t is None else f'{t:.1f}'} | {_speedup(label, sync_key, base, t, has_sync)} | "
            f"{'not reached' if held is None else f'{held:.1f}'} | "
            f"{_speedup(label, sync_key, base_held, held, has_sync)} |")
    return lines


def across(runs: dict[str, dict], sync_key: str = "sync", target: float = 10.0, hold: int = HOLD) -> list[str]:
    """One row per setting, one column per run (e.g. per seed): minutes to ``+target`` at the first checkpoint
    and held over ``hold`` checkpoints, with the speed-up over that run's sync on the held time."""
    names = list(runs)
    labels = list(dict.fromkeys(label for r in runs.values() for label in r))
    lines = [f"| setting | {' | '.join(names)} |", "|" + "---|" * (len(names) + 1),
             f"| (min to +{target:g}: first checkpoint / {hold}-ckpt mean, speed-up over sync on the mean) |"
             + " |" * len(names)]
    for label in labels:
        cells = []
        for run in runs.values():
            if label not in run:
                cells.append("-")
                continue
            t, held = minutes_to(run[label]["curve"], target), minutes_to(run[label]["curve"], target, hold)
            base = minutes_to(run[sync_key]["curve"], target, hold) if sync_key in run else None
            speed = _speedup(label, sync_key, base, held, sync_key in run)
            cells.append(f"{'never' if t is None else f'{t:.1f}'} / {'never' if held is None else f'{held:.1f}'}"
                         + ("" if speed == "-" else f" ({speed})"))
        lines.append(f"| {label} | {' | '.join(cells)} |")
    return lines


#: the grid on which :func:`pooled` averages the runs' curves, per x axis: minutes, or learner updates
GRID = {"minutes": 0.25, "updates": 10.0}
#: bootstrap resamples of the runs behind :func:`pooled`'s intervals
BOOT = 2000


def curve_steps(r: dict) -> list[int]:
    """The learner update of each point of a setting's curve (0 for the start): ``curve_steps`` of the results, or,
    for results written before it was kept, the checkpoints in its ``run_dir``."""
    if "curve_steps" in r:
        return list(r["curve_steps"])
    ckpt = Path(r.get("run_dir", "")) / "ckpt"
    steps = [0] + [step for step, _path in checkpoint_steps(ckpt)]
    if len(steps) != len(r["curve"]):
        raise ValueError(f"{ckpt}: {len(steps) - 1} checkpoints for the {len(r['curve']) - 1} points of the curve; "
                         "results without `curve_steps` need their run's checkpoints to pool them per update")
    return steps


def _gain_grid(xs: list[float], curve: list, grid: np.ndarray) -> np.ndarray:
    """Points over the curve's start at each ``grid`` value of its x axis (``xs``), read off straight lines between
    checkpoints."""
    return np.interp(grid, np.asarray(xs, float), 100.0 * (np.array([v for _m, v in curve], float) - curve[0][1]))


def _first_at(grid: np.ndarray, gains: np.ndarray, target: float) -> np.ndarray:
    """Per row of ``gains``: the first ``grid`` value (minute or update) at or above ``target`` (nan: never)."""
    over = gains >= target - 1e-9
    return np.where(over.any(-1), grid[np.argmax(over, -1)], np.nan)


def _ci(samples: np.ndarray, fmt: str, never: str = "never") -> str:
    """`` (lo, hi)``: the 95 % interval of bootstrap ``samples``; an infinite end (a time never reached; a ratio
    whose numerator never was) is printed as ``never``, nan (a ratio of two nevers) is left out."""
    x = samples[~np.isnan(samples)]
    if not len(x):
        return " (-)"
    ends = [np.percentile(x, 2.5, method="lower"), np.percentile(x, 97.5, method="higher")]
    return " (" + ", ".join(never if np.isinf(e) else format(e, fmt) for e in ends) + ")"


def _never_inf(t):
    return np.nan_to_num(t, nan=np.inf)


def pooled(runs: dict[str, dict], target: float = 10.0, x: str = "minutes", boot: int = BOOT,
           seed: int = 0) -> list[str]:
    """Several runs (e.g. one per ``--seed``) pooled per setting: each run's held-out curve as points over its
    own start on a grid of ``x`` (``minutes`` of training, or learner ``updates``: :data:`GRID`), averaged over the
    runs; the ``x`` to ``+target`` on that mean curve, the mean gain over the ``x`` every run covers (the area
    under the curve: a statistic that no single lucky checkpoint moves), and, against the best fixed threshold
    (soonest to the target, then the larger mean gain), the ratio of the times and the difference of the mean
    gains. The 95 % intervals resample the runs (paired: one resample serves every setting). Settings missing
    from a run are left out; one run gives no intervals. Per update, settings that run at the same speed compare
    without the machine's speed changing between them (it does, between settings run one after another)."""
    if x not in GRID:
        raise ValueError(f"x = {x!r}: one of {sorted(GRID)}")
    labels = [label for label in dict.fromkeys(k for r in runs.values() for k in r)
              if all(label in r for r in runs.values())]
    xs = {(name, label): [m for m, _v in r[label]["curve"]] if x == "minutes" else curve_steps(r[label])
          for name, r in runs.items() for label in labels}
    end = min(v[-1] for v in xs.values())
    grid = np.arange(0.0, end + 1e-9, GRID[x])
    gains = {label: np.stack([_gain_grid(xs[name, label], r[label]["curve"], grid) for name, r in runs.items()])
             for label in labels}
    n = len(runs)
    idx = np.random.default_rng(seed).integers(0, n, (boot, n))
    t_point = {k: _never_inf(_first_at(grid, g.mean(0, keepdims=True), target)[0]) for k, g in gains.items()}
    t_boot = {k: _never_inf(_first_at(grid, g[idx].mean(1), target)) for k, g in gains.items()}
    area = {k: g.mean(-1) for k, g in gains.items()}  # one mean gain per run
    fixed = [k for k in labels if k.startswith("async t=")]
    best = min(fixed, key=lambda k: (t_point[k], -area[k].mean())) if fixed else None
    ci = _ci if n > 1 else (lambda *_a: "")
    unit, fmt, span = ("min", ".2f", f"{end:.1f}") if x == "minutes" else ("updates", ".0f", f"{end:.0f}")
    lines = [f"pooled over {n} runs ({', '.join(runs)}) per {x[:-1]}: curves on a {GRID[x]:g}-{x[:-1]} grid up to "
             f"{span} {unit}; best fixed threshold: {best or '-'}",
             f"| setting | {unit} to +{target:g}, mean curve (95 % CI) | mean gain, 0-{span} {unit} (95 % CI) | "
             f"best fixed / this: {unit} ratio (95 % CI) | this - best fixed: mean gain (95 % CI) |",
             "|" + "---|" * 5]
    with np.errstate(invalid="ignore", divide="ignore"):  # never / never: no ratio
        for k in labels:
            t = t_point[k]
            cells = [("never" if np.isinf(t) else format(t, fmt)) + ci(t_boot[k], fmt),
                     f"{area[k].mean():+.2f}" + ci(area[k][idx].mean(1), "+.2f")]
            if best is None or k == best:
                cells += ["-", "-"]
            else:
                ratio, diff = t_point[best] / t, area[k] - area[best]
                point = "-" if np.isnan(ratio) else "inf" if np.isinf(ratio) else f"{ratio:.2f}x"
                cells += [point + ci(t_boot[best] / t_boot[k], ".2f", "inf"),
                          f"{diff.mean():+.2f}" + ci(diff[idx].mean(1), "+.2f")]
            lines.append(f"| {k} | {' | '.join(cells)} |")
    return lines


def _list(kind, choices=None):
    def parse(text: str):
        out = [kind(v) for v in text.split(",") if v]
        if not out or (choices is not None and any(v not in choices for v in out)):
            raise argparse.ArgumentTypeError(f"{text!r}: a comma list" + (f" from {choices}" if choices else ""))
        return out
    return parse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=4.0, help="training wall-clock per setting")
    ap.add_argument("--eval-every", type=int, default=15, help="checkpoint (and score) every N steps")
    ap.add_argument("--thresholds", type=_list(int), default=[0, 1, 2, 4], help="max_off_policy_threshold values")
    ap.add_argument("--strategies", type=_list(str, ["wait", "drop"]), default=["wait", "drop"])
    ap.add_argument("--no-auto", dest="auto", action="store_false", help="leave out max_off_policy_threshold: auto")
    ap.add_argument("--no-sync", dest="sync", action="store_false",
                    help="leave out sync (e.g. more seeds of the async settings alone; no speed-up column then)")
    ap.add_argument("--reverse", action="store_true",
                    help="train the settings in reverse order (sync last): use it on every other seed so that "
                         "the machine's speed drifting during a run cancels in pooled figures")
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="nft")
    ap.add_argument("--correction", dest="corrections", type=_list(str, sorted(CORRECTIONS)), default=["decoupled"],
                    help="rollout correction of the separate_async settings (geneval recipe), a comma list: "
                         "decoupled (the recipe's) and/or bypass (each threshold once per value)")
    ap.add_argument("--target", type=float, default=10.0, help="points over the base for the time-to column")
    ap.add_argument("--hold", type=int, default=HOLD,
                    help="checkpoints in a row whose mean must clear the target for the second time-to column")
    ap.add_argument("--table-from", metavar="RESULTS_JSON", nargs="+", default=None,
                    help="print the table of an earlier run's results.json (e.g. with another --target) and exit; "
                         "with several (e.g. one per seed), each one's table and then the times side by side")
    ap.add_argument("--plot", metavar="PNG", type=Path, default=None,
                    help="with --table-from and one results.json: redraw its curves (with the --target line) here")
    ap.add_argument("--reward-latency", type=float, default=0.0, metavar="SECONDS",
                    help="score the training reward on a loopback server answering each batch this late "
                         "(a remote reward service); 0 = in the rollout workers")
    add_heldout_args(ap, "bench_out/staleness")
    args = ap.parse_args(argv)
    if not args.reward_latency >= 0:
        ap.error(f"--reward-latency {args.reward_latency}: seconds >= 0")
    if args.plot and len(args.table_from or ()) != 1:
        ap.error("--plot redraws one earlier run: give it with --table-from RESULTS_JSON (exactly one)")
    if args.hold < 1:
        ap.error(f"--hold {args.hold}: the number of checkpoints averaged must be >= 1")
    if args.table_from:
        runs = {path: json.loads(Path(path).read_text()) for path in args.table_from}
        for path, results in runs.items():
            print(f"{path}:\n" + "\n".join(table(results, target=args.target, hold=args.hold)) + "\n")
        if len(runs) > 1:
            print("\n".join(across(runs, target=args.target, hold=args.hold)) + "\n")
            print("\n".join(pooled(runs, target=args.target)) + "\n")
            try:
                print("\n".join(pooled(runs, target=args.target, x="updates")))
            except ValueError as e:
                print(f"(not pooled per update: {e})")
        if args.plot:
            (results,) = runs.values()
            plot(results, args.plot, title=PLOT_TITLE, target=args.target)
            print(f"curves: {args.plot}")
        return 0
    if any(k < 0 for k in args.thresholds):
        ap.error(f"--thresholds {args.thresholds}: integers >= 0")
    if args.auto and args.recipe not in AUTO_RECIPES:
        print(f"(no `auto` setting: recipe {args.recipe} is a direct-preference loss, which measures no "
              "rollout/learner mismatch for `auto` to steer by; --recipe geneval has one)")

    out, prompts, base = heldout_setup(args)
    t0 = time.time()
    results: dict[str, dict] = {}
    with remote_reward(RECIPES[args.recipe] + args.overrides, args.reward_latency,
                       out / "reward_server.log") as train_only:
        for label, overrides in training_order(args):
            r = run_setting(label.replace(" ", "_").replace("=", ""), overrides, args, out, prompts, base,
                            train_overrides=train_only)
            r["metrics"] = run_metrics(Path(r["run_dir"]))
            r["reward_latency_s"] = args.reward_latency
            results[label] = r
            (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    results = {label: results[label] for label, _ in settings(args)}  # the tables' order, whatever trained first
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    plot(results, out / "curves.png", title=PLOT_TITLE, target=args.target)
    print(f"\nrecipe {args.recipe}, {args.minutes:g} min per setting, held-out GenEval overall strict accuracy "
          f"({len(prompts)} prompts x {args.images_per_prompt} images, seed {args.seed})"
          + (f", training reward {args.reward_latency:g} s late per batch" if args.reward_latency else "")
          + f"; {time.time() - t0:.0f} s:")
    print("\n".join(table(results, target=args.target, hold=args.hold)))
    print(f"curves: {out / 'curves.png'}; command: python benchmarks/bench_staleness.py "
          f"{' '.join(argv if argv is not None else sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
