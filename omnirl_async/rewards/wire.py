"""The reward service's wire format: msgpack messages (msgspec), never pickle.

``POST /score`` carries a :class:`ScoreRequest`: ``images`` is the raw
``uint8`` buffer of a C-ordered ``[B, H, W, 3]`` array of ``shape``,
``prompts`` its ``B`` prompts and ``rows`` (optional) the other fields of each
prompt's dataset row (``ground_truth``, metadata), passed on to the reward
function as :mod:`omnirl_async.rewards.adapters` describes. Answers:

* 200 :class:`ScoreResponse`: ``score`` (``B`` floats), ``extra`` (name ->
  ``B`` floats) and, when some samples failed on their own (a per-sample
  reward that raised on one image), ``reasons`` (``B`` entries, None where
  scored; the score there is NaN);
* 400 :class:`ErrorResponse` naming what is wrong with the request (an unknown
  or missing field, a shape that is not ``[B, H, W, 3]``, a byte count that does
  not match the shape, a prompt or row count that does not match ``B``, ``B``
  above the server's ``max_batch``);
* 401 when the server wants a bearer token and the request lacks the right one;
* 500 when the reward raised or returned something that is not a score.

``GET /health`` answers 200 ``{"status": "ok", "reward": name, ...}``.
msgpack and not JSON: images are bytes, and JSON would base64 them at ~20x
the cost (``/work/shared/PITFALLS.md``); pickle would let a server run code on
its clients.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np

__all__ = ["CONTENT_TYPE", "ScoreRequest", "ScoreResponse", "ErrorResponse", "BadRequest", "decode_request",
           "encode", "decode_response", "error_text"]

CONTENT_TYPE = "application/msgpack"


class ScoreRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Body of ``POST /score``; ``images`` is raw C-ordered ``uint8`` of ``shape``."""

    images: bytes
    shape: list[int]
    prompts: list[str]
    rows: list[dict[str, Any]] | None = None


class ScoreResponse(msgspec.Struct):
    """Answer of ``POST /score``: ``score``, each extra and ``reasons`` (if any) hold ``B`` entries."""

    score: list[float]
    extra: dict[str, list[float]] = {}
    reasons: list[str | None] | None = None


class ErrorResponse(msgspec.Struct):
    """Body of every non-200 answer."""

    error: str


_request_decoder = msgspec.msgpack.Decoder(ScoreRequest)
_response_decoder = msgspec.msgpack.Decoder(ScoreResponse)
_error_decoder = msgspec.msgpack.Decoder(ErrorResponse)
_encoder = msgspec.msgpack.Encoder()


def encode(message: Any) -> bytes:
    return _encoder.encode(message)


class BadRequest(Exception):
    """The request is malformed (HTTP 400)."""


def decode_request(body: bytes, max_batch: int) -> tuple[np.ndarray, list[str], list[dict] | None]:
    """Body -> ``(images uint8 [B,H,W,3] read-only, prompts, rows or None)``, or :class:`BadRequest`."""
    try:
        req = _request_decoder.decode(body)
    except msgspec.DecodeError as e:  # ValidationError is a subclass: names the field
        raise BadRequest(f"bad request body: {e}") from None
    shape = req.shape
    if len(shape) != 4 or shape[3] != 3 or shape[0] < 0 or shape[1] < 1 or shape[2] < 1:
        raise BadRequest(f"`shape` must be [B, H, W, 3] with B >= 0 and H, W >= 1, got {shape}")
    if shape[0] > max_batch:
        raise BadRequest(f"batch of {shape[0]} images exceeds this server's `max_batch` = {max_batch}; "
                         "send smaller batches")
    need = math.prod(shape)
    if len(req.images) != need:
        raise BadRequest(f"`images` holds {len(req.images)} bytes but `shape` {shape} needs {need} "
                         "(raw uint8, one byte per channel)")
    if len(req.prompts) != shape[0]:
        raise BadRequest(f"`prompts` has {len(req.prompts)} entries but `shape` says {shape[0]} images")
    if req.rows is not None and len(req.rows) != shape[0]:
        raise BadRequest(f"`rows` has {len(req.rows)} entries but `shape` says {shape[0]} images")
    images = np.frombuffer(req.images, dtype=np.uint8).reshape(shape)  # read-only view of the body
    return images, req.prompts, req.rows


def decode_response(payload: bytes) -> ScoreResponse:
    return _response_decoder.decode(payload)


def error_text(status: int, payload: bytes) -> str:
    """The server's error message, or a description of a body that is not one."""
    try:
        return _error_decoder.decode(payload).error
    except msgspec.DecodeError:
        return f"HTTP {status} with a body that is not an error message ({payload[:200]!r})"
