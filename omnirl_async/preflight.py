"""Input errors and the checks of single user files: the bottom of the driver's preflight.

A validated config can still name a prompt file that is a directory, a LoRA
folder holding garbage or a reward file with a syntax error. Found inside Ray
actors, such input costs many seconds of start-up and ends in a long traceback
from every actor. The driver's check,
:func:`omnirl_async.trainer.input_checks.check_inputs`, looks at all of them
before Ray starts, in well under a second, and raises one :class:`InputError`
listing every problem; ``TaskRunner.run`` calls it before ``init_ray`` and the
CLI prints it as one message with exit code 2.

This module holds what the loaders of every layer share, so that they raise the
same error the driver's check reports:

* :class:`InputError` - raised by the prompt-file readers
  (:mod:`omnirl_async.data.prompts`), the custom-reward loader
  (:mod:`omnirl_async.rewards.custom`) and every check;
* :func:`check_lora_adapter` - a PEFT folder whose ``adapter_config.json``
  parses and has the keys peft needs, and whose ``adapter_model.safetensors``
  has a readable header with lora_A / lora_B tensors of the rank the config
  declares (header only, no tensor is loaded; :func:`read_safetensors_header`);
* :func:`check_python_file` / :func:`check_user_definition` - a custom reward or
  sampler file exists, is a ``.py`` file that compiles (a syntax error is
  reported as ``file:line``) and binds the wanted name at module level, not to
  a plain literal.

User Python files are compiled and read, never executed: a reward file may load
a model onto the GPU at import time, which the driver must not do. The loaders
(:func:`omnirl_async.rewards.custom.load_custom_reward_fn`) run the same file
checks, then execute the file where it is used.

Layer: shared foundation. This module imports only the standard library, never
another module of the package (tests/test_layers.py), so every layer can import
:class:`InputError` from it without a cycle. Checks that need to know models,
rewards or checkpoints live in :mod:`omnirl_async.trainer.input_checks`.
"""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable

__all__ = [
    "InputError",
    "check_python_file",
    "check_user_definition",
    "check_lora_adapter",
    "read_safetensors_header",
]

LORA_KEY = "actor_rollout_ref.model.lora_adapter_path"
#: Keys of ``adapter_config.json`` that loading a LoRA adapter relies on.
ADAPTER_CONFIG_KEYS = ("r", "lora_alpha", "target_modules")
#: safetensors refuses headers above 100 MB; anything bigger is not a safetensors file.
_MAX_HEADER_BYTES = 100_000_000
_RESAVE = "save the adapter again with `save_lora` or `PeftModel.save_pretrained`"


class InputError(ValueError):
    """A file or folder named by the config is unusable; carries every problem found.

    ``problems`` is the list of one-line messages; ``str()`` is the single
    message, or a numbered list when there are several.
    """

    def __init__(self, problems: str | Iterable[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(_join(self.problems))


def _join(problems: list[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    lines = "\n".join(f"  {i}. {p}" for i, p in enumerate(problems, start=1))
    return f"{len(problems)} problems with the files this config points at:\n{lines}"


def _problems_of(fn: Callable, *args, **kwargs) -> list[str]:
    """Run ``fn`` and return the problems of the :class:`InputError` it raised (none: ``[]``)."""
    try:
        fn(*args, **kwargs)
    except InputError as err:
        return list(err.problems)
    return []


def _is_path(value: Any) -> bool:
    return isinstance(value, (str, os.PathLike)) and bool(os.fspath(value))


def _expand(value: str | os.PathLike) -> str:
    return os.path.abspath(os.path.expanduser(os.fspath(value)))


def _read_json_object(path: Path, key: str, *, fix: str) -> dict:
    """Parse ``path`` as a JSON object; problems name the file with line:column and end with ``fix``."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"`{key}`: {path}: byte {err.object[err.start]:#04x} at offset {err.start} is not "
                         f"valid UTF-8; {fix}.") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(f"`{key}`: {path}:{err.lineno}:{err.colno}: not valid JSON ({err.msg}); {fix}.") from None
    if not isinstance(value, dict):
        raise InputError(f"`{key}`: {path} holds a JSON {type(value).__name__}, not an object; {fix}.")
    return value


# --------------------------------------------------------------------------- LoRA adapter
def check_lora_adapter(folder: Any, *, key: str = LORA_KEY) -> dict:
    """Check a PEFT adapter folder cheaply; return its ``adapter_config.json``.

    The weights file is not loaded: only its safetensors header is read, which
    gives every tensor's name and shape, enough to compare the lora_A / lora_B
    shapes with the rank ``r`` of the config (and ``rank_pattern``).
    """
    if not _is_path(folder):
        raise InputError(f"`{key}` = {folder!r}: expected the path of a PEFT adapter folder (adapter_config.json "
                         "+ adapter_model.safetensors), or null.")
    path = Path(_expand(folder))
    _check_adapter_folder(path, key)
    config = _read_json_object(path / "adapter_config.json", key, fix=_RESAVE)
    _check_adapter_config(config, path / "adapter_config.json", key)
    weights = path / "adapter_model.safetensors"
    header = _read_header_or_fail(weights, key)
    _check_lora_shapes(header, config, weights, key)
    return config


def _check_adapter_folder(path: Path, key: str) -> None:
    fix = "point it at the folder that holds adapter_config.json and adapter_model.safetensors (a checkpoint's " \
          "global_step_<N>/lora)"
    if not path.exists():
        raise InputError(f"`{key}`: adapter folder {path} does not exist; fix the path, or set `{key}=null` to "
                         "start a new LoRA adapter.")
    if not path.is_dir():
        raise InputError(f"`{key}`: {path} is a file, not a PEFT adapter folder; {fix}.")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if not (path / name).is_file():
            hint = f" ({path / 'lora'} holds one: point at that)" if (path / "lora" / name).is_file() else ""
            raise InputError(f"`{key}`: {path} has no {name}, so it is not a PEFT adapter folder{hint}; {fix}.")


def _check_adapter_config(config: dict, path: Path, key: str) -> None:
    missing = [k for k in ADAPTER_CONFIG_KEYS if k not in config]
    if missing:
        raise InputError(f"`{key}`: {path} lacks the key(s) {missing} that peft needs; {_RESAVE}.")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise InputError(f"`{key}`: {path} has peft_type = {peft_type!r}; only LoRA adapters (peft_type LORA) "
                         "can be loaded.")
    r = config["r"]
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise InputError(f"`{key}`: {path} has r = {r!r}; the LoRA rank must be a positive integer; {_RESAVE}.")
    alpha = config["lora_alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise InputError(f"`{key}`: {path} has lora_alpha = {alpha!r}; it must be a number; {_RESAVE}.")
    targets = config["target_modules"]
    if not (isinstance(targets, str) and targets) and not (
            isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
        raise InputError(f"`{key}`: {path} has target_modules = {targets!r}; it must be a module-name regex or a "
                         f"non-empty list of module names; {_RESAVE}.")


def read_safetensors_header(path: str | os.PathLike) -> dict:
    """The JSON header of a safetensors file, validated; raises ``ValueError`` saying what is wrong.

    Layout: an 8-byte little-endian header length N, N bytes of JSON mapping
    each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
    (plus an optional ``__metadata__``), then the tensor bytes.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"it is {size} bytes long, shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > size - 8 or n > _MAX_HEADER_BYTES:
            raise ValueError(f"its 8-byte header length, {n}, exceeds the file size of {size} bytes")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"its {n}-byte header is not UTF-8 JSON") from None
    if not isinstance(header, dict):
        raise ValueError(f"its header is a JSON {type(header).__name__}, not an object")
    data_len = size - 8 - n
    for name, entry in header.items():
        if name != "__metadata__":
            _check_header_entry(name, entry, data_len)
    return header


def _check_header_entry(name: str, entry: Any, data_len: int) -> None:
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        raise ValueError(f"its header entry for tensor {name!r} has no dtype")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"its header gives tensor {name!r} the shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_len):
        raise ValueError(f"its header places tensor {name!r} at {offsets!r}, outside the {data_len} data bytes")


def _read_header_or_fail(weights: Path, key: str) -> dict:
    try:
        return read_safetensors_header(weights)
    except ValueError as err:
        raise InputError(f"`{key}`: {weights} is not a valid safetensors file ({err}); the file is damaged or "
                         f"not an adapter: {_RESAVE}.") from None


def _lora_rank_for(module: str, config: dict) -> int:
    """The rank peft gives ``module``: a matching ``rank_pattern`` entry, else ``r``."""
    for pattern, rank in (config.get("rank_pattern") or {}).items():
        if module == pattern or module.endswith("." + pattern) or _regex_hits(pattern, module):
            return int(rank)
    return int(config["r"])


def _regex_hits(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return False


def _check_lora_shapes(header: dict, config: dict, weights: Path, key: str) -> None:
    lora = {name: entry["shape"] for name, entry in header.items()
            if name != "__metadata__" and re.search(r"\.lora_[AB]\.", name)}
    if not lora:
        raise InputError(f"`{key}`: {weights} holds no lora_A / lora_B tensors; it is not a LoRA adapter: "
                         f"{_RESAVE}.")
    bad = []
    for name, shape in sorted(lora.items()):
        module = name.removeprefix("base_model.model.").split(".lora_")[0]
        rank = _lora_rank_for(module, config)
        axis = 0 if ".lora_A." in name else 1
        if len(shape) < 2 or shape[axis] != rank:
            bad.append((name, shape, rank, axis))
    if bad:
        name, shape, rank, axis = bad[0]
        more = f" (and {len(bad) - 1} more tensor(s))" if len(bad) > 1 else ""
        which, want = ("lora_A", "[r, in_features]") if axis == 0 else ("lora_B", "[out_features, r]")
        raise InputError(f"`{key}`: {weights}: tensor {name} has shape {list(shape)}{more}, but adapter_config.json "
                         f"says r = {rank} ({which} must be {want}); the two files come from different adapters: "
                         f"{_RESAVE}.")


# --------------------------------------------------------------------------- user Python files
def check_python_file(path: Any, *, key: str, wanted: str) -> str:
    """Return the absolute path of a readable ``.py`` file that compiles; else raise :class:`InputError`.

    ``key`` is the config path of the file's section (``reward.custom_reward_function``),
    ``wanted`` what the file should define, for the fix. The file is compiled,
    not executed.
    """
    if not _is_path(path):
        raise InputError(f"`{key}.path` = {path!r}: expected the path of a .py file that defines {wanted}.")
    full = _expand(path)
    if not os.path.exists(full):
        raise InputError(f"`{key}.path`: {full} does not exist; fix the path to a .py file that defines {wanted}.")
    if os.path.isdir(full):
        raise InputError(f"`{key}.path`: {full} is a directory; point it at the .py file inside it that defines "
                         f"{wanted}.")
    if not full.endswith(".py"):
        raise InputError(f"`{key}.path`: {full} is not a .py file; point it at a Python file that defines {wanted}.")
    with open(full, "rb") as fh:
        source = fh.read()
    try:
        compile(source, full, "exec", dont_inherit=True)
    except SyntaxError as err:
        line = f" in {err.text.strip()!r}" if err.text and err.text.strip() else ""
        raise InputError(f"`{key}.path`: {full}:{err.lineno}: Python syntax error: {err.msg}{line}; fix the file "
                         f"so that it defines {wanted}.") from None
    except ValueError as err:  # null bytes (Python < 3.12)
        raise InputError(f"`{key}.path`: {full} cannot be compiled ({err}); fix the file so that it defines "
                         f"{wanted}.") from None
    return full


_LITERALS = {ast.List: "list", ast.Tuple: "tuple", ast.Dict: "dict", ast.Set: "set", ast.JoinedStr: "str",
             ast.ListComp: "list", ast.DictComp: "dict", ast.SetComp: "set"}
#: Calls that may bind module names at run time; a module using one is given the benefit of the doubt.
_DYNAMIC_CALLS = {"globals", "exec", "eval", "setattr", "vars", "__import__"}


def _module_bindings(tree: ast.Module) -> tuple[dict[str, ast.AST], bool]:
    """Module-level name -> the statement that binds it last; and whether names may be bound dynamically."""
    bindings: dict[str, ast.AST] = {}
    dynamic = False

    def walk(node: ast.AST, stmt: ast.AST) -> None:
        nonlocal dynamic
        for child in ast.iter_child_nodes(node):
            here = child if isinstance(child, ast.stmt) else stmt
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bindings[child.name] = child
                dynamic |= child.name == "__getattr__" or any(
                    isinstance(n, ast.Global) for n in ast.walk(child))
                continue
            if isinstance(child, ast.Lambda):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for alias in child.names:
                    if alias.name == "*":
                        dynamic = True
                    else:
                        bindings[alias.asname or alias.name.split(".")[0]] = child
            elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                bindings[child.id] = here
            elif isinstance(child, ast.ExceptHandler) and child.name:
                bindings[child.name] = child
            elif isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and \
                    child.func.id in _DYNAMIC_CALLS:
                dynamic = True
            walk(child, here)

    walk(tree, tree)
    return bindings, dynamic


def _literal_type(binding: ast.AST) -> str | None:
    """The type name when ``binding`` is ``name = <literal>``, else None."""
    value = getattr(binding, "value", None) if isinstance(binding, (ast.Assign, ast.AnnAssign)) else None
    if isinstance(value, ast.Constant):
        return type(value.value).__name__
    return _LITERALS.get(type(value)) if value is not None else None


def check_user_definition(path: Any, name: Any, *, key: str, kind: str = "function") -> str:
    """Check, without executing it, that the ``.py`` file at ``path`` defines ``name``; return the absolute path.

    ``kind`` is ``"function"`` (a reward: anything callable) or ``"class"``
    (a sampler). The file must exist and compile, and bind ``name`` at module
    level - by ``def``/``class``, an import or an assignment - but not to a
    plain literal. A module that may bind names at run time (``from x import *``,
    ``globals()``, a module ``__getattr__``) passes the name check.
    """
    if not name or not isinstance(name, str):
        raise InputError(f"`{key}.name` must name a {kind} in {str(path)!r}, got {name!r}; set it to the name of "
                         f"the {kind} defined in that file.")
    wanted = f"`{name}`" if kind == "function" else f"class `{name}`"
    full = check_python_file(path, key=key, wanted=wanted)
    with open(full, "rb") as fh:
        tree = ast.parse(fh.read(), filename=full)
    bindings, dynamic = _module_bindings(tree)
    binding = bindings.get(name)
    defined = sorted(k for k, v in bindings.items()
                     if isinstance(v, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not k.startswith("_"))
    if binding is None and not dynamic:
        raise InputError(f"`{key}.name` = {name!r} is not defined in {full}; functions and classes there: "
                         f"{', '.join(defined) or '<none>'}; set `{key}.name` to one of them, or define {name} in "
                         "that file.")
    must = "be callable as fn(images, prompts, **kwargs)" if kind == "function" else \
        "be a subclass of omnirl_async.buffer.samplers.Sampler"
    literal = _literal_type(binding) if binding is not None else None
    if literal is not None:
        raise InputError(f"`{key}.name` = {name!r} in {full}:{binding.lineno} is a {literal}, not a {kind}; it "
                         f"must {must}.")
    if kind == "class" and isinstance(binding, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise InputError(f"`{key}.name` = {name!r} in {full}:{binding.lineno} is a function, not a class; it must "
                         f"{must}.")
    return full
