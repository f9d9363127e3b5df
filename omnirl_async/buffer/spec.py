"""What a replay buffer is built from: small frozen dataclasses, one per concern.

The buffer never reads a config object. :meth:`BufferSpec.from_sections` is
the one place that does: it reads ``buffer.*``, ``trainer.v1.sampler.*`` and
``transfer_queue.*`` by plain attribute access, with no defaults of its own
(a missing key is an error naming its path), at the caller's boundary
(:func:`omnirl_async.buffer.make_replay_buffer`). Everything below it takes a
:class:`BufferSpec`.

The parts and the keys they come from:

* :class:`TableSpec` – one table (per source): ``buffer.max_size``,
  ``buffer.sampler`` (+ ``priority_exponent`` / ``freshness_decay``),
  ``trainer.v1.sampler.sampler_kwargs`` / ``custom_sampler.{path,name}``,
  ``buffer.remover``, ``buffer.max_times_sampled``,
  ``trainer.v1.sampler.drop_incomplete_groups`` /
  ``max_incomplete_group_refill_rounds``;
* :class:`StalenessSpec` – ``trainer.v1.sampler.max_off_policy_threshold`` /
  ``max_off_policy_strategy``;
* :class:`RateSpec` – the rate limiter: ``buffer.min_size_to_sample``,
  ``samples_per_insert``, ``samples_per_insert_error_buffer``;
* :class:`CapacitySpec` – all tables together: ``transfer_queue.
  total_storage_size``, ``memory_budget_bytes``, ``put_timeout_s``;
* :class:`TransportSpec` – the Ray layout: ``transfer_queue.
  num_data_storage_units``, ``producer_owned_payloads``;
* :class:`BufferSpec` – the parts plus ``buffer.offline_mix_ratio``.

The defaults here are the config schema's defaults (``tests/buffer/test_spec.py``
holds them equal). Values are checked when a spec is built, so a bad setting
fails where it is made, naming its config key, the value and the fix. Which
sampler / remover a name means, and a custom sampler's file, are checked when
the buffer builds them.

Examples:
    >>> spec = BufferSpec(table=TableSpec(max_size=64, sampler="uniform"), staleness=StalenessSpec(threshold=2))
    >>> spec.table.max_size, spec.rate.samples_per_insert, spec.transport.num_data_storage_units
    (64, None, 2)
    >>> BufferSpec(offline_mix_ratio=1.5)
    Traceback (most recent call last):
    ...
    ValueError: `buffer.offline_mix_ratio` = 1.5: must be in [0, 1]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from omnirl_async.buffer.rate_limiters import MinSize, SampleToInsertRatio
from omnirl_async.buffer.removers import MaxTimesSampled
from omnirl_async.buffer.staleness import StalenessPolicy

__all__ = ["TableSpec", "StalenessSpec", "RateSpec", "CapacitySpec", "TransportSpec", "BufferSpec"]

_BUFFER, _SAMPLER, _TQ = "buffer", "trainer.v1.sampler", "transfer_queue"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class TableSpec:
    """One table: its size bound, which groups a batch takes, and when a group leaves."""

    max_size: int = 4096
    sampler: str = "fifo"
    #: keyword arguments for the sampler; win over the sampler defaults below
    sampler_kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: default ``exponent`` of the prioritized sampler
    priority_exponent: float = 0.6
    #: default ``decay`` of the freshness sampler
    freshness_decay: float = 0.5
    #: a user sampler class (file + class name); wins over ``sampler``
    custom_sampler_path: str | None = None
    custom_sampler_name: str | None = None
    remover: str = "fifo"
    max_times_sampled: int = 1
    drop_incomplete_groups: bool = False
    #: refill attempts per evicted incomplete group
    max_refill_rounds: int = 3

    def __post_init__(self) -> None:
        if not (_is_int(self.max_size) and self.max_size > 0):
            raise ValueError(f"`{_BUFFER}.max_size` = {self.max_size!r}: must be an integer > 0")
        MaxTimesSampled(self.max_times_sampled)  # its own check names `buffer.max_times_sampled`
        if not isinstance(self.sampler_kwargs, Mapping):
            raise ValueError(f"`{_SAMPLER}.sampler_kwargs` = {self.sampler_kwargs!r}: must be a mapping of keyword "
                             "arguments for the sampler ({} for none)")
        object.__setattr__(self, "sampler_kwargs", dict(self.sampler_kwargs))  # the spec's own copy
        if not (_is_int(self.max_refill_rounds) and self.max_refill_rounds >= 0):
            raise ValueError(f"`{_SAMPLER}.max_incomplete_group_refill_rounds` = {self.max_refill_rounds!r}: must "
                             "be an integer >= 0 (0 = never refill)")

    def sampler_defaults(self) -> dict[str, Any]:
        """Default keyword arguments of the built-in sampler ``sampler`` (``sampler_kwargs`` override them)."""
        return {"prioritized": {"exponent": self.priority_exponent},
                "freshness": {"decay": self.freshness_decay}}.get(self.sampler, {})


@dataclass(frozen=True)
class StalenessSpec:
    """How far behind the learner a trained sample may be, and what happens upstream (see :mod:`.staleness`)."""

    #: max version lag of a trained sample; None = no bound
    threshold: int | None = 1
    strategy: str = "wait"

    def __post_init__(self) -> None:
        StalenessPolicy(self.threshold, self.strategy)  # its checks name the trainer.v1.sampler keys


@dataclass(frozen=True)
class RateSpec:
    """The rate limiter (see :mod:`.rate_limiters`): ``samples_per_insert`` None = :class:`MinSize` only."""

    #: samples held before sampling may start; None = 0
    min_size_to_sample: int | None = None
    samples_per_insert: float | None = None
    #: slack of the ratio window in samples; None = sized automatically
    error_buffer: float | None = None

    def __post_init__(self) -> None:
        MinSize(self.min_size)  # checks `buffer.min_size_to_sample`
        if self.samples_per_insert is not None:
            SampleToInsertRatio(self.samples_per_insert, self.min_size, self.error_buffer)  # and these two
        elif self.error_buffer is not None and not (_is_number(self.error_buffer) and self.error_buffer >= 0):
            raise ValueError(f"`{_BUFFER}.samples_per_insert_error_buffer` = {self.error_buffer!r}: must be a "
                             "finite number >= 0, or null (sized automatically)")

    @property
    def min_size(self) -> int:
        return self.min_size_to_sample or 0


@dataclass(frozen=True)
class CapacitySpec:
    """Bounds on all tables together, and how long a producer waits for room."""

    #: capacity in samples; None = bounded by ``memory_budget_bytes``
    total_storage_size: int | None = None
    memory_budget_bytes: int = 2 * 1024**3
    put_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        t = self.total_storage_size
        if t is not None and not (_is_int(t) and t > 0):
            raise ValueError(f"`{_TQ}.total_storage_size` = {t!r}: must be an integer > 0, or null to bound "
                             "the buffer by `transfer_queue.memory_budget_bytes`")
        if not (_is_int(self.memory_budget_bytes) and self.memory_budget_bytes > 0):
            raise ValueError(f"`{_TQ}.memory_budget_bytes` = {self.memory_budget_bytes!r}: must be an integer "
                             "> 0 (bytes)")
        if not (_is_number(self.put_timeout_s) and self.put_timeout_s > 0):
            raise ValueError(f"`{_TQ}.put_timeout_s` = {self.put_timeout_s!r}: must be a finite number of "
                             "seconds > 0")


@dataclass(frozen=True)
class TransportSpec:
    """The Ray layout (see :mod:`.transfer_queue`); the in-process buffer ignores it."""

    num_data_storage_units: int = 2
    #: producers own their payloads: one copy less; a dead producer's untrained groups are generated again
    producer_owned_payloads: bool = True
    #: payloads below this many bytes travel inside the controller call and live in the controller
    inline_max_bytes: int = 64 * 1024
    #: puts handed to a background sender per process before a put waits (0: each put waits for the controller)
    max_pending_puts: int = 8
    #: how long the background sender waits for more registrations to share a controller call
    put_linger_s: float = 0.02

    def __post_init__(self) -> None:
        k = self.num_data_storage_units
        if not (_is_int(k) and k >= 1):
            raise ValueError(f"`{_TQ}.num_data_storage_units` = {k!r}: must be an integer >= 1")
        b = self.inline_max_bytes
        if not (_is_int(b) and b >= 0):
            raise ValueError(f"`{_TQ}.inline_max_bytes` = {b!r}: must be an integer >= 0 (0 = every payload goes "
                             "through the object store)")
        w = self.max_pending_puts
        if not (_is_int(w) and w >= 0):
            raise ValueError(f"`{_TQ}.max_pending_puts` = {w!r}: must be an integer >= 0 (0 = every put waits for the "
                             "controller)")
        lg = self.put_linger_s
        if isinstance(lg, bool) or not isinstance(lg, (int, float)) or not 0 <= lg <= 1:
            raise ValueError(f"`{_TQ}.put_linger_s` = {lg!r}: must be a number of seconds in [0, 1] (0 = each "
                             "registration is sent at once)")
        if lg and w == 0:
            raise ValueError(f"`{_TQ}.put_linger_s` = {lg!r} has no effect with `{_TQ}.max_pending_puts` = 0 (every "
                             f"put waits for the controller, alone): set `{_TQ}.put_linger_s=0`, or "
                             "max_pending_puts > 0")
        if not isinstance(self.producer_owned_payloads, bool):
            raise ValueError(f"`{_TQ}.producer_owned_payloads` = {self.producer_owned_payloads!r}: must be true "
                             "or false")


@dataclass(frozen=True)
class BufferSpec:
    """Everything a replay buffer is built from; ``BufferSpec()`` is the config schema's defaults."""

    table: TableSpec = field(default_factory=TableSpec)
    staleness: StalenessSpec = field(default_factory=StalenessSpec)
    rate: RateSpec = field(default_factory=RateSpec)
    capacity: CapacitySpec = field(default_factory=CapacitySpec)
    transport: TransportSpec = field(default_factory=TransportSpec)
    #: fraction of each learner batch drawn from the offline table
    offline_mix_ratio: float = 0.0

    def __post_init__(self) -> None:
        for name, cls in (("table", TableSpec), ("staleness", StalenessSpec), ("rate", RateSpec),
                          ("capacity", CapacitySpec), ("transport", TransportSpec)):
            part = getattr(self, name)
            if not isinstance(part, cls):
                raise ValueError(f"`{name}` = {part!r}: must be a {cls.__name__}")
        ratio = self.offline_mix_ratio
        if not (_is_number(ratio) and 0.0 <= ratio <= 1.0):
            raise ValueError(f"`{_BUFFER}.offline_mix_ratio` = {ratio!r}: must be in [0, 1]")
        max_size, min_size = self.table.max_size, self.rate.min_size
        if min_size > max_size:
            raise ValueError(f"`{_BUFFER}.min_size_to_sample` = {min_size} must deadlock: it exceeds "
                             f"`{_BUFFER}.max_size` = {max_size}; lower min_size_to_sample or raise max_size")
        spi, max_times = self.rate.samples_per_insert, self.table.max_times_sampled
        if spi is not None and spi > max_times:
            raise ValueError(f"`{_BUFFER}.samples_per_insert` = {spi} must deadlock: each sample can be drawn "
                             f"at most `{_BUFFER}.max_times_sampled` = {max_times} times; "
                             "raise max_times_sampled or lower samples_per_insert")

    @classmethod
    def from_sections(cls, buffer_cfg: Any, sampler_cfg: Any, tq_cfg: Any) -> "BufferSpec":
        """The spec of the config sections ``buffer``, ``trainer.v1.sampler`` and ``transfer_queue``.

        Reads each key by attribute (a dataclass of the schema, a namespace, ...):
        no defaults here, a missing one raises ``ValueError`` naming its key path.
        """
        b, s, q = _Section(buffer_cfg, _BUFFER), _Section(sampler_cfg, _SAMPLER), _Section(tq_cfg, _TQ)
        custom = _Section(s.custom_sampler, f"{_SAMPLER}.custom_sampler")
        table = TableSpec(max_size=b.max_size, sampler=b.sampler, sampler_kwargs=_or_empty(s.sampler_kwargs),
                          priority_exponent=b.priority_exponent, freshness_decay=b.freshness_decay,
                          custom_sampler_path=custom.path, custom_sampler_name=custom.name, remover=b.remover,
                          max_times_sampled=b.max_times_sampled, drop_incomplete_groups=s.drop_incomplete_groups,
                          max_refill_rounds=s.max_incomplete_group_refill_rounds)
        staleness = StalenessSpec(threshold=s.max_off_policy_threshold, strategy=s.max_off_policy_strategy)
        rate = RateSpec(min_size_to_sample=b.min_size_to_sample, samples_per_insert=b.samples_per_insert,
                        error_buffer=b.samples_per_insert_error_buffer)
        capacity = CapacitySpec(total_storage_size=q.total_storage_size, memory_budget_bytes=q.memory_budget_bytes,
                                put_timeout_s=q.put_timeout_s)
        transport = TransportSpec(num_data_storage_units=q.num_data_storage_units,
                                  producer_owned_payloads=q.producer_owned_payloads,
                                  inline_max_bytes=q.inline_max_bytes, max_pending_puts=q.max_pending_puts,
                                  put_linger_s=q.put_linger_s)
        return cls(table=table, staleness=staleness, rate=rate, capacity=capacity, transport=transport,
                   offline_mix_ratio=b.offline_mix_ratio)


def _or_empty(kwargs: Any) -> Any:
    """``sampler_kwargs: null`` in a config file means no keyword arguments."""
    return {} if kwargs is None else kwargs


class _Section:
    """A config section read by attribute; a missing key raises ``ValueError`` naming its path."""

    __slots__ = ("_obj", "_path")

    def __init__(self, obj: Any, path: str) -> None:
        if obj is None:
            raise ValueError(f"`{path}`: no config section given (None); pass the `{path}` section of the config, "
                             "or build a BufferSpec directly")
        self._obj, self._path = obj, path

    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(self._obj, name)
        except AttributeError:
            raise ValueError(f"`{self._path}.{name}` is missing: the `{self._path}` section given to the buffer "
                             f"({type(self._obj).__name__}) has no attribute {name!r}; pass the full section "
                             "(the config schema has every key)") from None
