"""Reward failures: counted per kind, explained once, and a limit that stops the job.

A sample whose reward could not be computed (the function raised, returned
NaN/inf or the wrong shape, or outlived ``reward.timeout_s``) reaches the
buffer as a failure with its reason and is never trained on. The buffer counts
failed samples by kind (:func:`omnirl_async.rewards.base.failure_kind`) and
keeps the first reason of each kind; :class:`FailureMonitor` turns those
counters into the trainer's metrics:

* ``reward/failed_frac`` – failed / scored samples since the previous step;
* ``reward/failed_frac_window`` – the same over the last
  ``reward.failed_frac_window`` scored samples;
* ``reward/failed/<kind>`` – failed samples of that kind so far;

prints the first example of every kind once, and raises
:class:`RewardFailureError` when more than ``reward.max_failed_frac`` of the
window failed, with the reward, the reasons and the counts – or, for a run
that ended before it scored a window's worth, of all it scored
(:meth:`FailureMonitor.check_run`). The trainer
calls :meth:`FailureMonitor.observe` after every step and while it waits for
data, so a reward that always fails stops the job in either mode.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

__all__ = ["FailureMonitor", "RewardFailureError", "describe_reward"]


class RewardFailureError(RuntimeError):
    """Too many samples failed reward scoring (``reward.max_failed_frac``)."""


def describe_reward(reward_cfg: Any) -> str:
    """The reward as the user configured it, for messages."""
    crf = reward_cfg.custom_reward_function
    if crf.path is not None:
        return f"custom reward `{crf.name}` from {crf.path}"
    if reward_cfg.reward_functions:
        return "reward functions " + ", ".join(f"`{k}`" for k in reward_cfg.reward_functions)
    return f"reward `{reward_cfg.reward_fn_name}`"


class FailureMonitor:
    def __init__(self, reward_cfg: Any, *, printer: Callable[[str], None] = print):
        self.max_frac = float(reward_cfg.max_failed_frac)
        self.window = int(reward_cfg.failed_frac_window)
        self.reward = describe_reward(reward_cfg)
        self.printer = printer
        self.recent: deque[tuple[int, int]] = deque()  # (failed, scored) per observation
        self.base_failed = self.base_ok = 0
        self.last_failed = self.last_ok = 0
        self.kinds: dict[str, int] = {}
        self.examples: dict[str, list[str]] = {}
        self.printed: set[str] = set()

    @staticmethod
    def _counts(buf: dict[str, Any]) -> tuple[int, int, dict[str, int]]:
        kinds = {k[len("buffer/failed/"):]: int(v) for k, v in buf.items() if k.startswith("buffer/failed/")}
        return sum(kinds.values()), int(buf.get("buffer/inserted", 0)), kinds

    def reset(self, buf: dict[str, Any]) -> None:
        """Start counting from the buffer's current totals (a restored buffer brings earlier runs' counts)."""
        failed, ok, _ = self._counts(buf)
        self.base_failed = self.last_failed = failed
        self.base_ok = self.last_ok = ok

    def observe(self, buf: dict[str, Any]) -> dict[str, float]:
        """Read the buffer's counters; returns metrics; raises :class:`RewardFailureError` over the limit."""
        failed, ok, kinds = self._counts(buf)
        d_failed, d_ok = failed - self.last_failed, ok - self.last_ok
        self.last_failed, self.last_ok = failed, ok
        if d_failed or d_ok:
            self.recent.append((d_failed, d_failed + d_ok))
        while len(self.recent) > 1 and sum(n for _, n in self.recent) - self.recent[0][1] >= self.window:
            self.recent.popleft()
        self.kinds = kinds
        for kind, reason, prompt in buf.get("buffer/failure_examples", []) or []:
            self.examples.setdefault(kind, [reason, prompt])
            if kind not in self.printed:
                self.printed.add(kind)
                self.printer(f"reward failure ({kind}), first example: {reason} [prompt: {prompt!r}]; such "
                             f"samples are not trained on and are counted in reward/failed/{kind}")
        w_failed, w_total = sum(f for f, _ in self.recent), sum(n for _, n in self.recent)
        metrics = {"reward/failed_frac": d_failed / (d_failed + d_ok) if d_failed + d_ok else 0.0,
                   "reward/failed_frac_window": w_failed / w_total if w_total else 0.0}
        metrics.update({f"reward/failed/{k}": float(v) for k, v in kinds.items()})
        if self.max_frac < 1.0 and w_total >= self.window and w_failed > self.max_frac * w_total:
            raise RewardFailureError(self.explain(w_failed, w_total))
        return metrics

    def check_run(self) -> None:
        """At the end of a run that scored fewer samples than the window: the same limit, over all of them (a short
        run whose reward always failed would otherwise end as if it had trained)."""
        failed, total = self._run_totals()
        if self.max_frac < 1.0 and 0 < total < self.window and failed > self.max_frac * total:
            raise RewardFailureError(self.explain(
                failed, total, f"the {total} samples this run scored (fewer than `reward.failed_frac_window` = "
                               f"{self.window}, so the limit is applied at the end)", "the run fails"))

    def explain(self, w_failed: int, w_total: int, scope: str | None = None, outcome: str = "stopping the job") -> str:
        scope = scope or f"the last {w_total} scored samples"
        lines = [f"{self.reward} failed on {w_failed} of {scope} "
                 f"({w_failed / w_total:.0%} > `reward.max_failed_frac` = {self.max_frac:g}); {outcome}."]
        for kind, count in sorted(self.kinds.items(), key=lambda kv: -kv[1]):
            reason, prompt = self.examples.get(kind, ["?", "?"])
            lines.append(f"  {kind}: {count} samples so far, e.g. {reason} [prompt: {prompt!r}]")
        lines.append("Fix the reward function (the reasons above), or raise `reward.max_failed_frac` "
                     "(1 = never stop) / `reward.timeout_s` if it is only slow.")
        return "\n".join(lines)

    def _run_totals(self) -> tuple[int, int]:
        """(failed, scored) samples of this run (a restored buffer's earlier counts left out)."""
        failed = self.last_failed - self.base_failed
        return failed, failed + self.last_ok - self.base_ok

    def summary(self) -> dict[str, Any]:
        total_failed, total = self._run_totals()
        return {"reward_failed": total_failed, "reward_scored": total,
                "reward_failed_kinds": dict(self.kinds)}
