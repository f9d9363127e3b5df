"""Remove a group once it has been sampled ``max_times_sampled`` times.

``1`` (the default) is on-policy consumption: every sample is trained exactly
once. Larger values allow reuse; between uses the group is evictable by the
table's remover when room is needed.
"""

from __future__ import annotations

__all__ = ["MaxTimesSampled"]


class MaxTimesSampled:
    def __init__(self, max_times_sampled: int = 1) -> None:
        if not (isinstance(max_times_sampled, int) and max_times_sampled >= 1):
            raise ValueError(f"`buffer.max_times_sampled` = {max_times_sampled!r}: must be an integer >= 1")
        self.max_times_sampled = max_times_sampled

    def exhausted(self, times_sampled: int) -> bool:
        """True when a group sampled ``times_sampled`` times must leave the table."""
        return times_sampled >= self.max_times_sampled
