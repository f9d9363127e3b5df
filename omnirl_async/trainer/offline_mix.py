"""Offline preference pairs in the one training loop: mixed into online batches, or trained alone.

The run's offline store (``<trainer.default_local_dir>/offline/``, filled by
``omnirl-async ingest`` or ``data.offline_files``) is loaded into the replay
buffer's offline table when the run starts, after a resume restored the
buffer (:meth:`OfflineData.fill`; only pairs the table lacks are added).
Then, in both trainer modes:

* ``buffer.offline_mix_ratio`` = r in (0, 1): the offline share takes the
  place of online groups. Each update trains
  :func:`online_groups_per_update` = ``round((1 - r) * data.train_batch_size)``
  (at least 1) online groups, the batch the mode produced from them (sync: the
  step's groups; separate_async: the admitted tickets, or the fresh samples
  under ``drop``), plus the offline share
  :meth:`~omnirl_async.buffer.base.ReplayBuffer.sample_offline` draws for it, so
  that offline rows are r of all rows trained (the rounding carries over
  between updates) and a learner batch keeps about
  ``data.train_batch_size * rollout.n`` rows: offline pairs save the rollouts
  they replace rather than lengthen the update. The online batch alone goes on
  to the step's metrics:
  rewards, staleness, the audit trail and the trained tickets never see an
  offline row. With ``buffer.offline_mix_ratio_final`` the share drawn moves
  linearly from r at the run's start to that value at its end
  (:meth:`OfflineData.ratio_at`; the run's progress is the one a cosine
  learning rate follows), and the rows it frees go back to online groups:
  update ``u`` trains ``round((1 - r(u)) * data.train_batch_size)`` of them
  (:func:`group_schedule`; separate_async lays its tickets out by those sizes,
  :mod:`omnirl_async.actors.ticket_layout`), so a share tapered to 0 ends on
  whole online batches;
* ``algorithm.sample_source=offline``: no rollout workers are started; every
  update trains ``data.train_batch_size * rollout.n`` offline rows (rounded up
  to whole pairs), and the run ends after ``trainer.total_training_steps``
  updates or ``trainer.total_epochs`` passes over the offline table.

The learner receives one batch: the fields both parts carry (``x0``,
``emb.*``, ``rewards``) stacked online first, plus the bool field
:data:`~omnirl_async.buffer.offline_table.OFFLINE_FIELD` marking the offline
rows (see :class:`~omnirl_async.learners.preference_learner.PreferenceLearner`
for what it does with them).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from omnirl_async.actors.ticket_layout import GroupSchedule
from omnirl_async.buffer.base import SampledBatch
from omnirl_async.buffer.offline_table import OFFLINE_FIELD

__all__ = ["OfflineData", "group_schedule", "learner_inputs", "online_groups_per_update"]


def group_schedule(config, total_steps: int = 1) -> GroupSchedule:
    """Online prompts (groups of ``rollout.n``) per learner update along the run: ``data.train_batch_size``, less
    the groups the offline share r of ``buffer.offline_mix_ratio`` takes the place of
    (``round((1 - r) * train_batch_size)``, at least one); with ``buffer.offline_mix_ratio_final`` r moves
    linearly over the run's progress (``total_steps`` updates after the learning-rate warm-up, or the time
    budget). The offline rows drawn with them make r of all rows trained
    (:meth:`~omnirl_async.buffer.base.ReplayBuffer.sample_offline`)."""
    groups = int(config.data.train_batch_size)
    r, final = float(config.buffer.offline_mix_ratio), config.buffer.offline_mix_ratio_final
    if config.algorithm.sample_source == "offline" or not 0.0 < r < 1.0:
        r, final = 0.0, None
    return GroupSchedule(groups=groups, share=r, share_final=None if final is None else float(final),
                         warmup=int(config.actor_rollout_ref.actor.optim.lr_warmup_steps),
                         total_steps=max(1, int(total_steps)),
                         taper_end=float(config.buffer.offline_mix_taper_end) if final is not None else 1.0)


def online_groups_per_update(config) -> int:
    """Online groups of the first update (of every update, unless the offline share tapers): see
    :func:`group_schedule`."""
    schedule = group_schedule(config)
    return schedule.groups_for(schedule.share)


def learner_inputs(online: SampledBatch, offline: SampledBatch) -> tuple[dict[str, np.ndarray], list[str]]:
    """One learner batch of both parts: their common fields, online rows first, and the offline marker."""
    if not len(offline):
        return online.fields, [m.tags.group_uid for m in online.metas]
    if not len(online):
        names = sorted(offline.fields)
    else:
        names = [k for k in online.fields if k in offline.fields]
        missing = sorted(k for k in ("x0", "rewards") if k not in names)
        if missing:
            raise ValueError(f"online samples lack the field(s) {missing} the offline pairs train on; offline data "
                             "mixes only into a direct-preference run (`algorithm.trainer_type` = direct_preference)")
    fields = {k: np.concatenate([online.fields[k], offline.fields[k]]) if len(online) else offline.fields[k]
              for k in names}
    fields[OFFLINE_FIELD] = np.concatenate([np.zeros(len(online), bool), np.ones(len(offline), bool)])
    group_ids = [m.tags.group_uid for m in online.metas] + [m.tags.group_uid for m in offline.metas]
    return fields, group_ids


class OfflineData:
    """The offline side of one run: fill the table, draw each update's share, or a whole offline batch."""

    def __init__(self, config, buffer, *, schedule: GroupSchedule | None = None, printer=print):
        """``schedule``: the run's :func:`group_schedule` (the trainer's, sized by the run's length); by default
        the config's."""
        self.buffer = buffer
        self.printer = printer
        self.run_dir = str(config.trainer.default_local_dir)
        self.only = config.algorithm.sample_source == "offline"
        self.ratio = float(config.buffer.offline_mix_ratio)
        self.schedule = group_schedule(config) if schedule is None else schedule
        rows = int(config.data.train_batch_size) * int(config.actor_rollout_ref.rollout.n)
        self.rows_per_step = rows + rows % 2  # whole pairs
        self.wait_timeout_s = float(config.trainer.wait_timeout_s)
        self.n = int(config.actor_rollout_ref.rollout.n)
        self.pairs = 0

    @property
    def used(self) -> bool:
        return self.only or self.ratio > 0

    def fill(self) -> None:
        """Load the store's pairs the offline table lacks (start of the run, after a resume)."""
        if not self.used:
            return
        info = self.buffer.load_offline(self.run_dir)
        self.pairs = int(info["pairs"])
        how = ("trains on them alone (`algorithm.sample_source` = offline)" if self.only else
               f"mixes them into each learner batch at `buffer.offline_mix_ratio` = {self.ratio:g}: "
               + self._per_update(self.ratio)
               + ("" if self.schedule.fixed else
                  f", the share moving to `buffer.offline_mix_ratio_final` = {self.schedule.share_final:g} by "
                  + ("the run's end" if self.schedule.taper_end == 1.0 else
                     f"{self.schedule.taper_end:.0%} of the run (`buffer.offline_mix_taper_end`)")
                  + f" ({self._per_update(self.schedule.share_final)})"))
        self.printer(f"offline table: {self.pairs} preference pairs from {info['dir']} ({info['added']} added now); "
                     f"the run {how}")

    def _per_update(self, share: float) -> str:
        groups = self.schedule.groups_for(share)
        return (f"{groups} online group(s) of {self.n} samples and ~{share / (1 - share) * groups * self.n:.0f} "
                "offline rows per update")

    def ratio_at(self, progress: float) -> float:
        """The offline share of an update at ``progress`` (the fraction of the run done, in [0, 1])."""
        return self.schedule.share_at(progress)

    def mix(self, online: SampledBatch, version: int,
            progress: float = 0.0) -> tuple[dict[str, np.ndarray], list[str], dict[str, float]]:
        """The learner's inputs for an online batch: with mixing on, plus its offline share (at ``progress``,
        the fraction of the run done, when the share tapers)."""
        if not self.ratio > 0:
            fields, group_ids = learner_inputs(online, SampledBatch(metas=[], fields={}))
            return fields, group_ids, {}
        ratio = self.ratio_at(progress)
        offline = self.buffer.sample_offline(len(online), learner_version=version, ratio=ratio)
        fields, group_ids = learner_inputs(online, offline)
        return fields, group_ids, {"training/offline_samples": float(len(offline)),
                                   "training/offline_mix_ratio": ratio}

    def batch(self, version: int) -> SampledBatch:
        """An update's batch of ``algorithm.sample_source=offline``: ``rows_per_step`` offline rows."""
        return self.buffer.sample(self.rows_per_step, learner_version=version, timeout=self.wait_timeout_s,
                                  source="offline")

    def total_steps(self, total_training_steps: Any, total_epochs: int) -> int:
        """Updates of an offline-only run: the cap, or ``total_epochs`` passes over the offline table."""
        if total_training_steps:
            return int(total_training_steps)
        return max(1, int(math.ceil(2 * self.pairs * int(total_epochs) / self.rows_per_step)))
