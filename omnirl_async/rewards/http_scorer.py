"""``http_scorer``: a reward computed by a scoring service over HTTP.

Some reward models live in their own process (a GPU-hungry VLM judge, a model
served by another team) or the benchmark wants a deliberately slow scorer.
The service side is :class:`~omnirl_async.rewards.server.RewardServer`
(``omnirl-async serve-reward``; :class:`ScorerServer` is the same class under
its older name); this module is the client, registered as the reward
``"http_scorer"`` that the :class:`~omnirl_async.rewards.manager.RewardManager`
calls. Wire format: :mod:`omnirl_async.rewards.wire` (msgpack, never pickle).

Serving::

    omnirl-async serve-reward --reward tiny_geneval --port 8000
    python -m omnirl_async.rewards.http_scorer --reward tiny_geneval --port 8000 --delay 0.2   # the same

Using it in training
--------------------
The manager calls every reward function with ``reward.reward_kwargs`` merged
under the entry's own ``kwargs``, so the URL can come from either place::

    # as one named component (can be mixed with others, weighted)
    'reward.reward_functions={http: {name: http_scorer, weight: 1.0, kwargs: {url: "http://127.0.0.1:8000"}}}'

    # as the single reward; note the `+`: `reward_kwargs` starts empty, and
    # Hydra only adds a new key to it with `+`
    reward.reward_fn_name=http_scorer +reward.reward_kwargs.url=http://127.0.0.1:8000

``timeout``, ``retries``, ``backoff`` and ``token_env`` are set the same way
(``kwargs: {url: ..., timeout: 60}`` or ``+reward.reward_kwargs.timeout=60``).
The other fields of each prompt's dataset row (``ground_truth``, metadata)
travel with the images as ``rows``, and the server passes them on to its
reward function.

Bearer token: when the environment variable ``token_env`` (default
``OMNIRL_REWARD_TOKEN``) is set where the client runs, every request carries
``Authorization: Bearer <its value>``. A token is not a config value on
purpose: the resolved config is saved beside the checkpoints. (On a Ray
cluster you started yourself, give the workers the variable through
``ray_kwargs.runtime_env.env_vars`` or the nodes' environment.)

Failures
--------
Connection errors, timeouts and 502/503/504 answers are retried ``retries``
times, sleeping ``backoff · 2^k`` seconds in between; then the client raises
``RuntimeError`` naming the URL and the last error. A 400, 401 or 500 is not
retried (the same request would fail the same way) and raises at once with
the server's message. The manager turns the exception into a failed batch
whose reason is that message, so nothing is trained on a made-up score.
Samples the server reports as failed on their own (``reasons``) fail alone.

Client kwargs are not forwarded to the server: ``reward_kwargs`` go to every
reward function, so forwarding them would leak unrelated keys into the
scorer. The server's own reward options are fixed when it is started
(``--kwargs``).
"""

from __future__ import annotations

import http.client
import os
import sys
import time
import urllib.parse
from typing import Any, Sequence

import msgspec
import numpy as np

from omnirl_async.rewards.base import ScoredSamples, register_reward
from omnirl_async.rewards.server import DEFAULT_TOKEN_ENV, RewardServer
from omnirl_async.rewards.wire import CONTENT_TYPE, ScoreRequest, decode_response, encode, error_text

__all__ = ["ScorerServer", "http_scorer", "main"]

_RETRY_STATUSES = (502, 503, 504)

#: The server class under the name benchmarks and older code use.
ScorerServer = RewardServer


def _score_endpoint(url: str) -> tuple[str, str, int | None, str]:
    """``url`` → ``(scheme, host, port, path of /score)``; ``/score`` is appended unless present."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"`url` must look like 'http://host:port', got {url!r}")
    path = parts.path.rstrip("/")
    if not path.endswith("/score"):
        path += "/score"
    return parts.scheme, parts.hostname, parts.port, path


def _post(scheme: str, host: str, port: int | None, path: str, body: bytes, timeout: float,
          headers: dict[str, str]) -> tuple[int, bytes]:
    """One attempt, the whole of it (connect, send, the answer to its last byte) within ``timeout`` seconds: a
    socket's own timeout bounds each read alone, and a server dripping its answer would stretch it without end."""
    deadline = time.monotonic() + timeout
    conn_cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(host, port, timeout=timeout)
    try:
        return _exchange(conn, path, body, headers, deadline)
    except TimeoutError:  # the socket's own, or the deadline's: one message
        raise TimeoutError(f"no complete answer within {timeout:g} s") from None
    finally:
        conn.close()


def _exchange(conn, path: str, body: bytes, headers: dict[str, str], deadline: float) -> tuple[int, bytes]:
    conn.request("POST", path, body=body, headers={"Content-Type": CONTENT_TYPE, **headers})
    _time_left(conn, deadline)
    resp = conn.getresponse()
    chunks = []
    while True:  # read1: at most one read of the socket each, so the deadline is checked between them
        _time_left(conn, deadline)
        chunk = resp.read1(1 << 16)
        if not chunk:
            return resp.status, b"".join(chunks)
        chunks.append(chunk)


def _time_left(conn, deadline: float) -> None:
    """The socket's timeout cut to what is left of the attempt; none left: ``TimeoutError`` (:func:`_post` words
    it; retried)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    if conn.sock is not None:
        conn.sock.settimeout(left)


@register_reward("http_scorer")
def http_scorer(
    images: np.ndarray,
    prompts: Sequence[str],
    *,
    url: str | None = None,
    timeout: float = 30.0,
    retries: int = 2,
    backoff: float = 0.5,
    token_env: str = DEFAULT_TOKEN_ENV,
    rows: Sequence[dict | None] | None = None,
    **_unused: Any,
) -> dict[str, np.ndarray] | ScoredSamples:
    """Score ``images`` by ``POST``-ing them to a reward server at ``url``.

    Returns ``{"score": float64[B], **extras}`` as the server sent them (a
    :class:`ScoredSamples` when the server reports samples that failed on
    their own). ``timeout`` (seconds) bounds each attempt; network errors are
    retried ``retries`` times with ``backoff · 2^k`` s between attempts, then
    raise ``RuntimeError`` naming ``url`` and the last error. ``rows`` (the
    prompt rows' other fields) go to the server with the images. Other keyword
    arguments (``reward_kwargs`` meant for other rewards) are ignored.
    """
    # 1. check the arguments; a missing URL is a config mistake, say which key fixes it.
    if not url:
        raise ValueError("`url` is not set for `http_scorer`; set `reward.reward_functions.<name>.kwargs.url` "
                         "or `+reward.reward_kwargs.url=http://host:port`")
    scheme, host, port, path = _score_endpoint(str(url))
    if not (isinstance(retries, int) and retries >= 0):
        raise ValueError(f"`retries` must be an int >= 0, got {retries!r}")
    timeout, backoff = float(timeout), float(backoff)
    if not (timeout > 0 and backoff >= 0):
        raise ValueError(f"`timeout` must be > 0 and `backoff` >= 0 (seconds), got {timeout!r} and {backoff!r}")
    images = np.ascontiguousarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"`images` must be uint8 [B, H, W, 3], got {images.dtype} {tuple(images.shape)}")
    prompts = [str(p) for p in prompts]
    wire_rows = [dict(r or {}) for r in rows] if rows is not None and any(rows) else None
    try:
        body = encode(ScoreRequest(images.tobytes(), list(images.shape), prompts, wire_rows))
    except (TypeError, msgspec.EncodeError) as e:
        raise ValueError(f"the prompt rows' fields cannot be sent as msgpack ({e}); keep row values to strings, "
                         "numbers, lists and objects") from None
    token = os.environ.get(token_env) if token_env else None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    target = str(url).rstrip("/")
    target = target if target.endswith("/score") else target + "/score"  # named in every error

    # 2. post, retrying what may go away by itself.
    last_error = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        try:
            status, payload = _post(scheme, host, port, path, body, timeout, headers)
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timeout, DNS, bad status line
            last_error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            continue
        if status in _RETRY_STATUSES:
            last_error = f"HTTP {status}: {error_text(status, payload)}"
            continue
        if status == 401 and not token:
            raise RuntimeError(f"reward server {target} answered HTTP 401: {error_text(status, payload)} "
                               f"(${token_env} is not set in this process)")
        if status != 200:
            raise RuntimeError(f"reward server {target} answered HTTP {status}: {error_text(status, payload)}")
        break
    else:
        raise RuntimeError(f"reward server {target} could not be reached after {retries + 1} attempt(s) "
                           f"(timeout {timeout:g} s each); last error: {last_error}")

    # 3. decode and check the answer.
    try:
        resp = decode_response(payload)
    except msgspec.DecodeError as e:
        raise RuntimeError(f"reward server {target} sent a response that is not a score: {e}") from None
    out = {"score": np.asarray(resp.score, dtype=np.float64)}
    for key, value in resp.extra.items():
        out[key] = np.asarray(value, dtype=np.float64)
    for key, value in out.items():
        if value.shape != (len(prompts),):
            raise RuntimeError(f"reward server {target} sent {value.shape[0]} values for {key!r} "
                               f"but was asked to score {len(prompts)} images")
    if resp.reasons is not None:
        if len(resp.reasons) != len(prompts):
            raise RuntimeError(f"reward server {target} sent {len(resp.reasons)} reasons for {len(prompts)} images")
        score = out.pop("score")
        return ScoredSamples(score=score, reasons=list(resp.reasons), extra=out)
    return out


# ----------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m omnirl_async.rewards.http_scorer``: the same as ``omnirl-async serve-reward``."""
    from omnirl_async.rewards.server import main as serve

    return serve(argv)


if __name__ == "__main__":
    # `python -m` runs this file a second time as `__main__` (runpy warns about it, since the
    # package import registered the reward already); serve with the one registered module.
    from omnirl_async.rewards.http_scorer import main as _main

    sys.exit(_main())
