"""Start-up validation of a composed config.

Three passes, each naming the key path of the first problem it finds:

1. unknown keys (Hydra's ``+key=value`` adds keys without complaint; we do not),
2. type conversion into the typed dataclasses (OmegaConf),
3. the per-field rules declared with :func:`omnirl_async.config.fields.opt`
   (including ``no_effect``: a value other than the default of a key that has
   no effect in this mode, or with these other keys, is refused with the
   reason), then each dataclass's own ``validate(path)`` for rules that span
   fields.

Whatever goes wrong comes out as one :class:`ConfigError` whose message starts
with the key path: OmegaConf's own errors are translated, a bounded field
(``gt=0``...) refuses values that are not numbers even when it is typed
``Any``, and a ``validate`` that trips over a value of the wrong shape (a
``TypeError`` on ``len(5)``) is reported with the keys of that section the user
changed, never as a bare traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from omnirl_async.config.fields import MODES, NoEffect, Rule

__all__ = ["ConfigError", "check_unknown_keys", "unknown_key_message", "type_at", "schema_at", "validate_tree",
           "to_validated_object", "show_value", "trainer_mode_of", "mirror_fields", "mirror_message",
           "check_mirrors"]


class ConfigError(ValueError):
    """A config value or key is not acceptable. The message starts with the key path."""


def _dataclass_fields(tp) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(tp)}


@functools.lru_cache(maxsize=None)
def _type_hints(owner: type) -> dict[str, Any]:
    return typing.get_type_hints(owner)


def _field_type(owner, f: dataclasses.Field):
    return _type_hints(owner).get(f.name, Any)


def unknown_key_message(key_path: str, schema: type) -> str:
    """``key_path`` is not a field of ``schema`` (the dataclass of its parent): say so, with near misses."""
    parent, _, key = key_path.rpartition(".")
    fields = _dataclass_fields(schema)
    close = difflib.get_close_matches(key, list(fields), n=3, cutoff=0.6)
    close += [k for k in fields if k.startswith(key[:3]) and k not in close]
    hint = f" Did you mean one of {close}?" if close else ""
    return (f"`{key_path}` is not a known config key.{hint} Known keys at `{parent or '<root>'}`: "
            f"{sorted(fields)}.")


def type_at(schema: type, key_path: str) -> Any:
    """The declared type of ``key_path`` under ``schema`` ("" = ``schema``); None when no field has that path."""
    tp: Any = schema
    for part in [p for p in key_path.split(".") if p]:
        fields = _dataclass_fields(tp) if dataclasses.is_dataclass(tp) else {}
        if part not in fields:
            return None
        tp = _field_type(tp, fields[part])
    return tp


def schema_at(schema: type, key_path: str) -> type | None:
    """The dataclass that declares the fields under ``key_path`` ("" = ``schema``), or None."""
    tp = type_at(schema, key_path)
    return tp if dataclasses.is_dataclass(tp) else None


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
            raise ConfigError(unknown_key_message(key_path, schema))
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
    if value is None:
        return
    if rule.string and not isinstance(value, str):
        raise ConfigError(_not_a_string(value, path))
    bounds = [("ge", ">=", lambda v, b: v >= b), ("gt", ">", lambda v, b: v > b),
              ("le", "<=", lambda v, b: v <= b), ("lt", "<", lambda v, b: v < b)]
    declared = [(sym, getattr(rule, attr), ok) for attr, sym, ok in bounds if getattr(rule, attr) is not None]
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number:
        if declared:  # a bounded field typed Any: only numbers (or null) make sense
            need = " and ".join(f"{sym} {b}" for sym, b, _ in declared)
            raise ConfigError(f"`{path}` = {value!r} is not a number; give a number {need}, or null.")
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"`{path}` = {value!r} must be a finite number.")
    for sym, b, ok in declared:
        if not ok(value, b):
            raise ConfigError(f"`{path}` = {value!r} must be {sym} {b}.")


def _not_a_string(value: Any, path: str) -> str:
    """A string-or-null key got a number, a bool or a collection (YAML / Hydra read ``nan``, ``5``, ``true`` so)."""
    if isinstance(value, (bool, int, float)):
        text = show_value(value) if isinstance(value, bool) else str(value)
        kind = "a bool" if isinstance(value, bool) else "an integer" if isinstance(value, int) else "a number"
        key = path.rpartition(".")[2]
        return (f"`{path}` = {value!r} is not a string (an unquoted {text} is read as {kind}); quote it: "
                f"`'{path}=\"{text}\"'` on the command line, `{key}: \"{text}\"` in YAML.")
    return f"`{path}` = {show_value(value)} is not a string; give a string, or null."


def show_value(value: Any) -> str:
    """A value as one writes it in YAML / an override: null, true, 1e-05, 'text', [a, b]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show_value(v) for v in value) + "]"
    return repr(value)


def trainer_mode_of(root: Any) -> str | None:
    """``trainer.v1.trainer_mode`` of a validated root config (None for a section validated alone)."""
    v1 = getattr(getattr(root, "trainer", None), "v1", None)
    return getattr(v1, "trainer_mode", None)


def _no_effect_condition(decl: NoEffect, section: Any, root: Any) -> str | None:
    """"" when ``decl`` holds unconditionally, the condition's text when its ``when`` holds, None when not."""
    if decl.when is None:
        return ""
    try:
        return decl.when(section, root)
    except Exception:  # noqa: BLE001 - a wrong-shaped other key is reported by its own check
        return None


def _check_no_effect(value: Any, default: Any, decls: tuple[NoEffect, ...], path: str, section: Any,
                     root: Any) -> None:
    """Refuse ``value`` at ``path`` when a declaration says the key has no effect here and it is not the default."""
    if value == default and type(value) is type(default):
        return
    mode = trainer_mode_of(root)
    for decl in decls:
        if not decl.applies_in(mode) or decl.accepts(value):
            continue
        cond = _no_effect_condition(decl, section, root)
        if cond is None:
            continue
        where = f" under `trainer.v1.trainer_mode` = {mode}" if decl.modes is not None else ""
        where += f" {cond}" if cond else ""
        fix = decl.fix.format(default=show_value(default)) if decl.fix else _default_fix(default, decl)
        raise ConfigError(f"`{path}` = {value!r} is refused{where}: {decl.reason}; {fix}.")


def _default_fix(default: Any, decl: NoEffect) -> str:
    fix = f"leave it at its default ({show_value(default)})"
    if decl.accept and not callable(decl.accept):
        fix += f" or use {' or '.join(show_value(a) for a in decl.accept)}"
    if decl.modes is not None:
        others = [m for m in MODES if m not in decl.modes]
        if others:
            fix += f", or set `trainer.v1.trainer_mode` = {' or '.join(others)}"
    return fix


def no_effect_of(f: dataclasses.Field, below: dict[str, tuple[NoEffect, ...]] | None = None) -> tuple[NoEffect, ...]:
    """Every :class:`NoEffect` of field ``f``: its own, and what its enclosing section field declares for it."""
    rule = f.metadata.get("rule")
    own = rule.no_effect if rule is not None else ()
    return tuple(own) + tuple((below or {}).get(f.name, ()))


def validate_tree(obj: Any, path: str = "", *, root: Any = None,
                  below: dict[str, tuple[NoEffect, ...]] | None = None) -> None:
    """Check every declared rule of a dataclass tree, then each class's ``validate``.

    ``root`` is the whole config (for ``no_effect`` declarations that depend on the mode or on other keys);
    ``below`` the ``no_effect`` declarations the enclosing section field makes for the keys of ``obj``.
    """
    root = obj if root is None else root
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key_path = f"{path}.{f.name}" if path else f.name
        rule = f.metadata.get("rule")
        if dataclasses.is_dataclass(value):
            validate_tree(value, key_path, root=root, below=f.metadata.get("no_effect_below"))
            continue
        if rule is not None:
            _check_rule(value, rule, key_path)
        decls = no_effect_of(f, below)
        if decls:
            _check_no_effect(value, _default_of(f), decls, key_path, obj, root)
    _run_class_check(obj, path)


def _run_class_check(obj: Any, path: str) -> None:
    """``obj.validate(path)``; a ValueError is the user's error, a crash on a wrong-shaped value too."""
    check = getattr(obj, "validate", None)
    if not callable(check):
        return
    try:
        check(path)
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from None
    except (TypeError, AttributeError, KeyError, IndexError) as err:
        raise ConfigError(_crash_message(obj, path, err)) from None


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _changed_fields(obj: Any) -> list[dataclasses.Field]:
    """Direct non-section fields of ``obj`` whose value differs from the declared default."""
    out = []
    for f in dataclasses.fields(obj):
        default = _default_of(f)
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) or (isinstance(default, str) and default.startswith("${")):
            continue
        if default is dataclasses.MISSING or value != default:
            out.append(f)
    return out


def _crashes(obj: Any, path: str) -> bool:
    try:
        obj.validate(path)
    except (TypeError, AttributeError, KeyError, IndexError):
        return True
    except Exception:  # noqa: BLE001 - another complaint is not this crash
        return False
    return False


def _culprits(obj: Any, path: str) -> list[dataclasses.Field]:
    """The changed fields whose value, put back to its default, makes ``validate`` stop crashing."""
    changed = _changed_fields(obj)
    found = []
    for f in changed:
        try:
            trial = dataclasses.replace(obj, **{f.name: _default_of(f)})
        except Exception:  # noqa: BLE001 - cannot rebuild: keep the field as a suspect
            found.append(f)
            continue
        if not _crashes(trial, path):
            found.append(f)
    return found or changed


def _crash_message(obj: Any, path: str, err: BaseException) -> str:
    """Name the keys of the section whose ``validate`` could not handle their values."""
    where = f"`{path}`" if path else "the config"
    reason = f"{type(err).__name__}: {err}"
    culprits = _culprits(obj, path)
    if not culprits:
        return f"{where}: a value has the wrong type or shape ({reason}); check the keys you set under it."
    parts = []
    for f in culprits:
        key = f"{path}.{f.name}" if path else f.name
        help_text = f.metadata.get("help", "")
        parts.append(f"`{key}` = {getattr(obj, f.name)!r}" + (f" (expected: {help_text.rstrip('.')})"
                                                              if help_text else ""))
    return f"{'; '.join(parts)}: the check of {where} cannot use this value ({reason})."


@functools.lru_cache(maxsize=None)
def mirror_fields(schema: type, path: str = "") -> tuple[tuple[str, str], ...]:
    """``(key path, section it copies)`` of every field of ``schema`` declared with ``mirror_of``."""
    out: list[tuple[str, str]] = []
    for f in dataclasses.fields(schema):
        key_path = f"{path}.{f.name}" if path else f.name
        rule = f.metadata.get("rule")
        if rule is not None and rule.mirror_of:
            out.append((key_path, rule.mirror_of))
        sub_type = _field_type(schema, f)
        if dataclasses.is_dataclass(sub_type):
            out.extend(mirror_fields(sub_type, key_path))
    return tuple(out)


def _mirror_above(schema: type, key_path: str) -> tuple[str, str] | None:
    """``(mirror path, source path)`` when ``key_path`` is a mirror field or a key under one."""
    for mirror, source in mirror_fields(schema):
        if key_path == mirror or key_path.startswith(mirror + "."):
            return mirror, source
    return None


def _override_text(value: Any) -> str:
    """``value`` as written after ``key=`` on the command line."""
    return value if isinstance(value, str) and value and value.strip() == value else show_value(value)


def mirror_message(schema: type, key_path: str, value: Any = dataclasses.MISSING, *,
                   written_out: bool = False) -> str | None:
    """Why ``key_path`` (a mirror field or a key under it) cannot be set, and the key of the source to set instead;
    None when ``key_path`` is not under a mirror field. ``written_out``: the config holds a whole resolved copy (a
    run's ``resolved_config.yaml``), which an override can link back to its section."""
    found = _mirror_above(schema, key_path)
    if found is None:
        return None
    mirror, source = found
    shown = "" if value is dataclasses.MISSING else f" = {show_value(value)}"
    head = (f"`{key_path}`{shown} is refused: `{mirror}` is a read-only copy of `{source}` (it follows that "
            f"section, which is what the learner reads)")
    rest = key_path[len(mirror):]
    if not rest:
        return f"{head}; leave it out and set the keys under `{source}` instead."
    target = source + rest
    parent, _, key = target.rpartition(".")
    section = schema_at(schema, parent)
    if section is not None and key not in _dataclass_fields(section):
        return f"{head}; and {unknown_key_message(target, section)}"
    if written_out:
        return (f"{head}, but a config file holds it written out (as a run's resolved_config.yaml does) and it no "
                f"longer matches `{target}`; link it back with `'{mirror}=${{{source}}}'`, or delete it from the file.")
    value_text = "<value>" if value is dataclasses.MISSING else _override_text(value)
    return f"{head}; set `{target}={value_text}` instead (no `+`)."


def check_mirrors(cfg: DictConfig, schema: type) -> None:
    """Refuse a mirror field (``mirror_of``) that no longer equals its section: set to another value, or a key
    added or changed under it (``+a.mirror.key=v`` replaces the interpolation by a mapping of that key alone).
    A complete copy equal to the section (what a run's ``resolved_config.yaml`` holds) is accepted."""
    for mirror, source in mirror_fields(schema):
        parent, _, key = mirror.rpartition(".")
        holder = OmegaConf.select(cfg, parent) if parent else cfg
        if not isinstance(holder, DictConfig) or key not in holder:
            continue
        node = holder._get_node(key)
        if node._is_interpolation() and node._value() == "${" + source + "}":
            continue
        try:
            mine = OmegaConf.select(cfg, mirror)
            mine = OmegaConf.to_container(mine, resolve=True) if isinstance(mine, DictConfig) else mine
            theirs = OmegaConf.to_container(OmegaConf.select(cfg, source), resolve=True)
        except OmegaConfBaseException:
            mine, theirs = node._value(), None
        if mine == theirs:
            continue
        if isinstance(mine, dict) and mine:
            differs = [k for k in mine if not isinstance(theirs, dict) or mine[k] != theirs.get(k)]
            first = (differs or list(mine))[0]
            written_out = isinstance(theirs, dict) and set(mine) == set(theirs)
            raise ConfigError(mirror_message(schema, f"{mirror}.{first}", mine[first], written_out=written_out))
        raise ConfigError(mirror_message(schema, mirror, mine))


def to_validated_object(cfg: DictConfig, schema: type):
    """Unknown keys → read-only copies → types → rules. Returns the typed dataclass instance."""
    check_unknown_keys(cfg, schema)
    if isinstance(cfg, DictConfig):
        check_mirrors(cfg, schema)
    try:
        # A config composed by the loader is already typed by the schema; merging it into a fresh
        # structured copy again would only cost time.
        typed = isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is schema
        merged = cfg if typed else OmegaConf.merge(OmegaConf.structured(schema), cfg)
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "<config>"
        msg = str(err).split("\n")[0]
        raise ConfigError(f"`{key}`: {msg}") from None
    validate_tree(obj)
    return obj
