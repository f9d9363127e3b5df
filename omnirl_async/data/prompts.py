"""Prompt sets of the shapes world and the prompt-file format.

The grammar of :mod:`omnirl_async.data.shapes` is finite, so the whole prompt
space can be listed (:func:`enumerate_prompts`, 2,772 prompts in four
categories). A fixed seed splits it once into a **held-out** set, which only
evaluation sees, and a **training** set made of everything else. The two are
disjoint by construction, and the split depends only on the seed (sorted
enumeration + ``numpy.random.default_rng``), never on hash order or the
Python version.

The held-out set is stratified (:data:`HELDOUT_COMPOSITION`) rather than
drawn uniformly: a uniform draw from the space would be 97 % two-group prompts
and say almost nothing about counting.

Prompt files
------------
``.jsonl``: one JSON object per line with at least ``"prompt"`` (or the field
``data.prompt_key`` names; other keys, such as ``"category"``, are kept).
``.txt``: one prompt per line. Files are UTF-8 (a BOM is allowed); blank lines
are skipped. Anything else - a missing file, a directory, another extension,
bytes that are not UTF-8, a line that is not JSON or has no prompt, a file
without prompts - raises :class:`omnirl_async.preflight.InputError` naming the
config key, the file and line, and the fix. :func:`load_train_prompts` and
:func:`load_val_prompts` read ``data.train_files`` / ``data.val_files`` (or,
when null, the embedded training / held-out sets).
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Iterable, Sequence

import numpy as np

from omnirl_async.data.shapes import (
    COLORS,
    MAX_COUNT,
    PAIR_COUNTS,
    SHAPES,
    SPATIAL_RELATIONS,
    ObjectGroup,
    SceneSpec,
    parse_prompt,
)
from omnirl_async.preflight import InputError

__all__ = [
    "CATEGORIES",
    "HELDOUT_COMPOSITION",
    "HELDOUT_SEED",
    "prompt_category",
    "enumerate_prompts",
    "prompt_split",
    "train_prompts",
    "heldout_prompts",
    "write_prompt_file",
    "PROMPT_FILE_SUFFIXES",
    "prompt_file_list",
    "read_prompt_rows",
    "read_prompts",
    "read_prompt_files",
    "load_train_prompts",
    "load_val_prompts",
]

CATEGORIES = ("single", "counting", "pair", "position")
#: Held-out prompts per category (256 in all). The rest of each category trains.
HELDOUT_COMPOSITION: dict[str, int] = {"single": 8, "counting": 24, "pair": 96, "position": 128}
HELDOUT_SEED = 20240611


def prompt_category(spec: SceneSpec | str) -> str:
    """``single`` (one object), ``counting`` (2–4 of one kind), ``pair``
    (two groups joined by "and") or ``position`` (a spatial relation)."""
    if isinstance(spec, str):
        spec = parse_prompt(spec)
    if spec.relation is None:
        return "single" if spec.groups[0].count == 1 else "counting"
    return "pair" if spec.relation == "and" else "position"


def enumerate_prompts(category: str) -> list[str]:
    """Every prompt of a category that :func:`shapes.sample_spec` can draw, sorted."""
    kinds = list(itertools.product(COLORS, SHAPES))
    specs: list[SceneSpec] = []
    if category == "single":
        specs = [SceneSpec((ObjectGroup(1, c, s),)) for c, s in kinds]
    elif category == "counting":
        specs = [SceneSpec((ObjectGroup(n, c, s),)) for n in range(2, MAX_COUNT + 1) for c, s in kinds]
    elif category in ("pair", "position"):
        pairs = [(a, b) for a in kinds for b in kinds if a[0] != b[0]]
        counts = PAIR_COUNTS if category == "pair" else ((1, 1),)
        relations = ("and",) if category == "pair" else SPATIAL_RELATIONS
        specs = [
            SceneSpec((ObjectGroup(n0, *a), ObjectGroup(n1, *b)), rel)
            for (a, b) in pairs
            for (n0, n1) in counts
            for rel in relations
        ]
    else:
        raise ValueError(f"`category` must be one of {CATEGORIES}, got {category!r}")
    return sorted(s.prompt for s in specs)


def prompt_split(
    seed: int = HELDOUT_SEED, composition: dict[str, int] | None = None
) -> tuple[list[str], list[str]]:
    """Split the prompt space into ``(train, heldout)``, disjoint and deterministic.

    ``composition`` maps category → number of held-out prompts
    (default :data:`HELDOUT_COMPOSITION`). Both lists are sorted.
    """
    composition = HELDOUT_COMPOSITION if composition is None else composition
    rng = np.random.default_rng(seed)
    train, heldout = [], []
    for category in CATEGORIES:
        prompts = enumerate_prompts(category)
        k = int(composition.get(category, 0))
        if not 0 <= k < len(prompts):
            raise ValueError(
                f"`composition[{category!r}]` must be in 0..{len(prompts) - 1} so that "
                f"training keeps at least one {category} prompt, got {k}"
            )
        chosen = set(rng.choice(len(prompts), size=k, replace=False).tolist())
        for i, p in enumerate(prompts):
            (heldout if i in chosen else train).append(p)
    return sorted(train), sorted(heldout)


def train_prompts(seed: int = HELDOUT_SEED) -> list[str]:
    """All prompts not in the held-out set (2,516 with the default split)."""
    return prompt_split(seed)[0]


def heldout_prompts(seed: int = HELDOUT_SEED) -> list[str]:
    """The 256 held-out evaluation prompts of the default split."""
    return prompt_split(seed)[1]


# ---------------------------------------------------------------- files
def write_prompt_file(path: str | os.PathLike, prompts: Iterable[str], *, with_category: bool = True) -> int:
    """Write prompts to ``path`` (``.jsonl`` rows, or ``.txt`` lines); returns the row count."""
    path = os.fspath(path)
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for prompt in prompts:
            if path.endswith(".txt"):
                if "\n" in prompt:
                    raise ValueError(f"prompt {prompt!r} holds a newline; write a .jsonl file instead")
                f.write(prompt + "\n")
            else:
                row = {"prompt": prompt}
                if with_category:
                    try:
                        row["category"] = prompt_category(prompt)
                    except ValueError:
                        pass  # prompts outside the shapes grammar are allowed in files
                f.write(json.dumps(row) + "\n")
            n += 1
    return n


#: Prompt-file extensions and their format.
PROMPT_FILE_SUFFIXES = {".jsonl": "jsonl", ".txt": "txt"}
_EXAMPLE_ROW = '{"prompt": "two red circles"}'


def _at(key: str | None) -> str:
    return f"`{key}`: " if key else ""


def prompt_file_list(value, *, key: str = "data.train_files") -> list[str]:
    """``data.*_files`` as a list of paths: one path, or a non-empty list of paths."""
    if isinstance(value, (str, os.PathLike)) and os.fspath(value):
        return [os.fspath(value)]
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, (str, os.PathLike)) and os.fspath(v) for v in value):
        return [os.fspath(v) for v in value]
    raise InputError(f"`{key}` = {value!r}: expected a prompt file path or a non-empty list of them (.jsonl or "
                     ".txt); null uses the embedded shapes prompts.")


def _check_prompt_path(path: str, key: str | None) -> str:
    """Raise :class:`InputError` unless ``path`` is a prompt file of a known format; return the format."""
    if os.path.isdir(path):
        inside = sorted(n for n in os.listdir(path) if os.path.splitext(n)[1] in PROMPT_FILE_SUFFIXES)
        if not inside:
            raise InputError(f"{_at(key)}{path} is a directory, not a prompt file, and holds no .jsonl or .txt "
                             "file; name a prompt file (.jsonl or .txt) instead.")
        listed = ", ".join(inside[:5]) + (", ..." if len(inside) > 5 else "")
        example = f"`{key}={os.path.join(path, inside[0])}`" if key else repr(os.path.join(path, inside[0]))
        raise InputError(f"{_at(key)}{path} is a directory, not a prompt file (it holds {listed}); name the "
                         f"prompt file(s) themselves, e.g. {example}.")
    if not os.path.exists(path):
        raise InputError(f"{_at(key)}prompt file {path} does not exist; fix the path (null uses the embedded "
                         "shapes prompts).")
    suffix = os.path.splitext(path)[1]
    if suffix not in PROMPT_FILE_SUFFIXES:
        raise InputError(f"{_at(key)}{path} has the extension {suffix or '(none)'!r}, which is not a prompt file "
                         f"format; use .jsonl (one object such as {_EXAMPLE_ROW} per line) or .txt (one prompt "
                         "per line).")
    return PROMPT_FILE_SUFFIXES[suffix]


def _read_text(path: str, key: str | None) -> str:
    """The file as text; bytes that are not UTF-8 are an error naming line, column and byte offset."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise InputError(f"{_at(key)}{path}:{line}: byte {data[e.start]:#04x} at offset {e.start} (column {col}) "
                         f"is not valid UTF-8 ({e.reason}); save the file as UTF-8.") from None


def _parse_row(line: str, lineno: int, path: str, prompt_key: str, key: str | None) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{_at(key)}{path}:{lineno}: not valid JSON ({e.msg}, column {e.colno}); each line must "
                         f"be one object such as {_EXAMPLE_ROW}.") from None
    if not isinstance(row, dict) or not isinstance(row.get(prompt_key), str):
        fix = ", or set `data.prompt_key` to the field that holds the prompt" if key else ""
        raise InputError(f"{_at(key)}{path}:{lineno}: row has no string {json.dumps(prompt_key)} field (got "
                         f"{line.strip()[:80]!r}); each line must look like "
                         f"{{{json.dumps(prompt_key)}: \"two red circles\"}}{fix}.")
    return row


def read_prompt_rows(path: str | os.PathLike, *, prompt_key: str = "prompt", key: str | None = None) -> list[dict]:
    """Read a prompt file into rows (dicts with at least a string ``prompt_key``).

    ``key`` is the config key that named the file (``data.train_files``); every
    problem - missing file, a directory, an unknown extension, bytes that are
    not UTF-8, invalid JSON, a row without the prompt, no prompt at all - is an
    :class:`InputError` that names it, the file and line, and the fix.
    """
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    kind = _check_prompt_path(path, key)
    rows = []
    for lineno, line in enumerate(_read_text(path, key).split("\n"), start=1):
        if not line.strip():
            continue
        if kind == "txt":
            rows.append({prompt_key: line.strip()})
        else:
            rows.append(_parse_row(line, lineno, path, prompt_key, key))
    if not rows:
        raise InputError(f"{_at(key)}{path} holds no prompts (it is empty or only blank lines); add one prompt "
                         "per line.")
    return rows


def read_prompts(path: str | os.PathLike, *, prompt_key: str = "prompt", key: str | None = None) -> list[str]:
    """Read just the prompt strings of a prompt file (see :func:`read_prompt_rows`)."""
    return [row[prompt_key] for row in read_prompt_rows(path, prompt_key=prompt_key, key=key)]


def read_prompt_files(files: list[str], prompt_key: str, what: str) -> list[str]:
    """Prompts from .jsonl (field ``prompt_key``) or .txt files, in order.

    ``what`` is the config key that named the files; any problem is an
    :class:`~omnirl_async.preflight.InputError` naming it, the file and line.
    """
    prompts: list[str] = []
    for f in files:
        prompts.extend(read_prompts(f, prompt_key=prompt_key, key=what))
    return prompts


def load_train_prompts(data_cfg) -> list[str]:
    """Training prompts: ``data.train_files`` or the embedded shapes training prompts."""
    files = data_cfg.train_files
    if files is None:
        return train_prompts()
    return read_prompt_files(prompt_file_list(files, key="data.train_files"), data_cfg.prompt_key,
                             "data.train_files")


def load_val_prompts(data_cfg, limit: int | None) -> list[str]:
    """Validation prompts: ``data.val_files`` or the embedded held-out shapes prompts, capped at ``limit``."""
    files = data_cfg.val_files
    if files is None:
        prompts = heldout_prompts()
    else:
        prompts = read_prompt_files(prompt_file_list(files, key="data.val_files"), data_cfg.prompt_key,
                                    "data.val_files")
    return prompts[:limit] if limit else prompts


def check_prompts(prompts: Sequence[str]) -> None:
    """Raise ``ValueError`` on the first prompt outside the shapes grammar."""
    for p in prompts:
        parse_prompt(p)
