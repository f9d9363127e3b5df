"""Which denoising steps get SDE noise (and are trained): the SDE window.

Flow-GRPO-Fast and MixGRPO do not inject noise at every step. Only a window of
``w`` consecutive steps ``[start, start + w)`` is stochastic; every other step
is a plain Euler (ODE) step. Only window steps carry a log-prob, so only they
are stored and trained, which cuts learner cost by ``num_steps / w``.

Placement strategies (``sample_strategy``), inside the envelope
``[lo, hi)`` = ``sde_window_range`` (the whole trajectory when None):

* ``"random"``: ``start ~ U{lo, ..., hi - w}``, drawn from an RNG seeded with
  ``sde_window_seed + iteration``. The same iteration always gives the same
  window, in every process, so rollout workers and the learner agree without
  talking to each other.
* ``"progressive"``: the window slides from ``lo`` towards ``hi``: position
  ``k = iteration // iters_per_group``, ``start = lo + (k mod P) * stride``,
  where ``stride`` defaults to ``w`` (MixGRPO's overlap variant uses a smaller
  stride) and ``P`` is the number of starts whose whole window fits in
  ``[lo, hi)``. After the last position it wraps back to ``lo``. Windows are
  never truncated at ``hi`` (the reference scheduler lets the last window
  shrink); a fixed ``w`` keeps every trajectory's trained-step count equal, so
  batches stack without padding.

``window_size = None`` means the whole trajectory: ``(0, num_steps)``.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Sequence

__all__ = ["SDE_WINDOW_STRATEGIES", "SDEWindow"]

SDE_WINDOW_STRATEGIES = ("random", "progressive")


class SDEWindow:
    """Deterministic schedule of SDE windows over training iterations.

    Args:
        num_steps: denoising steps of a trajectory (``num_inference_steps``).
        window_size: ``w``, steps per window; None = every step.
        window_range: ``[lo, hi)`` envelope for the window; None = ``[0, num_steps)``.
        strategy: ``"random"`` or ``"progressive"``.
        iters_per_group: iterations spent at each progressive position (> 0).
        seed: base seed of the random strategy.
        stride: progressive step between positions; None = ``window_size``.

    Examples:
        >>> SDEWindow(10, 2, None, "progressive", 3, 0).select(7)
        (4, 6)
    """

    def __init__(
        self,
        num_steps: int,
        window_size: int | None = None,
        window_range: Sequence[int] | None = None,
        strategy: str = "random",
        iters_per_group: int = 1,
        seed: int = 0,
        stride: int | None = None,
    ) -> None:
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"`num_steps` = {num_steps!r}: must be an int >= 1 (num_inference_steps).")
        if strategy not in SDE_WINDOW_STRATEGIES:
            raise ValueError(f"`sample_strategy` = {strategy!r} is not known; use one of {list(SDE_WINDOW_STRATEGIES)}.")
        if window_range is None:
            lo, hi = 0, num_steps
        else:
            if len(window_range) != 2:
                raise ValueError(f"`sde_window_range` = {list(window_range)!r}: expected [start, end).")
            lo, hi = int(window_range[0]), int(window_range[1])
            if not 0 <= lo < hi <= num_steps:
                raise ValueError(f"`sde_window_range` = {[lo, hi]!r}: need 0 <= start < end <= num_steps "
                                 f"({num_steps}).")
        if window_size is None:
            if window_range is not None:
                warnings.warn("`sde_window_range` is set but `sde_window_size` is null: the SDE window covers "
                              "every step and the range is ignored. Set sde_window_size to use the range.",
                              stacklevel=2)
            lo, hi = 0, num_steps
            w = num_steps
        else:
            w = int(window_size)
            if w < 1 or w > hi - lo:
                raise ValueError(f"`sde_window_size` = {window_size!r}: must be in [1, {hi - lo}] "
                                 f"(the width of sde_window_range [{lo}, {hi})).")
        if strategy == "progressive" and (not isinstance(iters_per_group, int) or iters_per_group < 1):
            raise ValueError(f"`iters_per_group` = {iters_per_group!r}: must be an int >= 1 with "
                             "sample_strategy='progressive'.")
        if stride is None:
            stride = w
        if int(stride) < 1:
            raise ValueError(f"`stride` = {stride!r}: must be >= 1.")
        self.num_steps = num_steps
        self.window_size = w
        self.lo, self.hi = lo, hi
        self.strategy = strategy
        self.iters_per_group = iters_per_group
        self.seed = int(seed)
        self.stride = int(stride)
        self.full = window_size is None

    @classmethod
    def from_config(cls, algo_config, num_steps: int) -> SDEWindow:
        """Build from a rollout ``algo`` config (``sde_window_size``, ``sde_window_range``,
        ``sample_strategy``, ``iters_per_group``, ``sde_window_seed``)."""
        return cls(
            num_steps,
            getattr(algo_config, "sde_window_size", None),
            getattr(algo_config, "sde_window_range", None),
            getattr(algo_config, "sample_strategy", "random"),
            getattr(algo_config, "iters_per_group", 1),
            getattr(algo_config, "sde_window_seed", 0),
        )

    @property
    def num_positions(self) -> int:
        """Number of distinct window starts a strategy can choose."""
        if self.full:
            return 1
        if self.strategy == "random":
            return self.hi - self.window_size - self.lo + 1
        return (self.hi - self.lo - self.window_size) // self.stride + 1

    def select(self, iteration: int) -> tuple[int, int]:
        """Return the window ``(start, end)`` (end exclusive) for a training iteration (>= 0)."""
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"`iteration` = {iteration!r}: must be an int >= 0.")
        if self.full:
            return 0, self.num_steps
        w = self.window_size
        if self.strategy == "random":
            start = random.Random(self.seed + iteration).randint(self.lo, self.hi - w)
        else:
            k = iteration // self.iters_per_group
            start = self.lo + (k % self.num_positions) * self.stride
        return start, start + w

    def noise_levels(self, iteration: int, noise_level: float) -> list[float]:
        """Per-step noise levels: ``noise_level`` inside the window, 0 (ODE) outside."""
        start, end = self.select(iteration)
        return [float(noise_level) if start <= i < end else 0.0 for i in range(self.num_steps)]

    def __repr__(self) -> str:
        return (f"SDEWindow(num_steps={self.num_steps}, window_size={self.window_size}, "
                f"range=[{self.lo}, {self.hi}), strategy={self.strategy!r}, "
                f"iters_per_group={self.iters_per_group}, seed={self.seed}, stride={self.stride})")
