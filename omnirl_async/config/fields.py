"""Declarative config fields: default, help text and the rule a value must obey.

Every config dataclass in this package declares its fields through :func:`opt`,
so the rule lives next to the help text and one generic validator
(:mod:`omnirl_async.config.validate`) checks the whole tree at start-up and
names the key path in its error. A value whose feature exists in the config
surface of VeRL-Omni but is not built in this project yet is declared with
``not_built`` so that it is refused loudly instead of silently ignored.

No silent setting: a key the config accepts has its effect in every trainer
mode (``trainer.v1.trainer_mode`` = sync or separate_async), or a value other
than its default is refused at start-up with the reason. Where a key has no
effect (in every mode, in one mode, or while other keys have some values) the
field says so with ``no_effect`` (one or more :class:`NoEffect`); a section
field can declare the same for keys below it (:func:`section`, used where a
dataclass appears at two paths and only one of them ignores a key). The
validator refuses accordingly and :mod:`omnirl_async.config.doc` renders the
per-mode table ``docs/CONFIG_KEYS.md`` from the same declarations.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

__all__ = ["opt", "section", "Rule", "NoEffect", "MODES"]

#: The trainer modes (``trainer.v1.trainer_mode``) that are built.
MODES = ("sync", "separate_async")


@dataclasses.dataclass(frozen=True)
class NoEffect:
    """Where a key has no effect, so that a value other than its default is refused there.

    ``reason``   why the key does nothing there; the error reads "`key` = value is refused ...: <reason>; <fix>".
    ``modes``    the trainer modes where it has no effect; None = every mode.
    ``accept``   values besides the default accepted there (they mean what happens anyway), or a predicate.
    ``accept_doc`` how a predicate ``accept`` reads in the key table.
    ``when``     ``when(section, root) -> str | None``: a condition on other keys; returns the text naming them
                 (e.g. "while `use_kl_loss` = false") when this key has no effect, None when it has. None = always.
    ``when_doc`` how ``when`` reads in the key table (a string, or a callable returning one).
    ``fix``      what to do instead (``{default}`` = the default as written in YAML); by default "leave it at its
                 default (...)", plus the accepted values and the other modes, if any.
    """

    reason: str
    modes: tuple[str, ...] | None = None
    accept: tuple | Callable[[Any], bool] = ()
    accept_doc: str = ""
    when: Callable[[Any, Any], str | None] | None = None
    when_doc: str | Callable[[], str] = ""
    fix: str = ""

    def applies_in(self, mode: str | None) -> bool:
        return self.modes is None or mode in self.modes

    def accepts(self, value: Any) -> bool:
        if callable(self.accept):
            return bool(self.accept(value))
        return any(value == a and type(value) is type(a) for a in self.accept)

    def condition_doc(self) -> str:
        return self.when_doc() if callable(self.when_doc) else self.when_doc


def _as_no_effect(no_effect) -> tuple[NoEffect, ...]:
    if no_effect is None:
        return ()
    if isinstance(no_effect, str):
        return (NoEffect(no_effect),)
    if isinstance(no_effect, NoEffect):
        return (no_effect,)
    return tuple(_as_no_effect(x)[0] for x in no_effect)


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
    no_effect: tuple[NoEffect, ...] = ()
    string: bool = False
    mirror_of: str | None = None


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
    no_effect: str | NoEffect | Iterable[NoEffect] | None = None,
    string: bool = False,
    mirror_of: str | None = None,
) -> Any:
    """A dataclass field with help text and a validation rule.

    ``choices`` may be a callable so that registry-backed keys (loss names,
    reward names) are checked against whatever is registered at start-up.
    ``not_built`` maps a value to the reason it is refused for now.
    ``no_effect`` declares where the key does nothing (a string = in every
    mode, for that reason); a value other than the default is refused there.
    ``string`` (for a field typed ``Any``): a value must be a string or null; an unquoted ``nan``, ``5`` or
    ``true`` that YAML / Hydra read as a number or bool is refused with how to quote it.
    ``mirror_of`` names the section this field is a read-only copy of (its default interpolates it); a value
    that differs from that section, set here or under it, is refused, pointing at the section's own keys.
    """
    rule = Rule(choices=choices, ge=ge, gt=gt, le=le, lt=lt, not_built=not_built,
                no_effect=_as_no_effect(no_effect), string=string, mirror_of=mirror_of)
    meta = {"help": help, "rule": rule}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(factory: Callable[[], Any], *,
            no_effect_below: dict[str, str | NoEffect | Iterable[NoEffect]] | None = None) -> Any:
    """A sub-section field. ``no_effect_below`` maps a key of the section to where it has no effect *at this path*
    (the same dataclass may serve another path where the key does take effect)."""
    below = {k: _as_no_effect(v) for k, v in (no_effect_below or {}).items()}
    return dataclasses.field(default_factory=factory, metadata={"no_effect_below": below})
