"""Direct-preference losses (DiffusionNFT, Diffusion-DPO, AWM) against the ALGORITHMS.md formulas.

The reference values are computed per sample with explicit Python loops over plain floats, independently
of the vectorised implementations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from omnirl_async.algos import (
    AWMLoss,
    DiffusionDPOLoss,
    DiffusionNFTLoss,
    FlowGRPOLoss,
    get_diffusion_loss_fn,
    loss_trainer_type,
    registered_losses,
)
from omnirl_async.algos.losses import DiffusionLossFn, TRAINER_TYPES, register_diffusion_loss


@dataclass
class Cfg:
    clip_ratio: float = 1e-4
    adv_clip_max: float = 5.0
    mix_beta: float = 0.5
    ref_kl_coef: float = 0.0
    old_kl_coef: float = 0.0
    adaptive_weight_min: float = 1e-5
    dpo_beta: float = 2000.0


SHAPE = (2, 3, 2)  # latent dims


def _batch(b=6, seed=0, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(b, *SHAPE, generator=g, dtype=torch.float64)
    eps = torch.randn(b, *SHAPE, generator=g, dtype=torch.float64)
    t = torch.rand(b, generator=g, dtype=torch.float64) * 0.9 + 0.05
    target = eps - x0
    v = (target + scale * torch.randn(b, *SHAPE, generator=g, dtype=torch.float64)).requires_grad_(True)
    v_old = target + scale * torch.randn(b, *SHAPE, generator=g, dtype=torch.float64)
    v_ref = target + scale * torch.randn(b, *SHAPE, generator=g, dtype=torch.float64)
    v_prox = v.detach() + 0.05 * torch.randn(b, *SHAPE, generator=g, dtype=torch.float64)
    adv = torch.tensor([2.0, -1.0, 0.5, -3.0, 7.0, -9.0, 0.0, 5.0][:b], dtype=torch.float64)
    mo = dict(v=v, v_old=v_old, v_ref=v_ref)
    data = dict(x0=x0, eps=eps, t=t, advantages=adv, v_prox=v_prox)
    return mo, data


def _flat(x, i):
    return x[i].detach().reshape(-1).tolist()


def _mean(xs):
    return sum(xs) / len(xs)


# ---- contract ------------------------------------------------------------------

def test_registered_with_trainer_types():
    names = set(registered_losses())
    assert {"diffusion_nft", "dpo", "awm"} <= names
    assert get_diffusion_loss_fn("diffusion_nft") is DiffusionNFTLoss
    assert get_diffusion_loss_fn("dpo") is DiffusionDPOLoss
    assert get_diffusion_loss_fn("awm") is AWMLoss
    for n in ("diffusion_nft", "dpo", "awm"):
        assert loss_trainer_type(n) == "direct_preference"
    for n in ("flow_grpo", "mix_grpo", "dance_grpo", "grpo_guard", "flow_dppo"):
        assert loss_trainer_type(n) == "policy_gradient"
    assert DiffusionLossFn.trainer_type == "policy_gradient" and FlowGRPOLoss.trainer_type == "policy_gradient"
    assert set(TRAINER_TYPES) == {"policy_gradient", "direct_preference"}
    with pytest.raises(ValueError, match="not a registered"):
        loss_trainer_type("nope")


def test_bad_trainer_type_refused_at_registration():
    class Odd(DiffusionLossFn):
        trainer_type = "value_based"

        def compute(self, model_output, data):
            raise AssertionError

    with pytest.raises(ValueError, match="trainer_type"):
        register_diffusion_loss("test_only_odd_trainer")(Odd)
    assert "test_only_odd_trainer" not in registered_losses()


def test_declared_keys_follow_coefficients():
    assert DiffusionNFTLoss(Cfg()).model_output_keys == ("v", "v_old")
    assert DiffusionNFTLoss(Cfg(ref_kl_coef=0.1)).model_output_keys == ("v", "v_old", "v_ref")
    assert DiffusionNFTLoss(Cfg()).data_keys == ("x0", "eps", "t", "advantages")
    assert DiffusionDPOLoss(Cfg()).model_output_keys == ("v", "v_ref")
    assert DiffusionDPOLoss(Cfg()).data_keys == ("x0", "eps", "t")
    assert AWMLoss(Cfg()).model_output_keys == ("v",)
    assert AWMLoss(Cfg(ref_kl_coef=0.1, old_kl_coef=0.2)).model_output_keys == ("v", "v_ref", "v_old")
    assert AWMLoss(Cfg()).data_keys == ("x0", "eps", "t", "advantages", "v_prox")


@pytest.mark.parametrize("cls, cfg, drop_from, key", [
    (DiffusionNFTLoss, Cfg(), "model_output", "v_old"),
    (DiffusionNFTLoss, Cfg(), "data", "advantages"),
    (DiffusionNFTLoss, Cfg(ref_kl_coef=0.1), "model_output", "v_ref"),
    (DiffusionDPOLoss, Cfg(), "model_output", "v_ref"),
    (DiffusionDPOLoss, Cfg(), "data", "eps"),
    (AWMLoss, Cfg(), "data", "v_prox"),
    (AWMLoss, Cfg(), "data", "t"),
    (AWMLoss, Cfg(old_kl_coef=0.1), "model_output", "v_old"),
    (AWMLoss, Cfg(ref_kl_coef=0.1), "model_output", "v_ref"),
])
def test_missing_key_is_base_class_key_error(cls, cfg, drop_from, key):
    mo, data = _batch()
    del (mo if drop_from == "model_output" else data)[key]
    with pytest.raises(KeyError) as e:
        cls(cfg)(mo, data)
    msg = str(e.value)
    assert cls.name in msg and key in msg and drop_from in msg


def test_unused_optional_keys_are_not_required():
    mo, data = _batch()
    del mo["v_ref"], mo["v_old"]
    AWMLoss(Cfg())(mo, data)
    mo, data = _batch()
    del mo["v_ref"]
    DiffusionNFTLoss(Cfg())(mo, data)


def test_missing_config_field_and_bad_values():
    @dataclass
    class NoOld:
        adv_clip_max: float = 5.0
        ref_kl_coef: float = 0.0

    with pytest.raises(KeyError, match="old_kl_coef"):
        AWMLoss(NoOld())
    with pytest.raises(ValueError, match="mix_beta"):
        DiffusionNFTLoss(Cfg(mix_beta=0.0))
    with pytest.raises(ValueError, match="dpo_beta"):
        DiffusionDPOLoss(Cfg(dpo_beta=-1.0))
    with pytest.raises(ValueError, match="old_kl_coef"):
        AWMLoss(Cfg(old_kl_coef=-0.1))


def test_shape_mismatches_raise():
    mo, data = _batch()
    data["t"] = data["t"][:3]
    with pytest.raises(ValueError, match="t"):
        DiffusionNFTLoss(Cfg())(mo, data)
    mo, data = _batch()
    mo["v_old"] = mo["v_old"][:, :1]
    with pytest.raises(ValueError, match="v_old"):
        DiffusionNFTLoss(Cfg())(mo, data)


# ---- DiffusionNFT ------------------------------------------------------------------

def _nft_reference(mo, data, beta, c, wmin, ref_coef, is_w=None):
    b = data["x0"].shape[0]
    per = []
    mse_p, mse_n, w_p, w_n, rs = [], [], [], [], []
    for i in range(b):
        t = float(data["t"][i])
        a = float(data["advantages"][i])
        r = min(max(a / (2 * c) + 0.5, 0.0), 1.0)
        x0, eps, v, vo = _flat(data["x0"], i), _flat(data["eps"], i), _flat(mo["v"], i), _flat(mo["v_old"], i)
        ep, en = [], []
        for k in range(len(x0)):
            xt = (1 - t) * x0[k] + t * eps[k]
            vp = beta * v[k] + (1 - beta) * vo[k]
            vn = (1 + beta) * vo[k] - beta * v[k]
            ep.append(xt - t * vp - x0[k])
            en.append(xt - t * vn - x0[k])
        sp, sn = _mean([e * e for e in ep]), _mean([e * e for e in en])
        wp, wn = max(_mean([abs(e) for e in ep]), wmin), max(_mean([abs(e) for e in en]), wmin)
        term = r * sp / wp + (1 - r) * sn / wn
        per.append(term * (1.0 if is_w is None else float(is_w[i])))
        mse_p.append(sp), mse_n.append(sn), w_p.append(wp), w_n.append(wn), rs.append(r)
    pg = _mean(per) / beta
    ref = 0.0
    if ref_coef > 0:
        diffs = []
        for i in range(b):
            diffs += [(x - y) ** 2 for x, y in zip(_flat(mo["v"], i), _flat(mo["v_ref"], i))]
        ref = _mean(diffs)
    return pg + ref_coef * ref, dict(pg=pg, mse_p=_mean(mse_p), mse_n=_mean(mse_n), w_p=_mean(w_p),
                                     w_n=_mean(w_n), r=_mean(rs), ref=ref)


@pytest.mark.parametrize("beta, ref_coef", [(0.5, 0.0), (1.0, 0.0), (0.3, 0.2)])
def test_nft_matches_formula(beta, ref_coef):
    mo, data = _batch()
    cfg = Cfg(mix_beta=beta, ref_kl_coef=ref_coef)
    res = DiffusionNFTLoss(cfg)(mo, data)
    want, m = _nft_reference(mo, data, beta, 5.0, 1e-5, ref_coef)
    assert res.loss.item() == pytest.approx(want, rel=1e-10)
    assert res.metrics["actor/pg_loss"] == pytest.approx(m["pg"], rel=1e-10)
    assert res.metrics["actor/nft/x0_err_pos"] == pytest.approx(m["mse_p"], rel=1e-10)
    assert res.metrics["actor/nft/x0_err_neg"] == pytest.approx(m["mse_n"], rel=1e-10)
    assert res.metrics["actor/nft/weight_pos"] == pytest.approx(m["w_p"], rel=1e-10)
    assert res.metrics["actor/nft/weight_neg"] == pytest.approx(m["w_n"], rel=1e-10)
    assert res.metrics["actor/nft/r_mean"] == pytest.approx(m["r"], rel=1e-12)
    if ref_coef > 0:
        assert res.metrics["actor/kl_loss"] == pytest.approx(m["ref"], rel=1e-10)
    else:
        assert "actor/kl_loss" not in res.metrics


def test_nft_r_values():
    # r = clamp(A/(2c) + 0.5, 0, 1): -9 -> 0, -3 -> 0.2, -1 -> 0.4, 0 -> 0.5, 0.5 -> 0.55, 2 -> 0.7, 5 -> 1, 7 -> 1
    mo, data = _batch(b=8)
    res = DiffusionNFTLoss(Cfg())(mo, data)
    assert res.metrics["actor/nft/r_mean"] == pytest.approx((0.7 + 0.4 + 0.55 + 0.2 + 1 + 0 + 0.5 + 1) / 8)


def test_nft_weight_floor():
    mo, data = _batch()
    # v_old = v = target: both implicit x0 predictions are exact, errors 0, weights hit the floor
    target = data["eps"] - data["x0"]
    mo["v"] = target.clone().requires_grad_(True)
    mo["v_old"] = target.clone()
    res = DiffusionNFTLoss(Cfg(adaptive_weight_min=0.25))(mo, data)
    assert res.metrics["actor/nft/weight_pos"] == pytest.approx(0.25)
    assert res.metrics["actor/nft/weight_neg"] == pytest.approx(0.25)
    assert res.loss.item() == pytest.approx(0.0, abs=1e-25)


def test_nft_r_one_beta_one_is_adaptive_x0_loss():
    mo, data = _batch()
    c = 5.0
    data["advantages"] = torch.full((6,), c, dtype=torch.float64)  # r = 1
    wmin = 1e-5
    res = DiffusionNFTLoss(Cfg(mix_beta=1.0, adv_clip_max=c, adaptive_weight_min=wmin))(mo, data)
    t = data["t"].reshape(-1, 1, 1, 1)
    xt = (1 - t) * data["x0"] + t * data["eps"]
    err = xt - t * mo["v"] - data["x0"]
    per = (err**2).mean(dim=(1, 2, 3)) / err.detach().abs().mean(dim=(1, 2, 3)).clamp_min(wmin)
    torch.testing.assert_close(res.loss, per.mean(), rtol=1e-12, atol=0)
    # same gradient too
    (g_loss,) = torch.autograd.grad(res.loss, mo["v"])
    (g_ref,) = torch.autograd.grad(per.mean(), mo["v"])
    torch.testing.assert_close(g_loss, g_ref, rtol=1e-12, atol=1e-15)


def test_nft_gradient_flows_only_through_v():
    mo, data = _batch()
    mo["v_old"] = mo["v_old"].clone().requires_grad_(True)
    mo["v_ref"] = mo["v_ref"].clone().requires_grad_(True)
    for k in ("x0", "eps", "t", "advantages"):
        data[k] = data[k].clone().requires_grad_(True)
    res = DiffusionNFTLoss(Cfg(ref_kl_coef=0.1))(mo, data)
    res.loss.backward()
    assert mo["v"].grad is not None and mo["v"].grad.abs().sum() > 0
    assert mo["v_old"].grad is None and mo["v_ref"].grad is None
    for k in ("x0", "eps", "t", "advantages"):
        assert data[k].grad is None, k


def test_nft_gradient_matches_finite_difference():
    mo, data = _batch(b=4)
    loss_fn = DiffusionNFTLoss(Cfg(mix_beta=0.7, ref_kl_coef=0.05))
    res = loss_fn(mo, data)
    (g,) = torch.autograd.grad(res.loss, mo["v"])
    # the adaptive weights are stop-gradient: hold them fixed for the finite difference
    base = mo["v"].detach()
    idx = (1, 0, 2, 1)
    h = 1e-6

    def fixed_weight_loss(v):
        beta, t = 0.7, data["t"].reshape(-1, 1, 1, 1)
        xt = (1 - t) * data["x0"] + t * data["eps"]
        ep = xt - t * (beta * v + (1 - beta) * mo["v_old"]) - data["x0"]
        en = xt - t * ((1 + beta) * mo["v_old"] - beta * v) - data["x0"]
        ep0 = xt - t * (beta * base + (1 - beta) * mo["v_old"]) - data["x0"]
        en0 = xt - t * ((1 + beta) * mo["v_old"] - beta * base) - data["x0"]
        wp = ep0.abs().mean(dim=(1, 2, 3)).clamp_min(1e-5)
        wn = en0.abs().mean(dim=(1, 2, 3)).clamp_min(1e-5)
        r = (data["advantages"] / 10 + 0.5).clamp(0, 1)
        per = r * (ep**2).mean(dim=(1, 2, 3)) / wp + (1 - r) * (en**2).mean(dim=(1, 2, 3)) / wn
        return per.mean() / beta + 0.05 * ((v - mo["v_ref"]) ** 2).mean()

    vp, vm = base.clone(), base.clone()
    vp[idx] += h
    vm[idx] -= h
    fd = (fixed_weight_loss(vp) - fixed_weight_loss(vm)) / (2 * h)
    assert g[idx].item() == pytest.approx(fd.item(), rel=1e-6)


def test_nft_is_weights_multiply():
    mo, data = _batch()
    w = torch.tensor([1.0, 0.0, 2.0, 0.5, 1.0, 0.0], dtype=torch.float64)
    data["is_weights"] = w
    res = DiffusionNFTLoss(Cfg())(mo, data)
    want, _ = _nft_reference(mo, data, 0.5, 5.0, 1e-5, 0.0, is_w=w)
    assert res.loss.item() == pytest.approx(want, rel=1e-10)


def test_nft_loss_scale_factor_and_bf16_inputs():
    from types import SimpleNamespace

    mo, data = _batch()
    base = DiffusionNFTLoss(Cfg())(mo, data).loss.item()
    scaled = DiffusionNFTLoss(Cfg(), SimpleNamespace(loss_scale_factor=0.5))(mo, data).loss.item()
    assert scaled == pytest.approx(0.5 * base)
    mo16 = {k: v.detach().to(torch.bfloat16) for k, v in mo.items()}
    mo16["v"].requires_grad_(True)
    res = DiffusionNFTLoss(Cfg())(mo16, data)
    assert res.loss.dtype == torch.float64 or res.loss.dtype == torch.float32
    res.loss.backward()
    assert mo16["v"].grad.dtype == torch.bfloat16


# ---- Diffusion-DPO -----------------------------------------------------------------

def _paired(b=6, seed=1):
    mo, data = _batch(b=b, seed=seed)
    # pair rows share eps and t (the learner's contract)
    data["eps"][1::2] = data["eps"][0::2]
    data["t"][1::2] = data["t"][0::2]
    return mo, data


def _dpo_reference(mo, data, beta, is_w=None):
    b = data["x0"].shape[0]
    e, er = [], []
    for i in range(b):
        x0, eps = _flat(data["x0"], i), _flat(data["eps"], i)
        tgt = [ep - x for ep, x in zip(eps, x0)]
        e.append(_mean([(v - y) ** 2 for v, y in zip(_flat(mo["v"], i), tgt)]))
        er.append(_mean([(v - y) ** 2 for v, y in zip(_flat(mo["v_ref"], i), tgt)]))
    losses, acc, chosen, rejected = [], [], [], []
    for p in range(b // 2):
        w, l = 2 * p, 2 * p + 1
        m = (e[w] - er[w]) - (e[l] - er[l])
        z = -0.5 * beta * m
        nls = math.log1p(math.exp(-z)) if z > -30 else -z + math.log1p(math.exp(z))  # -log sigmoid(z)
        losses.append(nls * (1.0 if is_w is None else float(is_w[w])))
        d_w, d_l = e[w] - er[w], e[l] - er[l]
        acc.append(1.0 if d_w < d_l else 0.5 if d_w == d_l else 0.0)
        chosen.append(-0.5 * beta * d_w)
        rejected.append(-0.5 * beta * d_l)
    return _mean(losses), dict(acc=_mean(acc), chosen=_mean(chosen), rejected=_mean(rejected),
                               mse_w=_mean(e[0::2]), mse_l=_mean(e[1::2]))


@pytest.mark.parametrize("beta", [1.0, 50.0, 2000.0])
def test_dpo_matches_formula(beta):
    mo, data = _paired()
    res = DiffusionDPOLoss(Cfg(dpo_beta=beta))(mo, data)
    want, m = _dpo_reference(mo, data, beta)
    assert res.loss.item() == pytest.approx(want, rel=1e-9)
    assert res.metrics["actor/pg_loss"] == pytest.approx(want, rel=1e-9)
    assert res.metrics["actor/dpo/implicit_acc"] == pytest.approx(m["acc"])
    assert res.metrics["actor/dpo/chosen_reward"] == pytest.approx(m["chosen"], rel=1e-9)
    assert res.metrics["actor/dpo/rejected_reward"] == pytest.approx(m["rejected"], rel=1e-9)
    assert res.metrics["actor/dpo/reward_margin"] == pytest.approx(m["chosen"] - m["rejected"], rel=1e-9)
    assert res.metrics["actor/dpo/mse_chosen"] == pytest.approx(m["mse_w"], rel=1e-10)
    assert res.metrics["actor/dpo/mse_rejected"] == pytest.approx(m["mse_l"], rel=1e-10)


def test_dpo_is_log2_when_policy_equals_reference():
    mo, data = _paired()
    mo["v"] = mo["v_ref"].clone().requires_grad_(True)
    res = DiffusionDPOLoss(Cfg())(mo, data)
    assert res.loss.item() == pytest.approx(math.log(2.0), rel=1e-14)
    assert res.metrics["actor/dpo/implicit_acc"] == 0.5  # every pair is a tie
    assert res.metrics["actor/dpo/reward_margin"] == 0.0


def test_dpo_gradient_pushes_winner_toward_target_and_loser_away():
    mo, data = _paired(b=2)
    mo["v"] = mo["v_ref"].clone().requires_grad_(True)
    res = DiffusionDPOLoss(Cfg(dpo_beta=10.0))(mo, data)
    res.loss.backward()
    target = data["eps"] - data["x0"]
    step = -mo["v"].grad  # gradient descent direction
    # winner: moving along -grad reduces its error; loser: increases it
    assert ((step[0] * (target[0] - mo["v"][0].detach())).sum()) > 0
    assert ((step[1] * (target[1] - mo["v"][1].detach())).sum()) < 0
    # at policy == reference: dL/dv = 0.5*beta*sigmoid(0)*(de_w/dv - de_l/dv)/P, de/dv = 2*(v - target)/D
    d = mo["v"][0].numel()
    want_w = 0.5 * 10.0 * 0.5 * 2 * (mo["v"][0].detach() - target[0]) / d
    torch.testing.assert_close(mo["v"].grad[0], want_w)
    torch.testing.assert_close(mo["v"].grad[1], -0.5 * 10.0 * 0.5 * 2 * (mo["v"][1].detach() - target[1]) / d)


def test_dpo_no_gradient_into_reference():
    mo, data = _paired()
    mo["v_ref"] = mo["v_ref"].clone().requires_grad_(True)
    DiffusionDPOLoss(Cfg(dpo_beta=5.0))(mo, data).loss.backward()
    assert mo["v_ref"].grad is None and mo["v"].grad is not None


def test_dpo_winner_is_weight_used():
    mo, data = _paired()
    w = torch.tensor([2.0, 100.0, 0.0, 100.0, 0.5, 100.0], dtype=torch.float64)
    data["is_weights"] = w
    res = DiffusionDPOLoss(Cfg(dpo_beta=20.0))(mo, data)
    want, _ = _dpo_reference(mo, data, 20.0, is_w=w)
    assert res.loss.item() == pytest.approx(want, rel=1e-9)
    data["is_weights"] = w[:3]
    with pytest.raises(ValueError, match="is_weights"):
        DiffusionDPOLoss(Cfg())(mo, data)


def test_dpo_accuracy_with_ties_and_orders():
    mo, data = _paired(b=6)
    tgt = data["eps"] - data["x0"]
    v = mo["v_ref"].clone()
    v[0] = tgt[0]            # pair 0: winner improved over reference -> correct
    v[3] = tgt[3]            # pair 1: loser improved -> wrong
    mo["v"] = v.requires_grad_(True)  # pair 2: policy == reference -> tie
    res = DiffusionDPOLoss(Cfg())(mo, data)
    assert res.metrics["actor/dpo/implicit_acc"] == pytest.approx(0.5)  # (1 + 0 + 0.5) / 3
    mo["v"] = mo["v"].detach().clone()
    mo["v"][3] = mo["v_ref"][3]
    res = DiffusionDPOLoss(Cfg())(mo, data)
    assert res.metrics["actor/dpo/implicit_acc"] == pytest.approx(2 / 3)


def test_dpo_odd_batch_and_unpaired_t_raise():
    mo, data = _paired(b=6)
    mo5 = {k: v[:5] for k, v in mo.items()}
    data5 = {k: v[:5] for k, v in data.items()}
    with pytest.raises(ValueError, match="odd"):
        DiffusionDPOLoss(Cfg())(mo5, data5)
    data["t"] = data["t"].clone()
    data["t"][3] += 0.01
    with pytest.raises(ValueError, match="pair 1.*interleaved pairs"):
        DiffusionDPOLoss(Cfg())(mo, data)


# ---- AWM -----------------------------------------------------------------------

def _awm_reference(mo, data, c, ref_coef=0.0, old_coef=0.0, is_w=None):
    p, e10 = 0.25, 1e-10
    b = data["x0"].shape[0]
    per, ratios, logr = [], [], []
    for i in range(b):
        x0, eps, t = _flat(data["x0"], i), _flat(data["eps"], i), float(data["t"][i])
        tgt = [ep - x for ep, x in zip(eps, x0)]
        l = _mean([(v - y) ** 2 for v, y in zip(_flat(mo["v"], i), tgt)])
        lo = _mean([(v - y) ** 2 for v, y in zip(_flat(data["v_prox"], i), tgt)])
        lp = -t * ((l + e10) ** p - e10**p) / p
        lpo = -t * ((lo + e10) ** p - e10**p) / p
        rho = math.exp(lp - lpo)
        a = min(max(float(data["advantages"][i]), -c), c) / c
        term = max(-a * rho, -a * min(max(rho, 0.0), 2.0))
        per.append(term * (1.0 if is_w is None else float(is_w[i])))
        ratios.append(rho), logr.append(lp - lpo)
    pg = _mean(per)

    def mse(other):
        d = []
        for i in range(b):
            d += [(x - y) ** 2 for x, y in zip(_flat(mo["v"], i), _flat(other, i))]
        return _mean(d)

    ref = mse(mo["v_ref"]) if ref_coef > 0 else 0.0
    old = mse(mo["v_old"]) if old_coef > 0 else 0.0
    return pg + ref_coef * ref + old_coef * old, dict(pg=pg, ratios=ratios, logr=logr, ref=ref, old=old)


@pytest.mark.parametrize("ref_coef, old_coef", [(0.0, 0.0), (0.1, 0.0), (0.0, 0.3), (0.05, 0.2)])
def test_awm_matches_formula(ref_coef, old_coef):
    mo, data = _batch(b=8, seed=3)
    res = AWMLoss(Cfg(ref_kl_coef=ref_coef, old_kl_coef=old_coef))(mo, data)
    want, m = _awm_reference(mo, data, 5.0, ref_coef, old_coef)
    assert res.loss.item() == pytest.approx(want, rel=1e-9)
    assert res.metrics["actor/pg_loss"] == pytest.approx(m["pg"], rel=1e-9, abs=1e-15)
    assert res.metrics["actor/ratio_mean"] == pytest.approx(_mean(m["ratios"]), rel=1e-10)
    assert res.metrics["actor/ratio_max"] == pytest.approx(max(m["ratios"]), rel=1e-10)
    assert res.metrics["actor/ratio_min"] == pytest.approx(min(m["ratios"]), rel=1e-10)
    assert res.metrics["actor/ppo_kl"] == pytest.approx(-_mean(m["logr"]), rel=1e-8, abs=1e-15)
    assert res.metrics["actor/pg_clipfrac"] == pytest.approx(_mean([float(r > 2) for r in m["ratios"]]))
    assert ("actor/kl_loss" in res.metrics) == (ref_coef > 0)
    assert ("actor/awm/old_mse" in res.metrics) == (old_coef > 0)
    if ref_coef > 0:
        assert res.metrics["actor/kl_loss"] == pytest.approx(m["ref"], rel=1e-10)
    if old_coef > 0:
        assert res.metrics["actor/awm/old_mse"] == pytest.approx(m["old"], rel=1e-10)


def test_awm_ratio_exactly_one_on_policy_and_gradient():
    mo, data = _batch(b=8, seed=4)
    data["v_prox"] = mo["v"].detach().clone()
    res = AWMLoss(Cfg())(mo, data)
    assert res.metrics["actor/ratio_mean"] == 1.0
    assert res.metrics["actor/ratio_max"] == 1.0 and res.metrics["actor/ratio_min"] == 1.0
    assert res.metrics["actor/ppo_kl"] == 0.0 and res.metrics["actor/pg_clipfrac"] == 0.0
    res.loss.backward()
    # on-policy: grad = -mean_B(A * grad lp), lp = -t*((l+1e-10)^p - 1e-10^p)/p
    v = mo["v"].detach().clone().requires_grad_(True)
    tgt = data["eps"] - data["x0"]
    l = ((v - tgt) ** 2).mean(dim=(1, 2, 3))
    lp = -data["t"] * ((l + 1e-10) ** 0.25 - 1e-10**0.25) / 0.25
    a = data["advantages"].clamp(-5, 5) / 5
    (-(a * lp).mean()).backward()
    torch.testing.assert_close(mo["v"].grad, v.grad)


def test_awm_clipping_large_ratio():
    mo, data = _batch(b=2, seed=5)
    tgt = data["eps"] - data["x0"]
    # current policy is exact, proximal far off: lp > lp_old, rho large
    mo["v"] = (tgt + 1e-3).requires_grad_(True)
    data["v_prox"] = tgt + 3.0
    data["t"] = torch.tensor([0.9, 0.9], dtype=torch.float64)
    data["advantages"] = torch.tensor([2.0, -2.0], dtype=torch.float64)
    res = AWMLoss(Cfg())(mo, data)
    want, m = _awm_reference(mo, data, 5.0)
    assert min(m["ratios"]) > 2
    assert res.metrics["actor/pg_clipfrac"] == 1.0
    assert res.loss.item() == pytest.approx(want, rel=1e-9)
    res.loss.backward()
    # A > 0, rho > 2: clipped branch wins (max of -A*rho, -0.4*2) -> no gradient; A < 0: unclipped, gradient
    assert mo["v"].grad[0].abs().max() == 0
    assert mo["v"].grad[1].abs().max() > 0


def test_awm_is_weights_and_no_grad_into_anchors():
    mo, data = _batch(b=6, seed=6)
    w = torch.tensor([1.0, 0.0, 2.0, 0.5, 1.0, 3.0], dtype=torch.float64)
    data["is_weights"] = w
    data["v_prox"] = data["v_prox"].clone().requires_grad_(True)
    mo["v_ref"] = mo["v_ref"].clone().requires_grad_(True)
    mo["v_old"] = mo["v_old"].clone().requires_grad_(True)
    res = AWMLoss(Cfg(ref_kl_coef=0.1, old_kl_coef=0.1))(mo, data)
    want, _ = _awm_reference(mo, data, 5.0, 0.1, 0.1, is_w=w)
    assert res.loss.item() == pytest.approx(want, rel=1e-9)
    res.loss.backward()
    assert data["v_prox"].grad is None and mo["v_ref"].grad is None and mo["v_old"].grad is None
