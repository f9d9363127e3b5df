"""Held-out scoring: GenEval's overall figure and the stratified paired bootstrap on a gain."""

from __future__ import annotations

import numpy as np
import pytest

from omnirl_async.data.prompts import HELDOUT_COMPOSITION, heldout_prompts, prompt_category
from omnirl_async.models.heldout import bootstrap_gain, overall_accuracy

PROMPTS = heldout_prompts()
CATS = np.array([prompt_category(p) for p in PROMPTS])


def test_the_gain_is_the_difference_of_the_overall_figures():
    rng = np.random.default_rng(0)
    before, after = rng.integers(0, 5, len(PROMPTS)) / 4, rng.integers(0, 5, len(PROMPTS)) / 4
    gain, lo, hi = bootstrap_gain(PROMPTS, before, after)
    assert gain == pytest.approx(100 * (overall_accuracy(PROMPTS, after) - overall_accuracy(PROMPTS, before)))
    assert lo < gain < hi


def test_draws_keep_the_composition_so_a_gain_constant_within_each_category_has_no_spread():
    """+40 points on every `single` prompt, 0 elsewhere: overall +10 in every draw that keeps 8 single prompts
    (an unstratified draw holding 3 or 14 of them would move it)."""
    assert dict(zip(*np.unique(CATS, return_counts=True))) == HELDOUT_COMPOSITION
    before = np.full(len(PROMPTS), 0.5)
    after = before + np.where(CATS == "single", 0.4, 0.0)
    assert bootstrap_gain(PROMPTS, before, after) == pytest.approx((10.0, 10.0, 10.0))


def test_the_interval_matches_the_normal_approximation_within_a_category():
    rng = np.random.default_rng(1)
    before = np.full(len(PROMPTS), 0.5)
    after = before.copy()
    pos = CATS == "position"
    after[pos] += rng.choice([-0.5, 0.5], pos.sum())  # only `position` (128 prompts) varies
    gain, lo, hi = bootstrap_gain(PROMPTS, before, after, n=20000)
    d = 100 * (after - before)[pos]
    half = 1.96 * d.std() / np.sqrt(pos.sum()) / 4  # one of four equally weighted categories
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.1)
    assert (lo + hi) / 2 == pytest.approx(gain, abs=0.3 * half)


def test_before_and_after_must_pair_up():
    with pytest.raises(ValueError, match="one before and one after value per prompt"):
        bootstrap_gain(PROMPTS, np.zeros(len(PROMPTS)), np.zeros(len(PROMPTS) - 1))
