"""Load a user's reward function from a Python file.

``reward.custom_reward_function.path=/abs/my_reward.py`` and ``.name=score``
(or an entry of ``reward.reward_functions`` with a ``path``) point at a plain
``.py`` file that need not be importable as a package. The file is executed
once per process under a private module name, so two files that both call
themselves ``reward.py`` do not collide, and the function must follow the
contract in :mod:`omnirl_async.rewards.base`.

Such a module cannot be pickled by reference, so the reward manager pickles
the ``(path, name)`` pair and loads the file again in the receiving process.

Every problem with the file - missing, a directory, not ``.py``, a syntax
error (reported as ``file:line``, found by compiling before anything runs),
an exception while it executes, the function missing or not callable - is an
:class:`omnirl_async.preflight.InputError` naming the config key, the file
and the fix. The driver's preflight calls this loader before Ray starts.
"""

from __future__ import annotations

import os
from typing import Callable

from omnirl_async.preflight import InputError, check_python_file
from omnirl_async.userfiles import exec_user_file

__all__ = ["load_custom_reward_fn"]


def load_custom_reward_fn(
    path: str | os.PathLike, name: str, *, key: str = "reward.custom_reward_function"
) -> Callable:
    """Execute the file at ``path`` and return its attribute ``name``.

    ``key`` is the config path named in error messages. Raises
    :class:`~omnirl_async.preflight.InputError` (a ``ValueError``) when the file
    is missing, is not a ``.py`` file, does not compile, fails to execute,
    lacks ``name``, or ``name`` is not callable.
    """
    if not name or not isinstance(name, str):
        raise InputError(f"`{key}.name` must name a function in {str(path)!r}, got {name!r}; set it to the "
                         "name of the reward function defined in that file.")
    wanted = f"`{name}`"
    path = check_python_file(path, key=key, wanted=wanted)
    try:
        module = exec_user_file(path, key=key, kind="reward", wanted=wanted)
    except ValueError as err:  # the file raised while executing: the user's code, reported as input
        raise InputError(str(err)) from err
    path = module.__file__
    if not hasattr(module, name):
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise InputError(
            f"`{key}.name` = {name!r} is not defined in {path}; callables there: {', '.join(public) or '<none>'}; "
            f"set `{key}.name` to one of them, or define {name} in that file."
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise InputError(
            f"`{key}.name` = {name!r} in {path} is a {type(fn).__name__}, not a function; "
            f"it must be callable as fn(images, prompts, **kwargs)."
        )
    return fn
