"""Which tickets each learner update trains, when updates differ in size.

Under the ``wait`` strategy update ``u`` trains the tickets ``[C(u), C(u+1))``
(see :mod:`omnirl_async.staleness`), where ``C`` is the prefix sum of the
online groups per update ``B(0), B(1), ...``. With a fixed ``B`` that is
``C(u) = u * B``. An offline share that tapers (``buffer.offline_mix_ratio``
moving to ``buffer.offline_mix_ratio_final``) hands the rows it frees back to
online groups, so ``B`` changes along the run:

    B(u) = max(1, round((1 - r(p(u))) * data.train_batch_size))

with ``r`` the share at progress ``p`` (linear from the start value to the
final one, reached at ``buffer.offline_mix_taper_end``) and ``p(u)`` the run's progress at update ``u``: updates after the
learning-rate warm-up over the run's updates, or the training time of
``trainer.total_time_minutes`` so far, whichever is further along (the
progress a cosine learning rate follows).

:class:`GroupSchedule` is that formula; :class:`TicketLayout` fixes ``B(u)``
the first time anything asks about update ``u`` (admission asks a few updates
ahead of training) and never changes it afterwards, so admission, the
trainer's wait for a batch and the dispatcher's seeds all see one layout. When
progress counts updates only, ``B(u)`` depends on ``u`` alone and the layout
is the same in every run; with a time budget the time progress known when
``u`` is laid out enters (it lags the update's own by the few updates
admission runs ahead). The sizes fixed so far travel in checkpoints
(:meth:`TicketLayout.state_dict`), so a resumed run keeps them.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

__all__ = ["GroupSchedule", "TicketLayout", "run_progress"]


def run_progress(update: int, *, warmup: int, total_steps: int, time_progress: float = 0.0) -> float:
    """The fraction of the run done at ``update`` (0-based), in [0, 1]: updates after the learning-rate warm-up
    over the run's ``total_steps``, or ``time_progress`` (training time over its budget), whichever is further
    along (the run ends at the first). A cosine learning rate and a tapered offline share follow it."""
    p = (update - warmup) / max(1, total_steps - warmup)
    return min(1.0, max(0.0, p, float(time_progress)))


@dataclasses.dataclass(frozen=True)
class GroupSchedule:
    """Online groups per update along the run (see the module docstring).

    ``groups``: ``data.train_batch_size``; ``share`` / ``share_final``: the
    offline share at the start and the end (``share_final`` None: no taper);
    ``taper_end``: the progress at which the share reaches ``share_final``
    (and stays); ``warmup``: learning-rate warm-up updates; ``total_steps``:
    the run's updates as the trainer counts them for its progress."""

    groups: int
    share: float = 0.0
    share_final: float | None = None
    warmup: int = 0
    total_steps: int = 1
    taper_end: float = 1.0

    def __post_init__(self):
        if self.groups <= 0:
            raise ValueError(f"`data.train_batch_size` = {self.groups}: must be > 0")
        for name, value in (("offline_mix_ratio", self.share), ("offline_mix_ratio_final", self.share_final)):
            if value is not None and not 0.0 <= value < 1.0:
                raise ValueError(f"`buffer.{name}` = {value!r}: must be in [0, 1) for online groups to remain")
        if not 0.0 < self.taper_end <= 1.0:
            raise ValueError(f"`buffer.offline_mix_taper_end` = {self.taper_end!r}: must be in (0, 1]")

    @property
    def fixed(self) -> bool:
        """Every update trains the same number of groups."""
        return self.share_final is None or self.share_final == self.share

    def progress(self, update: int, time_progress: float = 0.0) -> float:
        """The run's progress at ``update`` (0-based): see :func:`run_progress`."""
        return run_progress(update, warmup=self.warmup, total_steps=self.total_steps, time_progress=time_progress)

    def share_at(self, progress: float) -> float:
        """The offline share at ``progress``: linear from ``share`` to ``share_final`` until ``taper_end``, then
        ``share_final``."""
        if self.share_final is None:
            return self.share
        p = min(1.0, max(0.0, float(progress) / self.taper_end))
        return self.share + (self.share_final - self.share) * p

    def groups_for(self, share: float) -> int:
        """Online groups of an update whose offline share is ``share`` (at least one)."""
        if not 0.0 < share < 1.0:
            return self.groups
        return max(1, int(math.floor((1.0 - share) * self.groups + 0.5)))

    def at(self, update: int, time_progress: float = 0.0) -> int:
        """``B(update)``: the online groups of that update."""
        return self.groups_for(self.share_at(self.progress(update, time_progress)))

    def mean_groups(self) -> float:
        """Online groups per update averaged over the run (a linear taper: the share's mean)."""
        if self.fixed:
            return float(self.groups_for(self.share))
        tapering = (self.groups_for(self.share) + self.groups_for(self.share_final)) / 2.0
        return self.taper_end * tapering + (1.0 - self.taper_end) * self.groups_for(self.share_final)


class TicketLayout:
    """``C(u)``, the first ticket of update ``u``, with each ``B(u)`` fixed the first time it is needed.

    Not thread-safe on its own: its owner (the admission controller, under its
    lock, or the sync trainer) serialises the calls."""

    def __init__(self, schedule: GroupSchedule):
        self.schedule = schedule
        self.time_progress = 0.0
        self._starts = [0]  # C(0), C(1), ... as far as laid out (a tapered schedule only)

    @classmethod
    def fixed(cls, groups: int) -> "TicketLayout":
        """Every update trains ``groups`` tickets: ``C(u) = u * groups``."""
        return cls(GroupSchedule(groups=groups))

    @property
    def groups(self) -> int:
        """The groups of the first update (all updates', when fixed)."""
        return self.size(0)

    def set_time_progress(self, progress: float) -> None:
        """The training time's share of ``trainer.total_time_minutes`` now (updates laid out from now on use it)."""
        self.time_progress = max(self.time_progress, float(progress))

    def _extend(self, update: int) -> None:
        while len(self._starts) <= update:
            u = len(self._starts) - 1
            self._starts.append(self._starts[-1] + self.schedule.at(u, self.time_progress))

    def start(self, update: int) -> int:
        """``C(update)``: the first ticket update ``update`` (0-based) trains."""
        if update < 0:
            raise ValueError(f"update {update}: updates count from 0")
        if self.schedule.fixed:
            return update * self.schedule.groups_for(self.schedule.share)
        self._extend(update)
        return self._starts[update]

    def size(self, update: int) -> int:
        """``B(update)``: how many tickets it trains."""
        return self.start(update + 1) - self.start(update)

    def tickets(self, update: int) -> range:
        """The tickets update ``update`` trains."""
        return range(self.start(update), self.start(update + 1))

    def update_of(self, ticket: int) -> int:
        """The update that trains ``ticket``."""
        if ticket < 0:
            raise ValueError(f"ticket {ticket}: tickets count from 0")
        if self.schedule.fixed:
            return ticket // self.schedule.groups_for(self.schedule.share)
        while self._starts[-1] <= ticket:
            self._extend(len(self._starts))
        return bisect.bisect_right(self._starts, ticket) - 1

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The sizes fixed so far and the time progress (empty for a fixed layout: nothing to keep)."""
        if self.schedule.fixed:
            return {}
        sizes = [b - a for a, b in zip(self._starts, self._starts[1:])]
        return {"sizes": sizes, "time_progress": self.time_progress}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`: updates laid out before the checkpoint keep their sizes."""
        if not state:
            return
        if self.schedule.fixed:
            raise ValueError("the checkpoint's updates differ in size (an offline share that tapered: "
                             "`buffer.offline_mix_ratio_final`), but this run's do not; resume with the same "
                             "`buffer.offline_mix_ratio` / `buffer.offline_mix_ratio_final`")
        starts = [0]
        for b in state["sizes"]:
            if int(b) <= 0:
                raise ValueError(f"checkpoint's ticket layout has an update of {b} groups: must be > 0")
            starts.append(starts[-1] + int(b))
        self._starts = starts
        self.time_progress = float(state.get("time_progress", 0.0))
