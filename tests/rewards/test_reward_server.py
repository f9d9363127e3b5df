"""The reward service (`omnirl-async serve-reward`): batching, health, bearer token, rows, per-sample rewards."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from omnirl_async.rewards import RewardManager
from omnirl_async.rewards.http_scorer import http_scorer
from omnirl_async.rewards.server import RewardServer


def _health(url: str, headers: dict | None = None) -> tuple[int, dict]:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("GET", "/health", headers=headers or {})
        resp = conn.getresponse()
        return resp.status, msgspec.msgpack.decode(resp.read())
    finally:
        conn.close()


def _concurrently(fn, args_list):
    results, errors = [None] * len(args_list), []

    def run(i, args):
        try:
            results[i] = fn(*args)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def test_concurrent_requests_are_scored_in_shared_batches():
    calls: list[int] = []

    def level(images, prompts):  # each request's images carry its own value: the split back must be exact
        calls.append(len(prompts))
        time.sleep(0.05)
        return images[:, 0, 0, 0].astype(np.float64)

    requests = [np.full((2, 4, 4, 3), 10 * i, np.uint8) for i in range(6)]
    with RewardServer(level, batch_wait_s=0.1, max_concurrency=1, max_batch=8) as server:
        out = _concurrently(lambda imgs: http_scorer(imgs, ["p", "q"], url=server.url)["score"],
                            [(r,) for r in requests])
        status, health = _health(server.url)
    assert [o.tolist() for o in out] == [[10.0 * i, 10.0 * i] for i in range(6)]
    assert sum(calls) == 12 and len(calls) < 6 and max(calls) > 2 and max(calls) <= 8, calls
    assert status == 200 and health["requests"] == 6 and health["batches"] == len(calls) and health["images"] == 12


def test_bearer_token(monkeypatch):
    images = np.full((1, 4, 4, 3), 255, np.uint8)
    monkeypatch.delenv("OMNIRL_REWARD_TOKEN", raising=False)
    with RewardServer("brightness", token="s3cret") as server:
        with pytest.raises(RuntimeError, match=r"HTTP 401: .*bearer token.*\(\$OMNIRL_REWARD_TOKEN is not set"):
            http_scorer(images, ["a"], url=server.url)
        monkeypatch.setenv("OMNIRL_REWARD_TOKEN", "wrong")
        with pytest.raises(RuntimeError, match="HTTP 401: .* a wrong `Authorization` header"):
            http_scorer(images, ["a"], url=server.url, retries=3, backoff=5)  # not retried
        monkeypatch.setenv("MY_TOKEN", "s3cret")
        assert http_scorer(images, ["a"], url=server.url, token_env="MY_TOKEN")["score"].tolist() == [1.0]
        assert _health(server.url)[0] == 200  # probes need no token


def _get_health(url: str, accept: str | None) -> tuple[int, str, bytes]:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("GET", "/health", headers={} if accept is None else {"Accept": accept})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()


def test_health_answers_json_to_a_client_that_asks_for_it():
    images = np.full((2, 4, 4, 3), 255, np.uint8)
    with RewardServer("brightness", max_batch=16) as server:
        http_scorer(images, ["a", "b"], url=server.url)
        want = {"status": "ok", "reward": "brightness", "max_batch": 16, "requests": 1, "batches": 1, "images": 2}
        for accept in ("application/json", "application/json, text/plain;q=0.5", "text/plain",  # curl -H, no msgpack
                       "application/msgpack;q=0.5, application/json", "*/*;q=0.1, application/json;q=0.9"):
            status, ctype, body = _get_health(server.url, accept)
            assert (status, ctype.split(";")[0]) == (200, "application/json"), (accept, ctype)
            assert json.loads(body) == want, accept
        # the wire format otherwise: no Accept (the project's clients), curl's default */*, msgpack preferred
        for accept in (None, "*/*", "application/msgpack", "application/x-msgpack", "application/json;q=0.5, */*",
                       "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"):
            status, ctype, body = _get_health(server.url, accept)
            assert (status, ctype) == (200, "application/msgpack"), (accept, ctype)
            assert msgspec.msgpack.decode(body) == want, accept
        assert _health(server.url, {"Accept": "*/*"}) == (200, want)


def test_rows_reach_the_served_function():
    def score(images, prompts, ground_truth=None):
        return np.array([float(g) for g in ground_truth])

    with RewardServer(score) as server:
        mgr = RewardManager.from_config(SimpleNamespace(reward_functions={
            "remote": {"name": "http_scorer", "kwargs": {"url": server.url}}}))
        res = mgr(np.zeros((3, 4, 4, 3), np.uint8), ["a", "b", "c"],
                  [{"ground_truth": 0.5}, {"ground_truth": 1}, {"ground_truth": 0.25, "id": 7}])
    assert not res.failed.any(), res.reasons
    assert res.scores.tolist() == [0.5, 1.0, 0.25]


def test_served_per_sample_reward_fails_single_samples_with_the_servers_reason():
    def compute_score(data_source, solution_image, ground_truth, extra_info=None):
        if extra_info["prompt"] == "boom":
            raise ValueError("no ground truth for this one")
        return float(solution_image.mean() / 255)

    with RewardServer(compute_score) as server:
        mgr = RewardManager.from_config(SimpleNamespace(reward_functions={
            "remote": {"name": "http_scorer", "kwargs": {"url": server.url}}}))
        res = mgr(np.full((3, 4, 4, 3), 255, np.uint8), ["ok", "boom", "ok"])
    assert res.failed.tolist() == [False, True, False] and res.scores.tolist() == [1.0, 0.0, 1.0]
    assert res.reasons[1] == "reward `compute_score` raised ValueError: no ground truth for this one (sample 1)"


def test_server_arguments_are_checked():
    with pytest.raises(ValueError, match="`batch_wait_s`"):
        RewardServer("brightness", batch_wait_s=-1)
    with pytest.raises(ValueError, match="`max_concurrency`"):
        RewardServer("brightness", max_concurrency=0)
    with pytest.raises(ValueError, match="`token`"):
        RewardServer("brightness", token="")


@pytest.mark.slow  # starts the CLI in a subprocess (~4 s of imports on a shared core)
def test_serve_reward_cli_with_config_overrides_and_token(tmp_path):
    env = dict(os.environ, OMNIRL_REWARD_TOKEN="t0ken")
    proc = subprocess.Popen(
        [sys.executable, "-m", "omnirl_async.cli", "serve-reward", "--port", "0", "--max-batch", "16",
         "reward.reward_fn_name=brightness"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "serving reward 'brightness' at http://127.0.0.1:" in line, (line, proc.stderr.read())
        assert "max batch 16, bearer token from $OMNIRL_REWARD_TOKEN" in line
        url = line.split(" at ")[1].split()[0]
        os.environ["OMNIRL_REWARD_TOKEN"] = "t0ken"
        try:
            out = http_scorer(np.full((2, 4, 4, 3), 255, np.uint8), ["a", "b"], url=url)
        finally:
            del os.environ["OMNIRL_REWARD_TOKEN"]
        assert out["score"].tolist() == [1.0, 1.0] and out["reward/brightness"].tolist() == [1.0, 1.0]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert proc.returncode == 0  # SIGTERM stops it cleanly
    bad = subprocess.run([sys.executable, "-m", "omnirl_async.cli", "serve-reward", "--reward", "brightness",
                          "reward.reward_fn_name=brightness"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "serve-reward: give either --reward/--path/--kwargs" in bad.stderr
