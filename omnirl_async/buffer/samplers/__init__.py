"""Samplers: which complete groups a learner batch takes (one file per strategy)."""

from __future__ import annotations

from typing import Any, Mapping

from omnirl_async.buffer.samplers.base import GroupInfo, Sampler
from omnirl_async.userfiles import exec_user_file
from omnirl_async.buffer.samplers.fifo import FifoSampler
from omnirl_async.buffer.samplers.freshness import FreshnessSampler
from omnirl_async.buffer.samplers.passes import ShuffledPassSampler
from omnirl_async.buffer.samplers.prioritized import PrioritizedSampler, SumTree
from omnirl_async.buffer.samplers.ticket import TicketSampler
from omnirl_async.buffer.samplers.uniform import UniformSampler

__all__ = ["GroupInfo", "Sampler", "FifoSampler", "UniformSampler", "PrioritizedSampler", "FreshnessSampler",
           "TicketSampler", "ShuffledPassSampler", "SumTree", "SAMPLERS", "make_sampler", "load_custom_sampler"]

SAMPLERS: dict[str, type[Sampler]] = {
    "fifo": FifoSampler,
    "uniform": UniformSampler,
    "prioritized": PrioritizedSampler,
    "freshness": FreshnessSampler,
    "ticket": TicketSampler,
}


def load_custom_sampler(path: str, name: str) -> type[Sampler]:
    """Load class ``name`` from the Python file ``path``; it must subclass :class:`Sampler`."""
    where = "`trainer.v1.sampler.custom_sampler`"
    if not path or not name:
        raise ValueError(f"{where} needs both `path` and `name` (got path={path!r}, name={name!r})")
    module = exec_user_file(path, key="trainer.v1.sampler.custom_sampler", kind="sampler",
                            wanted=f"class {name!r}")
    path = module.__file__
    cls = getattr(module, str(name), None)
    if cls is None:
        found = sorted(k for k, v in vars(module).items() if isinstance(v, type) and issubclass(v, Sampler)
                       and v is not Sampler)
        raise ValueError(f"{where}.name = {name!r}: {path} defines no such class (Sampler subclasses there: "
                         f"{found})")
    if not (isinstance(cls, type) and issubclass(cls, Sampler)):
        raise ValueError(f"{where}.name = {name!r}: {cls!r} must subclass "
                         "omnirl_async.buffer.samplers.Sampler")
    return cls


def make_sampler(name: str, *, custom_path: str | None = None, custom_name: str | None = None,
                 defaults: Mapping[str, Any] | None = None, kwargs: Mapping[str, Any] | None = None) -> Sampler:
    """Build the sampler a config names. A custom sampler wins over ``name``."""
    kwargs = dict(kwargs or {})
    if custom_path or custom_name:
        cls = load_custom_sampler(custom_path, custom_name)
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise ValueError(f"`trainer.v1.sampler.sampler_kwargs` = {kwargs!r}: {cls.__name__}() refused "
                             f"them: {exc}") from exc
    if name not in SAMPLERS:
        raise ValueError(f"`buffer.sampler` = {name!r}: unknown sampler; choose one of {sorted(SAMPLERS)} "
                         "or set `trainer.v1.sampler.custom_sampler.{path,name}`")
    cls = SAMPLERS[name]
    args = {**(defaults or {}), **kwargs}
    try:
        return cls(**args)
    except TypeError as exc:
        raise ValueError(f"`trainer.v1.sampler.sampler_kwargs` = {kwargs!r}: sampler {name!r} refused them: "
                         f"{exc}") from exc
