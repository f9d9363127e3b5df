"""Rate limiters: when may a producer insert, and when may a learner sample.

Modelled on Reverb's rate limiters. Counts are in *samples* (not calls): a put
of a group of 8 is 8 inserts, a learner batch of 64 is 64 samples.

* :class:`MinSize` – sampling waits until the buffer holds ``min_size``
  samples; inserts are never held back (the table's size bound does that).
* :class:`SampleToInsertRatio` – keeps ``diff = inserts * samples_per_insert -
  samples`` within ``target ± error_buffer`` where ``target = min_size *
  samples_per_insert``: an insert that would push ``diff`` above the window
  waits for the learner, a sample that would push it below waits for the
  producers. ``samples_per_insert = 1`` with ``max_times_sampled = 1`` is
  lock-step on-policy; ``4`` with ``max_times_sampled = 4`` trains every sample
  about four times.

Why a window and not an exact ratio: inserts and samples come in chunks (a
group, a batch); an exact ratio would deadlock as soon as a chunk does not
fit. The window must hold at least one insert chunk plus one sample chunk.
Settings that can deadlock raise ``ValueError`` (a ratio above
``max_times_sampled``, ``min_size_to_sample > max_size``, a window narrower
than one put plus one batch); settings that are legal but tight log a
warning (as Reverb does). The window checks run when the chunk sizes become
known, i.e. at the first put and the first sample call.

``error_buffer = None`` sizes the window automatically to a deadlock-free
value for the largest insert and sample chunks seen so far.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod

__all__ = ["RateLimiter", "MinSize", "SampleToInsertRatio"]

log = logging.getLogger(__name__)


class RateLimiter(ABC):
    """Counts inserts and samples and answers ``can_insert`` / ``can_sample``."""

    def __init__(self) -> None:
        self.inserts = 0
        self.samples = 0.0
        self.max_insert_seen = 0
        self.max_sample_seen = 0

    def observe(self, *, insert_size: int | None = None, sample_size: int | None = None) -> bool:
        """Record a chunk size before waiting on it; validates. True if the limits loosened."""
        changed = False
        if insert_size is not None and insert_size > self.max_insert_seen:
            self.max_insert_seen = insert_size
            changed = True
        if sample_size is not None and sample_size > self.max_sample_seen:
            self.max_sample_seen = sample_size
            changed = True
        if changed:
            self.check(self.max_insert_seen, self.max_sample_seen)
        return changed

    def check(self, insert_size: int, sample_size: int) -> None:
        """Raise ``ValueError`` if these chunk sizes can deadlock."""

    @abstractmethod
    def can_insert(self, n: int) -> bool: ...

    @abstractmethod
    def can_sample(self, m: int, *, size: int) -> bool: ...

    def on_insert(self, n: int) -> None:
        self.inserts += n

    def on_sample(self, m: int) -> None:
        self.samples += m

    def on_drop(self, n: int, times_sampled: int) -> None:
        """``n`` samples left without being sampled as often as the ratio expects."""

    @abstractmethod
    def describe(self) -> str: ...

    def state_dict(self) -> dict:
        return {"inserts": self.inserts, "samples": self.samples, "max_insert_seen": self.max_insert_seen,
                "max_sample_seen": self.max_sample_seen}

    def load_state_dict(self, state: dict) -> None:
        self.inserts = int(state["inserts"])
        self.samples = float(state["samples"])
        self.max_insert_seen = int(state["max_insert_seen"])
        self.max_sample_seen = int(state["max_sample_seen"])


class MinSize(RateLimiter):
    """Sampling waits until ``min_size`` samples are stored; inserts are free."""

    def __init__(self, min_size: int = 0) -> None:
        super().__init__()
        if not (isinstance(min_size, int) and min_size >= 0):
            raise ValueError(f"`buffer.min_size_to_sample` = {min_size!r}: must be an integer >= 0 or null")
        self.min_size = min_size

    def can_insert(self, n: int) -> bool:
        return True

    def can_sample(self, m: int, *, size: int) -> bool:
        return size >= self.min_size

    def describe(self) -> str:
        return f"MinSize(min_size={self.min_size})"


class SampleToInsertRatio(MinSize):
    """Keeps the sample/insert ratio near ``samples_per_insert`` (see the module docstring)."""

    def __init__(self, samples_per_insert: float, min_size: int = 0, error_buffer: float | None = None) -> None:
        super().__init__(min_size)
        if not (isinstance(samples_per_insert, (int, float)) and samples_per_insert > 0
                and math.isfinite(samples_per_insert)):
            raise ValueError(f"`buffer.samples_per_insert` = {samples_per_insert!r}: must be a finite "
                             "number > 0, or null to switch the rate limiter off")
        if error_buffer is not None and not (error_buffer >= 0 and math.isfinite(error_buffer)):
            raise ValueError(f"`buffer.samples_per_insert_error_buffer` = {error_buffer!r}: must be a finite "
                             "number >= 0, or null (sized automatically)")
        self.spi = float(samples_per_insert)
        self.error_buffer = None if error_buffer is None else float(error_buffer)
        self._warned = False

    @property
    def target(self) -> float:
        return self.min_size * self.spi

    @property
    def window(self) -> float:
        """The error buffer in effect (explicit, or the automatic one)."""
        if self.error_buffer is not None:
            return self.error_buffer
        return max(self.spi * self.max_insert_seen + self.max_sample_seen,
                   self.spi * max(0, self.max_sample_seen - self.min_size))

    @property
    def diff(self) -> float:
        return self.inserts * self.spi - self.samples

    def min_error_buffer(self, insert_size: int, sample_size: int) -> float:
        """Smallest error buffer with which these chunk sizes cannot deadlock.

        When a put is held back (``diff > target + eb - n*spi``) the learner must
        be able to take a batch: rate-wise ``diff - m >= target - eb`` and
        data-wise at least ``m`` draws stored. With ``max_times_sampled >=
        samples_per_insert`` the stored draws are at least ``diff``, hence
        ``eb >= n*spi + m - target`` and ``2*eb >= n*spi + m``; and the first
        batch needs ``m`` inserts before any sample: ``eb >= spi*(m - min_size)``.
        Sampling also waits for ``min_size`` stored samples, which takes
        ``ceil(min_size / n)`` whole puts: ``eb >= spi*n*ceil(min_size/n) - target``.
        """
        n_spi = self.spi * insert_size
        fill = n_spi * math.ceil(self.min_size / insert_size) - self.target
        return max(n_spi + sample_size - self.target, (n_spi + sample_size) / 2.0,
                   self.spi * max(0, sample_size - self.min_size), fill)

    def check(self, insert_size: int, sample_size: int) -> None:
        if self.error_buffer is None:
            return
        need = self.min_error_buffer(insert_size, sample_size)
        if self.error_buffer < need:
            raise ValueError(
                f"`buffer.samples_per_insert_error_buffer` = {self.error_buffer:g} can deadlock with "
                f"samples_per_insert={self.spi:g}, min_size_to_sample={self.min_size}, puts of "
                f"{insert_size} samples and batches of {sample_size}: the window must hold one put and one "
                f"batch; set it >= {need:g} (or null to size it automatically)")
        comfy = 2 * need
        if self.error_buffer < comfy and not self._warned:
            self._warned = True
            log.warning("`buffer.samples_per_insert_error_buffer` = %g is tight for puts of %d and batches of "
                        "%d: producers and learner will often wait on each other; >= %g is smoother",
                        self.error_buffer, insert_size, sample_size, comfy)

    def can_insert(self, n: int) -> bool:
        return self.diff + n * self.spi <= self.target + self.window + 1e-9

    def can_sample(self, m: int, *, size: int) -> bool:
        return size >= self.min_size and self.diff - m >= self.target - self.window - 1e-9

    def on_drop(self, n: int, times_sampled: int) -> None:
        # A sample that leaves (stale, evicted) can no longer be drawn: credit the draws it still owed,
        # otherwise the limiter would wait for samples that can never happen.
        self.samples += n * max(0.0, self.spi - times_sampled)

    def describe(self) -> str:
        return (f"SampleToInsertRatio(samples_per_insert={self.spi:g}, min_size={self.min_size}, "
                f"error_buffer={self.window:g}{' (auto)' if self.error_buffer is None else ''}; "
                f"inserts={self.inserts}, samples={self.samples:g}, diff={self.diff:g}, "
                f"allowed [{self.target - self.window:g}, {self.target + self.window:g}])")
