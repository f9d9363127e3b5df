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
* ``.jsonl``: one JSON object per line with at least ``"prompt"`` (or the field
  ``data.prompt_key`` names);
* ``.parquet``: a table with a ``prompt`` column (or ``data.prompt_key``; needs
  pyarrow);
* a ``datasets`` folder written by ``Dataset.save_to_disk`` (or a
  ``DatasetDict`` with one split; needs the datasets package);
* ``.txt``: one prompt per line. Text files are UTF-8 (a BOM is allowed);
  blank lines are skipped.

The other fields of a row (``ground_truth``, ``data_source``, ``extra_info``,
metadata such as ``category``) are kept: :class:`PromptSet` carries them beside
the prompts, the dispatcher puts them on each prompt's lease, and the reward
function receives them as keyword arguments
(:mod:`omnirl_async.rewards.adapters`). Values must be plain data (strings,
numbers, booleans, null, lists, objects, bytes; numpy values and dates are
converted), since they travel through Ray and into checkpoints.

Anything else - a missing file, a directory that is not a ``datasets`` folder,
another extension, bytes that are not UTF-8, a line that is not JSON, a row
without a prompt string or with a blank one, a file without prompts - raises
:class:`omnirl_async.preflight.InputError` naming the config key, the file and
line (``file:line``) or row (``file row N``), and the fix; all bad rows are
listed together. A file whose first row has no prompt field names the fields
it has and suggests ``data.prompt_key=<the likely one>``.
:func:`load_train_prompts` and :func:`load_val_prompts` read
``data.train_files`` / ``data.val_files`` (or, when null, the embedded training
/ held-out sets).
"""

from __future__ import annotations

import datetime
import decimal
import itertools
import json
import os
from typing import Any, Iterable, Iterator, Sequence

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
    "PromptSet",
    "PROMPT_FILE_SUFFIXES",
    "prompt_file_list",
    "read_prompt_set",
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


class PromptSet(list):
    """Prompt strings that also carry the other fields of each prompt's row.

    A plain ``list[str]`` to every reader; ``fields[i]`` is the dict of row
    ``i`` without its prompt (``ground_truth``, ``data_source``, metadata), or
    ``fields`` is None when no row has other fields (``.txt`` files, the
    embedded prompts). The dispatcher puts a prompt's fields on its lease and
    the reward receives them (:mod:`omnirl_async.rewards.adapters`). Slicing
    keeps the fields; pickling (to Ray actors) keeps them too.
    """

    def __init__(self, prompts: Iterable[str] = (), fields: Sequence[dict] | None = None):
        super().__init__(prompts)
        if fields is not None:
            fields = [dict(f) for f in fields]
            if len(fields) != len(self):
                raise ValueError(f"`fields` has {len(fields)} entries for {len(self)} prompts")
            if not any(fields):
                fields = None
        self.fields: list[dict] | None = fields

    def __getitem__(self, index):
        if isinstance(index, slice):
            return PromptSet(list.__getitem__(self, index), None if self.fields is None else self.fields[index])
        return list.__getitem__(self, index)

    def row(self, i: int) -> dict:
        """The other fields of prompt ``i`` ({} when it has none)."""
        return dict(self.fields[i]) if self.fields is not None else {}

    @classmethod
    def concat(cls, parts: Iterable["PromptSet | list[str]"]) -> "PromptSet":
        prompts: list[str] = []
        fields: list[dict] = []
        for part in parts:
            prompts.extend(part)
            part_fields = getattr(part, "fields", None)
            fields.extend(part_fields if part_fields is not None else [{}] * len(part))
        return cls(prompts, fields)


#: Prompt-file extensions and their format (a folder written by `datasets`' save_to_disk is read too).
PROMPT_FILE_SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet", ".txt": "txt"}
_EXAMPLE_ROW = '{"prompt": "two red circles"}'
#: Column names that usually hold the prompt, tried first when suggesting `data.prompt_key`.
_PROMPT_LIKE = ("prompt", "caption", "text", "question", "instruction", "query", "description", "input", "prompts")
#: Bad rows listed in one error; the rest are counted.
MAX_LISTED_ROWS = 10


def _at(key: str | None) -> str:
    return f"`{key}`: " if key else ""


def prompt_file_list(value, *, key: str = "data.train_files") -> list[str]:
    """``data.*_files`` as a list of paths: one path, or a non-empty list of paths."""
    if isinstance(value, (str, os.PathLike)) and os.fspath(value):
        return [os.fspath(value)]
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, (str, os.PathLike)) and os.fspath(v) for v in value):
        return [os.fspath(v) for v in value]
    raise InputError(f"`{key}` = {value!r}: expected a prompt file path or a non-empty list of them (.jsonl, "
                     ".parquet, .txt or a `datasets` folder); null uses the embedded shapes prompts.")


def _is_datasets_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(os.path.join(path, "dataset_dict.json"))


def _check_prompt_path(path: str, key: str | None) -> str:
    """Raise :class:`InputError` unless ``path`` is a prompt file of a known format; return the format."""
    if os.path.isdir(path):
        if _is_datasets_folder(path):
            return "datasets"
        inside = sorted(n for n in os.listdir(path) if os.path.splitext(n)[1] in PROMPT_FILE_SUFFIXES)
        if not inside:
            raise InputError(f"{_at(key)}{path} is a directory, not a prompt file, and holds no .jsonl, .parquet or "
                             ".txt file nor a `datasets` folder's state.json; name a prompt file (.jsonl, .parquet or "
                             ".txt) or a folder written by `Dataset.save_to_disk` instead.")
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
                         f"format; use .jsonl (one object such as {_EXAMPLE_ROW} per line), .parquet (a `prompt` "
                         "column), .txt (one prompt per line) or a folder written by `Dataset.save_to_disk`.")
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


def _suggest_key(row: dict, prompt_key: str, key: str | None) -> str:
    """``, or set `data.prompt_key=caption` ...`` naming the row's most prompt-like text field."""
    texts = [k for k, v in row.items() if k != prompt_key and isinstance(v, str) and v.strip()]
    ranked = sorted(texts, key=lambda k: (_PROMPT_LIKE.index(k.lower()) if k.lower() in _PROMPT_LIKE
                                          else len(_PROMPT_LIKE), texts.index(k)))
    setting = "data.prompt_key" if key else "prompt_key"
    if ranked:
        return f", or set `{setting}={ranked[0]}` if {json.dumps(ranked[0])} holds the prompt"
    return f", or set `{setting}` to the field that holds the prompt"


def _fields_text(row: dict) -> str:
    names = [str(k) for k in row]
    return ", ".join(names[:12]) + (", ..." if len(names) > 12 else "") if names else "none"


def _plain(value: Any, where: str, name: str) -> Any:
    """A row value as plain data that msgpack (checkpoints) and Ray carry; anything else is an error."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v, where, f"{name}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where, f"{name}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return float(value)
    raise _BadRow(f"{where}: field `{name}` holds a {type(value).__name__}, which cannot travel with the prompt; "
                  "store it as a string, number, list or object")


class _BadRow(Exception):
    """One row's problem (collected, then raised together as an InputError)."""


def _row_fields(data: dict, prompt_key: str, where: str) -> dict:
    return {str(k): _plain(v, where, str(k)) for k, v in data.items() if k != prompt_key}


def _text_rows(path: str, kind: str, prompt_key: str, key: str | None) -> Iterator[tuple[str, dict | None, str]]:
    """``(where, row or None, problem)`` of a .txt / .jsonl file; a first row without the prompt raises at once."""
    first = True
    for lineno, line in enumerate(_read_text(path, key).split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{_at(key)}{path}:{lineno}"
        if kind == "txt":
            yield where, {prompt_key: line.strip()}, ""
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            yield where, None, (f"{where}: not valid JSON ({e.msg}, column {e.colno}); each line must be one object "
                                f"such as {_EXAMPLE_ROW}.")
            first = False
            continue
        if not isinstance(row, dict) or not isinstance(row.get(prompt_key), str):
            fields = f"; its fields: {_fields_text(row)}" if isinstance(row, dict) else ""
            problem = (f"{where}: row has no string {json.dumps(prompt_key)} field (got {line.strip()[:80]!r}"
                       f"{fields}); each line must look like {{{json.dumps(prompt_key)}: \"two red circles\"}}"
                       f"{_suggest_key(row, prompt_key, key) if isinstance(row, dict) else ''}.")
            if first:  # the whole file is in another layout: one message says how to read it
                raise InputError(problem)
            yield where, None, problem
        else:
            yield where, row, ""
        first = False


def _table_rows(path: str, prompt_key: str, key: str | None) -> Iterator[tuple[str, dict | None, str]]:
    """``(where, row or None, problem)`` of a Parquet file or a ``datasets`` folder."""
    from omnirl_async.data.preference import open_dataset

    try:
        source = open_dataset(path)
    except InputError as err:
        raise InputError(f"{_at(key)}{err}") from None
    first = True
    for rec in source.records():
        where = f"{_at(key)}{rec.where}"
        if rec.data is None:
            yield where, None, f"{where}: {rec.error}"
            continue
        if first and prompt_key not in rec.data:
            raise InputError(f"{_at(key)}{path} has no {json.dumps(prompt_key)} column (its columns: "
                             f"{_fields_text(rec.data)}); name the prompt column in the data"
                             f"{_suggest_key(rec.data, prompt_key, key)}.")
        first = False
        value = rec.data.get(prompt_key)
        if not isinstance(value, str):
            yield where, None, (f"{where}: `{prompt_key}` = {value!r:.80} is not a prompt (expected a string); "
                                "fill it in or drop the row.")
            continue
        yield where, rec.data, ""


def read_prompt_set(path: str | os.PathLike, *, prompt_key: str = "prompt", key: str | None = None) -> PromptSet:
    """Read a prompt file (.jsonl, .parquet, .txt) or a ``datasets`` folder into a :class:`PromptSet`.

    ``key`` is the config key that named the file (``data.train_files``); every
    problem - missing file, an unknown format, bytes that are not UTF-8, invalid
    JSON, a row without a prompt string or with a blank one, a value that
    cannot travel with the prompt, no prompt at all - is an
    :class:`InputError` that names it, the file and the line or row, and the
    fix. All bad rows are reported together (the first
    :data:`MAX_LISTED_ROWS`, then a count); a file whose first row lacks the
    prompt says which fields it has and suggests ``data.prompt_key``.
    """
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    kind = _check_prompt_path(path, key)
    rows = _table_rows(path, prompt_key, key) if kind in ("parquet", "datasets") else \
        _text_rows(path, kind, prompt_key, key)
    prompts: list[str] = []
    fields: list[dict] = []
    problems: list[str] = []
    for where, row, problem in rows:
        if row is not None:
            if not row[prompt_key].strip():
                problem = f"{where}: `{prompt_key}` is blank; write the prompt or drop the row."
            else:
                try:
                    fields.append(_row_fields(row, prompt_key, where))
                    prompts.append(row[prompt_key].strip() if kind == "txt" else row[prompt_key])
                    continue
                except _BadRow as err:
                    problem = str(err)
        problems.append(problem)
    if problems:
        listed = problems[:MAX_LISTED_ROWS]
        if len(problems) > MAX_LISTED_ROWS:
            listed.append(f"{_at(key)}{path}: {len(problems) - MAX_LISTED_ROWS} more bad rows like these "
                          f"({len(problems)} in all); fix them or remove them from the file.")
        raise InputError(listed)
    if not prompts:
        raise InputError(f"{_at(key)}{path} holds no prompts (it is empty or only blank lines); add one prompt "
                         "per line.")
    return PromptSet(prompts, fields)


def read_prompt_rows(path: str | os.PathLike, *, prompt_key: str = "prompt", key: str | None = None) -> list[dict]:
    """Read a prompt file into rows (dicts with the string ``prompt_key`` and the row's other fields)."""
    ps = read_prompt_set(path, prompt_key=prompt_key, key=key)
    return [{prompt_key: p, **ps.row(i)} for i, p in enumerate(ps)]


def read_prompts(path: str | os.PathLike, *, prompt_key: str = "prompt", key: str | None = None) -> PromptSet:
    """Read the prompts of a prompt file, with their rows' other fields (see :func:`read_prompt_set`)."""
    return read_prompt_set(path, prompt_key=prompt_key, key=key)


def read_prompt_files(files: list[str], prompt_key: str, what: str) -> PromptSet:
    """Prompts of several files (.jsonl / .parquet field ``prompt_key``, .txt, ``datasets`` folders), in order.

    ``what`` is the config key that named the files; any problem is an
    :class:`~omnirl_async.preflight.InputError` naming it, the file and line or row.
    """
    return PromptSet.concat(read_prompts(f, prompt_key=prompt_key, key=what) for f in files)


def load_train_prompts(data_cfg) -> PromptSet:
    """Training prompts: ``data.train_files`` or the embedded shapes training prompts."""
    files = data_cfg.train_files
    if files is None:
        return PromptSet(train_prompts())
    return read_prompt_files(prompt_file_list(files, key="data.train_files"), data_cfg.prompt_key,
                             "data.train_files")


def load_val_prompts(data_cfg, limit: int | None) -> PromptSet:
    """Validation prompts: ``data.val_files`` or the embedded held-out shapes prompts, capped at ``limit``."""
    files = data_cfg.val_files
    if files is None:
        prompts = PromptSet(heldout_prompts())
    else:
        prompts = read_prompt_files(prompt_file_list(files, key="data.val_files"), data_cfg.prompt_key,
                                    "data.val_files")
    return prompts[:limit] if limit else prompts


def check_prompts(prompts: Sequence[str]) -> None:
    """Raise ``ValueError`` on the first prompt outside the shapes grammar."""
    for p in prompts:
        parse_prompt(p)
