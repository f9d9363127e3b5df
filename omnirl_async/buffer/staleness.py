"""Staleness: how far behind the learner a sample's policy is, and what to do about it.

(The rule: :mod:`omnirl_async.staleness`.) ``lag = learner_version - policy_version`` of the sample (offline samples have
no policy version and lag 0). A group is *stale* when one of its members has
``lag`` above its bound: the threshold its prompt was admitted under
(``tags.max_lag``, stamped by admission; it differs from the configured value when
``max_off_policy_threshold: auto`` moved it), else ``max_off_policy_threshold``.
It is then never returned by ``sample``
(invariant 1 of DESIGN.md). A stale group can only get staler – versions are
monotone – so the table evicts it and counts it in ``buffer/dropped_stale``.

The two strategies differ upstream, not here:

* ``drop`` – rollout workers generate freely; the buffer evicts what went
  stale. Eviction is expected and the counter measures wasted generation.
* ``wait`` – admission control (the rollout side asks
  :meth:`ReplayBuffer.num_ready_samples` and the learner version) keeps
  workers from generating what would go stale. A stale group reaching the
  buffer anyway is still evicted and counted, and logged once, since it
  points at a gap in admission control.
"""

from __future__ import annotations

import logging
from typing import Iterable

from omnirl_async import staleness as rule

__all__ = ["StalenessPolicy", "STRATEGIES"]

log = logging.getLogger(__name__)

STRATEGIES = ("wait", "drop")


class StalenessPolicy:
    def __init__(self, max_off_policy_threshold: int | None = 1, strategy: str = "wait") -> None:
        t = max_off_policy_threshold
        if t is not None and not (isinstance(t, int) and t >= 0):
            raise ValueError(f"`trainer.v1.sampler.max_off_policy_threshold` = {t!r}: must be an integer >= 0 "
                             "(0 = on-policy)")
        if strategy not in STRATEGIES:
            raise ValueError(f"`trainer.v1.sampler.max_off_policy_strategy` = {strategy!r}: choose one of "
                             f"{list(STRATEGIES)}")
        self.threshold = t
        self.strategy = strategy
        self._warned = False

    lag = staticmethod(rule.lag)

    def bound(self, admitted: Iterable[int | None] = ()) -> int | None:
        """The bound a group is held to: the smallest ``tags.max_lag`` of its members, else the threshold."""
        known = [int(b) for b in admitted if b is not None]
        return min(known) if known else self.threshold

    def is_stale(self, policy_version: int | None, learner_version: int,
                 admitted: Iterable[int | None] = ()) -> bool:
        return rule.is_stale(policy_version, learner_version, self.bound(admitted))

    def last_trainable_version(self, policy_version: int | None,
                               admitted: Iterable[int | None] = ()) -> int | None:
        """The newest learner version that may train a group of ``policy_version`` (None = no limit)."""
        return rule.last_trainable_version(policy_version, self.bound(admitted))

    def oldest_fresh_version(self, learner_version: int) -> int | None:
        """Smallest policy version still trainable at ``learner_version`` (None = no bound)."""
        return rule.oldest_trainable_version(learner_version, self.threshold)

    def on_dropped(self, n_samples: int, learner_version: int) -> None:
        if self.strategy == "wait" and not self._warned and n_samples > 0:
            self._warned = True
            log.warning("replay buffer evicted %d stale samples at learner version %d under "
                        "max_off_policy_strategy=wait: admission control let them through", n_samples,
                        learner_version)
