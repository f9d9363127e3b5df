"""Compose a config the way ``omnirl-async train`` does: YAML defaults → recipe → overrides.

The schema is registered in Hydra's ConfigStore as ``diffusion_trainer_schema``;
``omnirl_async/configs/diffusion_trainer.yaml`` (inside the package, so a wheel
carries it; ``configs/`` at the repository root links to it) lists it first in
its defaults so every key is typed. Command-line overrides use Hydra's grammar
(``a.b=1``, ``+a.c=2``, ``~a.d``), and the result is checked by
:func:`to_validated_object`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from omnirl_async.config.root import DiffusionTrainerConfig
from omnirl_async.config.validate import ConfigError, to_validated_object

__all__ = ["register_configs", "default_config_dir", "compose_config", "load_config"]

SCHEMA_NAME = "diffusion_trainer_schema"
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


def compose_config(overrides: Sequence[str] = (), *, config_name: str = "diffusion_trainer",
                   config_dir: str | os.PathLike | None = None) -> DictConfig:
    """Compose the YAML and the overrides into a DictConfig (not yet validated)."""
    register_configs()
    cdir = Path(config_dir).resolve() if config_dir is not None else default_config_dir()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(cdir), version_base="1.3"):
            return compose(config_name=config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(_explain(err, config_name, cdir, overrides)) from None


def _explain(err: BaseException, config_name: str, cdir: Path, overrides: Sequence[str]) -> str:
    """Name the key path of the deepest OmegaConf error in the chain, with its one-line reason."""
    chain, e = [], err
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in reversed(chain):
        key = getattr(e, "full_key", None)
        if key:
            reason = str(e).splitlines()[0]
            return f"`{key}`: {reason} (composing `{config_name}` from {cdir})"
    return (f"could not compose `{config_name}` from {cdir} with overrides {list(overrides)}: "
            + " <- ".join(str(e).splitlines()[0] for e in chain))


def load_config(overrides: Sequence[str] = (), *, config_name: str = "diffusion_trainer",
                config_dir: str | os.PathLike | None = None) -> DiffusionTrainerConfig:
    """Compose, then validate; returns the typed :class:`DiffusionTrainerConfig`."""
    cfg = compose_config(overrides, config_name=config_name, config_dir=config_dir)
    return to_validated_object(cfg, DiffusionTrainerConfig)


def to_yaml(cfg: DiffusionTrainerConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
