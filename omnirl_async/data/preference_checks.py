"""Every row of a preference dataset checked against the model before anything enters a store.

:func:`check_dataset` reads the rows (:mod:`omnirl_async.data.preference`)
and checks, per row:

* the schema: required fields, types, a non-empty prompt, finite scores;
* the ``id`` is unique in the dataset (the first row with an id keeps it; a
  later row with the same id is refused, naming the first);
* every referenced file exists; an image decodes, is PNG or JPEG and has the
  model's size (``height`` x ``width``); latents are a float tensor of the
  model's one-sample latent shape with finite values;
* ``chosen`` and ``rejected`` differ: not the same file, tensor or bytes.

Each problem is a :class:`~omnirl_async.data.preference.Problem` naming the row
(``file:line`` for JSONL), the field, the value and the fix. The result holds
the good pairs with the SHA-256 of what each reference pointed at and a
content hash per row (prompt, both references' contents, scores, source,
metadata; not the id), which makes a second ingest of the same rows
idempotent. :class:`PreferenceDataError` (an :class:`InputError`, printed by
the CLI as one message with exit code 2) lists the bad rows;
:meth:`CheckResult.write_report` writes them as JSONL.

:func:`load_image` / :func:`load_latents` read a reference again when it is
encoded and refuse a file whose contents changed since the check.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
from typing import Any, Iterable

import msgspec
import numpy as np

from omnirl_async.data.preference import (ROW_FIELD, DatasetSource, ImageFile, InlineImage, LatentRef, PairFields,
                                          Problem, Ref, parse_record)
from omnirl_async.preflight import InputError

__all__ = ["IMAGE_FORMATS", "CheckedPair", "CheckResult", "PreferenceDataError", "check_dataset", "load_image",
           "load_latents", "row_content_hash", "PROGRESS_MIN_ROWS"]

IMAGE_FORMATS = ("PNG", "JPEG")
#: datasets with at least this many rows show a progress bar (when progress is on)
PROGRESS_MIN_ROWS = 200
#: bad rows listed in the error message; all of them are in the report
MESSAGE_MAX_ROWS = 30
_HASH_ENCODER = msgspec.msgpack.Encoder(order="sorted")
_HASH_VERSION = "omnirl-async-preference-row/1"


class _Bad(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class PreferenceDataError(InputError):
    """Rows of a preference dataset that cannot be ingested; ``problems`` lists one line per problem."""

    def __init__(self, message: str, problems: list[str]):
        super().__init__(problems or [message])
        self.args = (message,)

    def __str__(self) -> str:
        return self.args[0]


@dataclasses.dataclass
class CheckedPair:
    """A row that passed every check."""

    row: int
    where: str
    fields: PairFields
    chosen_hash: str
    rejected_hash: str
    content_hash: str

    @property
    def id(self) -> str:
        return self.fields.id


@dataclasses.dataclass
class CheckResult:
    source: DatasetSource
    pairs: list[CheckedPair]
    problems: list[Problem]
    total_rows: int
    #: row number -> the row's id, for every row whose id could be read
    ids: dict[int, str] = dataclasses.field(default_factory=dict)

    @property
    def bad_rows(self) -> dict[int, list[Problem]]:
        """Row number -> its problems, in row order."""
        out: dict[int, list[Problem]] = {}
        for p in sorted(self.problems, key=lambda p: p.row):
            out.setdefault(p.row, []).append(p)
        return out

    def refuse(self, pair: CheckedPair, field: str, value: Any, message: str) -> None:
        """Move a good pair to the bad rows (e.g. its id is in the store with other content)."""
        self.pairs = [p for p in self.pairs if p is not pair]
        self.problems.append(Problem(pair.row, pair.where, field, value, message))

    def report_rows(self) -> list[dict]:
        return [{"row": row, "where": problems[0].where, "id": self.ids.get(row),
                 "problems": [p.to_json() for p in problems]} for row, problems in self.bad_rows.items()]

    def write_report(self, path: str | os.PathLike) -> str:
        """Write one JSON line per bad row to ``path`` (parents created); return the path."""
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for line in self.report_rows():
                f.write(json.dumps(line) + "\n")
        return path

    def error(self, report: str | None = None, *, skip_hint: bool = True) -> PreferenceDataError:
        """The error refusing the dataset: the bad rows (the first :data:`MESSAGE_MAX_ROWS`), the report, the fix."""
        rows = self.bad_rows
        lines = [p.text() for problems in rows.values() for p in problems]
        good = self.total_rows - len(rows)
        head = (f"dataset {self.source.path}: {len(rows)} of {self.total_rows} rows cannot be ingested, so nothing "
                "was ingested; fix the rows below")
        if skip_hint:
            head += f", or pass --skip-invalid to ingest the {good} good rows and skip these"
        shown = lines[:MESSAGE_MAX_ROWS]
        body = "\n".join(f"  {i}. {line}" for i, line in enumerate(shown, start=1))
        tail = ""
        if len(lines) > len(shown):
            tail = f"\n  ... and {len(lines) - len(shown)} more problems"
        if report:
            tail += f"\nevery bad row is listed in {report}"
        return PreferenceDataError(f"{head}:\n{body}{tail}", lines)


# ----------------------------------------------------------------------------------- hashing
def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _latent_hash(arr: np.ndarray) -> str:
    arr = np.ascontiguousarray(arr, dtype="<f4")
    return _sha(f"f32{list(arr.shape)}".encode() + arr.tobytes())


def row_content_hash(fields: PairFields, chosen_hash: str, rejected_hash: str) -> str:
    """What makes two rows with one id "the same": prompt, both contents, scores, source and metadata."""
    return _sha(_HASH_ENCODER.encode([_HASH_VERSION, fields.prompt, chosen_hash, rejected_hash, fields.chosen_score,
                                      fields.rejected_score, fields.source, fields.metadata]))


# ----------------------------------------------------------------------------------- reading references
def _image_bytes(ref: ImageFile | InlineImage) -> bytes:
    if isinstance(ref, InlineImage):
        return ref.data
    if not os.path.exists(ref.path):
        raise _Bad(f"file {ref.path} not found; fix the path (relative paths are read from the dataset's folder)")
    if not os.path.isfile(ref.path):
        raise _Bad(f"{ref.path} is not a file; name a PNG or JPEG image")
    with open(ref.path, "rb") as f:
        return f.read()


def _decode(data: bytes, height: int | None, width: int | None) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format not in IMAGE_FORMATS:
                raise _Bad(f"is a {im.format} image; save it as PNG or JPEG")
            if height is not None and im.size != (width, height):
                raise _Bad(f"is {im.size[0]}x{im.size[1]} (width x height) but the model generates {width}x{height} "
                           "(`actor_rollout_ref.rollout.pipeline.width` x `height`); resize the image to that size "
                           "(or set the pipeline size to the images')")
            im.load()
            return np.asarray(im.convert("RGB"), dtype=np.uint8)
    except _Bad:
        raise
    except UnidentifiedImageError:
        raise _Bad("does not decode as an image (no PNG or JPEG data PIL can read); replace it with a readable PNG "
                   "or JPEG file") from None
    except (Image.DecompressionBombError, OSError, SyntaxError, ValueError) as err:
        raise _Bad(f"does not decode as an image ({type(err).__name__}: {err}); replace it with a readable PNG or "
                   "JPEG file") from None


def _read_latents(ref: LatentRef, latent_shape: tuple[int, ...] | None) -> np.ndarray:
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(ref.shard):
        raise _Bad(f"latents file {ref.shard} not found; fix the path (relative to the dataset's folder)")
    try:
        with safe_open(ref.shard, framework="numpy") as f:
            keys = list(f.keys())
            if ref.key not in keys:
                listed = ", ".join(repr(k) for k in keys[:5]) + (", ..." if len(keys) > 5 else "")
                raise _Bad(f"no tensor {ref.key!r} in {ref.shard} (it holds {listed or 'no tensor'}); fix the key "
                           "after `#`")
            sl = f.get_slice(ref.key)
            dtype, shape = sl.get_dtype(), tuple(sl.get_shape())
            if dtype not in ("F32", "F16"):
                raise _Bad(f"tensor {ref.key!r} has dtype {dtype}; store latents as float32 (or float16)")
            if latent_shape is not None and shape != tuple(latent_shape):
                raise _Bad(f"tensor {ref.key!r} has shape {list(shape)} but one sample of this model's latents is "
                           f"{list(latent_shape)} (the layout `x0` of rollouts, no batch dimension); encode the "
                           "images with this model's VAE, or give the images instead")
            arr = np.asarray(f.get_tensor(ref.key), dtype=np.float32)
    except SafetensorError as err:
        raise _Bad(f"{ref.shard} is not a readable safetensors file ({err}); write it with "
                   "`safetensors.numpy.save_file`") from None
    if not np.isfinite(arr).all():
        raise _Bad(f"tensor {ref.key!r} holds NaN or inf values; store finite latents")
    return arr


def _check_ref(ref: Ref, height, width, latent_shape) -> str:
    """The content hash of what ``ref`` points at; :class:`_Bad` when it cannot be used."""
    if isinstance(ref, LatentRef):
        return _latent_hash(_read_latents(ref, latent_shape))
    data = _image_bytes(ref)
    _decode(data, height, width)
    return _sha(data)


def load_image(ref: ImageFile | InlineImage, expect_hash: str | None = None) -> np.ndarray:
    """The image ``ref`` points at as ``uint8 [H, W, 3]``; :class:`InputError` if it changed since it was checked."""
    data = _image_bytes(ref)
    if expect_hash is not None and _sha(data) != expect_hash:
        raise InputError(f"{ref.text}: the file changed after it was checked; run the ingest again")
    return _decode(data, None, None)


def load_latents(ref: LatentRef, expect_hash: str | None = None) -> np.ndarray:
    """The latents ``ref`` points at, float32; :class:`InputError` if they changed since they were checked."""
    arr = _read_latents(ref, None)
    if expect_hash is not None and _latent_hash(arr) != expect_hash:
        raise InputError(f"{ref.text}: the tensor changed after it was checked; run the ingest again")
    return arr


def _same_reference(a: Ref, b: Ref) -> bool:
    if isinstance(a, ImageFile) and isinstance(b, ImageFile):
        return os.path.realpath(a.path) == os.path.realpath(b.path)
    if isinstance(a, LatentRef) and isinstance(b, LatentRef):
        return os.path.realpath(a.shard) == os.path.realpath(b.shard) and a.key == b.key
    return False


# ----------------------------------------------------------------------------------- the check
def check_dataset(source: DatasetSource, *, height: int, width: int, latent_shape: Iterable[int] | None,
                  progress: bool = False) -> CheckResult:
    """Check every row of ``source`` for a model generating ``height`` x ``width`` images whose one-sample
    latents have shape ``latent_shape``; opens every referenced file once."""
    from tqdm import tqdm

    latent_shape = tuple(int(n) for n in latent_shape) if latent_shape is not None else None
    pairs: list[CheckedPair] = []
    problems: list[Problem] = []
    first_where: dict[str, str] = {}
    ids: dict[int, str] = {}
    total = 0
    bar = tqdm(source.records(), total=source.num_rows, desc=f"check {os.path.basename(source.path)}", unit="row",
               disable=not progress or source.num_rows < PROGRESS_MIN_ROWS)
    for rec in bar:
        total += 1
        parsed = parse_record(rec, source.base)
        row_problems = list(parsed.problems)

        def bad(field: str, value: Any, message: str) -> None:
            row_problems.append(Problem(rec.row, rec.where, field, value, message))

        if parsed.id is not None:
            ids[rec.row] = parsed.id
            if parsed.id in first_where:
                bad("id", parsed.id, f"is also the id of {first_where[parsed.id]}; ids must be unique, give this row "
                                     "its own id")
            else:
                first_where[parsed.id] = rec.where
        hashes: dict[str, str] = {}
        for name, ref in parsed.refs.items():
            try:
                hashes[name] = _check_ref(ref, height, width, latent_shape)
            except _Bad as err:
                bad(name, ref, err.message)
        if len(hashes) == 2:
            c, r = parsed.refs["chosen"], parsed.refs["rejected"]
            if _same_reference(c, r):
                bad("rejected", r, "is the same file as `chosen`; a pair needs two different images")
            elif hashes["chosen"] == hashes["rejected"]:
                bad("rejected", r, f"has the same content as `chosen` ({c.text}); a pair needs two different images")
        if row_problems or parsed.fields is None:
            problems.extend(row_problems or [Problem(rec.row, rec.where, ROW_FIELD, None, "unusable row")])
            continue
        pairs.append(CheckedPair(rec.row, rec.where, parsed.fields, hashes["chosen"], hashes["rejected"],
                                 row_content_hash(parsed.fields, hashes["chosen"], hashes["rejected"])))
    bar.close()
    return CheckResult(source=source, pairs=pairs, problems=problems, total_rows=total, ids=ids)
