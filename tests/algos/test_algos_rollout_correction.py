"""Rollout correction (IS weights, RS masks, metrics) against direct computation."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnirl_async.algos import compute_rollout_correction
from omnirl_async.algos.rollout_correction import (RS_CRITERIA, RolloutCorrectionResult, compute_bypass_correction,
                                                   correction_weights)


def cfg(**kw):
    base = dict(rollout_is=None, rollout_is_threshold=2.0, rollout_is_batch_normalize=False,
                rollout_rs=None, rollout_rs_threshold=None, bypass_mode=False)
    base.update(kw)
    return SimpleNamespace(**base)


def _logps(seed=0, b=5, t=4, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    beh = torch.randn(b, t, generator=g, dtype=torch.float64)
    old = beh + scale * torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 3:] = False
    mask[3, 2:] = False
    return old, beh, mask


# ---- on-policy ---------------------------------------------------------------

@pytest.mark.parametrize("config", [
    cfg(),
    cfg(rollout_is="token"),
    cfg(rollout_is="sequence", rollout_is_batch_normalize=True),
    cfg(rollout_is="token", rollout_is_threshold="0.5_2.0", rollout_is_batch_normalize=True),
    cfg(rollout_is="sequence", rollout_rs="token_k1,seq_sum_k2,seq_mean_k3,seq_max_k3", rollout_rs_threshold=1.5),
])
def test_on_policy_weights_are_exactly_one(config):
    old, _, mask = _logps()
    res = compute_rollout_correction(old, old.clone(), None, config)
    assert torch.equal(res.weights, torch.ones_like(old))
    assert torch.equal(res.rs_mask, torch.ones_like(old))
    res = compute_rollout_correction(old, old.clone(), mask, config)
    assert torch.equal(res.weights[mask], torch.ones(int(mask.sum()), dtype=old.dtype))
    assert torch.equal(res.weights[~mask], torch.zeros(int((~mask).sum()), dtype=old.dtype))
    assert res.metrics["rollout_corr/rs_reject_frac"] == 0.0
    assert res.metrics["rollout_corr/kl"] == 0.0 and res.metrics["rollout_corr/is_weight_mean"] == 1.0


# ---- IS weights --------------------------------------------------------------

def test_token_is_truncated():
    old, beh, mask = _logps()
    res = compute_rollout_correction(old, beh, mask, cfg(rollout_is="token", rollout_is_threshold=1.5))
    expected = torch.where(mask, torch.exp(old - beh).clamp(max=1.5), torch.zeros_like(old))
    torch.testing.assert_close(res.weights, expected)
    torch.testing.assert_close(res.is_weights, expected)
    assert (res.weights == 1.5).any()  # truncation was exercised


def test_sequence_is_uses_valid_steps_only_and_is_copied_to_every_step():
    old, beh, mask = _logps()
    beh_garbage = beh.clone()
    beh_garbage[~mask] = 1e6  # padded steps must not matter
    res = compute_rollout_correction(old, beh_garbage, mask, cfg(rollout_is="sequence", rollout_is_threshold=1e9))
    seq = torch.stack([(old[i][mask[i]] - beh[i][mask[i]]).sum() for i in range(5)])
    w = torch.exp(seq.clamp(-20, 20))
    expected = w[:, None].expand_as(old) * mask
    torch.testing.assert_close(res.weights, expected)


def test_sequence_is_exponent_clamped_at_20():
    old = torch.zeros(2, 3, dtype=torch.float64)
    beh = torch.tensor([[-10.0, -10.0, -10.0], [10.0, 10.0, 10.0]], dtype=torch.float64)
    res = compute_rollout_correction(old, beh, None, cfg(rollout_is="sequence", rollout_is_threshold=1e12))
    torch.testing.assert_close(res.weights[0], torch.full((3,), math.exp(20), dtype=torch.float64))
    torch.testing.assert_close(res.weights[1], torch.full((3,), math.exp(-20), dtype=torch.float64))


def test_lo_hi_masks_weights_outside_bounds():
    old, beh, mask = _logps()
    res = compute_rollout_correction(old, beh, mask, cfg(rollout_is="token", rollout_is_threshold="0.8_1.25"))
    r = torch.exp(old - beh)
    inside = (r >= 0.8) & (r <= 1.25) & mask
    torch.testing.assert_close(res.weights, torch.where(inside, r, torch.zeros_like(r)))
    assert inside.any() and (mask & ~inside).any()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalize_after_truncation(level):
    old, beh, mask = _logps()
    res = compute_rollout_correction(old, beh, mask, cfg(rollout_is=level, rollout_is_threshold=1.5,
                                                         rollout_is_batch_normalize=True))
    m = mask.double()
    if level == "token":
        w = torch.exp(old - beh).clamp(max=1.5) * m
        norm = w.sum() / m.sum()
    else:
        seq = ((old - beh) * m).sum(-1)
        row_w = torch.exp(seq.clamp(-20, 20)).clamp(max=1.5)
        w = row_w[:, None] * m
        norm = row_w.mean()  # one weight per row
    torch.testing.assert_close(res.weights, w / norm)


def test_metrics_match_direct_computation():
    old, beh, mask = _logps()
    res = compute_rollout_correction(old, beh, mask, cfg(rollout_is="token", rollout_is_threshold=1.5,
                                                         rollout_rs="token_k2", rollout_rs_threshold=0.1))
    lr = (old - beh)[mask]
    w = torch.exp(lr).clamp(max=1.5)
    keep = 0.5 * lr**2 <= 0.1
    m = res.metrics
    assert m["rollout_corr/kl"] == pytest.approx(float((-lr).mean()))
    assert m["rollout_corr/k3_kl"] == pytest.approx(float((torch.exp(lr) - lr - 1).mean()))
    assert m["rollout_corr/logprob_abs_diff_mean"] == pytest.approx(float(lr.abs().mean()))
    assert m["rollout_corr/logprob_abs_diff_max"] == pytest.approx(float(lr.abs().max()))
    assert m["rollout_corr/is_weight_mean"] == pytest.approx(float(w.mean()))
    assert m["rollout_corr/is_weight_max"] == pytest.approx(float(w.max()))
    assert m["rollout_corr/rs_reject_frac"] == pytest.approx(float((~keep).double().mean()))
    assert 0 < m["rollout_corr/rs_reject_frac"] < 1


# ---- rejection sampling ------------------------------------------------------

def _direct_keep(crit, lr, mask, lo, hi):
    m = mask.double()
    lr = lr.clamp(-20, 20) * m
    k = {"k1": -lr, "k2": 0.5 * lr**2, "k3": torch.exp(lr) - 1 - lr}[crit[-2:]]
    if crit.startswith("token"):
        stat = k
    elif crit.startswith("seq_sum"):
        stat = (k * m).sum(-1, keepdim=True).expand_as(k)
    elif crit.startswith("seq_mean"):
        stat = ((k * m).sum(-1) / m.sum(-1)).unsqueeze(-1).expand_as(k)
    else:
        stat = torch.stack([k[i][mask[i]].max() for i in range(k.shape[0])]).unsqueeze(-1).expand_as(k)
    keep = (stat >= math.log(lo)) & (stat <= math.log(hi)) if crit.endswith("k1") else stat <= hi
    return keep & mask


THRESH = {"k1": 1.3, "k2": 0.05, "k3": 0.05}


@pytest.mark.parametrize("crit", RS_CRITERIA)
def test_each_rs_criterion(crit):
    old, beh, mask = _logps(scale=0.3)
    u = THRESH[crit[-2:]]
    if crit.startswith("seq_sum"):
        u = {"k1": 2.0, "k2": 0.15, "k3": 0.15}[crit[-2:]]
    res = compute_rollout_correction(old, beh, mask, cfg(rollout_rs=crit, rollout_rs_threshold=u))
    lo, hi = (1 / u, u) if crit.endswith("k1") else (None, u)
    keep = _direct_keep(crit, old - beh, mask, lo, hi)
    torch.testing.assert_close(res.rs_mask, keep.double())
    torch.testing.assert_close(res.weights, keep.double())  # no IS: weight = keep
    assert keep.any() and (mask & ~keep).any(), "threshold should both keep and reject something"


def test_k1_lo_hi_and_combined_criteria_with_is():
    old, beh, mask = _logps(scale=0.3)
    res = compute_rollout_correction(old, beh, mask, cfg(rollout_is="token", rollout_is_threshold=2.0,
                                                         rollout_rs="token_k1, seq_max_k2",
                                                         rollout_rs_threshold="0.7_1.2,0.2"))
    keep = _direct_keep("token_k1", old - beh, mask, 0.7, 1.2) & _direct_keep("seq_max_k2", old - beh, mask, None, 0.2)
    torch.testing.assert_close(res.rs_mask, keep.double())
    w = torch.exp(old - beh).clamp(max=2.0)
    torch.testing.assert_close(res.weights, w * keep.double())
    assert set(res.metrics) >= {"rollout_corr/rs_token_k1_reject_frac", "rollout_corr/rs_seq_max_k2_reject_frac"}


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["token", "sequence"]), st.floats(1.0, 5.0))
def test_property_weights_bounded_and_zero_on_padding(seed, level, u):
    old, beh, mask = _logps(seed=seed)
    res = compute_rollout_correction(old, beh, mask, cfg(rollout_is=level, rollout_is_threshold=u,
                                                         rollout_rs="token_k1", rollout_rs_threshold=u))
    assert torch.all(res.weights[~mask] == 0)
    assert torch.all((res.weights >= 0) & (res.weights <= u))
    assert torch.all(res.weights[res.rs_mask == 0] == 0)


# ---- validation --------------------------------------------------------------

@pytest.mark.parametrize("config, match", [
    (cfg(rollout_rs="seq_max_k1", rollout_rs_threshold=2.0), "seq_max_k1"),
    (cfg(rollout_rs="token_k4", rollout_rs_threshold=2.0), "token_k1"),
    (cfg(rollout_rs="token_k2"), "rollout_rs_threshold"),
    (cfg(rollout_rs="token_k2", rollout_rs_threshold="0.1_0.2"), "k2/k3"),
    (cfg(rollout_rs="token_k1,token_k2", rollout_rs_threshold="2.0,0.1,0.3"), "criteria"),
    (cfg(rollout_rs="token_k1", rollout_rs_threshold=0.5), "u >= 1"),
    (cfg(rollout_is="step"), "rollout_is"),
    (cfg(rollout_is="token", rollout_is_threshold=[0.5, 2.0]), "lo_hi"),
    (cfg(rollout_is="token", rollout_is_threshold="2.0_0.5"), "lower bound"),
    (cfg(rollout_is="token", rollout_is_threshold=-1.0), "> 0"),
    (cfg(rollout_is="token", rollout_is_threshold="abc"), "rollout_is_threshold"),
])
def test_bad_config_raises(config, match):
    old, beh, mask = _logps()
    with pytest.raises(ValueError, match=match):
        compute_rollout_correction(old, beh, mask, config)


def test_unknown_criterion_lists_allowed():
    old, beh, _ = _logps()
    with pytest.raises(ValueError) as e:
        compute_rollout_correction(old, beh, None, cfg(rollout_rs="foo", rollout_rs_threshold=1.0))
    assert all(c in str(e.value) for c in RS_CRITERIA)


def test_truncation_below_one_warns():
    old, beh, _ = _logps()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        compute_rollout_correction(old, beh, None, cfg(rollout_is="token", rollout_is_threshold=0.9))
    assert any("rollout_is_threshold" in str(w.message) for w in rec)


def test_shape_errors_and_mapping_config():
    old, beh, mask = _logps()
    with pytest.raises(ValueError, match="B, T"):
        compute_rollout_correction(old[:, 0], beh[:, 0], None, cfg())
    with pytest.raises(ValueError, match="mask"):
        compute_rollout_correction(old, beh, mask[:, :2], cfg())
    with pytest.raises(ValueError, match="no valid step"):
        compute_rollout_correction(old, beh, torch.zeros_like(mask), cfg())
    res = compute_rollout_correction(old, beh, mask, {"rollout_is": "token", "rollout_is_threshold": 2.0})
    torch.testing.assert_close(res.weights, torch.exp(old - beh).clamp(max=2.0) * mask)


# ---- bypass mode: current policy (detached) vs behaviour, computed in the loss ---------------------------------

# every option that makes sense per SDE step, and the sequence-level ones (whole rows only)
TOKEN_CONFIGS = [
    cfg(bypass_mode=True),
    cfg(bypass_mode=True, rollout_is="token", rollout_is_threshold=1.3),
    cfg(bypass_mode=True, rollout_is="token", rollout_is_threshold="0.8_1.25"),
    cfg(bypass_mode=True, rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True),
    cfg(bypass_mode=True, rollout_rs="token_k1", rollout_rs_threshold=1.3),
    cfg(bypass_mode=True, rollout_rs="token_k2,token_k3", rollout_rs_threshold="0.05,0.04"),
    cfg(bypass_mode=True, rollout_is="token", rollout_is_threshold="0.7_1.5",
        rollout_rs="token_k1,token_k3", rollout_rs_threshold="0.75_1.2,0.05"),
]
SEQUENCE_CONFIGS = [
    cfg(bypass_mode=True, rollout_is="sequence", rollout_is_threshold=3.0, rollout_is_batch_normalize=True),
    cfg(bypass_mode=True, rollout_is="token", rollout_rs="seq_mean_k1,seq_max_k2", rollout_rs_threshold="1.2,0.1"),
    cfg(bypass_mode=True, rollout_is="sequence", rollout_is_threshold="0.3_3.0",
        rollout_rs="seq_sum_k3", rollout_rs_threshold=0.15),
]


def _assert_same_correction(byp, dec, decoupled_keep_zeroes=True):
    """Bypass (current = proximal) and decoupled agree on IS weights, RS mask, rejected set and metrics."""
    torch.testing.assert_close(byp.is_weights, dec.is_weights, rtol=0, atol=0)
    torch.testing.assert_close(byp.rs_mask, dec.rs_mask, rtol=0, atol=0)
    # the same elements get weight 0 (RS, masked IS, padding) ...
    assert torch.equal(byp.weights == 0, dec.weights == 0)
    # ... and decoupled's multiplier is bypass's keep mask times the IS value, which bypass leaves to the ratio
    torch.testing.assert_close(dec.weights, byp.weights * byp.is_weights, rtol=0, atol=0)
    assert set(byp.metrics) == set(dec.metrics)
    for k, v in dec.metrics.items():
        assert byp.metrics[k] == v, k


@pytest.mark.parametrize("config", TOKEN_CONFIGS + SEQUENCE_CONFIGS)
def test_bypass_equals_decoupled_when_current_equals_proximal_whole_rows(config):
    prox, beh, mask = _logps(scale=0.3)
    current = prox.clone().requires_grad_(True)  # current policy == proximal policy, as at the first mini-batch
    dec = compute_rollout_correction(prox, beh, mask, config)
    byp = compute_bypass_correction(current, beh, config, mask)
    _assert_same_correction(byp, dec)
    rejected = (dec.weights == 0) & mask
    if config.rollout_rs is not None or isinstance(config.rollout_is_threshold, str):
        assert rejected.any() and (mask & ~rejected).any(), "the case should both keep and reject steps"


@pytest.mark.parametrize("config", TOKEN_CONFIGS)
def test_bypass_per_step_equals_decoupled_column(config):
    """What the loss sees: one SDE step [B] at a time. Token-level options give decoupled's column t
    (batch normalisation is over what one call sees, so it is compared on a one-step batch)."""
    prox, beh, _ = _logps(scale=0.3, b=64, t=3)
    for t in range(prox.shape[1]):
        dec = compute_rollout_correction(prox[:, t:t + 1], beh[:, t:t + 1], None, config)
        byp = compute_bypass_correction(prox[:, t].clone().requires_grad_(True), beh[:, t], config)
        assert byp.weights.shape == (64,)
        _assert_same_correction(byp, RolloutCorrectionResult(dec.weights[:, 0], dec.rs_mask[:, 0], dec.metrics,
                                                             dec.is_weights[:, 0]))
    if not config.rollout_is_batch_normalize:  # without normalisation a column of the whole batch is the same
        full = compute_rollout_correction(prox, beh, None, config)
        for t in range(prox.shape[1]):
            byp = compute_bypass_correction(prox[:, t], beh[:, t], config)
            torch.testing.assert_close(byp.is_weights, full.is_weights[:, t], rtol=0, atol=0)
            torch.testing.assert_close(byp.rs_mask, full.rs_mask[:, t], rtol=0, atol=0)
            assert torch.equal(byp.weights == 0, full.weights[:, t] == 0)


def test_bypass_compares_current_with_behaviour_direct_numpy():
    """Bypass: old := behaviour, current != behaviour. The correction is current vs behaviour (numpy formula);
    the old-vs-behaviour correction the learner used to compute is the identity; no gradient in the outputs."""
    g = np.random.default_rng(3)
    beh_np = g.normal(size=(40,))
    cur_np = beh_np + 0.25 * g.normal(size=(40,))
    config = cfg(bypass_mode=True, rollout_is="token", rollout_is_threshold="0.9_1.4",
                 rollout_rs="token_k1,token_k3", rollout_rs_threshold="0.7_1.25,0.03")
    beh = torch.tensor(beh_np)
    cur = torch.tensor(cur_np, requires_grad=True)
    res = compute_bypass_correction(cur * 1.0, beh, config)  # a non-leaf with a graph, as in the loss

    lr = cur_np - beh_np
    r = np.exp(lr)
    is_keep = (r >= 0.9) & (r <= 1.4)
    w = np.where(is_keep, r, 0.0)
    k1_keep = (-lr >= np.log(0.7)) & (-lr <= np.log(1.25))
    k3 = r - 1.0 - lr
    k3_keep = k3 <= 0.03
    keep = k1_keep & k3_keep
    np.testing.assert_allclose(res.is_weights.numpy(), w, rtol=1e-12)
    np.testing.assert_array_equal(res.rs_mask.numpy(), keep.astype(float))
    np.testing.assert_array_equal(res.weights.numpy(), (keep & is_keep).astype(float))
    assert 0 < keep.sum() < 40 and (keep & ~is_keep).any()  # both kinds of rejection were exercised
    m = res.metrics
    assert m["rollout_corr/kl"] == pytest.approx(float(np.mean(-lr)))
    assert m["rollout_corr/k3_kl"] == pytest.approx(float(np.mean(k3)))
    assert m["rollout_corr/logprob_abs_diff_mean"] == pytest.approx(float(np.mean(np.abs(lr))))
    assert m["rollout_corr/logprob_abs_diff_max"] == pytest.approx(float(np.max(np.abs(lr))))
    assert m["rollout_corr/is_weight_mean"] == pytest.approx(float(np.mean(w)))
    assert m["rollout_corr/is_weight_max"] == pytest.approx(float(np.max(w)))
    assert m["rollout_corr/rs_reject_frac"] == pytest.approx(float(np.mean(~keep)))
    assert m["rollout_corr/rs_token_k1_reject_frac"] == pytest.approx(float(np.mean(~k1_keep)))
    assert m["rollout_corr/rs_token_k3_reject_frac"] == pytest.approx(float(np.mean(~k3_keep)))
    # no gradient through the correction
    for t in (res.weights, res.rs_mask, res.is_weights):
        assert not t.requires_grad and t.grad_fn is None
    # what bypass mode did before: proximal := behaviour, compared with itself -> nothing at all
    old = compute_rollout_correction(beh[:, None], beh[:, None], None, config)
    assert torch.equal(old.weights, torch.ones(40, 1, dtype=beh.dtype))


@pytest.mark.parametrize("config", TOKEN_CONFIGS)
def test_bypass_current_equals_behaviour_is_identity(config):
    _, beh, mask = _logps()
    for t in range(beh.shape[1]):
        res = compute_bypass_correction(beh[:, t].clone().requires_grad_(True), beh[:, t].clone(), config)
        assert torch.equal(res.weights, torch.ones(5, dtype=beh.dtype))
        assert torch.equal(res.rs_mask, torch.ones(5, dtype=beh.dtype))
        assert torch.equal(res.is_weights, torch.ones(5, dtype=beh.dtype))
        assert res.metrics["rollout_corr/kl"] == 0.0 and res.metrics["rollout_corr/rs_reject_frac"] == 0.0
        assert res.metrics["rollout_corr/is_weight_mean"] == 1.0
    res = compute_bypass_correction(beh, beh.clone(), config, mask)
    assert torch.equal(res.weights, mask.to(beh.dtype)) and torch.equal(res.rs_mask, mask.to(beh.dtype))


@pytest.mark.parametrize("config", SEQUENCE_CONFIGS)
def test_bypass_refuses_sequence_options_for_one_step(config):
    _, beh, _ = _logps()
    with pytest.raises(ValueError, match="one SDE step at a time") as e:
        compute_bypass_correction(beh[:, 0], beh[:, 0], config)
    msg = str(e.value)
    assert "bypass_mode" in msg and ("rollout_is=sequence" in msg or "rollout_rs=seq_" in msg)


def test_bypass_shape_errors():
    _, beh, _ = _logps()
    with pytest.raises(ValueError, match=r"\[B\]"):
        compute_bypass_correction(beh[:, 0], beh[:, :2], cfg(bypass_mode=True))
    with pytest.raises(ValueError, match=r"\[B\]"):
        compute_bypass_correction(beh[None], beh[None], cfg(bypass_mode=True))


@pytest.mark.parametrize("opts", [{}, {"rollout_is": "token", "rollout_is_threshold": 1.1},
                                  {"rollout_is": "sequence", "rollout_is_threshold": "0.5_1.5"},
                                  {"rollout_is": "token", "rollout_is_batch_normalize": True},
                                  {"rollout_rs": "token_k1,seq_mean_k3", "rollout_rs_threshold": "1.2,0.01"}])
def test_correction_weights_are_the_full_computations_weights(opts):
    g = torch.Generator().manual_seed(3)
    old, behaviour = torch.randn(6, 4, generator=g) * 0.3, torch.randn(6, 4, generator=g) * 0.3
    mask = torch.rand(6, 4, generator=g) > 0.2
    full = compute_rollout_correction(old, behaviour, mask, cfg(**opts))
    assert torch.equal(correction_weights(old, behaviour, mask, cfg(**opts)), full.weights)
    if opts.get("rollout_rs"):  # the rejection case does drop some steps, and keeps others
        assert 0 < float((full.rs_mask == 0).float().mean()) < 1
