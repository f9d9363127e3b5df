"""Executing a user's Python file (custom rewards, custom samplers) under a private module name.

The file need not be importable as a package. It runs once per process under
``omnirl_async_user_<kind>_<hash of the path>``, so two files both called
``reward.py`` do not collide, and errors name the config key that pointed at it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from types import ModuleType

__all__ = ["exec_user_file"]


def exec_user_file(path: str | os.PathLike, *, key: str, kind: str, wanted: str) -> ModuleType:
    """Run the ``.py`` file at ``path`` (once per process) and return it as a module.

    ``key`` is the config path for error messages (``reward.custom_reward_function``),
    ``wanted`` what the file should define (for the fix in the message).
    """
    if not path:
        raise ValueError(f"`{key}.path` is empty; set it to a .py file that defines {wanted}")
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.isfile(path):
        raise ValueError(f"`{key}.path` = {path!r} does not exist; point it at a .py file that defines {wanted}")
    if not path.endswith(".py"):
        raise ValueError(f"`{key}.path` = {path!r} is not a .py file")
    mod_name = f"omnirl_async_user_{kind}_{hashlib.sha1(path.encode()).hexdigest()[:12]}"
    module = sys.modules.get(mod_name)
    if module is not None and getattr(module, "__file__", None) == path:
        return module
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"`{key}.path` = {path!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's file: report what failed in it
        sys.modules.pop(mod_name, None)
        raise ValueError(f"`{key}.path` = {path!r} raised while being executed: {type(e).__name__}: {e}") from e
    return module
