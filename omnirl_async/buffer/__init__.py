"""Transfer queue and version-aware replay buffer.

Entry point: :func:`make_replay_buffer`. See :mod:`.base` for the contract,
:mod:`.spec` for what a buffer is built from, :mod:`.table` for what a table
composes, :mod:`.transfer_queue` for the Ray layout (controller + storage
units), :mod:`.persistence` for snapshots and :mod:`.offline_table` for the
offline table (preference pairs of the run's offline store).
"""

from __future__ import annotations

from typing import Any

from omnirl_async.buffer.base import ReplayBuffer, SampledBatch
from omnirl_async.buffer.local import LocalReplayBuffer
from omnirl_async.buffer.spec import BufferSpec

__all__ = ["ReplayBuffer", "SampledBatch", "LocalReplayBuffer", "BufferSpec", "make_replay_buffer"]


def make_replay_buffer(buffer_cfg: Any, sampler_cfg: Any, tq_cfg: Any, *, use_ray: bool,
                       seed: int | None = None, **actor_options: Any) -> ReplayBuffer:
    """Build the buffer from the sections ``buffer``, ``trainer.v1.sampler`` and ``transfer_queue``.

    The sections are read once, here, into a :class:`BufferSpec`
    (:meth:`BufferSpec.from_sections`: every key must be there). ``use_ray=True``
    starts the transfer-queue actors (Ray must be initialised) and returns a
    :class:`~omnirl_async.buffer.transfer_queue.RayReplayBuffer` client that can
    be passed to any Ray actor; ``False`` returns a :class:`LocalReplayBuffer`.
    ``actor_options`` (``unit_options``, ``controller_options``) go to
    :meth:`RayReplayBuffer.create <omnirl_async.buffer.transfer_queue.RayReplayBuffer.create>`.
    """
    spec = BufferSpec.from_sections(buffer_cfg, sampler_cfg, tq_cfg)
    if use_ray:
        from omnirl_async.buffer.transfer_queue import RayReplayBuffer
        return RayReplayBuffer.create(spec, seed=seed, **actor_options)
    return LocalReplayBuffer(spec, seed=seed)
