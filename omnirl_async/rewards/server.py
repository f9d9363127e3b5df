"""Host any reward function as an HTTP service: ``omnirl-async serve-reward``.

A reward model that needs its own machine or GPU (a VLM judge, a model of
another team) runs as a service; training reaches it with the ``http_scorer``
reward (:mod:`omnirl_async.rewards.http_scorer`). :class:`RewardServer` serves
a registered reward, a function from a user file (per-sample ``compute_score``
functions included) or any callable, on aiohttp (an established asyncio web
framework that Ray's own dashboard runs on, so it is installed with
``ray[default]``).

Endpoints (wire format: :mod:`omnirl_async.rewards.wire`)
---------------------------------------------------------
* ``POST /score`` - score ``B`` images; the answer holds ``B`` scores.
* ``GET /health`` - ``{"status": "ok", "reward": name, "max_batch": ...,
  "requests": ..., "batches": ..., "images": ...}``; needs no token, so a load
  balancer can probe it.

Batching
--------
Requests are not scored one by one: a batcher waits ``batch_wait_s`` after the
first queued request for more, then scores up to ``max_batch`` images of the
queued requests (same image size) in **one** call of the reward function, and
splits the answer back. ``max_concurrency`` batches run at once, each in a
thread of its own, so the event loop keeps answering ``/health`` while a model
runs. With eight rollout workers sending a group of 4 each, a GPU judge sees
batches of 32 instead of 8 calls of 4. ``delay_s`` sleeps before every batch:
a stand-in for a slow model in benchmarks.

Bearer token
------------
With ``token`` set (``serve-reward`` reads it from the environment variable
``--token-env``, default ``OMNIRL_REWARD_TOKEN``, so that it appears neither
in ``ps`` nor in a saved config), ``/score`` answers 401 unless the request
carries ``Authorization: Bearer <token>`` (compared in constant time). The
client reads the same variable (``http_scorer``'s ``token_env``). Without a
token anyone who can reach the port can score; the server says so at start
when it listens beyond loopback.

Why a batcher in front of the reward and not one request per call: a model
server's throughput comes from batching (a forward of 32 images costs little
more than one of 4), and the rollout workers each send small groups.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import math
import os
import sys
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from omnirl_async.rewards.adapters import PerSampleReward, call_reward, is_per_sample
from omnirl_async.rewards.base import ScoredSamples, get_reward_fn
from omnirl_async.rewards.manager import _normalize
from omnirl_async.rewards.wire import CONTENT_TYPE, BadRequest, ErrorResponse, ScoreResponse, decode_request, encode

__all__ = ["RewardServer", "BackgroundApp", "ManagerReward", "DEFAULT_TOKEN_ENV", "add_serve_arguments",
           "build_parser", "reward_from_args", "serve", "main"]

logger = logging.getLogger(__name__)

#: The environment variable that holds the bearer token, on the server and in the client.
DEFAULT_TOKEN_ENV = "OMNIRL_REWARD_TOKEN"


# ------------------------------------------------------------------------ an app in a thread
class BackgroundApp:
    """Run an aiohttp ``web.Application`` on its own event loop in a daemon thread.

    ``start()`` returns ``http://host:port`` (``port=0`` picks a free port);
    ``stop()`` closes the site and the loop, giving requests still running
    ``shutdown_timeout`` seconds to finish. Tests use it for stand-in
    servers; :class:`RewardServer` runs on it.
    """

    def __init__(self, app_factory: Callable[[], Any], *, host: str = "127.0.0.1", port: int = 0,
                 name: str = "http", shutdown_timeout: float = 2.0):
        self.app_factory, self.host, self.port, self.name = app_factory, host, port, name
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner = None
        self.url: str | None = None

    def start(self, timeout: float = 30.0) -> str:
        if self._loop is not None:
            raise RuntimeError(f"{self.name} is already running at {self.url}")
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name=f"{self.name}-loop", daemon=True)
        self._thread.start()
        try:
            self.url = asyncio.run_coroutine_threadsafe(self._astart(), loop).result(timeout)
        except BaseException:
            self._close_loop()
            raise
        return self.url

    async def _astart(self) -> str:
        from aiohttp import web

        self._runner = web.AppRunner(self.app_factory(), access_log=None, shutdown_timeout=self.shutdown_timeout)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        try:
            await site.start()
        except BaseException:  # e.g. the port is taken: stop what on_startup started
            await self._runner.cleanup()
            self._runner = None
            raise
        host, port = self._runner.addresses[0][:2]  # the real port when 0 was asked for
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def stop(self) -> None:
        """Stop serving; a no-op when not running."""
        if self._loop is None:
            return
        if self._runner is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(self.shutdown_timeout + 10)
            except Exception as e:  # noqa: BLE001 - closing anyway
                logger.warning("%s: cleanup failed: %s", self.name, e)
        self._close_loop()

    def _close_loop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = self._runner = None
        self.url = None
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if not thread.is_alive():
            loop.close()

    @property
    def running(self) -> bool:
        return self._loop is not None


# ------------------------------------------------------------------------ batching
@dataclass
class _Pending:
    images: np.ndarray
    prompts: list[str]
    rows: list[dict] | None
    future: asyncio.Future

    @property
    def key(self) -> tuple:  # requests scored together share the image size and rows-or-not
        return self.images.shape[1], self.images.shape[2], self.rows is None


@dataclass
class _Batcher:
    """Collect queued requests into batches of up to ``max_batch`` images (see the module docstring)."""

    score: Callable[[np.ndarray, list[str], list | None], tuple]
    max_batch: int
    wait_s: float
    concurrency: int
    delay_s: float
    timeout_s: float  # a batch's scoring past it fails its requests (the thread is left to finish)
    name: str
    stats: dict = field(default_factory=lambda: {"requests": 0, "batches": 0, "images": 0})

    def __post_init__(self):
        self._queue: deque[_Pending] = deque()
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(self.concurrency)
        self._executor = ThreadPoolExecutor(self.concurrency, thread_name_prefix="reward-batch")
        self._task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for t in list(self._running):
            t.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, images: np.ndarray, prompts: list[str], rows: list[dict] | None) -> tuple:
        fut = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(images, prompts, rows, fut))
        self.stats["requests"] += 1
        self._wake.set()
        return await fut

    def _take(self) -> list[_Pending]:
        """The first queued request and the later ones that fit with it (same key, within ``max_batch``)."""
        first = self._queue.popleft()
        batch, size, keep = [first], len(first.prompts), deque()
        while self._queue:
            item = self._queue.popleft()
            if item.key == first.key and size + len(item.prompts) <= self.max_batch:
                batch.append(item)
                size += len(item.prompts)
            else:
                keep.append(item)
        self._queue = keep
        return batch

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            await self._slots.acquire()
            if self.wait_s > 0 and sum(len(p.prompts) for p in self._queue) < self.max_batch:
                await asyncio.sleep(self.wait_s)  # let the requests sent at about the same time join
            self._queue = deque(p for p in self._queue if not p.future.done())  # clients that gave up
            if not self._queue:
                self._wake.clear()
                self._slots.release()
                continue
            batch = self._take()
            if not self._queue:
                self._wake.clear()
            task = asyncio.get_running_loop().create_task(self._run_batch(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run_batch(self, batch: list[_Pending]) -> None:
        try:
            if self.delay_s > 0:
                await asyncio.sleep(self.delay_s)
            images = batch[0].images if len(batch) == 1 else np.concatenate([p.images for p in batch])
            prompts = [q for p in batch for q in p.prompts]
            rows = None if batch[0].rows is None else [r for p in batch for r in p.rows]
            self.stats["batches"] += 1
            self.stats["images"] += len(prompts)
            loop = asyncio.get_running_loop()
            try:
                score, extra, reasons = await asyncio.wait_for(
                    loop.run_in_executor(self._executor, self.score, images, prompts, rows), self.timeout_s)
            except asyncio.TimeoutError:
                logger.warning("reward %r took over %g s for a batch of %d images", self.name, self.timeout_s,
                               len(prompts))
                raise _RewardFailed(f"reward `{self.name}` did not return within the server's score timeout "
                                    f"({self.timeout_s:g} s, `--score-timeout`) for a batch of {len(prompts)} "
                                    "images: it hangs, or needs a longer timeout") from None
            lo = 0
            for p in batch:
                hi = lo + len(p.prompts)
                if not p.future.done():
                    p.future.set_result((score[lo:hi], {k: v[lo:hi] for k, v in extra.items()}, reasons[lo:hi]))
                lo = hi
        except Exception as e:  # noqa: BLE001 - every request of the batch gets the error
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(e)
        finally:
            self._slots.release()


class _RewardFailed(Exception):
    """The reward raised or returned something that is not a score (HTTP 500)."""


# ------------------------------------------------------------------------ the server
class RewardServer:
    """Serve a reward function over HTTP with batching, a health endpoint and an optional bearer token.

    Args:
        reward_fn_name_or_callable: a registered reward name (``"tiny_geneval"``)
            or a reward function (a per-sample ``compute_score`` is batched for).
        host, port: where to listen; ``port=0`` picks a free port (read it from
            the URL that :meth:`start` returns).
        delay_s: seconds each batch sleeps before scoring (slow-model stand-in).
        max_batch: most images per request and per batch; bigger requests get a 400.
        batch_wait_s: how long the batcher waits after a request for others to join it.
        max_concurrency: batches scored at the same time (threads).
        score_timeout_s: longest a batch's scoring may take; past it, its requests get HTTP 500 naming the
            limit (a reward that hangs still holds its thread, but no client waits on it for ever).
        token: bearer token required by ``/score``; None = no authentication.
        reward_kwargs: keyword arguments for every call of the reward.

    Examples:
        >>> import numpy as np
        >>> from omnirl_async.rewards.http_scorer import http_scorer
        >>> with RewardServer("brightness") as server:
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
        batch_wait_s: float = 0.005,
        max_concurrency: int = 2,
        score_timeout_s: float = 300.0,
        token: str | None = None,
        reward_kwargs: Mapping[str, Any] | None = None,
    ):
        fn = reward_fn_name_or_callable
        if isinstance(fn, str):
            self.reward_name, fn = fn, get_reward_fn(fn)
        elif callable(fn):
            self.reward_name = getattr(fn, "__name__", type(fn).__name__)
        else:
            raise ValueError("`reward_fn_name_or_callable` must be a registered reward name or a callable, "
                             f"got {fn!r}")
        self.reward_fn = PerSampleReward(fn, self.reward_name) if is_per_sample(fn) else fn
        if not (isinstance(port, int) and 0 <= port <= 65535):
            raise ValueError(f"`port` must be an int in [0, 65535] (0 = any free port), got {port!r}")
        for name, value in (("delay_s", delay_s), ("batch_wait_s", batch_wait_s)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"`{name}` must be a finite number >= 0 (seconds), got {value!r}")
        if not (isinstance(score_timeout_s, (int, float)) and math.isfinite(score_timeout_s) and score_timeout_s > 0):
            raise ValueError(f"`score_timeout_s` must be a finite number > 0 (seconds), got {score_timeout_s!r}")
        for name, value in (("max_batch", max_batch), ("max_concurrency", max_concurrency)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"`{name}` must be an int >= 1, got {value!r}")
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError("`token` must be a non-empty string or None (no authentication)")
        self.host, self.port = host, port
        self.delay_s, self.batch_wait_s = float(delay_s), float(batch_wait_s)
        self.max_batch, self.max_concurrency = max_batch, max_concurrency
        self.score_timeout_s = float(score_timeout_s)
        self.token = token
        self.reward_kwargs = dict(reward_kwargs or {})
        self._batcher: _Batcher | None = None
        self._app = BackgroundApp(self._make_app, host=host, port=port, name=f"RewardServer[{self.reward_name}]")

    # -------------------------------------------------------------- scoring (a batcher thread)
    def _score(self, images: np.ndarray, prompts: list[str], rows: list | None) -> tuple:
        try:
            out = call_reward(self.reward_fn, images, prompts, self.reward_kwargs, rows)
        except Exception as e:  # noqa: BLE001 - reported to the clients; the server keeps serving
            logger.warning("reward %r raised %s: %s", self.reward_name, type(e).__name__, e)
            raise _RewardFailed(f"reward `{self.reward_name}` raised {type(e).__name__}: {e}") from None
        score, extra, problem, reasons = _normalize(out, len(prompts), self.reward_name)
        if problem is not None:
            raise _RewardFailed(problem)
        return score, extra, reasons

    # -------------------------------------------------------------- the app (event loop)
    def _make_app(self):
        from aiohttp import web

        # the largest legal body: max_batch images of up to 1024 x 1024, plus prompts and rows
        app = web.Application(client_max_size=self.max_batch * 3 * 1024 * 1024 + (64 << 20))
        app.router.add_get("/health", self._health)
        app.router.add_post("/score", self._handle_score)
        app.router.add_route("*", "/{tail:.*}", self._not_found)

        async def on_startup(_app):
            self._batcher = _Batcher(self._score, max_batch=self.max_batch, wait_s=self.batch_wait_s,
                                     concurrency=self.max_concurrency, delay_s=self.delay_s,
                                     timeout_s=self.score_timeout_s, name=self.reward_name)
            self._batcher.start()

        async def on_cleanup(_app):
            if self._batcher is not None:
                await self._batcher.close()

        app.on_startup.append(on_startup)
        app.on_cleanup.append(on_cleanup)
        return app

    @staticmethod
    def _reply(status: int, message: Any):
        from aiohttp import web

        return web.Response(status=status, body=encode(message), content_type=CONTENT_TYPE)

    async def _health(self, request):
        """msgpack like every answer, or JSON for a client that prefers it (``curl -H 'Accept: application/json'``)
        or does not accept msgpack; no ``Accept`` header, or ``*/*``, gets msgpack."""
        from aiohttp import web

        stats = dict(self._batcher.stats) if self._batcher is not None else {}
        body = {"status": "ok", "reward": self.reward_name, "max_batch": self.max_batch, **stats}
        if self._prefers_json(request.headers.get("Accept")):
            return web.json_response(body, headers={"Vary": "Accept"})
        reply = self._reply(200, body)
        reply.headers["Vary"] = "Accept"
        return reply

    @staticmethod
    def _prefers_json(accept: str | None) -> bool:
        """``Accept`` ranks application/json above msgpack (by q, the most specific range deciding each), or
        does not accept msgpack at all."""
        if not accept:
            return False
        ranges: dict[str, float] = {}
        for part in accept.split(","):
            media, *params = (p.strip() for p in part.split(";"))
            q = 1.0
            for param in params:
                key, _, value = param.partition("=")
                if key.strip().lower() == "q":
                    try:
                        q = float(value)
                    except ValueError:
                        q = 0.0
            ranges[media.lower()] = q

        def quality(media: str) -> float:
            for r in (media, media.split("/")[0] + "/*", "*/*"):
                if r in ranges:
                    return ranges[r]
            return 0.0

        msgpack = max(quality(CONTENT_TYPE), quality("application/x-msgpack"))
        return msgpack <= 0.0 or quality("application/json") > msgpack

    async def _not_found(self, request):
        return self._reply(404, ErrorResponse(f"no such endpoint {request.method} {request.path!r}; use "
                                              "POST /score or GET /health"))

    async def _handle_score(self, request):
        # 1. authenticate before reading the body.
        if self.token is not None:
            sent = request.headers.get("Authorization", "")
            if not hmac.compare_digest(sent.encode(), f"Bearer {self.token}".encode()):
                what = "no" if not sent else "a wrong"
                return self._reply(401, ErrorResponse(
                    f"this reward server needs a bearer token and the request has {what} `Authorization` header; "
                    f"set the server's token in ${DEFAULT_TOKEN_ENV} (or the client's `token_env`) where the "
                    "client runs"))
        # 2. validate.
        try:
            images, prompts, rows = decode_request(await request.read(), self.max_batch)
        except BadRequest as e:
            return self._reply(400, ErrorResponse(str(e)))
        if not prompts:
            return self._reply(200, ScoreResponse([], {}))
        # 3. queue for a batch and wait for this request's share of the answer.
        try:
            score, extra, reasons = await self._batcher.submit(images, prompts, rows)
        except _RewardFailed as e:
            return self._reply(500, ErrorResponse(str(e)))
        return self._reply(200, ScoreResponse(score.tolist(), {k: v.tolist() for k, v in extra.items()},
                                              list(reasons) if any(r is not None for r in reasons) else None))

    # -------------------------------------------------------------- lifecycle
    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        if not self._app.running:
            raise RuntimeError("the server is not running; call `start()` first")
        return self._app.url

    def start(self) -> str:
        """Listen and serve in a background thread; returns the URL."""
        return self._app.start()

    def stop(self) -> None:
        """Stop serving and close the socket; a no-op when not running."""
        self._app.stop()

    def __enter__(self) -> "RewardServer":
        if not self._app.running:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self._app.url if self._app.running else "stopped"
        return (f"RewardServer({self.reward_name!r}, {where}, max_batch={self.max_batch}, "
                f"token={'set' if self.token else 'none'})")


# ------------------------------------------------------------------------ a whole reward config
class ManagerReward:
    """A :class:`~omnirl_async.rewards.manager.RewardManager` (a ``reward.*`` config) served as one reward.

    Failed samples come back with their reasons (:class:`ScoredSamples`), so a
    client's manager fails exactly those samples, with the server's reason.
    """

    def __init__(self, manager):
        self.manager = manager
        self.__name__ = "+".join(manager.names)

    def __call__(self, images: np.ndarray, prompts: Sequence[str], rows=None) -> ScoredSamples:
        res = self.manager(images, prompts, rows)
        score = np.where(res.failed, np.nan, res.scores.astype(np.float64))
        return ScoredSamples(score=score, reasons=list(res.reasons), extra=dict(res.extra))


# ------------------------------------------------------------------------ CLI
def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``serve-reward`` (shared by ``omnirl-async serve-reward`` and ``python -m ...http_scorer``)."""
    parser.add_argument("--reward", default=None,
                        help="registered reward name, or the function's name inside --path (default: the config's "
                             "reward, tiny_geneval unless overridden)")
    parser.add_argument("--path", default=None,
                        help="Python file defining --reward (a batched function or a per-sample compute_score)")
    parser.add_argument("--kwargs", default=None, metavar="JSON",
                        help="keyword arguments for --reward, as a JSON object, e.g. '{\"penalize_extras\": true}'")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 = every interface)")
    parser.add_argument("--port", type=int, default=8000, help="0 = any free port")
    parser.add_argument("--max-batch", type=int, default=256, help="most images per request and per batch")
    parser.add_argument("--batch-wait-ms", type=float, default=5.0,
                        help="how long a request waits for others to share its batch")
    parser.add_argument("--concurrency", type=int, default=2, help="batches scored at the same time")
    parser.add_argument("--token-env", default=DEFAULT_TOKEN_ENV,
                        help="environment variable holding the bearer token /score requires (unset = no token)")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds each batch sleeps (slow-model stand-in)")
    parser.add_argument("--score-timeout", type=float, default=300.0,
                        help="seconds a batch's scoring may take; past it its requests get HTTP 500 naming it")
    return parser


def build_parser(prog: str) -> argparse.ArgumentParser:
    return add_serve_arguments(argparse.ArgumentParser(
        prog=prog, description="Host a reward function as an HTTP service (POST /score, GET /health) for the "
                               "`http_scorer` reward; `omnirl-async serve-reward` also serves a `reward.*` config."))


def reward_from_args(args: argparse.Namespace) -> str | Callable:
    """``--reward`` / ``--path`` -> a registry name or the user's function (ValueError / InputError when wrong)."""
    if args.path is not None:
        from omnirl_async.rewards.custom import load_custom_reward_fn

        if not args.reward:
            raise ValueError("`--path` needs `--reward`, the name of the function in that file")
        return load_custom_reward_fn(args.path, args.reward, key="--path")
    return args.reward or "tiny_geneval"


def serve(reward: str | Callable, args: argparse.Namespace, *, prog: str) -> int:
    """Serve ``reward`` in the foreground with ``args`` (:func:`build_parser`) until Ctrl-C or SIGTERM."""
    import signal

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kwargs = json.loads(args.kwargs) if args.kwargs else {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"`--kwargs` must be a JSON object, got {args.kwargs!r}")
    token = os.environ.get(args.token_env) or None
    server = RewardServer(reward, host=args.host, port=args.port, delay_s=args.delay, max_batch=args.max_batch,
                          batch_wait_s=args.batch_wait_ms / 1000.0, max_concurrency=args.concurrency,
                          score_timeout_s=args.score_timeout, token=token, reward_kwargs=kwargs)
    url = server.start()
    auth = f"bearer token from ${args.token_env}" if token else f"no token (${args.token_env} is unset)"
    print(f"serving reward {server.reward_name!r} at {url} (max batch {server.max_batch}, {auth}); Ctrl-C stops",
          flush=True)
    if not token and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"{prog}: warning: listening on {args.host} without a token: anyone who can reach the port can score",
              file=sys.stderr, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m omnirl_async.rewards.http_scorer") -> int:
    """Serve one registered or file-defined reward (``omnirl-async serve-reward`` also takes config overrides)."""
    from omnirl_async.preflight import InputError

    args = build_parser(prog).parse_args(argv)
    try:
        return serve(reward_from_args(args), args, prog=prog)
    except (ValueError, KeyError, InputError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
