"""Typed config of omnirl-async: dataclasses (the schema), validation and loading."""

from omnirl_async.config.loader import load_config, register_configs
from omnirl_async.config.schema import *  # noqa: F401,F403
from omnirl_async.config.schema import __all__ as _schema_all
from omnirl_async.config.validate import ConfigError

__all__ = ["ConfigError", "load_config", "register_configs", *_schema_all]
