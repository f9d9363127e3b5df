"""Diffusion losses against their formulas, computed directly in the tests."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omnirl_async.algos import (
    DiffusionLossFn,
    DiffusionLossResult,
    FlowDPPOLoss,
    FlowGRPOLoss,
    GRPOGuardLoss,
    KLLoss,
    compute_rollout_correction,
    get_diffusion_loss_fn,
    register_diffusion_loss,
)
from omnirl_async.algos.losses import registered_losses


@dataclass
class LossCfg:
    loss_mode: str = "flow_grpo"
    clip_ratio: float = 1e-4
    adv_clip_max: float = 5.0
    mix_beta: float = 0.5
    ref_kl_coef: float = 0.0
    adaptive_weight_min: float = 1e-5
    dpo_beta: float = 2000.0
    kl_mask_threshold: float = 1e-5
    add_kl_coefficient: bool = True


def actor(**kw):
    base = dict(use_kl_loss=False, kl_loss_coef=0.001, loss_scale_factor=None)
    base.update(kw)
    return SimpleNamespace(**base)


B = 6


def _batch(seed=0, shape=(B, 4, 3, 3), spread=1e-3):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, generator=g, dtype=torch.float64)
    lp = (old + spread * torch.randn(B, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([2.0, -1.0, 0.5, -3.0, 7.0, -9.0], dtype=torch.float64)
    mean = torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_(True)
    old_mean = mean.detach() + 1e-3 * torch.randn(shape, generator=g, dtype=torch.float64)
    ref_mean = mean.detach() + 1e-2 * torch.randn(shape, generator=g, dtype=torch.float64)
    sig = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, 0.4], dtype=torch.float64)
    dt = torch.tensor([-0.1, -0.1, -0.2, -0.2, -0.05, -0.05], dtype=torch.float64)
    mo = dict(log_prob=lp, mean=mean, std=sig * torch.sqrt(-dt), sig=sig, dt=dt, ref_mean=ref_mean)
    data = dict(old_log_prob=old, advantages=adv, old_mean=old_mean)
    return mo, data


def _ppo(ratio, adv, eps):
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - eps, 1 + eps))


# ---- Flow-GRPO ---------------------------------------------------------------

def test_on_policy_ratio_is_one_and_gradient_is_minus_a_over_b():
    mo, data = _batch()
    lp = data["old_log_prob"].clone().requires_grad_(True)
    mo["log_prob"] = lp
    res = FlowGRPOLoss(LossCfg(), actor())(mo, data)
    assert res.metrics["actor/ratio_mean"] == 1.0
    assert res.metrics["actor/ratio_max"] == 1.0 and res.metrics["actor/ratio_min"] == 1.0
    assert res.metrics["actor/ppo_kl"] == 0.0 and res.metrics["actor/pg_clipfrac"] == 0.0
    res.loss.backward()
    a = data["advantages"].clamp(-5, 5)
    torch.testing.assert_close(lp.grad, -a / B)
    torch.testing.assert_close(res.loss.detach(), -a.mean())


def test_flow_grpo_matches_formula_and_metrics():
    mo, data = _batch(spread=3e-4)
    eps = 1e-4
    res = FlowGRPOLoss(LossCfg(clip_ratio=eps), actor())(mo, data)
    lr = mo["log_prob"].detach() - data["old_log_prob"]
    ratio = torch.exp(lr)
    a = data["advantages"].clamp(-5, 5)
    torch.testing.assert_close(res.loss.detach(), _ppo(ratio, a, eps).mean())
    assert res.metrics["actor/pg_loss"] == pytest.approx(float(_ppo(ratio, a, eps).mean()))
    assert res.metrics["actor/ppo_kl"] == pytest.approx(float((-lr).mean()))
    assert res.metrics["actor/pg_clipfrac"] == pytest.approx(float(((ratio - 1).abs() > eps).double().mean()))
    assert res.metrics["actor/ratio_max"] == pytest.approx(float(ratio.max()))
    assert res.metrics["actor/ratio_min"] == pytest.approx(float(ratio.min()))
    assert "actor/kl_loss" not in res.metrics


@pytest.mark.parametrize("adv, delta, grad_zero", [
    (1.0, +2e-4, True),    # A > 0, ratio above 1 + eps: clipped, no gradient
    (1.0, -2e-4, False),   # A > 0, ratio below 1 - eps: pessimistic branch keeps gradient
    (-1.0, -2e-4, True),   # A < 0, ratio below 1 - eps: clipped
    (-1.0, +2e-4, False),  # A < 0, ratio above 1 + eps: keeps gradient
    (1.0, +0.5e-4, False),  # inside the clip range: gradient
])
def test_clipping_at_the_boundary(adv, delta, grad_zero):
    old = torch.zeros(1, dtype=torch.float64)
    lp = torch.full((1,), delta, dtype=torch.float64, requires_grad=True)
    res = FlowGRPOLoss(LossCfg(clip_ratio=1e-4), actor())({"log_prob": lp},
                                                           {"old_log_prob": old, "advantages": torch.tensor([adv])})
    res.loss.backward()
    if grad_zero:
        assert lp.grad.item() == 0.0
        assert res.metrics["actor/pg_clipfrac"] == 1.0
        assert res.loss.item() == pytest.approx(-adv * (1 + (1e-4 if delta > 0 else -1e-4)))
    else:
        assert lp.grad.item() == pytest.approx(-adv * torch.exp(torch.tensor(delta)).item())


def test_advantages_are_clipped_inside_the_loss():
    lp = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    res = FlowGRPOLoss(LossCfg(adv_clip_max=2.0), actor())(
        {"log_prob": lp}, {"old_log_prob": torch.zeros(2, dtype=torch.float64), "advantages": torch.tensor([10.0, -3.0])})
    res.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-2.0, 2.0], dtype=torch.float64) / 2)


def test_is_weights_multiply_and_rejected_stay_in_denominator():
    mo, data = _batch()
    w = torch.tensor([1.0, 0.0, 2.0, 1.0, 0.0, 0.5], dtype=torch.float64)
    res = FlowGRPOLoss(LossCfg(), actor())(mo, dict(data, is_weights=w))
    ratio = torch.exp(mo["log_prob"].detach() - data["old_log_prob"])
    per = _ppo(ratio, data["advantages"].clamp(-5, 5), 1e-4)
    torch.testing.assert_close(res.loss.detach(), (per * w).sum() / B)


def test_kl_added_with_coefficient_when_use_kl_loss():
    mo, data = _batch()
    base = FlowGRPOLoss(LossCfg(), actor())(mo, data)
    res = FlowGRPOLoss(LossCfg(), actor(use_kl_loss=True, kl_loss_coef=0.3))(mo, data)
    diff = (mo["mean"].detach() - mo["ref_mean"]) ** 2
    kl = (diff.mean(dim=(1, 2, 3)) / (2 * mo["sig"] ** 2)).mean()
    assert res.metrics["actor/kl_loss"] == pytest.approx(float(kl))
    torch.testing.assert_close(res.loss.detach(), base.loss.detach() + 0.3 * kl)


def test_kl_loss_zero_when_means_equal_and_formula_otherwise():
    mo, _ = _batch()
    same = KLLoss(LossCfg())({"mean": mo["mean"], "ref_mean": mo["mean"].detach().clone(), "sig": mo["sig"]}, {})
    assert same.loss.item() == 0.0
    res = KLLoss(LossCfg())(mo, {})
    expected = (((mo["mean"].detach() - mo["ref_mean"]) ** 2).mean(dim=(1, 2, 3)) / (2 * mo["sig"] ** 2)).mean()
    torch.testing.assert_close(res.loss.detach(), expected)
    res.loss.backward()
    assert mo["mean"].grad.abs().sum() > 0


def test_loss_scale_factor():
    mo, data = _batch()
    a = FlowGRPOLoss(LossCfg(), actor())(mo, data).loss
    b = FlowGRPOLoss(LossCfg(), actor(loss_scale_factor=0.25))(mo, data).loss
    torch.testing.assert_close(b, 0.25 * a)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        FlowGRPOLoss(LossCfg(), actor(loss_scale_factor=-1.0))


# ---- GRPO-Guard --------------------------------------------------------------

def test_grpo_guard_matches_formula():
    mo, data = _batch(spread=1e-6)
    eps = 2e-6
    res = GRPOGuardLoss(LossCfg(clip_ratio=eps), actor())(mo, data)
    sqrt_dt = torch.sqrt(-mo["dt"])
    s = mo["sig"].mean() * sqrt_dt.mean()
    b = ((mo["mean"].detach() - data["old_mean"]) ** 2).mean(dim=(1, 2, 3)) / (2 * s**2)
    lr = mo["log_prob"].detach() - data["old_log_prob"]
    ratio = torch.exp((lr + b) * s)
    expected = _ppo(ratio, data["advantages"].clamp(-5, 5), eps).mean() / sqrt_dt.mean() ** 2
    torch.testing.assert_close(res.loss.detach(), expected)
    assert res.metrics["actor/ratio_mean"] == pytest.approx(float(ratio.mean()))
    assert res.metrics["actor/ppo_kl"] == pytest.approx(float((-lr).mean()))
    res.loss.backward()
    assert mo["log_prob"].grad is not None


def test_grpo_guard_on_policy_ratio_is_one():
    mo, data = _batch()
    mo["log_prob"] = data["old_log_prob"].clone().requires_grad_(True)
    data["old_mean"] = mo["mean"].detach().clone()
    res = GRPOGuardLoss(LossCfg(clip_ratio=2e-6), actor())(mo, data)
    assert res.metrics["actor/ratio_mean"] == 1.0 and res.metrics["actor/pg_clipfrac"] == 0.0


# ---- Flow-DPPO ---------------------------------------------------------------

@pytest.mark.parametrize("add_kl_coefficient", [True, False])
def test_flow_dppo_matches_formula(add_kl_coefficient):
    mo, data = _batch(spread=1e-2)
    # make half the samples drift far and half stay close
    far = torch.tensor([1, 1, 1, 0, 0, 0], dtype=torch.float64).view(-1, 1, 1, 1)
    data["old_mean"] = mo["mean"].detach() + far * 0.05 + (1 - far) * 1e-6
    tau = 1e-5
    res = FlowDPPOLoss(LossCfg(kl_mask_threshold=tau, add_kl_coefficient=add_kl_coefficient), actor())(mo, data)
    sq = (mo["mean"].detach() - data["old_mean"]) ** 2
    if add_kl_coefficient:
        d = (sq / (2 * mo["std"].view(-1, 1, 1, 1) ** 2)).mean(dim=(1, 2, 3))
    else:
        d = sq.mean(dim=(1, 2, 3)) / 2
    ratio = torch.exp(mo["log_prob"].detach() - data["old_log_prob"])
    a = data["advantages"].clamp(-5, 5)
    drop = (d >= tau) & (((ratio > 1) & (a > 0)) | ((ratio < 1) & (a < 0)))
    expected = (-a * ratio * (~drop).double()).mean()
    torch.testing.assert_close(res.loss.detach(), expected)
    assert res.metrics["actor/pg_clipfrac"] == pytest.approx(float(drop.double().mean()))
    assert res.metrics["actor/kl_mask_fraction"] == pytest.approx(float((d >= tau).double().mean()))
    # the mask really bites in this batch, and only in one direction
    assert 0 < int(drop.sum()) < B
    res.loss.backward()
    g = mo["log_prob"].grad
    assert torch.all(g[drop] == 0) and torch.all(g[~drop] != 0)


def test_flow_dppo_keeps_updates_that_pull_back():
    # far away, A > 0 but ratio < 1: moving up pulls back toward old -> kept
    lp = torch.tensor([-0.01], dtype=torch.float64, requires_grad=True)
    mean = torch.ones(1, 4, dtype=torch.float64)
    res = FlowDPPOLoss(LossCfg(), actor())(
        {"log_prob": lp, "mean": mean, "std": torch.tensor([0.1], dtype=torch.float64)},
        {"old_log_prob": torch.zeros(1, dtype=torch.float64), "advantages": torch.tensor([1.0]),
         "old_mean": mean + 1.0})
    res.loss.backward()
    assert res.metrics["actor/kl_mask_fraction"] == 1.0 and res.metrics["actor/pg_clipfrac"] == 0.0
    assert lp.grad.item() != 0.0


# ---- registry and key checks -------------------------------------------------

def test_registry_names_and_aliases():
    for name in ("flow_grpo", "mix_grpo", "dance_grpo"):
        assert get_diffusion_loss_fn(name) is FlowGRPOLoss
    assert get_diffusion_loss_fn("grpo_guard") is GRPOGuardLoss
    assert get_diffusion_loss_fn("flow_dppo") is FlowDPPOLoss
    assert {"flow_grpo", "grpo_guard", "flow_dppo"} <= set(registered_losses())
    assert FlowGRPOLoss.name == "flow_grpo"


def test_unknown_loss_lists_registered():
    with pytest.raises(ValueError) as e:
        get_diffusion_loss_fn("ppo_clip")
    msg = str(e.value)
    assert "'ppo_clip'" in msg and "flow_grpo" in msg and "flow_dppo" in msg and "grpo_guard" in msg


@pytest.mark.parametrize("cls, drop_from, key", [
    (FlowGRPOLoss, "model_output", "log_prob"),
    (FlowGRPOLoss, "data", "advantages"),
    (GRPOGuardLoss, "data", "old_mean"),
    (GRPOGuardLoss, "model_output", "dt"),
    (FlowDPPOLoss, "model_output", "std"),
    (KLLoss, "model_output", "ref_mean"),
])
def test_missing_key_names_loss_key_and_dict(cls, drop_from, key):
    mo, data = _batch()
    target = mo if drop_from == "model_output" else data
    del target[key]
    with pytest.raises(KeyError) as e:
        cls(LossCfg(), actor())(mo, data)
    msg = str(e.value)
    assert cls.name in msg and key in msg and drop_from in msg


def test_kl_keys_required_only_when_enabled():
    mo, data = _batch()
    del mo["ref_mean"]
    FlowGRPOLoss(LossCfg(), actor())(mo, data)
    with pytest.raises(KeyError, match="ref_mean"):
        FlowGRPOLoss(LossCfg(), actor(use_kl_loss=True))(mo, data)


def test_shape_mismatch_raises():
    mo, data = _batch()
    data["old_log_prob"] = data["old_log_prob"][:3]
    with pytest.raises(ValueError, match="old_log_prob"):
        FlowGRPOLoss(LossCfg(), actor())(mo, data)


def test_bad_config_values_raise():
    with pytest.raises(ValueError, match="clip_ratio"):
        FlowGRPOLoss(LossCfg(clip_ratio=0.0))
    with pytest.raises(ValueError, match="kl_mask_threshold"):
        FlowDPPOLoss(LossCfg(kl_mask_threshold=-1.0))


def test_custom_loss_registration_and_actor_config_optional():
    @register_diffusion_loss("test_only_zero")
    class Zero(DiffusionLossFn):
        required_model_outputs = ("log_prob",)

        def compute(self, model_output, data):
            return DiffusionLossResult(model_output["log_prob"].sum() * 0, {})

    assert get_diffusion_loss_fn("test_only_zero") is Zero and Zero.name == "test_only_zero"
    res = Zero(LossCfg())({"log_prob": torch.ones(2)}, {})
    assert res.loss.item() == 0.0
    with pytest.raises(ValueError, match="already registered"):
        register_diffusion_loss("test_only_zero")(FlowGRPOLoss)


# ---- rollout correction in bypass mode (computed in the loss, current vs behaviour) ---------------------------

def rc(**kw):
    base = dict(rollout_is=None, rollout_is_threshold=2.0, rollout_is_batch_normalize=False,
                rollout_rs=None, rollout_rs_threshold=None, bypass_mode=True)
    base.update(kw)
    return SimpleNamespace(**base)


BYPASS_RS = dict(rollout_rs="token_k1", rollout_rs_threshold=1.2)
# the "IS weights are reported, not multiplied in" notice of bypass mode (checked in its own test)
pytestmark = pytest.mark.filterwarnings("ignore:`algorithm.rollout_correction.bypass_mode` = true:UserWarning")


def _off_policy_batch(seed=0, n=32, spread=0.25):
    """Behaviour log-probs (stored as old in bypass mode) and current ones that differ by ~spread."""
    g = torch.Generator().manual_seed(seed)
    beh = torch.randn(n, generator=g, dtype=torch.float64)
    lp = (beh + spread * torch.randn(n, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = 3.0 * torch.randn(n, generator=g, dtype=torch.float64)
    mean = torch.randn(n, 2, 3, generator=g, dtype=torch.float64).requires_grad_(True)
    sig = torch.linspace(0.4, 0.9, n, dtype=torch.float64)
    dt = torch.full((n,), -0.1, dtype=torch.float64)
    mo = dict(log_prob=lp, mean=mean, std=sig * torch.sqrt(-dt), sig=sig, dt=dt)
    data = dict(old_log_prob=beh, advantages=adv, old_mean=mean.detach().clone())
    return mo, data


LOSSES = [(FlowGRPOLoss, LossCfg(clip_ratio=1e-4)), (GRPOGuardLoss, LossCfg(clip_ratio=2e-6)),
          (FlowDPPOLoss, LossCfg())]


@pytest.mark.parametrize("cls, lcfg", LOSSES)
def test_bypass_rejects_against_current_policy_and_no_gradient_through_weights(cls, lcfg):
    mo, data = _off_policy_batch()
    data_before = dict(data)
    res = cls(lcfg, actor(rollout_correction=rc(rollout_is="token", rollout_is_threshold=1.5, **BYPASS_RS)))(mo, data)
    assert data == data_before  # the caller's dict is not changed

    lr = (mo["log_prob"].detach() - data["old_log_prob"]).numpy()
    keep = (-lr >= np.log(1 / 1.2)) & (-lr <= np.log(1.2))  # token_k1, threshold 1.2: 1/1.2 <= r <= 1.2
    assert 0 < keep.sum() < len(keep)
    # the loss is the plain loss with rejected samples zeroed (still in the mean's denominator)
    mo_plain = {k: (v.detach().clone().requires_grad_(True) if v.requires_grad else v) for k, v in mo.items()}
    plain = cls(lcfg, actor())(mo_plain, dict(data, is_weights=torch.tensor(keep, dtype=torch.float64)))
    torch.testing.assert_close(res.loss, plain.loss)
    res.loss.backward()
    plain.loss.backward()
    g = mo["log_prob"].grad
    assert torch.all(g[torch.tensor(~keep)] == 0)
    torch.testing.assert_close(g, mo_plain["log_prob"].grad)  # the keep mask is a constant: no gradient through it
    torch.testing.assert_close(mo["mean"].grad, mo_plain["mean"].grad)
    # metrics: current vs behaviour, under the decoupled names
    w = np.minimum(np.exp(lr), 1.5)
    m = res.metrics
    assert m["rollout_corr/kl"] == pytest.approx(float(np.mean(-lr)))
    assert m["rollout_corr/is_weight_mean"] == pytest.approx(float(np.mean(w)))
    assert m["rollout_corr/rs_reject_frac"] == pytest.approx(float(np.mean(~keep)))
    assert m["rollout_corr/rs_token_k1_reject_frac"] == pytest.approx(float(np.mean(~keep)))
    assert "actor/pg_loss" in m


@pytest.mark.parametrize("cls, lcfg", [(FlowGRPOLoss, LossCfg(clip_ratio=10.0)), (FlowDPPOLoss, LossCfg())])
@pytest.mark.parametrize("corr", [
    dict(rollout_is="token", rollout_is_threshold=1e3, **BYPASS_RS),
    dict(rollout_is="token", rollout_is_threshold="0.85_1.3", rollout_rs="token_k3", rollout_rs_threshold=0.02),
])
def test_bypass_loss_equals_decoupled_loss_when_current_equals_proximal(cls, lcfg, corr):
    """Decoupled: ratio current/proximal = 1, weight w = proximal/behaviour (x RS). Bypass: ratio current/behaviour
    = w, RS mask from current vs behaviour. With current == proximal and no clipping or truncation biting, the two
    give the same loss and gradient: bypass rejects the same samples, and its ratio carries the IS weight (which is
    why the weight values are not multiplied in again)."""
    mo, data = _off_policy_batch(seed=1)
    beh, current = data["old_log_prob"], mo["log_prob"]
    dec_rc = compute_rollout_correction(current.detach()[:, None], beh[:, None], None, rc(bypass_mode=False, **corr))
    mo_dec = {k: (v.detach().clone().requires_grad_(True) if v.requires_grad else v) for k, v in mo.items()}
    dec = cls(lcfg, actor())(mo_dec, dict(data, old_log_prob=current.detach().clone(),
                                          is_weights=dec_rc.weights[:, 0]))
    byp = cls(lcfg, actor(rollout_correction=rc(**corr)))(mo, data)
    rejected = dec_rc.weights[:, 0] == 0
    assert 0 < int(rejected.sum()) < len(rejected)
    torch.testing.assert_close(byp.loss, dec.loss)
    byp.loss.backward()
    dec.loss.backward()
    torch.testing.assert_close(current.grad, mo_dec["log_prob"].grad)
    assert torch.all(current.grad[rejected] == 0)
    for k, v in dec_rc.metrics.items():
        assert byp.metrics[k] == pytest.approx(v), k
    # multiplying the IS values in as well would count the ratio twice: a different gradient
    w = dec_rc.is_weights[:, 0]
    assert not torch.allclose(current.grad * w, mo_dec["log_prob"].grad)


@pytest.mark.parametrize("cls, lcfg", LOSSES)
def test_bypass_current_equals_behaviour_changes_nothing(cls, lcfg):
    mo, data = _off_policy_batch()
    mo["log_prob"] = data["old_log_prob"].clone().requires_grad_(True)
    corr = rc(rollout_is="token", rollout_is_threshold="0.9_1.1", rollout_rs="token_k1,token_k2",
              rollout_rs_threshold="1.01,1e-6")
    byp = cls(lcfg, actor(rollout_correction=corr))(mo, data)
    plain = cls(lcfg, actor())(mo, data)
    assert torch.equal(byp.loss, plain.loss)
    m = byp.metrics
    assert m["rollout_corr/rs_reject_frac"] == 0.0 and m["rollout_corr/kl"] == 0.0
    assert m["rollout_corr/is_weight_mean"] == 1.0 and m["rollout_corr/is_weight_max"] == 1.0


def test_bypass_multiplies_given_is_weights_and_decoupled_mode_is_untouched():
    mo, data = _off_policy_batch()
    given = torch.linspace(0.5, 1.5, 32, dtype=torch.float64)
    byp = FlowGRPOLoss(LossCfg(), actor(rollout_correction=rc(**BYPASS_RS)))(mo, dict(data, is_weights=given))
    keep = compute_rollout_correction(mo["log_prob"].detach()[:, None], data["old_log_prob"][:, None], None,
                                      rc(**BYPASS_RS)).weights[:, 0]
    plain = FlowGRPOLoss(LossCfg(), actor())(mo, dict(data, is_weights=given * keep))
    torch.testing.assert_close(byp.loss, plain.loss)
    # decoupled mode: the loss applies data['is_weights'] as given and reports no rollout_corr metric
    dec = FlowGRPOLoss(LossCfg(), actor(rollout_correction=rc(bypass_mode=False, **BYPASS_RS)))
    assert dec.bypass_correction is None
    res = dec(mo, dict(data, is_weights=given))
    torch.testing.assert_close(res.loss, FlowGRPOLoss(LossCfg(), actor())(mo, dict(data, is_weights=given)).loss)
    assert not any(k.startswith("rollout_corr/") for k in res.metrics)
    with pytest.raises(ValueError, match="is_weights"):
        FlowGRPOLoss(LossCfg(), actor(rollout_correction=rc(**BYPASS_RS)))(mo, dict(data, is_weights=given[:3]))


def test_bypass_options_checked_at_construction():
    with pytest.raises(ValueError, match="one SDE step at a time"):
        FlowGRPOLoss(LossCfg(), actor(rollout_correction=rc(rollout_rs="seq_mean_k1", rollout_rs_threshold=1.2)))
    with pytest.raises(ValueError, match="rollout_is=sequence"):
        FlowGRPOLoss(LossCfg(), actor(rollout_correction=rc(rollout_is="sequence")))
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        FlowGRPOLoss(LossCfg(), actor(rollout_correction=rc(rollout_rs="token_k2")))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        FlowGRPOLoss(LossCfg(), actor(rollout_correction=rc(rollout_is="token")))
    assert any("reported" in str(w.message) and "not" in str(w.message) for w in rec)
    # decoupled mode accepts sequence-level options (the learner applies them to whole rows)
    assert FlowGRPOLoss(LossCfg(), actor(rollout_correction=rc(bypass_mode=False, rollout_is="sequence"))
                        ).bypass_correction is None


def test_bypass_leaves_losses_without_a_ratio_alone():
    mo, _ = _batch()
    kl = KLLoss(LossCfg(), actor(rollout_correction=rc(**BYPASS_RS)))
    assert kl.bypass_correction is None
    torch.testing.assert_close(kl(mo, {}).loss, KLLoss(LossCfg())(mo, {}).loss)


def test_bypass_reads_the_actor_mirror_of_the_real_config():
    from omnirl_async.config import load_config

    on = load_config(["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_rs=token_k1",
                      "algorithm.rollout_correction.rollout_rs_threshold=1.2"])
    a = on.actor_rollout_ref.actor
    assert FlowGRPOLoss(a.diffusion_loss, a).bypass_correction.rollout_rs == "token_k1"
    off = load_config(["algorithm.rollout_correction.rollout_rs=token_k1",
                       "algorithm.rollout_correction.rollout_rs_threshold=1.2"]).actor_rollout_ref.actor
    assert FlowGRPOLoss(off.diffusion_loss, off).bypass_correction is None
