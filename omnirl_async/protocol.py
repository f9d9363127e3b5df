"""Messages that cross process boundaries.

Every structure here is a ``msgspec.Struct``: it serialises to msgpack with no
pickle, validates its field types on decode, and is cheap to copy between Ray
actors. Tensors never live in these structs; they travel beside them as a
``dict[str, numpy.ndarray]`` (one entry per field, batch dimension first) so
that Ray's object store can hand them over without a copy.

Vocabulary
----------
* **sample** – one generated trajectory (diffusion: one image and the SDE
  steps that produced it), or one offline record.
* **group** – the ``n`` samples generated for one prompt; GRPO advantages are
  computed within a group, so the buffer hands groups out whole.
* **policy version** – a monotone integer; ``0`` is the initial weights and
  the learner publishes ``v + 1`` after every ``parameter_sync_step`` updates.
"""

from __future__ import annotations

import enum
import time
import uuid
from typing import Any

import msgspec

__all__ = [
    "SampleStatus",
    "SampleSource",
    "SampleTags",
    "SampleMeta",
    "PromptLease",
    "WeightsInfo",
    "RefillRequest",
    "new_uid",
    "encode",
    "decode",
]


class SampleStatus(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCESS = "success"
    FAILURE = "failure"


class SampleSource(str, enum.Enum):
    ONLINE = "online"
    OFFLINE = "offline"


def new_uid() -> str:
    return uuid.uuid4().hex


class SampleTags(msgspec.Struct, kw_only=True):
    """Who produced a sample, with which weights, and for which prompt."""

    uid: str
    group_uid: str
    sample_index: int = 0
    group_size: int = 1
    policy_version: int | None = None  # None for offline data
    global_step: int = 0  # learner step when the prompt was submitted
    source: SampleSource = SampleSource.ONLINE
    seed: int | None = None
    prompt: str = ""
    epoch: int = 0
    ticket: int = -1  # position in the learner's training order (admission control); -1 = none
    max_lag: int | None = None  # the staleness bound its prompt was admitted under; None = the buffer's threshold


class SampleMeta(msgspec.Struct, kw_only=True):
    """Metadata of one sample held by the transfer queue controller."""

    key: str
    partition: str = "train"
    status: SampleStatus = SampleStatus.PENDING
    reason: str | None = None
    tags: SampleTags
    created_at: float = msgspec.field(default_factory=time.time)
    updated_at: float = msgspec.field(default_factory=time.time)
    times_sampled: int = 0
    reward: float | None = None
    timings: dict[str, float] = msgspec.field(default_factory=dict)


class PromptLease(msgspec.Struct, kw_only=True):
    """A prompt handed to a rollout worker; completed or returned exactly once."""

    lease_id: str
    group_uid: str
    prompt: str
    epoch: int
    index: int  # position in the epoch's prompt order
    n: int
    seed: int | None = None
    global_step: int = 0
    negative_prompt: str | None = None
    ticket: int = -1  # global training order of this prompt group (see actors/staleness.py)
    max_lag: int | None = None  # the staleness threshold it was admitted under (its samples keep it); None = none
    fields: dict[str, Any] | None = None  # the other fields of the prompt's dataset row, for the reward; None = none
    #: the oldest weights version the group may be generated with: the one admission counted on (the newest
    #: published version the dispatcher knew of, or the worker's own if newer); None = no requirement
    weights_version: int | None = None
    #: seconds the lease call waited in the dispatcher for admission before this lease was granted (0: at once)
    admission_wait_s: float = 0.0


class WeightsInfo(msgspec.Struct, kw_only=True):
    """Announcement of a published weight version."""

    version: int
    num_bytes: int
    is_lora: bool
    published_at: float = msgspec.field(default_factory=time.time)
    #: the learner update each policy state holds: {"default": u} (+ {"old": u_old} with DiffusionNFT's old adapter)
    adapter_versions: dict[str, int] = msgspec.field(default_factory=dict)


class RefillRequest(msgspec.Struct, kw_only=True):
    """A group the replay buffer evicted because a member failed; generate it again.

    Emitted only when ``trainer.v1.sampler.drop_incomplete_groups`` is set. The
    prompt is regenerated whole (``n`` samples) under the same ``group_uid``;
    ``round`` counts refills of this group (1 = first refill) and never exceeds
    ``max_incomplete_group_refill_rounds``.
    """

    group_uid: str
    prompt: str
    n: int
    round: int
    failed_keys: list[str] = msgspec.field(default_factory=list)
    reasons: list[str] = msgspec.field(default_factory=list)
    seed: int | None = None
    epoch: int = 0
    global_step: int = 0
    source: SampleSource = SampleSource.ONLINE


_ENCODER = msgspec.msgpack.Encoder()


def encode(obj) -> bytes:
    """msgpack-encode a Struct (or plain containers of them)."""
    return _ENCODER.encode(obj)


def decode(data: bytes, type_):
    """Decode msgpack bytes into ``type_``, validating every field."""
    return msgspec.msgpack.decode(data, type=type_)
