"""Group advantages against hand computation (numpy float64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnirl_async.algos import (
    DiffusionAdvantageEstimator,
    compute_flow_grpo_outcome_advantage,
    get_diffusion_adv_estimator_fn,
    register_diffusion_adv_est,
)
from omnirl_async.algos.advantage import compute_dance_grpo_outcome_advantage, registered_adv_estimators

R = [1.0, 3.0, 2.0, 6.0, 0.5, 0.5, 9.0]
IDX = ["a", "b", "a", "b", "c", "c", "d"]  # groups a, b, c (equal rewards), d (single member)


def _hand(rewards, index, *, global_std, norm=True, eps=1e-4, ddof=0, clip=5.0):
    r = np.asarray(rewards, dtype=np.float64)
    idx = np.asarray(index)
    out = np.zeros_like(r)
    batch_std = r.std(ddof=ddof) if len(r) > ddof else 0.0
    for g in np.unique(idx):
        sel = idx == g
        mean = r[sel].mean()
        if global_std:
            std = batch_std
        elif sel.sum() > 1:
            std = r[sel].std(ddof=ddof)
        else:
            std = batch_std if batch_std > 0 else 1.0
        out[sel] = (r[sel] - mean) / (std + eps) if norm else r[sel] - mean
    return np.clip(out, -clip, clip) if clip is not None else out


@pytest.mark.parametrize("global_std", [True, False])
@pytest.mark.parametrize("norm", [True, False])
def test_flow_grpo_matches_hand_computation(global_std, norm):
    adv, metrics = compute_flow_grpo_outcome_advantage(torch.tensor(R), IDX, global_std=global_std,
                                                       norm_adv_by_std_in_grpo=norm, adv_clip_max=None)
    expected = _hand(R, IDX, global_std=global_std, norm=norm, clip=None)
    np.testing.assert_allclose(adv.numpy(), expected, rtol=1e-6, atol=1e-6)
    assert adv.dtype == torch.float32 and adv.shape == (7,)
    # groups c (equal rewards) and d (single member) carry no signal: 2 of 4 groups.
    assert metrics["critic/rewards/zero_std_ratio"] == pytest.approx(0.5)
    assert torch.equal(adv[4:], torch.zeros(3))


def test_global_std_is_population_std():
    r = torch.tensor([0.0, 1.0, 2.0, 3.0])
    adv, _ = compute_flow_grpo_outcome_advantage(r, [0, 0, 1, 1], adv_clip_max=None)
    pop = np.std([0, 1, 2, 3])  # ddof = 0
    np.testing.assert_allclose(adv.numpy(), [-0.5 / (pop + 1e-4), 0.5 / (pop + 1e-4)] * 2, rtol=1e-6)


def test_per_group_std_uses_each_group():
    r = torch.tensor([0.0, 2.0, 10.0, 30.0])
    adv, _ = compute_flow_grpo_outcome_advantage(r, [0, 0, 1, 1], global_std=False, adv_clip_max=None)
    np.testing.assert_allclose(adv.numpy(), [-1 / 1.0001, 1 / 1.0001, -10 / 10.0001, 10 / 10.0001], rtol=1e-6)


def test_single_member_groups_get_zero_and_no_nan():
    adv, m = compute_flow_grpo_outcome_advantage(torch.tensor([4.0]), ["x"], global_std=False)
    assert torch.equal(adv, torch.zeros(1))
    adv, m = compute_flow_grpo_outcome_advantage(torch.tensor([1.0, 2.0, 3.0]), ["x", "y", "z"], global_std=False)
    assert torch.equal(adv, torch.zeros(3)) and m["critic/rewards/zero_std_ratio"] == 1.0


def test_clip():
    r = torch.tensor([0.0] * 9 + [1.0])  # the outlier gets A = 0.9 / 0.3 = 3 > 2
    adv, _ = compute_flow_grpo_outcome_advantage(r, [0] * 10, adv_clip_max=2.0)
    raw = _hand(r.tolist(), [0] * 10, global_std=True, clip=None)
    assert raw.max() > 2.0
    np.testing.assert_allclose(adv.numpy(), np.clip(raw, -2.0, 2.0), rtol=1e-6)
    assert float(adv.max()) == 2.0


@pytest.mark.parametrize("mode, fn", [
    ("continuous", lambda a: a),
    ("positive_only", lambda a: np.maximum(a, 0)),
    ("negative_only", lambda a: np.minimum(a, 0)),
    ("one_only", lambda a: (a > 0).astype(np.float64)),
    ("binary", np.sign),
])
def test_adv_modes(mode, fn):
    adv, _ = compute_flow_grpo_outcome_advantage(torch.tensor(R), IDX, adv_mode=mode)
    base = _hand(R, IDX, global_std=True)
    np.testing.assert_allclose(adv.numpy(), fn(base), rtol=1e-6, atol=1e-7)


def test_dance_uses_unbiased_per_group_std():
    adv, _ = compute_dance_grpo_outcome_advantage(torch.tensor(R), IDX, adv_clip_max=None)
    np.testing.assert_allclose(adv.numpy(), _hand(R, IDX, global_std=False, ddof=1, clip=None), rtol=1e-6)


def test_rewards_2d_and_numpy_index_and_noncontiguous_groups():
    r = torch.tensor([[1.0], [5.0], [2.0], [8.0]])
    adv, _ = compute_flow_grpo_outcome_advantage(r, np.array(["p", "q", "p", "q"], dtype=object),
                                                 adv_clip_max=None)
    np.testing.assert_allclose(adv.numpy(), _hand([1, 5, 2, 8], ["p", "q", "p", "q"], global_std=True, clip=None),
                               rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.floats(-100, 100, allow_nan=False)), min_size=1, max_size=24),
       st.booleans(), st.booleans())
def test_property_groups_sum_to_zero_before_clipping(items, global_std, norm):
    idx = [g for g, _ in items]
    r = torch.tensor([x for _, x in items], dtype=torch.float64)
    adv, m = compute_flow_grpo_outcome_advantage(r, idx, global_std=global_std, norm_adv_by_std_in_grpo=norm,
                                                 adv_clip_max=None)
    assert torch.isfinite(adv).all()
    scale = max(1.0, float(r.abs().max())) / 1e-4
    for g in set(idx):
        sel = torch.tensor([i == g for i in idx])
        assert abs(float(adv[sel].sum())) <= 1e-9 * scale * sel.sum()
    assert 0.0 <= m["critic/rewards/zero_std_ratio"] <= 1.0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-50, 50, allow_nan=False), min_size=2, max_size=16), st.floats(0.1, 5.0))
def test_property_clip_bounds(values, clip):
    adv, _ = compute_flow_grpo_outcome_advantage(torch.tensor(values), [0] * len(values), adv_clip_max=clip)
    assert float(adv.abs().max()) <= clip + 1e-6


# ---- registry ----------------------------------------------------------------

def test_registry_names_and_lookup():
    for e in DiffusionAdvantageEstimator:
        assert e.value in registered_adv_estimators()
    assert get_diffusion_adv_estimator_fn("flow_grpo") is compute_flow_grpo_outcome_advantage
    assert get_diffusion_adv_estimator_fn(DiffusionAdvantageEstimator.MIX_GRPO) is compute_flow_grpo_outcome_advantage
    assert get_diffusion_adv_estimator_fn("grpo_guard") is compute_flow_grpo_outcome_advantage
    assert get_diffusion_adv_estimator_fn("dance_grpo") is compute_dance_grpo_outcome_advantage


def test_unknown_estimator_lists_registered():
    with pytest.raises(ValueError) as e:
        get_diffusion_adv_estimator_fn("gae")
    assert "'gae'" in str(e.value) and "flow_grpo" in str(e.value) and "dance_grpo" in str(e.value)


def test_register_conflict_and_custom():
    @register_diffusion_adv_est("test_only_const")
    def const(rewards, index, **kw):
        return torch.ones_like(rewards), {}

    assert get_diffusion_adv_estimator_fn("test_only_const") is const
    with pytest.raises(ValueError, match="already registered"):
        register_diffusion_adv_est("test_only_const")(lambda r, i: None)


@pytest.mark.parametrize("kwargs, match", [
    (dict(adv_mode="sigmoid"), "adv_mode"),
    (dict(adv_clip_max=0.0), "adv_clip_max"),
])
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_flow_grpo_outcome_advantage(torch.tensor(R), IDX, **kwargs)


def test_index_length_mismatch_raises():
    with pytest.raises(ValueError, match="index"):
        compute_flow_grpo_outcome_advantage(torch.tensor(R), IDX[:-1])
