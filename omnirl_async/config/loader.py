"""Compose a config the way ``omnirl-async train`` does: YAML defaults → recipe → overrides.

The schema is registered in Hydra's ConfigStore as ``diffusion_trainer_schema``;
``omnirl_async/configs/diffusion_trainer.yaml`` (inside the package, so a wheel
carries it; ``configs/`` at the repository root links to it) lists it first in
its defaults so every key is typed. Command-line overrides use Hydra's grammar
(``a.b=1``, ``+a.c=2``, ``~a.d``), and the result is checked by
:func:`to_validated_object`.

Choosing an algorithm applies its preset (:mod:`omnirl_async.config.presets`)
between the trainer YAML and what you set: schema default < ``diffusion_trainer.yaml``
< preset < recipe YAML < command line. Which keys *you* set is read from the
composition itself: the keys written in every config file of its defaults list
other than the schema and ``diffusion_trainer`` (the recipe and what it
includes), plus the keys of the command-line overrides (the files' part is
cached per process, keyed on the config-group choices and a digest of every
file of the config sources, since working out the defaults list costs as much
as composing). Validation runs after the presets.

Every failure is a :class:`ConfigError` whose message starts with the key
path: each override is parsed on its own first, so a malformed one (``a.b=[1``,
``a.b``, a sweep such as ``a.b=choice(1,2)``) is reported with its key, and
whatever Hydra or OmegaConf raise while composing is translated, never passed
through.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Sequence

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from omnirl_async.config import presets as _presets
from omnirl_async.config.root import DiffusionTrainerConfig
from omnirl_async.config.validate import (ConfigError, mirror_message, schema_at, to_validated_object, type_at,
                                          unknown_key_message)

__all__ = ["register_configs", "default_config_dir", "check_override_syntax", "compose_config", "load_config",
           "user_set_keys", "to_yaml"]

SCHEMA_NAME = "diffusion_trainer_schema"
#: The trainer YAML: its values are defaults that a preset replaces; any other config file's are the user's.
BASE_CONFIG_NAME = "diffusion_trainer"
_REGISTERED = False


def register_configs() -> None:
    """Put the structured schema into Hydra's ConfigStore (idempotent)."""
    global _REGISTERED
    if not _REGISTERED:
        ConfigStore.instance().store(name=SCHEMA_NAME, node=DiffusionTrainerConfig)
        _REGISTERED = True


def default_config_dir() -> Path:
    """``$OMNIRL_CONFIG_DIR``, else ``configs/`` beside the package (a checkout), else the package's own copy."""
    env = os.environ.get("OMNIRL_CONFIG_DIR")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "configs", here.parents[1] / "configs"):
        if (candidate / "diffusion_trainer.yaml").is_file():
            return candidate
    raise FileNotFoundError("could not find configs/diffusion_trainer.yaml; set OMNIRL_CONFIG_DIR to the "
                            "folder that holds it.")


def override_key(text: str) -> str:
    """The key an override string is about, even when it does not parse (``+a.b=1`` -> ``a.b``)."""
    return text.lstrip("+~").split("=", 1)[0].split("@", 1)[0].strip()


def check_override_syntax(overrides: Sequence[str]) -> list:
    """Parse each override alone; raise :class:`ConfigError` naming the key of the first malformed one.

    Returns the parsed overrides (Hydra's ``Override``), one per string, for callers that need them again."""
    parser, out = None, []
    for text in overrides:
        if not isinstance(text, str):
            raise ConfigError(f"override {text!r} is a {type(text).__name__}; overrides are strings such as "
                              "`data.train_batch_size=16`.")
        key = override_key(text)
        if not key:
            raise ConfigError(f"override {text!r} has no key before '='; write `<key>=<value>`, e.g. "
                              "`data.train_batch_size=16`.")
        parser = parser or OverridesParser.create()
        try:
            parsed = parser.parse_override(text)
        except Exception as err:  # noqa: BLE001 - Hydra's grammar errors come in several types
            raise ConfigError(f"`{key}`: cannot parse the override {text!r} ({_first_lines(err)}); write "
                              f"`{key}=<value>` in Hydra's grammar and quote a value with spaces or special "
                              f"characters, e.g. `{key}='a b'`.") from None
        if parsed.is_sweep_override():
            raise ConfigError(f"`{key}`: {text!r} is a sweep (choice/range/glob/interval/shuffle/sort); a run "
                              f"takes one value: write `{key}=<value>`.")
        _check_bool_value(key, parsed)
        out.append(parsed)
    return out


def _check_bool_value(key: str, parsed) -> None:
    """OmegaConf turns any integer into a bool (``2`` -> true); a bool key takes true/false (or 0/1) only."""
    if parsed.value_type is None or type_at(DiffusionTrainerConfig, key) is not bool:
        return
    value = parsed.value()
    if isinstance(value, int) and not isinstance(value, bool) and value not in (0, 1):
        raise ConfigError(f"`{key}` = {value!r} is not a bool; write `{key}=true` or `{key}=false`.")


def _first_lines(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("See https://", "Error parsing override"))]
    return "; ".join(lines[:2]) or type(err).__name__


def compose_config(overrides: Sequence[str] = (), *, config_name: str = "diffusion_trainer",
                   config_dir: str | os.PathLike | None = None) -> DictConfig:
    """Compose the YAML and the overrides into a DictConfig, presets applied (not yet validated)."""
    return _compose(overrides, config_name=config_name, config_dir=config_dir)[0]


def _compose(overrides: Sequence[str], *, config_name: str,
             config_dir: str | os.PathLike | None) -> tuple[DictConfig, _presets.PresetReport]:
    register_configs()
    overrides = list(overrides)
    parsed = check_override_syntax(overrides)
    cdir = Path(config_dir).resolve() if config_dir is not None else default_config_dir()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(cdir), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=overrides)
            user_keys = user_set_keys(config_name, overrides, parsed=parsed)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - Hydra/OmegaConf internals: translate, never pass through
        raise ConfigError(_explain(err, config_name, cdir, overrides)) from None
    return cfg, _presets.apply_presets(cfg, user_keys)


def user_set_keys(config_name: str, overrides: Sequence[str], *, parsed: Sequence | None = None) -> set[str]:
    """The key paths the user set: those of the command-line overrides, and every key written in a config file
    of the composition other than the schema and the trainer YAML (:data:`BASE_CONFIG_NAME`).

    Call inside an initialised Hydra context (as :func:`compose_config` does). The defaults list and the files'
    own text come from Hydra's config loader (the interface config-source plugins implement), so recipes that
    include other recipes, config groups and ``@package`` placement are all followed. ``parsed``: the overrides
    already parsed (what :func:`check_override_syntax` returns), else it parses (and checks) them here.
    """
    keys: set[str] = set()
    if parsed is None:
        parsed = check_override_syntax(overrides)
    for text, override in zip(overrides, parsed):
        key = override_key(text)
        if not key or "/" in key:  # a config-group choice (hydra/...), not a key
            continue
        value = override.value() if "=" in text else None
        keys |= _leaf_paths(OmegaConf.create(value), key) if isinstance(value, dict) else {key}
    return keys | _file_keys(config_name, overrides, parsed)


#: :func:`_file_keys` per composition: (config name, the overrides that can change the defaults list, the config
#: sources and a digest of each of their files, the ConfigStore's names) -> keys. Working out the
#: defaults list costs as much as composing again; a process composes the same few (a test suite, a sweep) often.
_FILE_KEYS: dict[tuple, frozenset[str]] = {}
_FILE_KEYS_MAX = 256
_SIGNED_FILES_MAX = 500


def _file_keys(config_name: str, overrides: Sequence[str], parsed: Sequence) -> frozenset[str]:
    """The keys written in the composition's config files other than the schema and the trainer YAML (cached;
    the cache key changes whenever a file of a config source, a config-group choice or the ConfigStore does)."""
    loader = GlobalHydra.instance().config_loader()
    sources = _sources_signature(loader.get_sources())
    if sources is None:
        return frozenset(_read_file_keys(loader, config_name, overrides))
    sig = (config_name, _defaults_overrides(loader, overrides, parsed), sources,
           _store_names(ConfigStore.instance().repo))
    hit = _FILE_KEYS.get(sig)
    if hit is None:
        hit = frozenset(_read_file_keys(loader, config_name, overrides))
        if len(_FILE_KEYS) >= _FILE_KEYS_MAX:
            _FILE_KEYS.clear()
        _FILE_KEYS[sig] = hit
    return hit


def _defaults_overrides(loader, overrides: Sequence[str], parsed: Sequence) -> tuple[str, ...]:
    """The overrides (``parsed``: each one parsed) that can change the defaults list, as Hydra sorts them:
    config-group choices (a non-mapping value for a key that names a group) and anything under ``hydra`` (its
    search path adds config sources)."""
    return tuple(text for text, o in zip(overrides, parsed) if o.key_or_group.startswith("hydra") or (
        not isinstance(o.value(), dict) and loader.repository.group_exists(o.key_or_group)))


def _sources_signature(sources) -> tuple | None:
    """Each config source, and for a folder on disk every ``.yaml`` file under it (what Hydra's file source
    composes) with a digest of its bytes (timestamps are too coarse on some file systems to see a file rewritten
    within a few ms); None (do not cache) for a folder of more than :data:`_SIGNED_FILES_MAX` of them."""
    out = []
    for source in sources:
        entry: tuple = (source.provider, source.scheme(), source.path)
        if source.scheme() == "file" and os.path.isdir(source.path):
            files = []
            for root, dirs, names in os.walk(source.path):
                dirs.sort()
                for name in sorted(n for n in names if n.endswith(".yaml")):  # all a file source composes
                    if len(files) >= _SIGNED_FILES_MAX:
                        return None
                    path = os.path.join(root, name)
                    with open(path, "rb") as f:
                        files.append((os.path.relpath(path, source.path), hashlib.blake2b(f.read()).digest()))
            entry += (tuple(files),)
        out.append(entry)
    return tuple(out)


def _store_names(repo: dict, prefix: str = "") -> tuple[str, ...]:
    """Every name (with its group path) in the ConfigStore."""
    out: list[str] = []
    for name, node in repo.items():
        out.extend(_store_names(node, f"{prefix}{name}/") if isinstance(node, dict) else [f"{prefix}{name}"])
    return tuple(out)


def _read_file_keys(loader, config_name: str, overrides: Sequence[str]) -> set[str]:
    from hydra.types import RunMode

    keys: set[str] = set()
    sources = loader.get_sources()
    for entry in loader.compute_defaults_list(config_name, list(overrides), RunMode.RUN).defaults:
        path, package = entry.config_path, entry.package or ""
        if path is None or path in (SCHEMA_NAME, BASE_CONFIG_NAME) or path.startswith("hydra/") \
                or package == "hydra" or package.startswith("hydra."):
            continue
        source = next((s for s in sources if s.is_config(path)), None)
        if source is None:
            continue
        node = source.load_config(path).config
        if not isinstance(node, DictConfig):
            continue
        prefix = "" if package == "_global_" else package.removeprefix("_global_.")
        for key in node.keys():
            if key != "defaults" or prefix:
                keys |= _leaf_paths(node._get_node(key), f"{prefix}.{key}" if prefix else str(key))
    return keys


def _leaf_paths(node, path: str) -> set[str]:
    """The key paths of the leaves at and below ``path`` in a raw (unresolved) config node.

    A section is merged key by key (in a YAML file and in a ``key={...}`` override alike), so it sets only its
    leaves; a list, a null, an interpolation or an empty mapping is one leaf."""
    if isinstance(node, DictConfig) and not node._is_missing() and not node._is_none() \
            and not node._is_interpolation() and len(node):
        out: set[str] = set()
        for key in node.keys():
            out |= _leaf_paths(node._get_node(key), f"{path}.{key}")
        return out
    return {path}


def _explain(err: BaseException, config_name: str, cdir: Path, overrides: Sequence[str]) -> str:
    """Name the key path of the deepest OmegaConf error in the chain (else the override the message quotes)."""
    chain, e = [], err
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    where = f"(composing `{config_name}` from {cdir})"
    for e in reversed(chain):
        key = getattr(e, "full_key", None)
        if key:
            reason = str(e).splitlines()[0]
            if isinstance(e, (ConfigKeyError, ConfigAttributeError)) and "not in" in reason:
                parent = key.rpartition(".")[0]
                copy = mirror_message(DiffusionTrainerConfig, key, _override_value(key, overrides))
                if copy is not None:  # a read-only copy: adding the key with `+` would be refused as well
                    return copy
                schema = schema_at(DiffusionTrainerConfig, parent)
                if schema is not None:
                    return unknown_key_message(key, schema)
                return f"`{key}`: {reason}; `{parent}` is a mapping: add a key to it with `+{key}=<value>` {where}"
            return f"`{key}`: {reason} {where}"
    reasons = " <- ".join(str(e).splitlines()[0] for e in chain if str(e).strip())
    for text in overrides:
        key = override_key(text)
        if key and (key in reasons or text in reasons):
            copy = mirror_message(DiffusionTrainerConfig, key, _override_value(key, overrides))
            return copy or f"`{key}`: {reasons} (override {text!r}) {where}"
    return f"could not compose `{config_name}` from {cdir} with overrides {list(overrides)}: {reasons}"


def _override_value(key: str, overrides: Sequence[str]):
    """The value the last override of ``key`` gives it (as Hydra parses it); MISSING when none does or it does not
    parse."""
    import dataclasses

    for text in reversed(overrides):
        if override_key(text) == key and "=" in text:
            try:
                return OverridesParser.create().parse_override(text).value()
            except Exception:  # noqa: BLE001 - reported by check_override_syntax
                break
    return dataclasses.MISSING


def load_config(overrides: Sequence[str] = (), *, config_name: str = "diffusion_trainer",
                config_dir: str | os.PathLike | None = None) -> DiffusionTrainerConfig:
    """Compose, apply the presets, then validate; returns the typed :class:`DiffusionTrainerConfig`
    (:func:`omnirl_async.config.presets.applied_presets` tells which presets it carries)."""
    cfg, report = _compose(overrides, config_name=config_name, config_dir=config_dir)
    try:
        obj = to_validated_object(cfg, DiffusionTrainerConfig)
    except ConfigError as err:
        raise ConfigError(_presets.explain(str(err), report)) from None
    return _presets.attach(obj, report)


def to_yaml(cfg: DiffusionTrainerConfig, *, show_presets: bool = False) -> str:
    """The config as YAML; ``show_presets`` puts comment lines above it naming the preset keys applied."""
    text = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    return (_presets.describe(_presets.applied_presets(cfg)) + text) if show_presets else text
