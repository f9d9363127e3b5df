"""Held-out strict accuracy per prompt, GenEval's overall figure, and a paired bootstrap interval on a gain.

Used by ``make demo`` and the benchmarks: the same prompts and seeds are scored before and after training, so
the interval resamples prompts and keeps each prompt's before/after pair together.
"""

from __future__ import annotations

import numpy as np

__all__ = ["bootstrap_gain", "overall_accuracy", "per_prompt_strict"]


def per_prompt_strict(res) -> tuple[list[str], np.ndarray]:
    """Strict accuracy per prompt (mean over its images) of an ``EvalResult``, prompts in first-seen order."""
    keys = [k for k in res.extra if k.endswith("strict")]
    if not keys:
        raise ValueError(f"the reward gave no `strict` field (fields: {sorted(res.extra)}); held-out strict "
                         "accuracy needs a GenEval-style reward such as tiny_geneval")
    strict = res.extra[keys[0]]
    order: dict[str, list[float]] = {}
    for p, s in zip(res.prompts, strict):
        order.setdefault(p, []).append(float(s > 0.5))
    return list(order), np.array([np.mean(v) for v in order.values()])


def overall_accuracy(prompts: list[str], acc: np.ndarray) -> float:
    """GenEval's overall figure: the mean over prompt categories of the mean accuracy in each."""
    from omnirl_async.data.prompts import prompt_category

    cats: dict[str, list[float]] = {}
    for p, a in zip(prompts, acc):
        cats.setdefault(prompt_category(p), []).append(float(a))
    return float(np.mean([np.mean(v) for v in cats.values()]))


def bootstrap_gain(prompts: list[str], before: np.ndarray, after: np.ndarray, *, n: int = 2000,
                   seed: int = 0) -> tuple[float, float, float]:
    """Gain in overall strict accuracy (points) and its 95 % interval, resampling prompts (paired)."""
    if len(prompts) != len(before) or len(before) != len(after):
        raise ValueError(f"paired bootstrap needs one before and one after value per prompt: {len(prompts)} "
                         f"prompts, {len(before)} before, {len(after)} after")
    rng = np.random.default_rng(seed)
    gain = 100 * (overall_accuracy(prompts, after) - overall_accuracy(prompts, before))
    draws = []
    for _ in range(n):
        idx = rng.integers(0, len(prompts), len(prompts))
        ps = [prompts[i] for i in idx]
        draws.append(100 * (overall_accuracy(ps, after[idx]) - overall_accuracy(ps, before[idx])))
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return gain, float(lo), float(hi)
