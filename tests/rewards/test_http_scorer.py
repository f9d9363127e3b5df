"""http_scorer: a real reward server (ScorerServer = RewardServer) on loopback and the registered client reward."""

import ast
import http.client
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from omnirl_async.data.shapes import render_batch, sample_spec
from omnirl_async.rewards import RewardManager, get_reward_fn
from omnirl_async.rewards import http_scorer as hs
from omnirl_async.rewards.http_scorer import ScorerServer, http_scorer

tiny_geneval = get_reward_fn("tiny_geneval")


@pytest.fixture(scope="module")
def world():
    rng = np.random.default_rng(7)
    specs = [sample_spec(rng) for _ in range(64)]
    images, _ = render_batch(specs, rng)
    return images, [s.prompt for s in specs]


@pytest.fixture(scope="module")
def server():
    with ScorerServer("tiny_geneval") as s:
        yield s


def _raw(url: str, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request(method, path, body=body)
        resp = conn.getresponse()
        return resp.status, msgspec.msgpack.decode(resp.read())
    finally:
        conn.close()


def _dead_url() -> str:
    with socket.socket() as s:  # a port that was free a moment ago: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_registered():
    assert get_reward_fn("http_scorer") is http_scorer


def test_scores_equal_direct_tiny_geneval(server, world):
    images, prompts = world
    direct = tiny_geneval(images, prompts)
    remote = http_scorer(images, prompts, url=server.url)
    assert set(remote) == set(direct)  # score and every extra (strict, clause/*)
    for key, value in direct.items():
        assert np.array_equal(remote[key], value), key
    assert direct["strict"].mean() > 0.9  # rendered scenes really are scored, not all zero


def test_url_forms_and_health(server, world):
    images, prompts = world
    for url in (server.url + "/", server.url + "/score"):
        assert np.array_equal(http_scorer(images[:2], prompts[:2], url=url)["score"],
                              tiny_geneval(images[:2], prompts[:2])["score"])
    status, health = _raw(server.url, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["reward"] == "tiny_geneval"
    assert health["max_batch"] == 256 and health["requests"] >= 2 and health["images"] >= 4
    status, body = _raw(server.url, "GET", "/nope")
    assert status == 404 and "/nope" in body["error"]


def _body(images=b"\0" * 12, shape=(1, 2, 2, 3), prompts=("a",), **more) -> bytes:
    return msgspec.msgpack.encode({"images": images, "shape": list(shape), "prompts": list(prompts), **more})


@pytest.mark.parametrize("body, needle", [
    (_body(shape=(1, 2, 2)), "`shape`"),
    (_body(shape=(1, 2, 2, 4)), "`shape`"),
    (_body(images=b"\0" * 11), "`images` holds 11 bytes"),
    (_body(prompts=("a", "b")), "`prompts` has 2 entries"),
    (_body(colour="red"), "unknown field `colour`"),
    (msgspec.msgpack.encode({"shape": [1, 2, 2, 3], "prompts": ["a"]}), "missing required field `images`"),
    (msgspec.msgpack.encode({"images": "not bytes", "shape": [1, 2, 2, 3], "prompts": ["a"]}), "images"),
    (b"\xc1 not msgpack", "bad request body"),
    (_body(images=b"\0" * 12 * 300, shape=(300, 2, 2, 3), prompts=["a"] * 300), "`max_batch` = 256"),
])
def test_bad_requests_get_400_naming_the_problem(server, body, needle):
    status, answer = _raw(server.url, "POST", "/score", body)
    assert status == 400
    assert needle in answer["error"]


def test_delay_and_concurrency():
    images, prompts = np.zeros((2, 4, 4, 3), np.uint8), ["a", "b"]
    with ScorerServer("brightness", delay_s=0.2) as slow:
        t0 = time.perf_counter()
        assert http_scorer(images, prompts, url=slow.url)["score"].tolist() == [0.0, 0.0]
        assert time.perf_counter() - t0 >= 0.2

        results, errors = [], []

        def call():
            try:
                results.append(http_scorer(images, prompts, url=slow.url)["score"])
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=call) for _ in range(4)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
    assert not errors and len(results) == 4
    assert 0.2 <= elapsed < 0.6, elapsed  # serial would take 4 × 0.2 = 0.8 s


def test_reward_that_raises_gives_500_and_client_runtime_error():
    def broken(images, prompts, **_):
        raise ValueError("model weights missing")

    def wrong_length(images, prompts, **_):
        return np.zeros(len(prompts) + 1)

    images, prompts = np.zeros((2, 4, 4, 3), np.uint8), ["a", "b"]
    with ScorerServer(broken) as s:
        status, answer = _raw(s.url, "POST", "/score", _body())
        assert status == 500 and "ValueError: model weights missing" in answer["error"]
        with pytest.raises(RuntimeError, match="model weights missing") as info:
            http_scorer(images, prompts, url=s.url, retries=2, backoff=5.0)  # a 500 is not retried
        assert s.url in str(info.value) and "HTTP 500" in str(info.value)
    with ScorerServer(wrong_length) as s:
        with pytest.raises(RuntimeError, match=r"shape \(3,\)"):
            http_scorer(images, prompts, url=s.url)


def test_a_batch_past_the_score_timeout_fails_its_requests_and_the_server_keeps_serving():
    def slow_on_request(images, prompts, **_):
        if prompts[0] == "slow":
            time.sleep(3.0)  # a reward that hangs (its thread is left to finish)
        return np.ones(len(prompts))

    images = np.zeros((1, 4, 4, 3), np.uint8)
    with pytest.raises(ValueError, match=r"`score_timeout_s` must be a finite number > 0 \(seconds\), got 0"):
        ScorerServer(slow_on_request, score_timeout_s=0)
    with ScorerServer(slow_on_request, score_timeout_s=0.3) as s:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            http_scorer(images, ["slow"], url=s.url, timeout=30)
        assert time.monotonic() - t0 < 2.5
        assert "HTTP 500" in str(info.value) and ("reward `slow_on_request` did not return within the server's "
                                                  "score timeout (0.3 s, `--score-timeout`) for a batch of 1 images"
                                                  ) in str(info.value)
        assert http_scorer(images, ["fast"], url=s.url)["score"].tolist() == [1.0]  # the other thread serves


def test_a_server_dripping_its_answer_is_cut_at_the_attempts_timeout():
    """Each byte comes within the socket's own timeout, the whole answer never does: the attempt is bounded."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    stop = threading.Event()

    def drip():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(1 << 20)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\nContent-Length: 1000\r\n\r\n")
                for _ in range(1000):
                    if stop.wait(0.1):
                        break
                    try:
                        conn.sendall(b"x")
                    except OSError:
                        break

    thread = threading.Thread(target=drip, daemon=True)
    thread.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            http_scorer(np.zeros((1, 4, 4, 3), np.uint8), ["a"], url=f"http://127.0.0.1:{listener.getsockname()[1]}",
                        timeout=1.0, retries=0)
        assert time.monotonic() - t0 < 3
        assert "(timeout 1 s each); last error: TimeoutError: no complete answer within 1 s" in str(info.value)
    finally:
        stop.set()
        listener.close()
        thread.join(timeout=10)


def test_unreachable_url_retries_then_fails_and_manager_marks_batch_failed():
    url = _dead_url()
    images, prompts = np.zeros((3, 4, 4, 3), np.uint8), ["a", "b", "c"]
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="after 3 attempt") as info:
        http_scorer(images, prompts, url=url, retries=2, backoff=0.05)
    assert time.perf_counter() - t0 >= 0.05 + 0.1  # backoff 0.05, then 0.1
    assert url in str(info.value) and "ConnectionRefusedError" in str(info.value)

    mgr = RewardManager.from_config(SimpleNamespace(reward_functions={
        "http": {"name": "http_scorer", "weight": 1.0, "kwargs": {"url": url, "retries": 1, "backoff": 0.01}},
    }))
    res = mgr(images, prompts)
    assert res.failed.all() and res.scores.tolist() == [0.0, 0.0, 0.0]
    for reason in res.reasons:
        assert reason.startswith("reward `http` raised RuntimeError") and url in reason and "refused" in reason


def test_missing_url_names_the_config_key():
    with pytest.raises(ValueError, match=r"reward_kwargs\.url"):
        http_scorer(np.zeros((1, 4, 4, 3), np.uint8), ["a"])


def test_documented_config_overrides(server, world):
    from omnirl_async.config.loader import load_config

    images, prompts = world
    expected = tiny_geneval(images[:8], prompts[:8])
    for overrides in (
        ["reward.reward_functions={http: {name: http_scorer, weight: 1.0, kwargs: {url: \"%s\"}}}" % server.url],
        ["reward.reward_fn_name=http_scorer", f"+reward.reward_kwargs.url={server.url}"],
    ):
        mgr = RewardManager.from_config(load_config(overrides).reward)
        res = mgr(images[:8], prompts[:8])
        assert not res.failed.any(), res.reasons
        assert np.array_equal(res.scores, expected["score"])
        name = mgr.names[0]
        assert np.array_equal(res.extra[f"{name}/strict"], expected["strict"])


def test_server_arguments_are_checked():
    with pytest.raises(ValueError, match="`delay_s`"):
        ScorerServer("brightness", delay_s=-1)
    with pytest.raises(ValueError, match="`max_batch`"):
        ScorerServer("brightness", max_batch=0)
    with pytest.raises(KeyError, match="no_such_reward"):
        ScorerServer("no_such_reward")
    s = ScorerServer("brightness")
    s.stop()  # not started: a no-op
    url = s.start()
    s.stop()
    with pytest.raises(RuntimeError, match="after 1 attempt"):
        http_scorer(np.zeros((1, 4, 4, 3), np.uint8), ["a"], url=url, retries=0)


@pytest.mark.parametrize("module", ["http_scorer", "server", "wire", "judge", "adapters"])
def test_no_pickle_imported(module):
    tree = ast.parse((Path(hs.__file__).parent / f"{module}.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any("pickle" in name for name in imported), imported


def test_cli_smoke():
    proc = subprocess.Popen(
        [sys.executable, "-m", "omnirl_async.rewards.http_scorer", "--reward", "brightness", "--port", "0",
         "--delay", "0.01"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "serving reward 'brightness' at http://127.0.0.1:" in line, (line, proc.stderr.read())
        url = line.split(" at ")[1].split()[0]
        out = http_scorer(np.full((2, 4, 4, 3), 255, np.uint8), ["a", "b"], url=url)
        assert out["score"].tolist() == [1.0, 1.0]
        assert _raw(url, "GET", "/health")[1]["reward"] == "brightness"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
