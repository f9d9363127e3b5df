"""How the reward layer calls a reward function: row fields as keyword arguments, per-sample functions batched.

Row fields
----------
A prompt dataset row (``data.train_files``: JSONL, Parquet, a ``datasets``
folder) holds the prompt and any other fields: ``ground_truth``,
``data_source``, metadata. They travel with the prompt's lease to the rollout
worker (or the reward worker pool) and reach the reward as ``rows``, one dict
per image. :func:`call_reward` hands them to a batched function

* as keyword arguments, one per field, each a list of ``B`` values (``None``
  where a row lacks the field): the fields the function names as parameters,
  or every field when it takes ``**kwargs``. A function written before rows
  existed, ``fn(images, prompts)``, gets none and works as before;
* or, when the function has a ``rows`` parameter, as ``rows=`` (``B`` dicts),
  and no field one by one. A scorer that forwards fields (the HTTP client)
  uses that.

Fields named ``images``, ``prompts`` or ``rows`` reach a function only through
``rows``. A field with the same name as a configured keyword argument
(``reward.reward_kwargs`` or the entry's ``kwargs``) that the function would
receive makes the call fail with a reason naming both: neither the config nor
the data silently wins.

Why by signature rather than always passing ``**fields``: built-in rewards
take ``**_`` and ignore what they do not know, but a user's
``def score(images, prompts)`` would raise ``TypeError`` on the first dataset
with a ``category`` column.

Per-sample functions (verl's ``compute_score``)
-----------------------------------------------
verl scores one sample at a time::

    def compute_score(data_source, solution_str, ground_truth, extra_info=None): ...

For images the solution is the image, so a function with a
``solution_image`` parameter is recognised as per-sample
(:func:`is_per_sample`) and wrapped in :class:`PerSampleReward`, which calls
it once per image, by keyword as verl does:

* ``data_source`` - the row's ``data_source`` (None when absent);
* ``solution_image`` - ``uint8 [H, W, 3]`` RGB (numpy, read-only);
* ``ground_truth`` - the row's ``ground_truth``, else
  ``row["reward_model"]["ground_truth"]`` (verl's Parquet layout), else None;
* ``extra_info`` - a dict: the row's ``extra_info`` (when it is a dict), plus
  ``prompt`` and the row's other fields where ``extra_info`` lacks them;
* any configured keyword argument the function accepts.

Only the parameters the function has are passed. It returns a number, or a
dict with a number ``"score"`` (verl's form; other numeric entries are logged
as extras, NaN where a sample lacks them). A sample whose call raised or
returned anything else fails alone, with the reason; the others are scored.
The calls run one after another in the calling thread, as in verl's naive
reward manager; a scorer that waits on a network should batch itself (the
OpenAI-compatible judge, :mod:`omnirl_async.rewards.judge`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import numpy as np

from omnirl_async.rewards.base import ScoredSamples

__all__ = ["RESERVED_FIELDS", "PER_SAMPLE_PARAMS", "is_per_sample", "row_kwargs", "call_reward",
           "PerSampleReward", "per_sample_arguments"]

#: Row fields that are never passed one by one (they name the call's own arguments).
RESERVED_FIELDS = ("images", "prompts", "rows")
#: verl's per-sample parameters, with ``solution_image`` in place of ``solution_str``.
PER_SAMPLE_PARAMS = ("data_source", "solution_image", "ground_truth", "extra_info")


def _params(fn: Callable) -> tuple[frozenset[str], bool]:
    """``(names that can be passed by keyword, takes **kwargs)``; a callable without a signature takes neither."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return frozenset(), False
    names = {p.name for p in sig.parameters.values()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    return frozenset(names), var_kw


def is_per_sample(fn: Callable) -> bool:
    """A verl-style per-sample function: it has a ``solution_image`` parameter."""
    return not isinstance(fn, PerSampleReward) and "solution_image" in _params(fn)[0]


def row_kwargs(rows: Sequence[Mapping[str, Any] | None]) -> dict[str, list]:
    """``B`` row dicts -> ``{field: [B values]}`` (fields in order of first appearance; None where missing)."""
    keys: dict[str, None] = {}
    for row in rows:
        for key in row or ():
            keys.setdefault(str(key), None)
    return {key: [(row or {}).get(key) for row in rows] for key in keys}


def call_reward(fn: Callable, images: np.ndarray, prompts: list[str], kwargs: Mapping[str, Any],
                rows: Sequence[Mapping[str, Any] | None] | None = None) -> Any:
    """Call a reward function with the configured ``kwargs`` and the rows' fields it takes (module docstring)."""
    if isinstance(fn, PerSampleReward):
        return fn(images, prompts, rows=rows, **kwargs)
    names, var_kw = _params(fn)
    call_kwargs = dict(kwargs)
    if rows is not None and any(rows):
        if "rows" in names:
            call_kwargs["rows"] = [dict(r or {}) for r in rows]
        else:
            for key, values in row_kwargs(rows).items():
                if key in RESERVED_FIELDS or not (var_kw or key in names):
                    continue
                if key in kwargs:
                    raise ValueError(f"the prompt rows' field {key!r} has the name of a configured keyword argument "
                                     f"({key}={kwargs[key]!r} from `reward.reward_kwargs` or the entry's `kwargs`); "
                                     "rename the column or the argument")
                call_kwargs[key] = values
    return fn(images, prompts, **call_kwargs)


def per_sample_arguments(row: Mapping[str, Any] | None, prompt: str) -> dict[str, Any]:
    """verl's ``data_source``, ``ground_truth`` and ``extra_info`` for one row (see the module docstring)."""
    row = dict(row or {})
    ground_truth = row.get("ground_truth")
    reward_model = row.get("reward_model")
    if "ground_truth" not in row and isinstance(reward_model, Mapping):
        ground_truth = reward_model.get("ground_truth")
    info = dict(row["extra_info"]) if isinstance(row.get("extra_info"), Mapping) else {}
    info.setdefault("prompt", prompt)
    for key, value in row.items():
        if key not in ("data_source", "ground_truth", "reward_model", "extra_info"):
            info.setdefault(key, value)
    return {"data_source": row.get("data_source"), "ground_truth": ground_truth, "extra_info": info}


def _number(value: Any) -> float | None:
    if isinstance(value, (bool, int, float, np.integer, np.floating)):
        return float(value)
    if isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind in "biuf":
        return float(value)
    return None


class PerSampleReward:
    """A per-sample ``compute_score`` made into a batched reward function (module docstring).

    Examples:
        >>> def compute_score(data_source, solution_image, ground_truth, extra_info=None):
        ...     return float(solution_image.mean() / 255 > 0.5) == ground_truth
        >>> fn = PerSampleReward(compute_score, "mine")
        >>> out = fn(np.zeros((2, 4, 4, 3), np.uint8), ["a", "b"], rows=[{"ground_truth": 0.0}, {}])
        >>> out.score.tolist(), out.reasons
        ([1.0, 0.0], [None, None])
    """

    def __init__(self, fn: Callable, name: str):
        if not callable(fn):
            raise ValueError(f"`fn` of reward {name!r} must be callable, got {fn!r}")
        self.fn, self.name = fn, name
        self._names, self._var_kw = _params(fn)

    def _takes(self, key: str) -> bool:
        return self._var_kw or key in self._names

    def __call__(self, images: np.ndarray, prompts: Sequence[str], *, rows=None, **kwargs: Any) -> ScoredSamples:
        batch = len(prompts)
        config = {k: v for k, v in kwargs.items() if k not in PER_SAMPLE_PARAMS and self._takes(k)}
        score = np.full(batch, np.nan, np.float64)
        reasons: list[str | None] = [None] * batch
        extras: dict[str, np.ndarray] = {}
        for i in range(batch):
            args = per_sample_arguments(rows[i] if rows else None, prompts[i])
            args = {k: v for k, v in args.items() if self._takes(k)}
            try:
                out = self.fn(solution_image=images[i], **args, **config)
            except Exception as e:  # noqa: BLE001 - one sample's failure is that sample's, the rest are scored
                reasons[i] = f"reward `{self.name}` raised {type(e).__name__}: {e} (sample {i})"
                continue
            value = _number(out["score"] if isinstance(out, Mapping) and "score" in out else out)
            if value is None:
                what = (f"a dict without 'score' (keys: {sorted(map(str, out))})" if isinstance(out, Mapping)
                        else f"a {type(out).__name__}")
                reasons[i] = (f"reward `{self.name}` returned {what} for sample {i}; a per-sample reward returns a "
                              "number or a dict with a number 'score'")
                continue
            if not math.isfinite(value):
                reasons[i] = f"reward `{self.name}` returned {value} for this sample"
                continue
            score[i] = value
            if isinstance(out, Mapping):
                for key, extra in out.items():
                    number = _number(extra)
                    if key != "score" and number is not None:
                        extras.setdefault(str(key), np.full(batch, np.nan, np.float32))[i] = number
        return ScoredSamples(score=score, reasons=reasons, extra=extras)

    def __repr__(self) -> str:
        return f"PerSampleReward({self.name!r}, {getattr(self.fn, '__qualname__', self.fn)!r})"
