"""``openai_judge``: score images with a judge model behind an OpenAI-compatible chat-completions API.

vLLM (``vllm serve Qwen/Qwen2.5-VL-7B-Instruct``), SGLang, TGI and hosted APIs
all speak the same protocol, so one client reaches any of them. For every
image the reward sends::

    POST {base_url}/chat/completions
    {"model": model, "temperature": 0, "max_tokens": 16,
     "messages": [{"role": "system", "content": system},             # when `system` is set
                  {"role": "user", "content": [
                      {"type": "text", "text": question.format(prompt=..., **row fields)},
                      {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}]}]}

and reads the first number in ``choices[0].message.content`` ("8", "Score:
7.5/10", "I would rate it 6"); the score is that number divided by
``max_score`` (so a 0-10 judge gives 0-1). ``score_regex`` (a regular
expression whose first group is the number) overrides the "first number" rule.

Configure it like any reward (``api_key_env`` names the environment variable
holding the API key, sent as a bearer token; the key itself never goes into
the config, which is saved beside the checkpoints)::

    omnirl-async train 'reward.reward_functions={judge: {name: openai_judge, weight: 1.0, kwargs: {base_url:
    "http://judge-host:8000/v1", model: "Qwen/Qwen2.5-VL-7B-Instruct", max_score: 10}}}'    # one line

Failures are per image and never a hang: each request is bounded by
``timeout`` seconds (the whole request, connecting included), connection
errors and 429/5xx answers are retried ``retries`` times, and an image whose
request timed out, was refused, answered with an HTTP error, a body that is
not a chat completion, or a reply without a usable number (or one outside
``[0, max_score]``) fails alone with that reason; the others are scored. At
most ``concurrency`` requests are in flight at once.

The question template may name row fields (``{ground_truth}``): the prompt
dataset's other fields reach the judge through ``rows``. A template naming a
field a row lacks fails that image with a reason naming the field.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import os
import re
import threading
from typing import Any, Sequence

import numpy as np

from omnirl_async.rewards.base import ScoredSamples, register_reward

__all__ = ["openai_judge", "DEFAULT_QUESTION", "image_data_url", "parse_score"]

DEFAULT_QUESTION = ("Does this image show exactly this: \"{prompt}\"? Rate how well it matches from 0 (not at all) "
                    "to 10 (perfectly). Answer with the number only.")
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_RETRY_STATUSES = (429, 500, 502, 503, 504)


def image_data_url(image: np.ndarray, fmt: str = "png") -> str:
    """``uint8 [H, W, 3]`` -> ``data:image/png;base64,...`` (or jpeg)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image), "RGB").save(buf, format="PNG" if fmt == "png" else "JPEG")
    return f"data:image/{fmt};base64,{base64.b64encode(buf.getvalue()).decode('ascii')}"


def parse_score(text: str, max_score: float, score_regex: str | None = None) -> tuple[float | None, str | None]:
    """The judge's reply -> ``(score in [0, 1], None)`` or ``(None, why not)``."""
    shown = repr(text if len(text) <= 120 else text[:117] + "...")
    if score_regex:
        m = re.search(score_regex, text)
        raw = (m.group(1) if m.groups() else m.group(0)) if m else None
    else:
        m = _NUMBER.search(text)
        raw = m.group(0) if m else None
    if raw is None:
        return None, f"the judge's reply {shown} holds no number"
    try:
        value = float(raw)
    except ValueError:
        return None, f"the judge's reply {shown}: {raw!r} is not a number"
    if not (math.isfinite(value) and 0 <= value <= max_score):
        return None, f"the judge's reply {shown} gives {value:g}, outside [0, max_score={max_score:g}]"
    return value / max_score, None


def _question(template: str, prompt: str, row: dict | None) -> str:
    return template.format(**{**(row or {}), "prompt": prompt})


async def _ask(session, url: str, payload: dict, headers: dict, timeout: float, retries: int,
               backoff: float) -> tuple[str | None, str | None]:
    """One chat completion -> ``(reply text, None)`` or ``(None, reason)``."""
    import aiohttp

    last = ""
    for attempt in range(retries + 1):
        if attempt:
            await asyncio.sleep(backoff * 2 ** (attempt - 1))
        try:
            async with session.post(url, json=payload, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                body = await resp.read()
                status = resp.status
        except asyncio.TimeoutError:
            last = f"request to {url} timed out after {timeout:g} s"
            continue
        except aiohttp.ClientError as e:
            last = f"request to {url} failed: {type(e).__name__}: {e}"
            continue
        text = body[:300].decode("utf-8", "replace")
        if status in _RETRY_STATUSES:
            last = f"{url} answered HTTP {status}: {text}"
            continue
        if status != 200:
            return None, f"{url} answered HTTP {status}: {text}"
        try:
            reply = json.loads(body)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            return None, f"{url} sent a body that is not a chat completion: {text!r}"
        if isinstance(reply, list):  # content parts
            reply = " ".join(p.get("text", "") for p in reply if isinstance(p, dict))
        if not isinstance(reply, str):
            return None, f"{url} sent message content {reply!r}, not text"
        return reply, None
    return None, f"{last} ({retries + 1} attempt(s))"


async def _judge_all(images, prompts, rows, *, url, model, question, system, max_score, score_regex, timeout,
                     retries, backoff, concurrency, temperature, max_tokens, image_format, headers):
    import aiohttp

    batch = len(prompts)
    score = np.full(batch, np.nan, np.float64)
    reasons: list[str | None] = [None] * batch
    limit = asyncio.Semaphore(concurrency)

    async def one(i: int, session) -> None:
        row = rows[i] if rows else None
        try:
            text = _question(question, prompts[i], row)
        except (KeyError, IndexError) as e:
            reasons[i] = f"openai_judge: the question template names {e} but the prompt's row has no such field"
            return
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": image_data_url(images[i], image_format)}}]})
        payload = {"model": model, "messages": messages, "temperature": temperature, "max_tokens": max_tokens}
        async with limit:
            reply, why = await _ask(session, url, payload, headers, timeout, retries, backoff)
        if why is None:
            value, why = parse_score(reply, max_score, score_regex)
            if why is None:
                score[i] = value
                return
        reasons[i] = f"openai_judge: {why}"

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(i, session) for i in range(batch)))
    return ScoredSamples(score=score, reasons=reasons)


def _run(coro):
    """Run ``coro`` to completion here, or in a helper thread when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target():
        try:
            box["out"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["err"] = e

    t = threading.Thread(target=target, name="openai-judge", daemon=True)
    t.start()
    t.join()
    if "err" in box:
        raise box["err"]
    return box["out"]


@register_reward("openai_judge")
def openai_judge(
    images: np.ndarray,
    prompts: Sequence[str],
    *,
    base_url: str | None = None,
    model: str | None = None,
    question: str = DEFAULT_QUESTION,
    system: str | None = None,
    max_score: float = 10.0,
    score_regex: str | None = None,
    api_key_env: str = "OPENAI_API_KEY",
    timeout: float = 60.0,
    retries: int = 1,
    backoff: float = 0.5,
    concurrency: int = 16,
    temperature: float = 0.0,
    max_tokens: int = 16,
    image_format: str = "png",
    rows: Sequence[dict | None] | None = None,
    **_unused: Any,
) -> ScoredSamples:
    """Score each image with a judge model behind ``{base_url}/chat/completions`` (see the module docstring).

    Returns a :class:`ScoredSamples`: the judge's number / ``max_score`` per
    image, NaN with a reason where that image's request or reply failed.
    Arguments that cannot work for any image (no ``base_url`` or ``model``, a
    bad number) raise ``ValueError`` naming the key.
    """
    # 1. arguments: a mistake here is the config's, so say which key fixes it.
    where = "`reward.reward_functions.<name>.kwargs` (or `+reward.reward_kwargs`)"
    if not base_url or not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise ValueError(f"`base_url` = {base_url!r} for `openai_judge`: set it in {where} to the server's "
                         "OpenAI-compatible root, e.g. http://judge-host:8000/v1")
    if not model or not isinstance(model, str):
        raise ValueError(f"`model` = {model!r} for `openai_judge`: set it in {where} to the served model's name "
                         "(GET {base_url}/models lists them)")
    for key, value, low in (("max_score", max_score, 0.0), ("timeout", timeout, 0.0)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > low):
            raise ValueError(f"`{key}` = {value!r} for `openai_judge`: expected a number > {low:g}")
    if not (isinstance(retries, int) and retries >= 0) or not (isinstance(concurrency, int) and concurrency >= 1):
        raise ValueError(f"`retries` = {retries!r} (int >= 0) and `concurrency` = {concurrency!r} (int >= 1) "
                         "for `openai_judge`")
    if image_format not in ("png", "jpeg"):
        raise ValueError(f"`image_format` = {image_format!r} for `openai_judge`: use 'png' or 'jpeg'")
    if score_regex is not None:
        re.compile(score_regex)  # a bad pattern raises re.error naming it
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"`images` must be uint8 [B, H, W, 3], got {images.dtype} {tuple(images.shape)}")
    # 2. ask, one request per image, `concurrency` at a time.
    key = os.environ.get(api_key_env) if api_key_env else None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = base_url.rstrip("/") + "/chat/completions"
    return _run(_judge_all(images, [str(p) for p in prompts], rows, url=url, model=model, question=question,
                           system=system, max_score=float(max_score), score_regex=score_regex, timeout=float(timeout),
                           retries=retries, backoff=float(backoff), concurrency=concurrency,
                           temperature=temperature, max_tokens=max_tokens, image_format=image_format,
                           headers=headers))
