"""Metric computation with VeRL-Omni's names.

* ``critic/rewards/{mean,max,min,std}``, ``critic/advantages/{mean,max,min}``,
  ``critic/score/<extra>`` for per-sample reward extras (e.g. ``strict``),
* ``timing_s/<phase>`` seconds per step and ``timing_per_image_ms/<phase>``,
* ``perf/throughput`` rows trained (online samples and offline rows) per second of step wall-clock,
* ``training/off_policy/trajectory_staleness/{mean,max,min}``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Mapping

import numpy as np

__all__ = ["Timer", "compute_data_metrics", "compute_timing_metrics", "compute_throughput_metrics",
           "compute_staleness_metrics", "reduce_metrics"]


class Timer:
    """Accumulates ``timing_s/<name>`` for the phases of one step."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.started = time.perf_counter()  # when the step began

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0


def _stats(prefix: str, x: np.ndarray) -> dict[str, float]:
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        return {}
    return {f"{prefix}/mean": float(x.mean()), f"{prefix}/max": float(x.max()),
            f"{prefix}/min": float(x.min()), f"{prefix}/std": float(x.std())}


def compute_data_metrics(rewards: np.ndarray, advantages: np.ndarray | None = None,
                         extras: Mapping[str, np.ndarray] | None = None,
                         failed: np.ndarray | None = None) -> dict[str, float]:
    m = _stats("critic/rewards", rewards)
    if advantages is not None:
        m.update({k: v for k, v in _stats("critic/advantages", advantages).items() if not k.endswith("/std")})
    extras = extras or {}
    for name, arr in extras.items():
        arr = np.asarray(arr, dtype=np.float64)
        if name.endswith("_total") and name[: -len("_total")] in extras:
            continue
        total = extras.get(f"{name}_total")
        if total is not None:  # a count of clauses met over a count of clauses: report the ratio
            denom = float(np.sum(total))
            if denom > 0:
                m[f"critic/score/{name}/acc"] = float(np.sum(arr)) / denom
        elif arr.size:
            m[f"critic/score/{name}/mean"] = float(np.mean(arr))
    if failed is not None and len(failed):
        m["critic/rewards/failed_frac"] = float(np.mean(failed))
    return m


def compute_timing_metrics(times: Mapping[str, float], num_images: int) -> dict[str, float]:
    m = {f"timing_s/{k}": float(v) for k, v in times.items()}
    if num_images > 0:
        m.update({f"timing_per_image_ms/{k}": 1000.0 * float(v) / num_images for k, v in times.items()})
    return m


def compute_throughput_metrics(num_samples: int, step_seconds: float, offline_rows: int = 0) -> dict[str, float]:
    """``perf/throughput``: the online samples and ``offline_rows`` trained per second; ``perf/total_num_samples``:
    the online samples."""
    trained = num_samples + offline_rows
    return {"perf/throughput": trained / step_seconds if step_seconds > 0 else 0.0,
            "perf/total_num_samples": float(num_samples)}


def compute_staleness_metrics(staleness: np.ndarray) -> dict[str, float]:
    s = np.asarray(staleness, dtype=np.float64)
    if s.size == 0:
        return {}
    p = "training/off_policy/trajectory_staleness"
    return {f"{p}/mean": float(s.mean()), f"{p}/max": float(s.max()), f"{p}/min": float(s.min())}


def reduce_metrics(items: list[Mapping[str, float]]) -> dict[str, float]:
    """Mean of each key over a list of metric dicts (keys may differ)."""
    acc: dict[str, list[float]] = {}
    for d in items:
        for k, v in d.items():
            acc.setdefault(k, []).append(float(v))
    return {k: float(np.mean(v)) for k, v in acc.items()}
