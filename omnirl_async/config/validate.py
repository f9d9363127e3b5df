"""Start-up validation of a composed config.

Three passes, each naming the key path of the first problem it finds:

1. unknown keys (Hydra's ``+key=value`` adds keys without complaint; we do not),
2. type conversion into the typed dataclasses (OmegaConf),
3. the per-field rules declared with :func:`omnirl_async.config.fields.opt`,
   then each dataclass's own ``validate(path)`` for rules that span fields.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from omnirl_async.config.fields import Rule

__all__ = ["ConfigError", "check_unknown_keys", "validate_tree", "to_validated_object"]


class ConfigError(ValueError):
    """A config value or key is not acceptable. The message starts with the key path."""


def _dataclass_fields(tp) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(tp)}


def _field_type(owner, f: dataclasses.Field):
    hints = typing.get_type_hints(owner)
    return hints.get(f.name, Any)


def check_unknown_keys(node: Any, schema: type, path: str = "") -> None:
    """Raise :class:`ConfigError` for the first key of ``node`` that ``schema`` does not declare."""
    if not isinstance(node, (DictConfig, dict)):
        return
    fields = _dataclass_fields(schema)
    for key in node.keys():
        key_path = f"{path}.{key}" if path else str(key)
        if key in ("_target_",):
            continue
        if key not in fields:
            close = [k for k in fields if k.startswith(str(key)[:3])]
            hint = f" Did you mean one of {close}?" if close else ""
            raise ConfigError(f"`{key_path}` is not a known config key.{hint} Known keys at "
                              f"`{path or '<root>'}`: {sorted(fields)}.")
        sub_type = _field_type(schema, fields[key])
        if dataclasses.is_dataclass(sub_type):
            value = node[key] if not isinstance(node, DictConfig) else node._get_node(key)
            check_unknown_keys(value, sub_type, key_path)


def _allowed(rule: Rule) -> list | None:
    if rule.choices is None:
        return None
    return list(rule.choices() if callable(rule.choices) else rule.choices)


def _check_rule(value: Any, rule: Rule, path: str) -> None:
    if rule.not_built:
        for bad, reason in rule.not_built.items():
            if value == bad and type(value) is type(bad):
                raise ConfigError(f"`{path}` = {value!r} is refused: {reason}.")
    allowed = _allowed(rule)
    if allowed is not None and value not in allowed:
        raise ConfigError(f"`{path}` = {value!r} is not allowed; choose one of {allowed}.")
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"`{path}` = {value!r} must be a finite number.")
    bounds = [("ge", ">=", lambda v, b: v >= b), ("gt", ">", lambda v, b: v > b),
              ("le", "<=", lambda v, b: v <= b), ("lt", "<", lambda v, b: v < b)]
    for attr, sym, ok in bounds:
        b = getattr(rule, attr)
        if b is not None and not ok(value, b):
            raise ConfigError(f"`{path}` = {value!r} must be {sym} {b}.")


def validate_tree(obj: Any, path: str = "") -> None:
    """Check every declared rule of a dataclass tree, then each class's ``validate``."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key_path = f"{path}.{f.name}" if path else f.name
        rule = f.metadata.get("rule")
        if dataclasses.is_dataclass(value):
            validate_tree(value, key_path)
        elif rule is not None:
            _check_rule(value, rule, key_path)
    check = getattr(obj, "validate", None)
    if callable(check):
        try:
            check(path)
        except ConfigError:
            raise
        except ValueError as err:
            raise ConfigError(str(err)) from None


def to_validated_object(cfg: DictConfig, schema: type):
    """Unknown keys → types → rules. Returns the typed dataclass instance."""
    check_unknown_keys(cfg, schema)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "<config>"
        msg = str(err).split("\n")[0]
        raise ConfigError(f"`{key}`: {msg}") from None
    validate_tree(obj)
    return obj
