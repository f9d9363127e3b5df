"""``http_scorer``: a reward computed by a scoring service over HTTP.

Some reward models live in their own process (a GPU-hungry VLM judge, a model
served by another team) or the benchmark wants a deliberately slow scorer.
This module has both ends of that wire:

* :class:`ScorerServer` wraps any reward function (registry name or callable)
  in a small threaded HTTP server;
* :func:`http_scorer`, registered as the reward ``"http_scorer"``, is the
  client the :class:`~omnirl_async.rewards.manager.RewardManager` calls.

Wire format (msgpack via msgspec; never pickle, so a server cannot run code on
the client and the other way round)
-----------------------------------------------------------------------------
``POST /score`` with body ``{"images": bytes, "shape": [B, H, W, 3],
"prompts": [str] * B}``, where ``images`` is the raw ``uint8`` buffer of a
C-ordered ``[B, H, W, 3]`` array. Answers:

* 200 ``{"score": [float] * B, "extra": {name: [float] * B}}``;
* 400 ``{"error": ...}`` naming what is wrong with the request (an unknown or
  missing field, a shape that is not ``[B, H, W, 3]``, a byte count that does
  not match the shape, a prompt count that does not match ``B``, ``B`` above
  ``max_batch``);
* 500 ``{"error": ...}`` with the exception when the reward raised or returned
  something that is not ``float[B]`` / ``{"score": float[B], ...}``.

``GET /health`` answers 200 ``{"status": "ok", "reward": name}``.

Serving::

    python -m omnirl_async.rewards.http_scorer --reward tiny_geneval --port 8000 --delay 0.2

``--delay`` (``delay_s``) sleeps that long in every request before scoring: a
stand-in for a slow model (the slow-scorer benchmark uses 0.2 s). Requests are
served concurrently, one thread each (``ThreadingHTTPServer``), so the reward
function must be thread-safe; the built-ins are. The server does not batch
requests together: a real model server would, but the point here is a
latency that overlaps across rollout workers, not throughput.

Using it in training
--------------------
The manager calls every reward function with ``reward.reward_kwargs`` merged
under the entry's own ``kwargs``, so the URL can come from either place::

    # as one named component (can be mixed with others, weighted)
    'reward.reward_functions={http: {name: http_scorer, weight: 1.0, kwargs: {url: "http://127.0.0.1:8000"}}}'

    # as the single reward; note the `+`: `reward_kwargs` starts empty, and
    # Hydra only adds a new key to it with `+`
    reward.reward_fn_name=http_scorer +reward.reward_kwargs.url=http://127.0.0.1:8000

``timeout``, ``retries`` and ``backoff`` are set the same way
(``kwargs: {url: ..., timeout: 60}`` or ``+reward.reward_kwargs.timeout=60``).

Failures
--------
Connection errors, timeouts and 502/503/504 answers are retried ``retries``
times, sleeping ``backoff · 2^k`` seconds in between; then the client raises
``RuntimeError`` naming the URL and the last error. A 400 or 500 is not
retried (the same request would fail the same way) and raises at once with
the server's message. The manager turns the exception into a failed batch
whose reason is that message, so nothing is trained on a made-up score.

Client kwargs are not forwarded to the server: ``reward_kwargs`` go to every
reward function, so forwarding them would leak unrelated keys into the
scorer. The server's own reward options are fixed when it is started
(``ScorerServer(..., reward_kwargs=...)``).
"""

from __future__ import annotations

import argparse
import http.client
import logging
import math
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Mapping, Sequence

import msgspec
import numpy as np

from omnirl_async.rewards.base import get_reward_fn, register_reward
from omnirl_async.rewards.manager import _normalize

__all__ = ["ScoreRequest", "ScoreResponse", "ErrorResponse", "ScorerServer", "http_scorer", "main"]

logger = logging.getLogger(__name__)

_CONTENT_TYPE = "application/msgpack"
_RETRY_STATUSES = (502, 503, 504)


# ------------------------------------------------------------------ messages
class ScoreRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Body of ``POST /score``; ``images`` is raw C-ordered ``uint8`` of ``shape``."""

    images: bytes
    shape: list[int]
    prompts: list[str]


class ScoreResponse(msgspec.Struct):
    """Answer of ``POST /score``: ``score`` and each extra hold ``B`` floats."""

    score: list[float]
    extra: dict[str, list[float]] = {}


class ErrorResponse(msgspec.Struct):
    """Body of every non-200 answer."""

    error: str


_request_decoder = msgspec.msgpack.Decoder(ScoreRequest)
_response_decoder = msgspec.msgpack.Decoder(ScoreResponse)
_error_decoder = msgspec.msgpack.Decoder(ErrorResponse)
_encoder = msgspec.msgpack.Encoder()


class _BadRequest(Exception):
    """The request is malformed (HTTP 400)."""


def _decode_request(body: bytes, max_batch: int) -> tuple[np.ndarray, list[str]]:
    """Body → ``(images uint8 [B,H,W,3] read-only, prompts)``, or :class:`_BadRequest`."""
    try:
        req = _request_decoder.decode(body)
    except msgspec.DecodeError as e:  # ValidationError is a subclass: names the field
        raise _BadRequest(f"bad request body: {e}") from None
    shape = req.shape
    if len(shape) != 4 or shape[3] != 3 or shape[0] < 0 or shape[1] < 1 or shape[2] < 1:
        raise _BadRequest(f"`shape` must be [B, H, W, 3] with B >= 0 and H, W >= 1, got {shape}")
    if shape[0] > max_batch:
        raise _BadRequest(f"batch of {shape[0]} images exceeds this server's `max_batch` = {max_batch}; "
                          "send smaller batches")
    need = math.prod(shape)
    if len(req.images) != need:
        raise _BadRequest(f"`images` holds {len(req.images)} bytes but `shape` {shape} needs {need} "
                          "(raw uint8, one byte per channel)")
    if len(req.prompts) != shape[0]:
        raise _BadRequest(f"`prompts` has {len(req.prompts)} entries but `shape` says {shape[0]} images")
    images = np.frombuffer(req.images, dtype=np.uint8).reshape(shape)  # read-only view of the body
    return images, req.prompts


# -------------------------------------------------------------------- server
class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so a client may reuse its connection
    server: "_Server"

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        if self.path.rstrip("/") != "/health":
            self._send(404, ErrorResponse(f"no such endpoint {self.path!r}; use POST /score or GET /health"))
            return
        self._send(200, {"status": "ok", "reward": self.server.owner.reward_name})

    def do_POST(self) -> None:  # noqa: N802
        # 1. read the whole body first, so the connection stays usable whatever happens next.
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._send(411, ErrorResponse(f"`Content-Length` header is required, got {length!r}"))
            self.close_connection = True
            return
        body = self.rfile.read(int(length))
        if self.path.rstrip("/") != "/score":
            self._send(404, ErrorResponse(f"no such endpoint {self.path!r}; use POST /score or GET /health"))
            return
        owner = self.server.owner
        # 2. validate.
        try:
            images, prompts = _decode_request(body, owner.max_batch)
        except _BadRequest as e:
            self._send(400, ErrorResponse(str(e)))
            return
        # 3. the simulated model latency, then the reward itself.
        if owner.delay_s > 0:
            time.sleep(owner.delay_s)
        try:
            out = owner.reward_fn(images, prompts, **owner.reward_kwargs)
            score, extra, problem = _normalize(out, len(prompts), owner.reward_name)
        except Exception as e:  # noqa: BLE001 - reported to the client, the server keeps serving
            logger.warning("reward %r raised %s: %s", owner.reward_name, type(e).__name__, e)
            self._send(500, ErrorResponse(f"reward `{owner.reward_name}` raised {type(e).__name__}: {e}"))
            return
        if problem is not None:
            self._send(500, ErrorResponse(problem))
            return
        self._send(200, ScoreResponse(score.tolist(), {k: v.tolist() for k, v in extra.items()}))

    def _send(self, status: int, message: Any) -> None:
        payload = _encoder.encode(message)
        self.send_response(status)
        self.send_header("Content-Type", _CONTENT_TYPE)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base-class signature
        logger.debug("%s - %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # idle keep-alive connections must not block stop()
    owner: "ScorerServer"


class ScorerServer:
    """Serve a reward function over HTTP (see the module docstring for the protocol).

    Args:
        reward_fn_name_or_callable: a registered reward name (``"tiny_geneval"``)
            or a reward function.
        host, port: where to listen; ``port=0`` picks a free port (read it from
            the URL that :meth:`start` returns).
        delay_s: seconds each ``/score`` request sleeps before scoring, to
            simulate a slow model.
        max_batch: largest ``B`` accepted; bigger batches get a 400.
        reward_kwargs: keyword arguments for every call of the reward.

    Examples:
        >>> import numpy as np
        >>> with ScorerServer("brightness") as server:
        ...     out = http_scorer(np.full((2, 4, 4, 3), 255, np.uint8), ["a", "b"], url=server.url)
        >>> out["score"].tolist()
        [1.0, 1.0]
    """

    def __init__(
        self,
        reward_fn_name_or_callable: str | Callable,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        delay_s: float = 0.0,
        max_batch: int = 256,
        reward_kwargs: Mapping[str, Any] | None = None,
    ):
        fn = reward_fn_name_or_callable
        if isinstance(fn, str):
            self.reward_name, self.reward_fn = fn, get_reward_fn(fn)
        elif callable(fn):
            self.reward_name, self.reward_fn = getattr(fn, "__name__", type(fn).__name__), fn
        else:
            raise ValueError("`reward_fn_name_or_callable` must be a registered reward name or a callable, "
                             f"got {fn!r}")
        if not (isinstance(port, int) and 0 <= port <= 65535):
            raise ValueError(f"`port` must be an int in [0, 65535] (0 = any free port), got {port!r}")
        if not (math.isfinite(float(delay_s)) and float(delay_s) >= 0):
            raise ValueError(f"`delay_s` must be a finite number >= 0, got {delay_s!r}")
        if not (isinstance(max_batch, int) and max_batch >= 1):
            raise ValueError(f"`max_batch` must be an int >= 1, got {max_batch!r}")
        self.host, self.port = host, port
        self.delay_s = float(delay_s)
        self.max_batch = max_batch
        self.reward_kwargs = dict(reward_kwargs or {})
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        if self._httpd is None:
            raise RuntimeError("the server is not running; call `start()` first")
        host, port = self._httpd.server_address[:2]
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{port}"

    def _bind(self) -> None:
        if self._httpd is not None:
            raise RuntimeError(f"the server is already running at {self.url}")
        self._httpd = _Server((self.host, self.port), _Handler)
        self._httpd.owner = self

    def start(self) -> str:
        """Listen and serve in a background daemon thread; returns the URL."""
        self._bind()
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"ScorerServer[{self.url}]", daemon=True)
        self._thread.start()
        return self.url

    def stop(self) -> None:
        """Stop serving and close the socket; a no-op when not running."""
        httpd, thread = self._httpd, self._thread
        self._httpd, self._thread = None, None
        if httpd is None:
            return
        if thread is not None:  # shutdown() waits for serve_forever, so only call it when one runs
            httpd.shutdown()
            thread.join()
        httpd.server_close()

    def __enter__(self) -> "ScorerServer":
        if self._httpd is None:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.url if self._httpd is not None else "stopped"
        return f"ScorerServer({self.reward_name!r}, {where}, delay_s={self.delay_s:g}, max_batch={self.max_batch})"


# -------------------------------------------------------------------- client
def _score_endpoint(url: str) -> tuple[str, str, int | None, str]:
    """``url`` → ``(scheme, host, port, path of /score)``; ``/score`` is appended unless present."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"`url` must look like 'http://host:port', got {url!r}")
    path = parts.path.rstrip("/")
    if not path.endswith("/score"):
        path += "/score"
    return parts.scheme, parts.hostname, parts.port, path


def _post(scheme: str, host: str, port: int | None, path: str, body: bytes, timeout: float) -> tuple[int, bytes]:
    conn_cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(host, port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": _CONTENT_TYPE})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _error_text(status: int, payload: bytes) -> str:
    try:
        return _error_decoder.decode(payload).error
    except msgspec.DecodeError:
        return f"HTTP {status} with a body that is not an error message ({payload[:200]!r})"


@register_reward("http_scorer")
def http_scorer(
    images: np.ndarray,
    prompts: Sequence[str],
    *,
    url: str | None = None,
    timeout: float = 30.0,
    retries: int = 2,
    backoff: float = 0.5,
    **_unused: Any,
) -> dict[str, np.ndarray]:
    """Score ``images`` by ``POST``-ing them to a :class:`ScorerServer` at ``url``.

    Returns ``{"score": float64[B], **extras}`` as the server sent them.
    ``timeout`` (seconds) bounds each attempt; network errors are retried
    ``retries`` times with ``backoff · 2^k`` s between attempts, then raise
    ``RuntimeError`` naming ``url`` and the last error. Other keyword
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
    body = _encoder.encode(ScoreRequest(images.tobytes(), list(images.shape), prompts))
    target = str(url).rstrip("/")
    target = target if target.endswith("/score") else target + "/score"  # named in every error

    # 2. post, retrying what may go away by itself.
    last_error = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        try:
            status, payload = _post(scheme, host, port, path, body, timeout)
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timeout, DNS, bad status line
            last_error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            continue
        if status in _RETRY_STATUSES:
            last_error = f"HTTP {status}: {_error_text(status, payload)}"
            continue
        if status != 200:
            raise RuntimeError(f"reward server {target} answered HTTP {status}: {_error_text(status, payload)}")
        break
    else:
        raise RuntimeError(f"reward server {target} could not be reached after {retries + 1} attempt(s) "
                           f"(timeout {timeout:g} s each); last error: {last_error}")

    # 3. decode and check the answer.
    try:
        resp = _response_decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise RuntimeError(f"reward server {target} sent a response that is not a score: {e}") from None
    out = {"score": np.asarray(resp.score, dtype=np.float64)}
    for key, value in resp.extra.items():
        out[key] = np.asarray(value, dtype=np.float64)
    for key, value in out.items():
        if value.shape != (len(prompts),):
            raise RuntimeError(f"reward server {target} sent {value.shape[0]} values for {key!r} "
                               f"but was asked to score {len(prompts)} images")
    return out


# ----------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m omnirl_async.rewards.http_scorer``: serve a reward in the foreground."""
    parser = argparse.ArgumentParser(prog="python -m omnirl_async.rewards.http_scorer",
                                     description="Serve a reward function over HTTP (POST /score, GET /health).")
    parser.add_argument("--reward", default="tiny_geneval",
                        help="registered reward name, or the function name inside --path")
    parser.add_argument("--path", default=None, help="Python file defining --reward (default: the registry)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 = any free port")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds each request sleeps (slow-model stand-in)")
    parser.add_argument("--max-batch", type=int, default=256)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    fn: str | Callable = args.reward
    if args.path is not None:
        from omnirl_async.rewards.custom import load_custom_reward_fn

        fn = load_custom_reward_fn(args.path, args.reward, key="--path")
    try:
        server = ScorerServer(fn, host=args.host, port=args.port, delay_s=args.delay, max_batch=args.max_batch)
    except (ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    server._bind()  # bind before printing, so the URL carries the real port (for --port 0)
    print(f"serving reward {server.reward_name!r} at {server.url} (delay {server.delay_s:g} s); Ctrl-C stops",
          flush=True)
    try:
        server._httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    # `python -m` runs this file a second time as `__main__` (runpy warns about it, since the
    # package import registered the reward already); serve with the one registered module.
    from omnirl_async.rewards.http_scorer import main as _main

    sys.exit(_main())
