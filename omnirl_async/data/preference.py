"""Offline preference datasets: the row format and the readers (JSONL, Parquet, a ``datasets`` folder).

A dataset is a table of preference pairs, one row per pair (``docs/PREFERENCE_DATA.md``)::

    {"id": "p-0001", "prompt": "two red circles", "chosen": "images/p-0001-a.png",
     "rejected": "images/p-0001-b.png", "chosen_score": 1.0, "rejected_score": 0.67,
     "source": "judge-v2", "metadata": {"annotator": 7}}

* ``id`` (string, or an integer read as its decimal string) - unique in the dataset;
* ``prompt`` (string, not blank);
* ``chosen`` / ``rejected`` - a *reference* to an image or to latents:

  - an image file path, relative to the dataset (the folder holding the JSONL
    or Parquet file, or the ``datasets`` folder) or absolute; PNG or JPEG, of
    exactly the model's resolution (``actor_rollout_ref.rollout.pipeline.height``
    x ``width``);
  - ``latents:<shard>.safetensors#<key>`` - the tensor ``<key>`` of a
    safetensors file (path relative to the dataset), fp32 or fp16, shaped like
    one sample of the model's latents (the layout ``x0`` that rollouts store);
  - in Parquet and ``datasets`` folders also an image struct
    ``{"bytes": <PNG/JPEG bytes>, "path": <name or null>}`` (what a ``datasets``
    ``Image`` column stores); without bytes its ``path`` is read as a file path;

* optional ``chosen_score`` / ``rejected_score`` (finite numbers or null),
  ``source`` (string or null) and ``metadata`` (an object); every other column
  is kept as metadata too (a column whose name is close to a known field, such
  as ``chosen_scor``, is refused as a likely typo).

This module reads rows and turns them into :class:`PairFields` with the
references resolved; :mod:`omnirl_async.data.preference_checks` opens every
referenced file and checks it against the model. Nothing here needs a model.
Parquet needs ``pyarrow`` and a ``datasets`` folder the ``datasets`` package
(the ``preference`` extra: ``pip install 'omnirl-async[preference]'``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from typing import Any, Iterator

import msgspec

from omnirl_async.preflight import InputError

__all__ = ["REQUIRED_FIELDS", "OPTIONAL_FIELDS", "LATENTS_PREFIX", "ImageFile", "InlineImage", "LatentRef", "Ref",
           "Record", "Problem", "ROW_FIELD", "PairFields", "ParsedRow", "DatasetSource", "open_dataset",
           "parse_record"]

REQUIRED_FIELDS = ("id", "prompt", "chosen", "rejected")
OPTIONAL_FIELDS = ("chosen_score", "rejected_score", "source", "metadata")
LATENTS_PREFIX = "latents:"
_SHARD_SUFFIX = ".safetensors"
_EXTRA = "pip install 'omnirl-async[preference]' (or `pip install datasets`)"
_EXAMPLE = ('{"id": "p1", "prompt": "two red circles", "chosen": "images/p1-a.png", '
            '"rejected": "images/p1-b.png"}')
_ENCODER = msgspec.msgpack.Encoder(order="sorted")
#: the field name of a problem with the whole row (a line that is not JSON, an unreadable row)
ROW_FIELD = "<row>"


# ----------------------------------------------------------------------------------- references
@dataclasses.dataclass(frozen=True)
class ImageFile:
    """A PNG/JPEG file; ``path`` absolute, ``text`` as the row wrote it."""

    path: str
    text: str


@dataclasses.dataclass(frozen=True)
class InlineImage:
    """Image bytes held in the row itself (a ``datasets`` ``Image`` column)."""

    data: bytes
    name: str | None = None

    @property
    def text(self) -> str:
        return f"<{len(self.data)} image bytes{' ' + self.name if self.name else ''}>"


@dataclasses.dataclass(frozen=True)
class LatentRef:
    """Tensor ``key`` of the safetensors file ``shard`` (absolute); ``text`` as the row wrote it."""

    shard: str
    key: str
    text: str


Ref = ImageFile | InlineImage | LatentRef


# ----------------------------------------------------------------------------------- rows and problems
@dataclasses.dataclass(frozen=True)
class Record:
    """One row as read: ``row`` (1-based), ``where`` (``file:line`` for JSONL, else ``file row N``).

    ``data`` is the row's mapping, or None when the row could not be read (then ``error`` says why).
    """

    row: int
    where: str
    data: dict | None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Problem:
    """Why one field of one row cannot be ingested."""

    row: int
    where: str
    field: str
    value: Any
    message: str

    def text(self) -> str:
        if self.field == ROW_FIELD:
            return f"{self.where}: {self.message}"
        return f"{self.where}: `{self.field}` = {_show(self.value)}: {self.message}"

    def to_json(self) -> dict:
        return {"field": self.field, "value": _jsonable(self.value), "message": self.message}


def _show(value: Any, limit: int = 80) -> str:
    text = repr(value.text if isinstance(value, (ImageFile, InlineImage, LatentRef)) else value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _jsonable(value: Any) -> Any:
    if isinstance(value, (ImageFile, InlineImage, LatentRef)):
        return value.text
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)[:200]


@dataclasses.dataclass
class PairFields:
    """The fields of a row whose schema is right (files not opened yet)."""

    id: str
    prompt: str
    chosen: Ref
    rejected: Ref
    chosen_score: float | None
    rejected_score: float | None
    source: str | None
    metadata: dict[str, Any]


# ----------------------------------------------------------------------------------- parsing one row
@dataclasses.dataclass
class ParsedRow:
    """A row after the schema check: ``fields`` when the schema is right, else None; the references and the id
    that could be read either way (so that files and duplicate ids are checked even on a row with other
    problems)."""

    fields: PairFields | None
    problems: list[Problem]
    refs: dict[str, Ref]
    id: str | None


def parse_record(rec: Record, base: str) -> ParsedRow:
    """Check the schema of one row and resolve its references against the folder ``base``."""
    if rec.data is None:
        return ParsedRow(None, [Problem(rec.row, rec.where, ROW_FIELD, None, rec.error or "unreadable row")], {}, None)
    d = rec.data
    problems: list[Problem] = []

    def bad(name: str, value: Any, message: str) -> None:
        problems.append(Problem(rec.row, rec.where, name, value, message))

    for name in REQUIRED_FIELDS:
        if d.get(name) is None:
            bad(name, None, f"missing; every row needs {', '.join(REQUIRED_FIELDS)} (e.g. {_EXAMPLE})")
    known = set(REQUIRED_FIELDS) | set(OPTIONAL_FIELDS)
    extra: dict[str, Any] = {}
    for name, value in d.items():
        if name in known:
            continue
        close = difflib.get_close_matches(str(name), sorted(known), n=1, cutoff=0.8)
        if close:
            bad(str(name), value, f"unknown field, close to `{close[0]}`: rename it to `{close[0]}` (other "
                                  "unknown fields are kept as metadata)")
        else:
            extra[str(name)] = value

    pid = d.get("id")
    if pid is not None:
        if isinstance(pid, bool) or not isinstance(pid, (str, int)) or (isinstance(pid, str) and not pid.strip()):
            bad("id", pid, "must be a non-empty string (or an integer); give every row its own id")
            pid = None
        else:
            pid = str(pid)
    prompt = d.get("prompt")
    if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
        bad("prompt", prompt, "must be a non-empty string; write the prompt the two images answer")
    refs: dict[str, Ref] = {}
    for name in ("chosen", "rejected"):
        value = d.get(name)
        if value is None:
            continue
        ref, message = _parse_ref(value, base)
        if message:
            bad(name, value, message)
        else:
            refs[name] = ref
    scores: dict[str, float | None] = {}
    for name in ("chosen_score", "rejected_score"):
        value = d.get(name)
        if value is None:
            scores[name] = None
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
            bad(name, value, "must be a finite number or null (leave it out when there is no score)")
        else:
            scores[name] = float(value)
    source = d.get("source")
    if source is not None and not isinstance(source, str):
        bad("source", source, "must be a string or null (where the pair comes from, e.g. 'human' or 'judge')")
    metadata = d.get("metadata")
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict):
        bad("metadata", metadata, "must be an object (a JSON mapping) or null")
        metadata = {}
    metadata = {**extra, **{str(k): v for k, v in metadata.items()}}
    try:
        metadata = msgspec.msgpack.decode(_ENCODER.encode(metadata))
    except (TypeError, ValueError, OverflowError, msgspec.MsgspecError) as err:
        bad("metadata", metadata, f"cannot be stored ({err}); keep metadata to JSON values (strings, numbers, "
                                  "booleans, null, lists and objects)")
    fields = None
    if not problems:
        fields = PairFields(id=pid, prompt=prompt, chosen=refs["chosen"], rejected=refs["rejected"],
                            chosen_score=scores["chosen_score"], rejected_score=scores["rejected_score"],
                            source=source, metadata=metadata)
    return ParsedRow(fields, problems, refs, pid)


def _parse_ref(value: Any, base: str) -> tuple[Ref | None, str | None]:
    """A reference and no message, or None and the message saying what is wrong."""
    if isinstance(value, dict) and set(value) <= {"bytes", "path"}:
        data, path = value.get("bytes"), value.get("path")
        if isinstance(data, (bytes, bytearray)) and data:
            return InlineImage(bytes(data), path if isinstance(path, str) else None), None
        value = path
    if not isinstance(value, str) or not value.strip():
        return None, ("must be an image path (PNG/JPEG, relative to the dataset), "
                      f"`{LATENTS_PREFIX}<shard>{_SHARD_SUFFIX}#<key>`, or an image struct {{bytes, path}}")
    if value.startswith(LATENTS_PREFIX):
        body = value[len(LATENTS_PREFIX):]
        shard, sep, key = body.partition(_SHARD_SUFFIX + "#")
        if not sep or not shard or not key:
            return None, (f"a latents reference reads `{LATENTS_PREFIX}<shard>{_SHARD_SUFFIX}#<key>` "
                          f"(e.g. `{LATENTS_PREFIX}latents/part-0{_SHARD_SUFFIX}#p1.chosen`)")
        return LatentRef(_resolve(shard + _SHARD_SUFFIX, base), key, value), None
    return ImageFile(_resolve(value, base), value), None


def _resolve(path: str, base: str) -> str:
    return os.path.normpath(os.path.join(base, os.path.expanduser(path)))


# ----------------------------------------------------------------------------------- sources
@dataclasses.dataclass
class DatasetSource:
    """An opened dataset: ``kind`` (jsonl, parquet, datasets), ``base`` (folder of relative paths)."""

    path: str
    kind: str
    base: str
    num_rows: int
    _target: Any = None

    def records(self) -> Iterator[Record]:
        if self.kind == "jsonl":
            yield from _jsonl_records(self.path)
        elif self.kind == "parquet":
            yield from _parquet_records(self.path, self._target)
        else:
            yield from _hf_records(self.path, self._target)


def open_dataset(path: str | os.PathLike) -> DatasetSource:
    """Open a JSONL file, a Parquet file, a ``datasets`` folder (``save_to_disk``) or a folder holding one
    JSONL or Parquet file; :class:`InputError` naming the path and the fix when it is none of these."""
    text = os.fspath(path)
    full = os.path.abspath(os.path.expanduser(text))
    if not os.path.exists(full):
        raise InputError(f"dataset {text}: does not exist; give a .jsonl or .parquet file or a folder written by "
                         "`datasets.Dataset.save_to_disk` (docs/PREFERENCE_DATA.md)")
    if os.path.isdir(full):
        if os.path.isfile(os.path.join(full, "state.json")) or os.path.isfile(os.path.join(full, "dataset_dict.json")):
            return _open_hf(text, full)
        inside = sorted(n for n in os.listdir(full) if n.endswith((".jsonl", ".parquet")))
        if len(inside) == 1:
            return open_dataset(os.path.join(text, inside[0]))
        what = f"holds {len(inside)} ({', '.join(inside[:4])}{', ...' if len(inside) > 4 else ''})" if inside \
            else "holds no .jsonl or .parquet file and is not a `datasets` folder (no state.json)"
        raise InputError(f"dataset {text}: a folder that {what}; name one data file, or save a `datasets` folder "
                         "with `save_to_disk`")
    if full.endswith(".jsonl"):
        with open(full, "rb") as f:
            n = sum(1 for line in f if line.strip())
        return DatasetSource(text, "jsonl", os.path.dirname(full), n)
    if full.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise InputError(f"dataset {text}: reading Parquet needs pyarrow; {_EXTRA}") from None
        try:
            pf = pq.ParquetFile(full)
        except Exception as err:  # noqa: BLE001 - any reader error means the file is not usable Parquet
            raise InputError(f"dataset {text}: not a readable Parquet file ({type(err).__name__}: {err}); "
                             "write it again (e.g. `pandas.DataFrame.to_parquet`)") from None
        return DatasetSource(text, "parquet", os.path.dirname(full), int(pf.metadata.num_rows), pf)
    raise InputError(f"dataset {text}: extension {os.path.splitext(full)[1] or '(none)'!r} is not a dataset format; "
                     "use .jsonl (one object per line, e.g. " + _EXAMPLE + "), .parquet, or a `datasets` folder")


def _jsonl_records(path: str) -> Iterator[Record]:
    row = 0
    with open(os.path.abspath(os.path.expanduser(path)), "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            row += 1
            where = f"{path}:{lineno} (row {row})"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                yield Record(row, where, None, f"byte {raw[e.start]:#04x} at column {e.start + 1} is not valid "
                                               "UTF-8; save the file as UTF-8")
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as e:
                yield Record(row, where, None, f"not valid JSON ({e.msg}, column {e.colno}); each line must be one "
                                               f"object such as {_EXAMPLE}")
                continue
            if not isinstance(data, dict):
                yield Record(row, where, None, f"a JSON {type(data).__name__}, not an object; each line must be one "
                                               f"object such as {_EXAMPLE}")
                continue
            yield Record(row, where, data)


def _parquet_records(path: str, pf) -> Iterator[Record]:
    row = 0
    for batch in pf.iter_batches(batch_size=512):
        for data in batch.to_pylist():
            row += 1
            yield Record(row, f"{path} row {row}", data)


def _open_hf(text: str, full: str) -> DatasetSource:
    try:
        import datasets
    except ImportError:
        raise InputError(f"dataset {text}: reading a `datasets` folder needs the datasets package; {_EXTRA}") from None
    try:
        ds = datasets.load_from_disk(full)
    except Exception as err:  # noqa: BLE001 - any loader error means the folder is not usable
        raise InputError(f"dataset {text}: not a readable `datasets` folder ({type(err).__name__}: {err}); write it "
                         "again with `Dataset.save_to_disk`") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if len(splits) != 1:
            raise InputError(f"dataset {text}: a DatasetDict with splits {splits}; name one split's folder, e.g. "
                             f"{os.path.join(text, splits[0] if splits else 'train')}")
        ds = ds[splits[0]]
    for name, feature in ds.features.items():
        if isinstance(feature, datasets.Image) and feature.decode:
            ds = ds.cast_column(name, datasets.Image(decode=False))  # keep the file's bytes, decode ourselves
    return DatasetSource(text, "datasets", full, len(ds), ds)


def _hf_records(path: str, ds) -> Iterator[Record]:
    for i, data in enumerate(ds, start=1):
        yield Record(i, f"{path} row {i}", dict(data))
