"""Reward functions that fail on purpose, for the chaos tests (loaded by path as custom rewards).

Each scores an image by its mean brightness (a real, cheap score) and fails on
every third call of its process in one way: it raises, returns NaN, returns
the wrong shape, or sleeps past ``reward.timeout_s``. ``always_fails`` raises
on every call.
"""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np

_calls = itertools.count(1)
_lock = threading.Lock()


def _third_call() -> bool:
    with _lock:
        return next(_calls) % 3 == 0


def _brightness(images: np.ndarray) -> np.ndarray:
    return images.reshape(len(images), -1).mean(axis=1) / 255.0


def raises_every_third(images, prompts, **kwargs):
    if _third_call():
        raise ConnectionError("scorer service refused the connection")
    return _brightness(images)


def nan_every_third(images, prompts, **kwargs):
    score = _brightness(images)
    if _third_call():
        score = np.full_like(score, np.nan)
    return score


def wrong_shape_every_third(images, prompts, **kwargs):
    score = _brightness(images)
    return score[:-1] if _third_call() else score


def slow_every_third(images, prompts, sleep_s: float = 3.0, **kwargs):
    if _third_call():
        time.sleep(sleep_s)
    return _brightness(images)


def raises_on_a_red_triangle(images, prompts, **kwargs):
    """Fails every group of the prompt "a red triangle" (whichever call scores it), scores the rest."""
    if "a red triangle" in prompts:
        raise ConnectionError("scorer service refused the connection")
    return _brightness(images)


def slow_on_triangles(images, prompts, sleep_s: float = 4.0, **kwargs):
    """Scores every group; those of prompts with a triangle come sleep_s late (a long-tailed remote reward)."""
    if any("triangle" in p for p in prompts):
        time.sleep(sleep_s)
    return _brightness(images)


def always_fails(images, prompts, **kwargs):
    raise RuntimeError("the judge model is not loaded")


def mixed_every_third(images, prompts, sleep_s: float = 3.0, **kwargs):
    """Every third call fails, in turn: raises, NaN, wrong shape, too slow."""
    with _lock:
        k = next(_calls)
    score = _brightness(images)
    if k % 3:
        return score
    mode = (k // 3) % 4
    if mode == 0:
        raise ConnectionError("scorer service refused the connection")
    if mode == 1:
        return np.full_like(score, np.nan)
    if mode == 2:
        return score[:-1]
    time.sleep(sleep_s)
    return score


def hangs(images, prompts, sleep_s: float = 60.0, **kwargs):
    time.sleep(sleep_s)
    return _brightness(images)


def sleepy(images, prompts, sleep_s: float = 0.3, **kwargs):
    time.sleep(sleep_s)
    return _brightness(images)
