"""The distillation formulas (``algos/losses/distill.py``) against direct computation."""

from __future__ import annotations

import pytest
import torch

from omnirl_async.algos.losses.distill import DISTILL_MODES, distill_fm_mse, distill_kl, distill_term
from omnirl_async.models.sde import sde_step_with_logprob


def _tensors(seed=0, shape=(3, 4, 8, 8)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(3)]


def test_fm_mse_is_the_per_sample_velocity_mse():
    v_s, v_t, _ = _tensors()
    direct = torch.stack([((v_s[i] - v_t[i]) ** 2).mean() for i in range(v_s.shape[0])])
    torch.testing.assert_close(distill_fm_mse(v_s, v_t), direct)
    assert float(distill_term("distill_fm_mse", v_student=v_s, v_teacher=v_t)) == pytest.approx(float(direct.mean()))
    assert torch.equal(distill_fm_mse(v_s, v_s.clone()), torch.zeros(3))


def test_kl_is_the_mean_drift_over_two_sig_squared_of_the_sde_steps():
    v_s, v_t, x = _tensors(1)
    s = torch.tensor([1.0, 0.7, 0.3])
    s_next = torch.tensor([0.8, 0.5, 0.1])
    st = sde_step_with_logprob(v_s, s, s_next, x, noise_level=0.7, prev_sample=x)
    te = sde_step_with_logprob(v_t, s, s_next, x, noise_level=0.7, prev_sample=x)
    # direct: the ALGORITHMS.md SDE mean, written out
    sig = torch.tensor([0.7 * (1.0 / (1 - 0.8)) ** 0.5, 0.7 * (0.7 / 0.3) ** 0.5, 0.7 * (0.3 / 0.7) ** 0.5])
    dt = (s_next - s).view(-1, 1, 1, 1)
    sb, sigb = s.view(-1, 1, 1, 1), sig.view(-1, 1, 1, 1)

    def mu(v):
        return x + dt * (v + sigb**2 / (2 * sb) * (x + (1 - sb) * v))

    direct = ((mu(v_s) - mu(v_t)) ** 2).mean(dim=(1, 2, 3)) / (2 * sig**2)
    torch.testing.assert_close(distill_kl(st.mean, te.mean, st.sig), direct, rtol=1e-5, atol=1e-8)
    term = distill_term("distill_kl", mean_student=st.mean, mean_teacher=te.mean, sig=st.sig)
    assert float(term) == pytest.approx(float(direct.mean()), rel=1e-5)


def test_kl_is_zero_without_noise_and_for_equal_means():
    v_s, v_t, x = _tensors(2)
    s, s_next = torch.full((3,), 0.6), torch.full((3,), 0.4)
    st = sde_step_with_logprob(v_s, s, s_next, x, noise_level=0.0)
    te = sde_step_with_logprob(v_t, s, s_next, x, noise_level=0.0)
    assert torch.equal(distill_kl(st.mean, te.mean, st.sig), torch.zeros(3))  # sig = 0: no KL term
    noisy = sde_step_with_logprob(v_s, s, s_next, x, noise_level=0.7, prev_sample=x)
    assert torch.equal(distill_kl(noisy.mean, noisy.mean.clone(), noisy.sig), torch.zeros(3))


def test_only_the_student_gets_a_gradient():
    v_s, v_t, _ = _tensors(3)
    v_s.requires_grad_(True)
    v_t.requires_grad_(True)
    distill_term("distill_fm_mse", v_student=v_s, v_teacher=v_t).backward()
    assert v_s.grad is not None and float(v_s.grad.abs().sum()) > 0
    assert v_t.grad is None
    # d/dv_s of mean_B mean_dims((v_s - v_t)^2) = 2 (v_s - v_t) / numel
    torch.testing.assert_close(v_s.grad, 2 * (v_s - v_t).detach() / v_s.numel())


def test_bad_inputs_are_named():
    v_s, v_t, _ = _tensors(4)
    with pytest.raises(ValueError, match="distill_loss_mode"):
        distill_term("distill_l2", v_student=v_s, v_teacher=v_t)
    with pytest.raises(ValueError, match="distill_teacher_path"):
        distill_fm_mse(v_s, v_t[:, :2])
    with pytest.raises(ValueError, match="needs `mean_student`"):
        distill_term("distill_kl", v_student=v_s, v_teacher=v_t)
    assert DISTILL_MODES == ("distill_kl", "distill_fm_mse")
