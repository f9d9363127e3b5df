"""Transfer queue and version-aware replay buffer.

Entry point: :func:`make_replay_buffer`. See :mod:`.base` for the contract,
:mod:`.table` for what a table composes, :mod:`.transfer_queue` for the Ray
layout (controller + storage units) and :mod:`.persistence` for snapshots.
"""

from __future__ import annotations

from typing import Any

from omnirl_async.buffer.base import ReplayBuffer, SampledBatch
from omnirl_async.buffer.local import LocalReplayBuffer

__all__ = ["ReplayBuffer", "SampledBatch", "LocalReplayBuffer", "make_replay_buffer"]


def make_replay_buffer(buffer_cfg: Any = None, sampler_cfg: Any = None, tq_cfg: Any = None, *,
                       use_ray: bool, seed: int | None = None) -> ReplayBuffer:
    """Build the buffer from ``buffer.*``, ``trainer.v1.sampler.*`` and ``transfer_queue.*``.

    ``use_ray=True`` starts the transfer-queue actors (Ray must be initialised)
    and returns a :class:`~omnirl_async.buffer.transfer_queue.RayReplayBuffer`
    client that can be passed to any Ray actor; ``False`` returns a
    :class:`LocalReplayBuffer`.
    """
    if use_ray:
        from omnirl_async.buffer.transfer_queue import RayReplayBuffer
        return RayReplayBuffer.create(buffer_cfg, sampler_cfg, tq_cfg, seed=seed)
    return LocalReplayBuffer(buffer_cfg, sampler_cfg, tq_cfg, seed=seed)
