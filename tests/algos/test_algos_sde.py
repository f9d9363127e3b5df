"""SDE step with log-prob and the SDE window, against direct computation."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal

from omnirl_async.models.sde import SDEStepOutput, euler_step, sde_step_with_logprob
from omnirl_async.models.sde_window import SDEWindow


def _inputs(shape=(3, 4, 5, 6), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=dtype)
    v = torch.randn(shape, generator=g, dtype=dtype)
    z = torch.randn(shape, generator=g, dtype=dtype)
    return x, v, z


def _dims(t):
    return tuple(range(1, t.ndim))


# ---- deterministic step ------------------------------------------------------

@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance"])
@pytest.mark.parametrize("sigmas", [(1.0, 0.9), (0.6, 0.45), (0.2, 0.0)])
def test_noise_level_zero_is_exactly_euler(sde_type, sigmas):
    x, v, z = _inputs()
    out = sde_step_with_logprob(v, *sigmas, x, noise_level=0.0, sde_type=sde_type, noise=z)
    dt = torch.tensor(sigmas[1]) - torch.tensor(sigmas[0])  # fp32 sigmas, as make_sigmas gives them
    expected = x + dt * v
    assert torch.equal(out.prev_sample, euler_step(v, *sigmas, x))
    assert torch.equal(out.prev_sample, expected)
    assert torch.equal(out.log_prob, torch.zeros(3))
    assert torch.equal(out.std, torch.zeros(3)) and torch.equal(out.sig, torch.zeros(3))


def test_euler_step_per_sample_sigmas():
    x, v, _ = _inputs()
    s, sn = torch.tensor([1.0, 0.5, 0.3]), torch.tensor([0.8, 0.4, 0.0])
    out = euler_step(v, s, sn, x)
    for i in range(3):
        assert torch.equal(out[i], x[i] + (sn[i] - s[i]) * v[i])


# ---- Flow-GRPO SDE -----------------------------------------------------------

@pytest.mark.parametrize("shape", [(3, 4, 5, 6), (3, 7), (3, 2, 3, 4, 5)])
def test_sde_logprob_matches_normal_density(shape):
    x, v, z = _inputs(shape, dtype=torch.float64)
    s, sn, a = 0.7, 0.55, 0.7
    out = sde_step_with_logprob(v, s, sn, x, noise_level=a, noise=z)
    sig = a * math.sqrt(s / (1 - s))
    dt = sn - s
    mu = x + dt * (v + sig**2 / (2 * s) * (x + (1 - s) * v))
    std = sig * math.sqrt(-dt)
    torch.testing.assert_close(out.mean, mu)
    torch.testing.assert_close(out.prev_sample, mu + std * z)
    lp = Normal(mu, std).log_prob(out.prev_sample).mean(dim=_dims(x))
    torch.testing.assert_close(out.log_prob, lp)
    torch.testing.assert_close(out.std, torch.full((3,), std, dtype=torch.float64))
    torch.testing.assert_close(out.sig, torch.full((3,), sig, dtype=torch.float64))
    torch.testing.assert_close(out.dt, torch.full((3,), dt, dtype=torch.float64))


def test_sde_at_sigma_one_uses_next_sigma_in_denominator():
    x, v, z = _inputs(dtype=torch.float64)
    out = sde_step_with_logprob(v, 1.0, 0.93, x, noise_level=0.7, noise=z)
    sig = 0.7 * math.sqrt(1.0 / (1.0 - 0.93))
    torch.testing.assert_close(out.sig, torch.full((3,), sig, dtype=torch.float64))
    assert torch.isfinite(out.log_prob).all()


def test_sde_per_sample_sigmas_match_single_sample_calls():
    x, v, z = _inputs()
    s, sn = torch.tensor([1.0, 0.6, 0.3]), torch.tensor([0.9, 0.5, 0.0])
    out = sde_step_with_logprob(v, s, sn, x, noise_level=0.8, noise=z)
    for i in range(3):
        one = sde_step_with_logprob(v[i:i + 1], float(s[i]), float(sn[i]), x[i:i + 1], noise_level=0.8,
                                    noise=z[i:i + 1])
        torch.testing.assert_close(out.log_prob[i:i + 1], one.log_prob)
        torch.testing.assert_close(out.prev_sample[i:i + 1], one.prev_sample)


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance"])
def test_recompute_from_prev_sample_gives_same_logprob(sde_type):
    x, v, _ = _inputs()
    g = torch.Generator().manual_seed(5)
    a = 0.5 if sde_type != "dance" else 0.3
    roll = sde_step_with_logprob(v, 0.8, 0.7, x, noise_level=a, sde_type=sde_type, generator=g)
    again = sde_step_with_logprob(v, 0.8, 0.7, x, noise_level=a, sde_type=sde_type, prev_sample=roll.prev_sample)
    assert torch.equal(again.log_prob, roll.log_prob)
    assert torch.equal(again.prev_sample, roll.prev_sample)


def test_bf16_rollout_logprob_is_reproduced_from_stored_latent():
    x, v, z = _inputs()
    xb, vb = x.to(torch.bfloat16), v.to(torch.bfloat16)
    roll = sde_step_with_logprob(vb, 0.8, 0.7, xb, noise_level=0.7, noise=z)
    assert roll.prev_sample.dtype == torch.bfloat16 and roll.log_prob.dtype == torch.float32
    again = sde_step_with_logprob(vb, 0.8, 0.7, xb, noise_level=0.7, prev_sample=roll.prev_sample)
    assert torch.equal(again.log_prob, roll.log_prob)


def test_generator_makes_draws_reproducible():
    x, v, _ = _inputs()
    a = sde_step_with_logprob(v, 0.8, 0.7, x, noise_level=0.7, generator=torch.Generator().manual_seed(3))
    b = sde_step_with_logprob(v, 0.8, 0.7, x, noise_level=0.7, generator=torch.Generator().manual_seed(3))
    c = sde_step_with_logprob(v, 0.8, 0.7, x, noise_level=0.7, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a.prev_sample, b.prev_sample)
    assert not torch.equal(a.prev_sample, c.prev_sample)


def test_logprob_gradient_flows_through_velocity_not_prev_sample():
    x, v, _ = _inputs()
    v = v.clone().requires_grad_(True)
    target = (x + 0.1).requires_grad_(True)
    out = sde_step_with_logprob(v, 0.8, 0.7, x, noise_level=0.7, prev_sample=target)
    out.log_prob.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0
    assert target.grad is None


# ---- CPS ---------------------------------------------------------------------

def test_cps_coefficients_and_logprob():
    x, v, z = _inputs(dtype=torch.float64)
    s, sn, a = 0.7, 0.5, 0.8
    out = sde_step_with_logprob(v, s, sn, x, noise_level=a, sde_type="cps", noise=z)
    sig = sn * math.sin(a * math.pi / 2)
    x0_hat, eps_hat = x - s * v, x + (1 - s) * v
    mu = (1 - sn) * x0_hat + math.sqrt(sn**2 - sig**2) * eps_hat
    torch.testing.assert_close(out.mean, mu)
    torch.testing.assert_close(out.sig, torch.full((3,), sig, dtype=torch.float64))
    torch.testing.assert_close(out.std, out.sig)
    torch.testing.assert_close(out.prev_sample, mu + sig * z)
    torch.testing.assert_close(out.log_prob, -((out.prev_sample - mu) ** 2).mean(dim=_dims(x)))


@pytest.mark.parametrize("a", [0.3, 0.8, 1.0])
def test_cps_preserves_x0_coefficient_and_noise_variance(a):
    # With an exact model (x = (1-s) x0 + s eps, v = eps - x0) the step output is
    # (1 - s_next) x0 + c * eps + sig * z: the forward-process marginal at s_next.
    g = torch.Generator().manual_seed(1)
    x0, eps = torch.randn(4, 64, generator=g, dtype=torch.float64), torch.randn(4, 64, generator=g, dtype=torch.float64)
    s, sn = 0.8, 0.6
    x, v = (1 - s) * x0 + s * eps, eps - x0
    out = sde_step_with_logprob(v, s, sn, x, noise_level=a, sde_type="cps", noise=torch.zeros_like(x))
    c = ((out.mean - (1 - sn) * x0) / eps).mean(dim=1)  # coefficient of eps in the mean
    torch.testing.assert_close(out.mean, (1 - sn) * x0 + c[:, None] * eps)
    torch.testing.assert_close(c**2 + out.std**2, torch.full((4,), sn**2, dtype=torch.float64))


def test_cps_rejects_noise_level_above_one():
    x, v, _ = _inputs()
    with pytest.raises(ValueError, match="noise_level"):
        sde_step_with_logprob(v, 0.7, 0.5, x, noise_level=1.5, sde_type="cps")


# ---- DanceGRPO ---------------------------------------------------------------

def test_dance_constant_sig_and_density():
    x, v, z = _inputs(dtype=torch.float64)
    s, sn, eta = 0.6, 0.45, 0.3
    out = sde_step_with_logprob(v, s, sn, x, noise_level=eta, sde_type="dance", noise=z)
    dt = sn - s
    mu = x + dt * (v + eta**2 / (2 * s) * (x + (1 - s) * v))
    std = eta * math.sqrt(s - sn)
    torch.testing.assert_close(out.mean, mu)
    torch.testing.assert_close(out.sig, torch.full((3,), eta, dtype=torch.float64))
    lp = Normal(mu, std).log_prob(out.prev_sample).mean(dim=_dims(x))
    torch.testing.assert_close(out.log_prob, lp)


# ---- validation --------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(sigma=0.5, sigma_next=0.6), "sigma_next"),
    (dict(sigma=0.5, sigma_next=0.4, sde_type="ode"), "sde_type"),
    (dict(sigma=0.5, sigma_next=0.4, noise_level=-1.0), "noise_level"),
    (dict(sigma=torch.tensor([0.5, 0.4]), sigma_next=0.3), "sigma"),
])
def test_bad_arguments_raise(kwargs, match):
    x, v, _ = _inputs()
    kw = dict(noise_level=0.7)
    kw.update(kwargs)
    s, sn = kw.pop("sigma"), kw.pop("sigma_next")
    with pytest.raises(ValueError, match=match):
        sde_step_with_logprob(v, s, sn, x, **kw)


def test_output_is_named_tuple():
    x, v, _ = _inputs()
    out = sde_step_with_logprob(v, 0.5, 0.4, x, noise_level=0.7)
    assert isinstance(out, SDEStepOutput)
    assert out.log_prob.shape == out.std.shape == out.sig.shape == out.dt.shape == (3,)
    assert out.mean.shape == x.shape


# ---- SDE window --------------------------------------------------------------

def test_window_none_is_whole_trajectory():
    w = SDEWindow(10, None, None, "random", 1, 0)
    assert w.select(0) == (0, 10) and w.select(99) == (0, 10)


def test_random_window_is_seeded_and_inside_range():
    w = SDEWindow(20, 4, [2, 15], "random", 1, seed=7)
    starts = [w.select(i)[0] for i in range(300)]
    assert all(2 <= s <= 11 for s in starts)
    assert set(starts) == set(range(2, 12))  # every legal start is reachable
    assert [w.select(i) for i in range(20)] == [SDEWindow(20, 4, [2, 15], "random", 1, 7).select(i)
                                                 for i in range(20)]
    other = SDEWindow(20, 4, [2, 15], "random", 1, seed=8)
    assert [w.select(i) for i in range(20)] != [other.select(i) for i in range(20)]
    # seed + step: seed 7 at step 1 equals seed 8 at step 0.
    assert w.select(1) == other.select(0)


def test_progressive_window_advances_and_wraps():
    w = SDEWindow(10, 3, [1, 10], "progressive", iters_per_group=2, seed=0)
    got = [w.select(i) for i in range(8)]
    assert got == [(1, 4), (1, 4), (4, 7), (4, 7), (7, 10), (7, 10), (1, 4), (1, 4)]


def test_progressive_never_truncates_last_window():
    w = SDEWindow(10, 4, None, "progressive", 1, 0)
    assert [w.select(i) for i in range(3)] == [(0, 4), (4, 8), (0, 4)]


def test_noise_levels_mask():
    w = SDEWindow(6, 2, None, "progressive", 1, 0)
    assert w.noise_levels(1, 0.7) == [0.0, 0.0, 0.7, 0.7, 0.0, 0.0]


def test_from_config_duck_typed():
    from types import SimpleNamespace

    cfg = SimpleNamespace(sde_window_size=2, sde_window_range=[0, 6], sample_strategy="progressive",
                          iters_per_group=1, sde_window_seed=0)
    assert SDEWindow.from_config(cfg, 6).select(2) == (4, 6)


@pytest.mark.parametrize("args, match", [
    ((0, 2, None, "random", 1, 0), "num_steps"),
    ((10, 11, None, "random", 1, 0), "sde_window_size"),
    ((10, 0, None, "random", 1, 0), "sde_window_size"),
    ((10, 2, [5, 3], "random", 1, 0), "sde_window_range"),
    ((10, 2, [0, 11], "random", 1, 0), "sde_window_range"),
    ((10, 4, [0, 3], "random", 1, 0), "sde_window_size"),
    ((10, 2, None, "sliding", 1, 0), "sample_strategy"),
    ((10, 2, None, "progressive", 0, 0), "iters_per_group"),
])
def test_window_validation(args, match):
    with pytest.raises(ValueError, match=match):
        SDEWindow(*args)


def test_window_rejects_negative_iteration():
    with pytest.raises(ValueError, match="iteration"):
        SDEWindow(10, 2, None, "random", 1, 0).select(-1)


def test_noise_level_zero_bf16_matches_euler_step_exactly():
    x, v, _ = _inputs()
    xb, vb = x.to(torch.bfloat16), v.to(torch.bfloat16)
    out = sde_step_with_logprob(vb, 0.8, 0.7, xb, noise_level=0.0)
    assert out.prev_sample.dtype == torch.bfloat16 and out.mean.dtype == torch.float32
    assert torch.equal(out.prev_sample, euler_step(vb, 0.8, 0.7, xb))
