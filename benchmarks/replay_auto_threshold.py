"""Replay logged runs through ``max_off_policy_threshold: auto``'s mismatch rule, to choose ``target_mismatch``.

    python benchmarks/replay_auto_threshold.py RUN_TB_DIR [RUN_TB_DIR ...] [--targets 1e-3,3e-4,1e-4]
                                              [--window 4]

Reads each run's ``rollout_corr/kl`` and ``rollout_corr/ess`` per update from its TensorBoard folder (the
``trainer.log_dir`` of a separate_async run, fixed threshold or ``auto``), cuts them into the controller's windows
of ``--window`` updates and, for each target, asks the real controller
(:class:`~omnirl_async.trainer.auto_threshold.ThresholdController`) whether that window's mismatch would lower the
threshold. Prints per run the typical window mismatch (median, 90th percentile, max) and per target how many
windows were over it and the update of the first. A good target is crossed early by a run that went wrong and
rarely by healthy ones (docs/AUTO_THRESHOLD.md, "Calibrating the target on a replayed trace").

The replay is open-loop: the logged signals came from the threshold the run had, so it shows when ``auto`` would
have lowered, not what the run would have done after.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_geneval_rl import _scalars  # noqa: E402

from omnirl_async.trainer.auto_threshold import StepSignals, ThresholdController, WindowSignals  # noqa: E402


def read_trace(log_dir: Path) -> list[tuple[int, StepSignals]]:
    """(update, the signals ``auto`` reads from it) for every update that logged ``rollout_corr/kl``."""
    kl = {step: value for _w, step, value in _scalars(log_dir, "rollout_corr/kl")}
    if not kl:
        raise SystemExit(f"{log_dir}: no `rollout_corr/kl` logged; give the TensorBoard folder (trainer.log_dir) of "
                         "a run whose loss applies rollout correction (e.g. the FlowGRPO recipe)")
    ess = {step: value for _w, step, value in _scalars(log_dir, "rollout_corr/ess")}
    return [(s, StepSignals(step_s=1.0, learner_wait_s=0.0, kl=kl[s], ess=ess.get(s))) for s in sorted(kl)]


def windows(trace: list[tuple[int, StepSignals]], window: int) -> list[tuple[int, WindowSignals]]:
    """(last update of the window, its signals) for every whole window."""
    return [(trace[i + window - 1][0], WindowSignals.of([s for _u, s in trace[i:i + window]]))
            for i in range(0, len(trace) - window + 1, window)]


def over(wins: list[tuple[int, WindowSignals]], target: float, window: int) -> list[int]:
    """The windows (by their last update) whose mismatch would make ``auto`` lower at ``target``."""
    controller = ThresholdController(min=0, max=1, target_mismatch=target, window=window)
    return [update for update, w in wins if controller.lower_reason(w) is not None]


def report(log_dir: Path, targets: list[float], window: int) -> list[str]:
    wins = windows(read_trace(log_dir), window)
    if not wins:
        raise SystemExit(f"{log_dir}: fewer than --window {window} updates logged")
    mm = np.array([w.mismatch for _u, w in wins if w.mismatch is not None])
    lines = [f"{log_dir}: {len(wins)} windows of {window} updates; window mismatch median {np.median(mm):.2g}, "
             f"p90 {np.quantile(mm, 0.9):.2g}, max {mm.max():.2g}"]
    for target in targets:
        hits = over(wins, target, window)
        lines.append(f"  target {target:g}: {len(hits)} windows over"
                     + (f", the first ending at update {hits[0]}" if hits else ""))
    return lines


def _floats(text: str) -> list[float]:
    try:
        out = [float(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma list of numbers, e.g. 1e-3,3e-4") from None
    if not out or any(not v > 0 for v in out):
        raise argparse.ArgumentTypeError(f"{text!r}: targets must be > 0")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, metavar="RUN_TB_DIR")
    ap.add_argument("--targets", type=_floats, default=[1e-3, 3e-4, 1e-4])
    ap.add_argument("--window", type=int, default=4, help="updates per decision (trainer.v1.sampler.auto.window)")
    args = ap.parse_args(argv)
    if args.window < 1:
        ap.error(f"--window {args.window}: an integer >= 1")
    for run in args.runs:
        print("\n".join(report(run, args.targets, args.window)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
