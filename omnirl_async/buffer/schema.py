"""Field schema of a replay table: field name -> dtype and per-sample shape.

A table stores, for every sample, one row of each tensor field (latents,
log-probs, the decoded image...). The schema pins down what a row looks like
so that a learner batch can be stacked without surprises. It is either
declared up front or inferred from the first put that holds a successful
sample; afterwards every put must match it exactly. A put that does not is
rejected *whole* with a message naming a sample key and the field, and
nothing of it is stored.

Failed samples carry no tensors the learner will ever read, so a put of only
failed samples may pass ``fields={}``.

Only plain numeric and boolean dtypes are allowed: they are what safetensors
can snapshot without pickle. Strings belong in the sample's tags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

__all__ = ["FieldSpec", "Schema", "describe_fields", "as_numpy"]

_ALLOWED_KINDS = "biuf"  # bool, int, uint, float


@dataclass(frozen=True)
class FieldSpec:
    """dtype (``numpy.dtype.str``, e.g. ``'<f4'``) and shape of one sample's row."""

    dtype: str
    shape: tuple[int, ...]

    def to_list(self) -> list:
        return [self.dtype, list(self.shape)]

    @classmethod
    def from_list(cls, v) -> "FieldSpec":
        return cls(str(v[0]), tuple(int(d) for d in v[1]))

    def describe(self) -> str:
        return f"{np.dtype(self.dtype).name}{list(self.shape)}"


def as_numpy(name: str, value: Any) -> np.ndarray:
    """Accept a numpy array or a CPU tensor (anything with ``.numpy()``); refuse the rest."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        try:
            return value.detach().cpu().numpy()
        except TypeError as exc:  # e.g. bfloat16 has no numpy dtype
            raise ValueError(f"field `{name}`: cannot convert tensor of dtype {value.dtype} to numpy ({exc}); "
                             "cast it to float32 or float16 before put") from None
    raise ValueError(f"field `{name}`: expected a numpy.ndarray with the batch dimension first, "
                     f"got {type(value).__name__}")


def describe_fields(fields: Mapping[str, Any], n_rows: int, *, first_key: str) -> dict[str, np.ndarray]:
    """Convert ``fields`` to numpy and check each has ``n_rows`` rows and an allowed dtype."""
    out: dict[str, np.ndarray] = {}
    for name, value in fields.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"put rejected (first key `{first_key}`): field name {name!r} must be a "
                             "non-empty string without '/'")
        arr = as_numpy(name, value)
        if arr.ndim == 0 or arr.shape[0] != n_rows:
            raise ValueError(f"put rejected (first key `{first_key}`): field `{name}` has shape "
                             f"{tuple(arr.shape)}, but the batch dimension must equal len(metas) = {n_rows}")
        if arr.dtype.kind not in _ALLOWED_KINDS or arr.dtype.byteorder == ">":
            raise ValueError(f"put rejected (first key `{first_key}`): field `{name}` has dtype "
                             f"{arr.dtype}; only native bool/int/uint/float arrays can be stored "
                             "(put strings into the sample's tags)")
        out[name] = arr
    return out


def spec_of(arrays: Mapping[str, np.ndarray]) -> dict[str, FieldSpec]:
    return {k: FieldSpec(np.dtype(v.dtype).str, tuple(int(d) for d in v.shape[1:])) for k, v in arrays.items()}


class Schema:
    """The fields every successful sample of one table must carry.

    Examples:
        >>> s = Schema()
        >>> s.check({"x": FieldSpec("<f4", (4,))}, key="a")   # first put: inferred
        >>> s.check({"x": FieldSpec("<f2", (4,))}, key="b")
        Traceback (most recent call last):
        ValueError: put rejected: sample `b` field `x` has dtype/shape float16[4], the online table schema says float32[4]
    """

    def __init__(self, fields: Mapping[str, FieldSpec] | None = None, *, table: str = "online"):
        self.fields: dict[str, FieldSpec] | None = dict(fields) if fields is not None else None
        self.table = table

    @property
    def known(self) -> bool:
        return self.fields is not None

    def check(self, spec: Mapping[str, FieldSpec], *, key: str) -> None:
        """Raise ``ValueError`` naming ``key`` and the field if ``spec`` differs; infer it if unknown."""
        if self.fields is None:
            if not spec:
                raise ValueError(f"put rejected: sample `{key}` is a success but the put has no fields; "
                                 "pass its tensors in `fields` (batch dimension first)")
            self.fields = dict(spec)
            return
        for name, want in self.fields.items():
            got = spec.get(name)
            if got is None:
                raise ValueError(f"put rejected: sample `{key}` is missing field `{name}` "
                                 f"({want.describe()}) of the {self.table} table schema")
            if got != want:
                raise ValueError(f"put rejected: sample `{key}` field `{name}` has dtype/shape "
                                 f"{got.describe()}, the {self.table} table schema says {want.describe()}")
        extra = sorted(set(spec) - set(self.fields))
        if extra:
            raise ValueError(f"put rejected: sample `{key}` has field `{extra[0]}` which is not in the "
                             f"{self.table} table schema {sorted(self.fields)}")

    def row_nbytes(self) -> int:
        """Bytes of one stored row over all fields."""
        return sum(int(np.dtype(f.dtype).itemsize * int(np.prod(f.shape, dtype=np.int64)))
                   for f in (self.fields or {}).values())

    def to_dict(self) -> dict | None:
        return None if self.fields is None else {k: v.to_list() for k, v in self.fields.items()}

    @classmethod
    def from_dict(cls, d: dict | None, *, table: str) -> "Schema":
        if d is None:
            return cls(table=table)
        return cls({k: FieldSpec.from_list(v) for k, v in d.items()}, table=table)
