"""Sweeps: ``omnirl-async train -m key=a,b,c ...`` trains every combination, one run directory each.

Hydra's multirun semantics, without Hydra's launcher (the project composes
its config with Hydra's compose API, :mod:`omnirl_async.config.loader`):

* every override is parsed with Hydra's own override parser; one whose value
  is a sweep -- a comma list ``key=0,1,2,4``, ``choice(...)``, ``range(...)``
  and ``shuffle``/``sort`` of them -- contributes its values, every other
  override is passed to each run unchanged. A quoted comma (``key='a,b'``) is
  one value, ``key=[1,2],[3]`` sweeps two lists.
* the runs are the cartesian product of the swept values, the first swept key
  varying slowest (Hydra's ``BasicSweeper`` order), trained one after another
  in this process.
* run ``k`` writes its checkpoints to ``<trainer.default_local_dir>/sweep/<name>``
  and its logs to ``<log dir>/sweep/<name>``, where ``<name>`` is
  ``key=value`` of each swept key joined by ``,``
  (``max_off_policy_threshold=2``; the last part of the key path unless two
  swept keys share it). ``omnirl-async report <dir>/sweep`` compares them.

Every run's config is composed and validated before the first run starts, so
a value one of them refuses (``max_off_policy_threshold=2`` under
``trainer_mode=sync``) stops the sweep at once, not after hours. A run that
fails while training is reported and the sweep goes on to the next one.

Refused (why): no swept override (drop ``-m``); ``interval()`` / ``glob()``
(they need an optimiser or a config group to enumerate); a key swept twice;
two runs that would get the same directory; and, with more than one run,
``trainer.resume_mode=resume_path`` with one ``trainer.resume_from_path`` --
every run would continue that one run (its optimizer, buffer and prompt
cursor). ``resume_mode=auto`` is per run: rerunning a sweep continues each
run from its own directory.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import shlex
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from omnirl_async.config import load_config
from omnirl_async.config.loader import override_key
from omnirl_async.config.presets import applied_presets, attach
from omnirl_async.config.validate import ConfigError
from omnirl_async.metrics.loggers import resolve_log_dir

__all__ = ["SWEEP_FOLDER", "SweepRun", "PlannedRun", "RunOutcome", "expand_sweep", "plan_sweep", "run_sweep",
           "sweep"]

#: The folder under a run's ``default_local_dir`` (and log dir) that holds the sweep's runs.
SWEEP_FOLDER = "sweep"


@dataclass(frozen=True)
class SweepRun:
    """One combination: its overrides (each sweep replaced by one value) and its directory name."""

    overrides: tuple[str, ...]
    swept: tuple[tuple[str, str], ...]  # (key, value as an override value) of each swept key, in order
    name: str


@dataclass(frozen=True)
class PlannedRun:
    """A combination with its validated config and the folders it writes."""

    index: int
    run: SweepRun
    config: object  # DiffusionTrainerConfig
    run_dir: Path
    log_dir: Path


@dataclass(frozen=True)
class RunOutcome:
    planned: PlannedRun
    ok: bool
    detail: str  # ok: "step N, T s"; failed: the one-line reason

    def line(self) -> str:
        return f"  {'ok' if self.ok else 'failed':<7} {self.planned.run.name}  {self.detail}"


# ---------------------------------------------------------------------------- expansion (pure)
def _parse(text: str, parser):
    key = override_key(text)
    try:
        return parser.parse_override(text)
    except Exception as err:  # noqa: BLE001 - Hydra's grammar errors come in several types
        first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
        raise ConfigError(f"`{key}`: cannot parse the override {text!r} ({first}); write `{key}=<value>` or a "
                          f"sweep `{key}=a,b,c` in Hydra's grammar, quoting a value with spaces or commas "
                          f"(`{key}='a,b'`).") from None


def _values(text: str, parsed) -> list[str]:
    key = parsed.key_or_group
    try:
        values = list(parsed.sweep_string_iterator())
    except Exception:  # noqa: BLE001 - Hydra raises HydraException (interval) or others (glob needs a loader)
        raise ConfigError(f"`{key}`: {text!r} cannot be enumerated: a sweep here is a comma list "
                          f"(`{key}=0,1,2`), choice(...), range(...), or shuffle/sort of them; interval() and "
                          "glob() are not supported.") from None
    if not values:
        raise ConfigError(f"`{key}`: the sweep {text!r} has no values; give at least one, e.g. `{key}=0,1`.")
    return values


_UNSAFE = re.compile(r"[^A-Za-z0-9._+\-@:]+")


def _dir_part(value: str) -> str:
    """A swept value as part of a folder name: quotes dropped, anything but ``[A-Za-z0-9._+-@:]`` -> ``_``."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1]
    return _UNSAFE.sub("_", value) or "_"


def expand_sweep(overrides: Sequence[str]) -> list[SweepRun]:
    """The cartesian product of the swept overrides: one :class:`SweepRun` per combination, first key slowest.

    Raises :class:`ConfigError` (naming the key) when nothing is swept, a sweep cannot be enumerated or is
    empty, a key is swept twice, or two combinations would share a directory name."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    parsed = [(text, _parse(text, parser)) for text in overrides]
    sweeps = [(i, p) for i, (text, p) in enumerate(parsed) if p.is_sweep_override()]
    if not sweeps:
        raise ConfigError(f"`-m` (multirun) needs an override with a comma list of values, e.g. "
                          f"`trainer.v1.sampler.max_off_policy_threshold=0,1,2,4`; none of {list(overrides)} has "
                          "one. Fix: add one, or drop `-m` for a single run.")
    keys = [p.key_or_group for _, p in sweeps]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ConfigError(f"`{twice[0]}` is swept more than once; give all its values in one override, e.g. "
                          f"`{twice[0]}=0,1,2`.")
    leaves = [k.rsplit(".", 1)[-1] for k in keys]
    labels = [leaf if leaves.count(leaf) == 1 else key for leaf, key in zip(leaves, keys)]
    values = [_values(parsed[i][0], p) for i, p in sweeps]
    runs: list[SweepRun] = []
    seen: dict[str, tuple[tuple[str, str], ...]] = {}
    for combo in itertools.product(*values):
        texts = [text for text, _ in parsed]
        for (i, p), value in zip(sweeps, combo):
            texts[i] = f"{p.get_key_element()}={value}"
        swept = tuple(zip(keys, combo))
        name = ",".join(f"{label}={_dir_part(v)}" for label, v in zip(labels, combo))
        if name in seen:
            a = ", ".join(f"{k}={v}" for k, v in seen[name])
            b = ", ".join(f"{k}={v}" for k, v in swept)
            raise ConfigError(f"the sweep runs {a} and {b} would share the run directory `{SWEEP_FOLDER}/{name}`; "
                              "Fix: give each value once (values that differ only in characters other than "
                              "letters, digits and ._+-@: map to the same folder name).")
        seen[name] = swept
        runs.append(SweepRun(overrides=tuple(texts), swept=swept, name=name))
    return runs


# ---------------------------------------------------------------------------- planning
def plan_sweep(overrides: Sequence[str], *, config_name: str = "diffusion_trainer",
               config_dir=None) -> list[PlannedRun]:
    """Expand, then compose and validate every run's config with its own directories (before anything runs)."""
    runs = expand_sweep(overrides)
    planned: list[PlannedRun] = []
    for index, run in enumerate(runs):
        where = f"sweep run {index + 1}/{len(runs)} ({run.name})"
        try:
            cfg = load_config(list(run.overrides), config_name=config_name, config_dir=config_dir)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
        run_dir = Path(cfg.trainer.default_local_dir) / SWEEP_FOLDER / run.name
        log_dir = resolve_log_dir(cfg.trainer) / SWEEP_FOLDER / run.name
        planned.append(PlannedRun(index, run, _with_folders(cfg, run_dir, log_dir), run_dir, log_dir))
    _check_separate(planned)
    return planned


def _with_folders(cfg, run_dir: Path, log_dir: Path):
    """``cfg`` writing to the run's own folders (two plain path strings: composing again is not needed)."""
    trainer = dataclasses.replace(cfg.trainer, default_local_dir=str(run_dir), log_dir=str(log_dir))
    return attach(dataclasses.replace(cfg, trainer=trainer), applied_presets(cfg))


def _check_separate(planned: list[PlannedRun]) -> None:
    """Refuse runs that would write into, or continue from, the same folder."""
    if len(planned) < 2:
        return
    by_dir: dict[Path, PlannedRun] = {}
    for p in planned:
        for folder in (p.run_dir, p.log_dir):
            other = by_dir.setdefault(folder.resolve(), p)
            if other is not p:
                raise ConfigError(f"the sweep runs {other.run.name} and {p.run.name} would share the folder "
                                  f"{folder}; Fix: sweep values that give each run its own folder.")
    by_source: dict[str, list[PlannedRun]] = {}
    for p in planned:
        t = p.config.trainer
        if t.resume_mode == "resume_path":
            by_source.setdefault(str(Path(t.resume_from_path).resolve()), []).append(p)
    for source, group in by_source.items():
        if len(group) > 1:
            raise ConfigError(
                f"`trainer.resume_mode` = resume_path with `trainer.resume_from_path` = {source!r} for "
                f"{len(group)} sweep runs ({', '.join(g.run.name for g in group)}): each would continue that one "
                "run (its optimizer, replay buffer, prompt cursor and step count). Fix: "
                "`trainer.resume_mode=auto` (each run continues its own <dir>/sweep/<name> when the sweep is "
                "rerun) or `disable`; to start every run from that checkpoint's weights set "
                f"`actor_rollout_ref.model.lora_adapter_path={source}/lora` with `trainer.resume_mode=disable`; "
                "or sweep `trainer.resume_from_path` as well.")


# ---------------------------------------------------------------------------- running
def _reason(err: BaseException) -> str:
    """The error as one line: its type and first line (a Ray-wrapped error: the original one)."""
    cause = getattr(err, "cause", None)
    if type(err).__name__.startswith("RayTaskError") and isinstance(cause, BaseException):
        err = cause
    first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), "")
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def run_sweep(planned: Sequence[PlannedRun], train: Callable[[object], dict], *, printer=print,
              user_errors: tuple[type[BaseException], ...] = ()) -> list[RunOutcome]:
    """Train each planned run with ``train(config)`` (returns the run's summary), one after another.

    A run that raises is recorded as failed (a bug's traceback also goes to stderr; ``user_errors`` are
    the exception types whose message is enough) and the next run starts."""
    outcomes: list[RunOutcome] = []
    for p in planned:
        printer(f"=== sweep run {p.index + 1}/{len(planned)}: {p.run.name}  ({p.run_dir}) ===")
        t0 = time.monotonic()
        try:
            summary = train(p.config)
        except Exception as err:  # noqa: BLE001 - one failed run must not stop the sweep
            if not isinstance(err, user_errors):
                traceback.print_exc(file=sys.stderr)
            outcomes.append(RunOutcome(p, False, _reason(err)))
            printer(f"=== sweep run {p.index + 1}/{len(planned)} failed: {outcomes[-1].detail}")
            continue
        step = summary.get("global_step") if isinstance(summary, dict) else None
        outcomes.append(RunOutcome(p, True, f"step {step}, {time.monotonic() - t0:.0f} s, {p.run_dir}"))
    return outcomes


def sweep(overrides: Sequence[str], *, config_name: str = "diffusion_trainer", config_dir=None,
          printer=print, user_errors: tuple[type[BaseException], ...] = ()) -> int:
    """``train -m``: plan, train each run with :class:`TaskRunner`, print one final line per run; 0 when every
    run finished, else 1."""
    from omnirl_async.trainer.task_runner import TaskRunner

    planned = plan_sweep(overrides, config_name=config_name, config_dir=config_dir)
    printer(f"sweep: {len(planned)} runs of " + "; ".join(
        f"{key} in {', '.join(dict.fromkeys(r.run.swept[j][1] for r in planned))}"
        for j, (key, _) in enumerate(planned[0].run.swept)))
    loggers = planned[0].config.trainer.logger
    if "tensorboard" not in ([loggers] if isinstance(loggers, str) else list(loggers or [])):
        printer("note: `trainer.logger` has no tensorboard; `omnirl-async report` reads the runs' TensorBoard "
                "events (add tensorboard to trainer.logger to compare them)")
    outcomes = run_sweep(planned, lambda config: TaskRunner(config, printer=printer).run(), printer=printer,
                         user_errors=user_errors)
    n_ok = sum(o.ok for o in outcomes)
    printer(f"sweep finished: {n_ok} ok, {len(outcomes) - n_ok} failed")
    for o in outcomes:
        printer(o.line())
    done = [o.planned.run_dir for o in outcomes if o.ok]
    if done:  # the sweep folder when every run finished, else the finished runs
        parents = {d.parent for d in done}
        shown = list(parents) if len(done) == len(outcomes) and len(parents) == 1 else done
        printer(f"compare them: omnirl-async report {' '.join(shlex.quote(str(d)) for d in shown)}")
    return 0 if n_ok == len(outcomes) else 1
