"""Declarative config fields: default, help text and the rule a value must obey.

Every config dataclass in this package declares its fields through :func:`opt`,
so the rule lives next to the help text and one generic validator
(:mod:`omnirl_async.config.validate`) checks the whole tree at start-up and
names the key path in its error. A value whose feature exists in the config
surface of VeRL-Omni but is not built in this project yet is declared with
``not_built`` so that it is refused loudly instead of silently ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

__all__ = ["opt", "Rule"]


@dataclasses.dataclass(frozen=True)
class Rule:
    """What a value must satisfy. Every part is optional."""

    choices: tuple | Callable[[], Iterable] | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    nullable: bool = True
    not_built: dict[Any, str] | None = None


def opt(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    choices: tuple | Callable[[], Iterable] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    not_built: dict[Any, str] | None = None,
) -> Any:
    """A dataclass field with help text and a validation rule.

    ``choices`` may be a callable so that registry-backed keys (loss names,
    reward names) are checked against whatever is registered at start-up.
    ``not_built`` maps a value to the reason it is refused for now.
    """
    rule = Rule(choices=choices, ge=ge, gt=gt, le=le, lt=lt, not_built=not_built)
    meta = {"help": help, "rule": rule}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=meta)
    return dataclasses.field(default=default, metadata=meta)
