"""Buffer metrics: counters, windowed rates and a histogram of sampled staleness.

Names (logged as is by the trainer):

* ``buffer/size`` – samples stored; ``buffer/ready_samples``; ``buffer/bytes``
* ``buffer/insert_rate``, ``buffer/sample_rate`` – samples/s over the last
  ``window_s`` seconds
* ``buffer/inserted``, ``buffer/sampled`` – totals
* ``buffer/dropped_stale``, ``buffer/dropped_failed``,
  ``buffer/dropped_incomplete_groups``, ``buffer/evicted`` – totals
* ``buffer/failed/<kind>`` – failed samples by kind of reason (see
  :func:`omnirl_async.rewards.base.failure_kind`: raised, nonfinite,
  bad_output, timeout, no_worker, other); ``buffer/failure_examples`` (not a
  number, not logged) holds the first ``[kind, reason, prompt]`` of each kind
* ``buffer/staleness/lag_<k>`` – how many sampled samples had lag ``k``
  (``lag_<K>+`` for the last bin); ``buffer/staleness/mean``, ``/max``
* ``buffer/offline_size`` – samples in the offline table (2 per preference
  pair); ``buffer/offline_sampled`` – offline samples drawn so far;
  ``buffer/offline_frac`` – the offline share of every sample drawn so far
  (offline / (online + offline)), what ``buffer.offline_mix_ratio`` targets

Online and offline draws are counted apart: offline samples have no policy
version, so they never enter the staleness histogram, the rates or
``buffer/sampled`` / ``buffer/inserted`` (those describe the rollouts).
"""

from __future__ import annotations

import time
from collections import deque

__all__ = ["BufferMetrics"]


class _Rate:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.events: deque[tuple[float, int]] = deque()
        self.total = 0
        self.started = time.monotonic()

    def add(self, n: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.events.append((now, n))
        self.total += n
        self._prune(now)

    def _prune(self, now: float) -> None:
        while self.events and self.events[0][0] < now - self.window_s:
            self.events.popleft()

    def rate(self) -> float:
        now = time.monotonic()
        self._prune(now)
        span = min(self.window_s, max(now - self.started, 1e-3))
        return sum(n for _, n in self.events) / span


class BufferMetrics:
    """Not thread-safe on its own: the buffer core calls it under its lock."""

    def __init__(self, window_s: float = 30.0, max_lag_bin: int = 8) -> None:
        self.inserts = _Rate(window_s)
        self.samples = _Rate(window_s)
        self.max_lag_bin = max_lag_bin
        self.counters = {"dropped_stale": 0, "dropped_failed": 0, "dropped_incomplete_groups": 0,
                         "evicted": 0, "refill_requests": 0, "offline_sampled": 0,
                         # groups whose payload died with its producer before being trained, generated again
                         "regenerated_groups": 0,
                         # the offline share's running totals (BufferCore.sample_offline): online samples mixed
                         # with, offline samples drawn for them, and the offline samples wanted so far (the sum of
                         # each call's ratio / (1 - ratio) * online; a float)
                         "mix_online": 0, "mix_offline": 0, "mix_target": 0.0}
        self.lag_hist = [0] * (max_lag_bin + 1)
        self.lag_sum = 0
        self.lag_max = 0
        self.failed_kinds: dict[str, int] = {}
        self.failure_examples: dict[str, list[str]] = {}

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def on_failed(self, reason: str | None, prompt: str) -> None:
        """One failed sample (its reason and prompt): counted by kind, the first of each kind kept."""
        from omnirl_async.rewards.base import failure_kind

        kind = failure_kind(reason)
        self.failed_kinds[kind] = self.failed_kinds.get(kind, 0) + 1
        self.failure_examples.setdefault(kind, [kind, reason or "(no reason given)", prompt])

    def on_insert(self, n: int) -> None:
        self.inserts.add(n)

    def on_sample(self, lags) -> None:
        self.samples.add(len(lags))
        for lag in lags:
            lag = max(0, int(lag))
            self.lag_hist[min(lag, self.max_lag_bin)] += 1
            self.lag_sum += lag
            self.lag_max = max(self.lag_max, lag)

    def on_offline_sample(self, n: int) -> None:
        self.counters["offline_sampled"] += int(n)

    def snapshot(self, **gauges: float) -> dict[str, float]:
        out = {f"buffer/{k}": float(v) for k, v in gauges.items()}
        out["buffer/insert_rate"] = self.inserts.rate()
        out["buffer/sample_rate"] = self.samples.rate()
        out["buffer/inserted"] = float(self.inserts.total)
        out["buffer/sampled"] = float(self.samples.total)
        out.update({f"buffer/{k}": float(v) for k, v in self.counters.items() if not k.startswith("mix_")})
        drawn = self.samples.total + self.counters["offline_sampled"]
        out["buffer/offline_frac"] = self.counters["offline_sampled"] / drawn if drawn else 0.0
        out.update({f"buffer/failed/{k}": float(v) for k, v in sorted(self.failed_kinds.items())})
        out["buffer/failure_examples"] = [list(v) for v in self.failure_examples.values()]
        for k, c in enumerate(self.lag_hist):
            name = f"lag_{k}+" if k == self.max_lag_bin else f"lag_{k}"
            out[f"buffer/staleness/{name}"] = float(c)
        n = self.samples.total
        out["buffer/staleness/mean"] = self.lag_sum / n if n else 0.0
        out["buffer/staleness/max"] = float(self.lag_max)
        return out

    def state_dict(self) -> dict:
        return {"counters": dict(self.counters), "lag_hist": list(self.lag_hist), "lag_sum": self.lag_sum,
                "lag_max": self.lag_max, "inserted": self.inserts.total, "sampled": self.samples.total,
                "failed_kinds": dict(self.failed_kinds)}

    def load_state_dict(self, s: dict) -> None:
        self.counters.update({k: float(v) if isinstance(self.counters.get(k), float) else int(v)
                              for k, v in s["counters"].items()})
        if "mix_target" not in s["counters"]:  # snapshots of older versions: no carry
            self.counters["mix_target"] = float(self.counters["mix_offline"])
        hist = [int(x) for x in s["lag_hist"]]
        self.lag_hist = (hist + [0] * len(self.lag_hist))[:len(self.lag_hist)]
        self.lag_sum, self.lag_max = int(s["lag_sum"]), int(s["lag_max"])
        self.inserts.total, self.samples.total = int(s["inserted"]), int(s["sampled"])
        self.failed_kinds = {str(k): int(v) for k, v in (s.get("failed_kinds") or {}).items()}
