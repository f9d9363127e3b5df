"""``omnirl-async report RUN_DIR...``: compare runs (a staleness sweep) from what each run wrote.

A run folder holds ``resolved_config.yaml`` (``omnirl-async train`` writes it
into ``trainer.default_local_dir`` and into the log folder) and, in the log
folder, TensorBoard events (``trainer.logger`` with ``tensorboard``). The
report reads, per run:

* the config, to name the keys whose values differ between the runs;
* per training step: ``timing_s/step`` (its event time, minus the first step's
  duration, starts the run's wall-clock: the training loop's start, as
  ``perf/learner_idle_frac`` counts it), ``perf/total_num_samples`` (samples
  trained that step; summed: samples so far), ``critic/rewards/mean``, the last
  ``perf/learner_idle_frac``;
* the held-out metric ``val/overall`` (GenEval's task-averaged accuracy; else
  ``val/strict``), with the wall-clock of each validation (one before the
  first step, ``val_before_train``, sits at 0 s);
* staleness: the per-sample histogram ``training/off_policy/trajectory_staleness``
  (one bucket per version), else the per-step ``.../mean`` weighted by the
  step's samples and ``.../max``.

It prints one row per run and saves a PNG (:mod:`omnirl_async.metrics.report_plot`).
A folder without ``resolved_config.yaml`` whose sub-folders have one (a
sweep's ``<dir>/sweep``) stands for those runs.
"""

from __future__ import annotations

import glob
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping, Sequence

import numpy as np

from omnirl_async.metrics.loggers import flatten_config, resolve_log_dir
from omnirl_async.preflight import InputError

__all__ = ["RESOLVED_CONFIG", "RunData", "find_runs", "load_run", "read_integer_histogram", "differing_keys",
           "summary_row", "format_table", "report"]

#: The file ``omnirl_async.trainer.run_dir`` writes into each run folder (the same name; a test checks).
RESOLVED_CONFIG = "resolved_config.yaml"
STEP_TIME = "timing_s/step"
SAMPLES = "perf/total_num_samples"
REWARD = "critic/rewards/mean"
IDLE = "perf/learner_idle_frac"
VAL_KEYS = ("val/overall", "val/strict")
STALENESS = "training/off_policy/trajectory_staleness"
#: Config keys that differ between any two runs by construction (where they write), left out of the table.
PER_RUN_KEYS = ("trainer.default_local_dir", "trainer.log_dir")


@dataclass
class RunData:
    """What one run logged, on its own wall-clock (seconds since its training loop started)."""

    folder: Path
    log_dir: Path
    config: dict[str, Any]  # flat: key path -> value
    steps: np.ndarray  # training steps with a reward
    wall: np.ndarray  # their wall-clock, s
    samples: np.ndarray  # samples trained up to and including each of them
    reward: np.ndarray
    total_samples: float = 0.0
    run_s: float = float("nan")
    learner_idle: float = float("nan")
    val_key: str | None = None
    val_wall: np.ndarray = field(default_factory=lambda: np.zeros(0))
    val: np.ndarray = field(default_factory=lambda: np.zeros(0))
    staleness: dict[int, int] = field(default_factory=dict)  # lag -> samples (empty: no histogram logged)
    staleness_mean: float = float("nan")
    staleness_max: float = float("nan")
    label: str = ""


# ---------------------------------------------------------------------------- finding runs
def _is_run(folder: Path) -> bool:
    return (folder / RESOLVED_CONFIG).is_file()


def find_runs(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """The run folders named by ``paths``: run folders, folders of runs (a sweep folder), shell globs."""
    if not paths:
        raise InputError("report: give at least one RUN_DIR (a run's trainer.default_local_dir or log folder, or "
                         "a sweep folder <dir>/sweep).")
    found: list[Path] = []
    for raw in paths:
        text = os.fspath(raw)
        matches = [Path(text)] if Path(text).exists() else [Path(m) for m in sorted(glob.glob(text))]
        if not matches:
            raise InputError(f"report: RUN_DIR {text!r} does not exist. Fix: give a run's folder "
                             "(trainer.default_local_dir) or a sweep folder <dir>/sweep.")
        for p in matches:
            if _is_run(p):
                found.append(p)
                continue
            children = sorted(c for c in p.iterdir() if c.is_dir() and _is_run(c)) if p.is_dir() else []
            if not children:
                raise InputError(f"report: RUN_DIR {os.fspath(p)!r} has no {RESOLVED_CONFIG} (nor has any folder "
                                 "in it): not a run folder. `omnirl-async train` writes the file into "
                                 "trainer.default_local_dir and the log folder. Fix: give a run's folder or a sweep "
                                 "folder <dir>/sweep.")
            found.extend(children)
    unique: dict[Path, Path] = {}
    for p in found:
        unique.setdefault(p.resolve(), p)
    return list(unique.values())


def _read_config(folder: Path) -> dict[str, Any]:
    from omegaconf import OmegaConf

    path = folder / RESOLVED_CONFIG
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as err:  # noqa: BLE001 - YAML and OmegaConf errors come in several types
        raise InputError(f"report: {path} cannot be read ({type(err).__name__}: {str(err).splitlines()[0]}). "
                         "Fix: restore the run's resolved_config.yaml, or leave the run out.") from None
    if not isinstance(data, dict):
        raise InputError(f"report: {path} is not a mapping of config keys. Fix: restore the run's "
                         "resolved_config.yaml, or leave the run out.")
    data.pop("defaults", None)
    return flatten_config(data)


def _has_events(folder: Path) -> bool:
    return folder.is_dir() and any(folder.glob("events.out.tfevents.*"))


def _log_dir(folder: Path, config: Mapping[str, Any]) -> Path:
    """The folder with the run's events: the run folder itself (its log folder), else the config's log folder."""
    if _has_events(folder):
        return folder
    trainer = SimpleNamespace(log_dir=config.get("trainer.log_dir"),
                              project_name=config.get("trainer.project_name", ""),
                              experiment_name=config.get("trainer.experiment_name", ""))
    log_dir = resolve_log_dir(trainer)
    if _has_events(log_dir):
        return log_dir
    loggers = config.get("trainer.logger")
    loggers = [loggers] if isinstance(loggers, str) else list(loggers or [])
    fix = ("it was trained with `trainer.logger` = " + repr(loggers) + ": rerun with tensorboard in it, e.g. "
           "`trainer.logger=[console,tensorboard]`") if "tensorboard" not in loggers else \
        "the run may have failed before its first step, or its log folder was moved: point report at the log " \
        "folder (it holds resolved_config.yaml too)"
    raise InputError(f"report: run {os.fspath(folder)!r} has no TensorBoard events (looked in {folder} and "
                     f"{log_dir}); {fix}.")


# ---------------------------------------------------------------------------- reading events
def read_integer_histogram(hist) -> dict[int, int]:
    """Counts per integer of a histogram written by :meth:`Tracking.log_histogram` (edges at ``k +- 0.5``)."""
    out: dict[int, int] = {}
    for limit, count in zip(hist.bucket_limit, hist.bucket):
        if count > 0:
            k = int(round(limit - 0.5))
            out[k] = out.get(k, 0) + int(round(count))
    return out


def _scalars(acc, tag: str) -> list[tuple[int, float, float]]:
    """``(step, wall_time, value)`` of a tag, the last event per step (a resumed run logs some steps again)."""
    if tag not in acc.Tags().get("scalars", []):
        return []
    by_step = {e.step: (e.step, e.wall_time, float(e.value)) for e in acc.Scalars(tag)}
    return [by_step[s] for s in sorted(by_step)]


def load_run(folder: str | os.PathLike) -> RunData:
    """Read one run folder (see the module docstring); :class:`InputError` when config or events are missing."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = Path(folder)
    if not _is_run(folder):
        raise InputError(f"report: RUN_DIR {os.fspath(folder)!r} has no {RESOLVED_CONFIG}: not a run folder. Fix: "
                         "give a run's trainer.default_local_dir or log folder.")
    config = _read_config(folder)
    log_dir = _log_dir(folder, config)
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0, "images": 1, "tensors": 1})
    acc.Reload()

    # 1. the run's clock: the training loop started one step duration before the first step was logged
    step_time = _scalars(acc, STEP_TIME)
    first_wall = min((e.wall_time for tag in acc.Tags().get("scalars", []) for e in acc.Scalars(tag)[:1]),
                     default=0.0)
    t0 = step_time[0][1] - step_time[0][2] if step_time else first_wall
    # 2. samples so far, per step
    per_step = {s: v for s, _, v in _scalars(acc, SAMPLES)}
    cum, total = {}, 0.0
    for s in sorted(per_step):
        total += per_step[s]
        cum[s] = total
    # 3. reward per step
    rewards = _scalars(acc, REWARD)
    steps = np.array([s for s, _, _ in rewards], dtype=np.int64)
    run = RunData(folder=folder, log_dir=log_dir, config=config, steps=steps,
                  wall=np.array([w - t0 for _, w, _ in rewards], dtype=np.float64),
                  samples=np.array([cum.get(s, np.nan) for s in steps], dtype=np.float64),
                  reward=np.array([v for _, _, v in rewards], dtype=np.float64), total_samples=total)
    last_wall = max([w for _, w, _ in step_time] + [w for _, w, _ in rewards], default=None)
    if last_wall is not None:
        run.run_s = last_wall - t0
    idle = _scalars(acc, IDLE)
    if idle:
        run.learner_idle = idle[-1][2]
    # 4. held-out accuracy
    for key in VAL_KEYS:
        val = _scalars(acc, key)
        if val:
            run.val_key = key
            first_step = step_time[0][0] if step_time else 1
            run.val_wall = np.array([0.0 if s < first_step else max(0.0, w - t0) for s, w, _ in val],
                                    dtype=np.float64)
            run.val = np.array([v for _, _, v in val], dtype=np.float64)
            break
    # 5. staleness: the exact per-sample histogram, else the per-step summaries
    if STALENESS in acc.Tags().get("histograms", []):
        by_step = {e.step: e.histogram_value for e in acc.Histograms(STALENESS)}
        for hist in by_step.values():
            for lag, n in read_integer_histogram(hist).items():
                run.staleness[lag] = run.staleness.get(lag, 0) + n
    if run.staleness:
        lags = np.array(sorted(run.staleness), dtype=np.float64)
        counts = np.array([run.staleness[int(k)] for k in lags], dtype=np.float64)
        run.staleness_mean = float((lags * counts).sum() / counts.sum())
        run.staleness_max = float(lags.max())
    else:
        means = _scalars(acc, f"{STALENESS}/mean")
        if means:
            w = np.array([per_step.get(s, 1.0) for s, _, _ in means], dtype=np.float64)
            run.staleness_mean = float(np.dot(w, [v for _, _, v in means]) / max(w.sum(), 1e-12))
        maxes = _scalars(acc, f"{STALENESS}/max")
        if maxes:
            run.staleness_max = max(v for _, _, v in maxes)
    return run


# ---------------------------------------------------------------------------- the table
def differing_keys(runs: Sequence[RunData]) -> list[str]:
    """Config keys whose values differ between the runs (sorted; where each run writes left out)."""
    if len(runs) < 2:
        return []
    keys = set().union(*(r.config for r in runs))
    out = []
    for key in sorted(keys):
        if key in PER_RUN_KEYS:
            continue
        values = [repr(r.config[key]) if key in r.config else "<absent>" for r in runs]
        if len(set(values)) > 1:
            out.append(key)
    return out


def summary_row(run: RunData) -> dict[str, float]:
    """The numbers of one table row (NaN where the run logged nothing)."""
    nan = float("nan")
    row = {"steps": float(run.steps[-1]) if len(run.steps) else 0.0, "samples": run.total_samples,
           "wall_s": run.run_s,
           "samples_per_s": run.total_samples / run.run_s if run.run_s and run.run_s > 0 else nan,
           "learner_idle": run.learner_idle,
           "reward_final": float(run.reward[-1]) if len(run.reward) else nan,
           "reward_best": float(run.reward.max()) if len(run.reward) else nan,
           "val_first": nan, "val_final": nan, "val_best": nan, "val_best_at_s": nan,
           "staleness_mean": run.staleness_mean, "staleness_max": run.staleness_max}
    if len(run.val):
        best = int(np.argmax(run.val))  # the first time the best value was reached
        row.update(val_first=float(run.val[0]), val_final=float(run.val[-1]), val_best=float(run.val[best]),
                   val_best_at_s=float(run.val_wall[best]))
    return row


def _fmt(value: Any, kind: str) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    if kind == "int":
        return f"{value:.0f}"
    if kind == "pct":
        return f"{100 * value:.0f}%"
    if kind == "s":
        return f"{value:.1f}"
    if kind == "f1":
        return f"{value:.1f}"
    if kind == "f2":
        return f"{value:.2f}"
    if kind == "f3":
        return f"{value:.3f}"
    return str(value)


#: (row key, header, format) of the numeric columns
COLUMNS = (("steps", "steps", "int"), ("samples", "samples", "int"), ("wall_s", "wall s", "s"),
           ("samples_per_s", "samples/s", "f2"), ("learner_idle", "learner idle", "pct"),
           ("reward_final", "reward final", "f3"), ("reward_best", "best", "f3"),
           ("val_first", "{val} first", "f3"), ("val_final", "final", "f3"), ("val_best", "best", "f3"),
           ("val_best_at_s", "best at s", "s"), ("staleness_mean", "staleness mean", "f2"),
           ("staleness_max", "max", "int"))


def _labels(runs: Sequence[RunData]) -> list[str]:
    names = [r.folder.name for r in runs]
    return names if len(set(names)) == len(names) else [os.fspath(r.folder) for r in runs]


def format_table(runs: Sequence[RunData]) -> str:
    """One row per run: the differing config keys, then the numbers of :func:`summary_row`."""
    keys = differing_keys(runs)
    leaves = [k.rsplit(".", 1)[-1] for k in keys]
    key_headers = [leaf if leaves.count(leaf) == 1 else key for leaf, key in zip(leaves, keys)]
    val_keys = {r.val_key for r in runs if r.val_key}
    val = val_keys.pop() if len(val_keys) == 1 else "held-out"
    headers = ["run", *key_headers, *(h.format(val=val) for _, h, _ in COLUMNS)]
    rows = []
    for run, label in zip(runs, _labels(runs)):
        row = summary_row(run)
        rows.append([label, *(_show_value(run.config.get(k)) for k in keys),
                     *(_fmt(row[k], kind) for k, _, kind in COLUMNS)])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    n_text = 1 + len(keys)  # left-aligned columns

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i < n_text else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]
    return "\n".join(out)


def _show_value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(_show_value(v) for v in value) + "]"
    return "null" if value is None else str(value)


def default_png(runs: Sequence[RunData]) -> Path:
    """``<common parent>/report.png`` when every run sits in one folder (a sweep), else ``report.png`` here."""
    parents = {r.folder.resolve().parent for r in runs}
    return (runs[0].folder.parent / "report.png") if len(parents) == 1 else Path("report.png")


def report(paths: Sequence[str | os.PathLike], *, png: str | os.PathLike | None = None,
           printer=print) -> tuple[list[RunData], Path | None]:
    """Print the table of the runs in ``paths`` and save the PNG; returns the runs and the PNG's path."""
    from omnirl_async.metrics.report_plot import plot_runs

    runs = [load_run(p) for p in find_runs(paths)]
    for run, label in zip(runs, _labels(runs)):
        run.label = label
    printer(format_table(runs))
    for run in runs:
        printer(f"  {run.label}: {run.folder}" + (f"  (events: {run.log_dir})" if run.log_dir != run.folder else ""))
    out = Path(png) if png is not None else default_png(runs)
    path = plot_runs(runs, out)
    printer(f"plot: {path}")
    return runs, path
