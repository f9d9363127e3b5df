"""openai_judge against a local stand-in that speaks the OpenAI chat-completions protocol."""

from __future__ import annotations

import asyncio
import base64
import io
import re
import socket
import time
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from omnirl_async.rewards import RewardManager, get_reward_fn
from omnirl_async.rewards.base import failure_kind
from omnirl_async.rewards.judge import openai_judge, parse_score
from omnirl_async.rewards.server import BackgroundApp

MODEL = "stand-in-vl"


class StandIn:
    """A chat-completions server: replies "Score: <10 x mean brightness>/10", or misbehaves on cue.

    The cue is the question text: "bad" (a reply without a number), "slow" (answers after 30 s),
    "error" (HTTP 500), "garbage" (a body that is not JSON), "big" (a number above max_score).
    """

    def __init__(self):
        self.requests: list[dict] = []
        self.images: list[np.ndarray] = []
        self.in_flight = self.max_in_flight = 0

    def app(self):
        from aiohttp import web

        async def completions(request):
            body = await request.json()
            self.requests.append({"headers": dict(request.headers), "body": body})
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                text, image = body["messages"][-1]["content"]
                url = image["image_url"]["url"]
                assert url.startswith("data:image/png;base64,"), url[:40]
                pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))
                self.images.append(pixels)
                cue = text["text"]
                await asyncio.sleep(0.02)  # a model takes a while: lets requests overlap
                if "slow" in cue:
                    await asyncio.sleep(30)
                if "error" in cue:
                    return web.json_response({"error": {"message": "model overloaded"}}, status=500)
                if "garbage" in cue:
                    return web.Response(text="<html>gateway</html>", content_type="text/html")
                reply = ("I cannot judge this picture." if "bad" in cue else
                         "Score: 12" if "big" in cue else f"Score: {pixels.mean() / 255 * 10:.4f}/10")
                return web.json_response({"id": "c1", "object": "chat.completion", "model": body["model"],
                                          "choices": [{"index": 0, "finish_reason": "stop",
                                                       "message": {"role": "assistant", "content": reply}}]})
            finally:
                self.in_flight -= 1

        app = web.Application()
        app.router.add_post("/v1/chat/completions", completions)
        return app


@pytest.fixture(scope="module")
def judge():
    stand_in = StandIn()
    server = BackgroundApp(stand_in.app, name="stand-in", shutdown_timeout=0.5)
    stand_in.url = server.start() + "/v1"
    yield stand_in
    server.stop()


def _grays(levels) -> np.ndarray:
    return np.stack([np.full((8, 8, 3), v, np.uint8) for v in levels])


def test_registered():
    assert get_reward_fn("openai_judge") is openai_judge


def test_scores_are_the_judges_numbers_and_requests_follow_the_protocol(judge, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    images = _grays([0, 51, 153, 255])
    images[1, 0, 0] = [255, 0, 0]  # not uniform: the PNG round trip is checked pixel for pixel
    judge.requests.clear()
    judge.images.clear()
    out = openai_judge(images, ["a", "b", "c", "d"], base_url=judge.url, model=MODEL, api_key_env="JUDGE_KEY",
                       question="Rate: {prompt}", concurrency=2)
    assert out.reasons == [None] * 4
    np.testing.assert_allclose(out.score, images.reshape(4, -1).mean(1) / 255, atol=1e-4)
    assert len(judge.requests) == 4 and judge.max_in_flight == 2  # at most `concurrency` at once
    req = judge.requests[0]
    assert req["headers"]["Authorization"] == "Bearer sk-test"
    assert req["body"]["model"] == MODEL and req["body"]["temperature"] == 0.0 and req["body"]["max_tokens"] == 16
    assert sorted(r["body"]["messages"][-1]["content"][0]["text"] for r in judge.requests) == [
        "Rate: a", "Rate: b", "Rate: c", "Rate: d"]
    assert any(np.array_equal(img, images[1]) for img in judge.images)  # the data URL carries the exact image


def test_failures_are_per_image_with_a_reason_and_never_hang(judge):
    prompts = ["fine", "bad", "slow", "error", "garbage", "big"]
    t0 = time.perf_counter()
    out = openai_judge(_grays([255] * 6), prompts, base_url=judge.url, model=MODEL, question="{prompt}",
                       timeout=2.0, retries=0)
    # the 30 s reply is cut off at 2 s (a timeout that leaves a loaded CI box time for the fast replies)
    assert time.perf_counter() - t0 < 10.0
    assert out.score[0] == pytest.approx(1.0) and out.reasons[0] is None
    assert np.isnan(out.score[1:]).all()
    why = dict(zip(prompts, out.reasons))
    assert why["bad"] == "openai_judge: the judge's reply 'I cannot judge this picture.' holds no number"
    assert "timed out after 2 s" in why["slow"] and judge.url in why["slow"]
    assert "answered HTTP 500" in why["error"] and "model overloaded" in why["error"]
    assert "not a chat completion" in why["garbage"] and "gateway" in why["garbage"]
    assert "gives 12, outside [0, max_score=10]" in why["big"]

    # through the manager: only those images fail, each with its reason and kind
    mgr = RewardManager.from_config(SimpleNamespace(reward_functions={"judge": {
        "name": "openai_judge", "kwargs": {"base_url": judge.url, "model": MODEL, "question": "{prompt}",
                                           "timeout": 2.0, "retries": 0}}}))
    res = mgr(_grays([255] * 6), prompts)
    assert res.failed.tolist() == [False, True, True, True, True, True]
    assert res.scores[0] == pytest.approx(1.0) and res.reasons[2] == why["slow"]
    assert failure_kind(res.reasons[2]) == "timeout" and failure_kind(res.reasons[1]) == "other"


def test_unreachable_server_fails_every_image_with_the_reason():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = openai_judge(_grays([0, 0]), ["a", "b"], base_url=f"http://127.0.0.1:{port}/v1", model=MODEL,
                       retries=1, backoff=0.01, timeout=2)
    assert np.isnan(out.score).all()
    assert all("failed: ClientConnectorError" in r and "(2 attempt(s))" in r for r in out.reasons)


def test_question_template_takes_row_fields(judge):
    judge.requests.clear()
    rows = [{"ground_truth": "circle"}, {"category": "x"}]
    out = openai_judge(_grays([255, 255]), ["p0", "p1"], base_url=judge.url, model=MODEL,
                       question="{prompt} should show a {ground_truth}", rows=rows)
    assert [r["body"]["messages"][-1]["content"][0]["text"] for r in judge.requests] == ["p0 should show a circle"]
    assert out.reasons[0] is None
    assert out.reasons[1] == ("openai_judge: the question template names 'ground_truth' but the prompt's row has "
                              "no such field")


def test_config_mistakes_name_the_key(judge):
    images = _grays([0])
    with pytest.raises(ValueError, match="`base_url` = None .* http://judge-host:8000/v1"):
        openai_judge(images, ["a"], model=MODEL)
    with pytest.raises(ValueError, match="`model` = None"):
        openai_judge(images, ["a"], base_url=judge.url)
    with pytest.raises(ValueError, match="`max_score` = 0"):
        openai_judge(images, ["a"], base_url=judge.url, model=MODEL, max_score=0)
    with pytest.raises(ValueError, match="`image_format`"):
        openai_judge(images, ["a"], base_url=judge.url, model=MODEL, image_format="gif")


def test_documented_config_override(judge):
    from omnirl_async.config import load_config

    cfg = load_config(['reward.reward_functions={judge: {name: openai_judge, weight: 1.0, kwargs: '
                       f'{{base_url: "{judge.url}", model: {MODEL}, max_score: 10}}}}}}'])
    res = RewardManager.from_config(cfg.reward)(_grays([102, 204]), ["a red circle", "two blue squares"])
    assert not res.failed.any(), res.reasons
    np.testing.assert_allclose(res.scores, [0.4, 0.8], atol=1e-4)


@pytest.mark.parametrize("text, expected", [
    ("8", 0.8), ("Score: 7.5/10", 0.75), ("I would rate it 6 out of 10.", 0.6), ("10", 1.0), ("0", 0.0),
])
def test_parse_score(text, expected):
    assert parse_score(text, 10.0) == (pytest.approx(expected), None)


def test_parse_score_regex_and_failures():
    assert parse_score("reasoning 3 steps... final: 9", 10.0, r"final:\s*(\d+)")[0] == pytest.approx(0.9)
    assert parse_score("-1", 10.0)[1] == "the judge's reply '-1' gives -1, outside [0, max_score=10]"
    assert re.search("holds no number", parse_score("n/a", 10.0)[1])
