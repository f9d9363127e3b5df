"""Held-out strict accuracy per prompt, GenEval's overall figure, and a paired bootstrap interval on a gain.

Used by ``make demo`` and the benchmarks: the same prompts and seeds are scored before and after training, so
the interval resamples prompts (within their category) and keeps each prompt's before/after pair together.
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


def _strata(prompts: list[str]) -> dict[str, list[int]]:
    """Prompt indices by GenEval category (prompts outside the shapes grammar form one group, ``other``)."""
    from omnirl_async.models.evaluate import _category

    cats: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        cats.setdefault(_category(p) or "other", []).append(i)
    return cats


def overall_accuracy(prompts: list[str], acc: np.ndarray) -> float:
    """GenEval's overall figure: the mean over prompt categories of the mean accuracy in each."""
    acc = np.asarray(acc, dtype=np.float64)
    return float(np.mean([acc[idx].mean() for idx in _strata(prompts).values()]))


def bootstrap_gain(prompts: list[str], before: np.ndarray, after: np.ndarray, *, n: int = 2000,
                   seed: int = 0) -> tuple[float, float, float]:
    """Gain in overall strict accuracy (points) and its 95 % interval: a paired bootstrap stratified by category.

    Each draw resamples the prompts of every category within that category (keeping each prompt's before and
    after together), so a draw has the held-out set's composition: ``overall`` weighs the categories equally
    and their sizes are fixed by design (:data:`~omnirl_async.data.prompts.HELDOUT_COMPOSITION`); resampling
    across categories would let a draw hold 3 or 14 of the 8 ``single`` prompts, or none, and widen the
    interval with variation the held-out set does not have.
    """
    if len(prompts) != len(before) or len(before) != len(after):
        raise ValueError(f"paired bootstrap needs one before and one after value per prompt: {len(prompts)} "
                         f"prompts, {len(before)} before, {len(after)} after")
    diff = 100.0 * (np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64))
    cats = _strata(prompts)
    rng = np.random.default_rng(seed)
    gain = overall_accuracy(prompts, diff)
    draws = np.zeros(n)
    for idx in cats.values():
        members = diff[np.asarray(idx)]
        draws += members[rng.integers(0, len(members), (n, len(members)))].mean(axis=1)
    lo, hi = np.percentile(draws / len(cats), [2.5, 97.5])
    return gain, float(lo), float(hi)
