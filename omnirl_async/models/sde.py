"""One reverse-time denoising step of a flow-matching model, with its log-probability.

Why a stochastic step at all
----------------------------
A flow-matching sampler integrates the ODE ``dx = v(x, s) ds`` from pure noise
(``s = 1``) to data (``s = 0``). An ODE step is deterministic, so it has no
probability and a policy-gradient method cannot score it. Flow-GRPO replaces
each step by an SDE step with the same marginals: the new latent is drawn from
a Gaussian ``N(mu, std^2)`` around a drift-corrected mean. The per-step
log-density of the drawn latent is the "action log-prob" of RL, and the ratio
of two such densities (current vs old policy) drives the PPO-style losses in
:mod:`omnirl_async.algos.losses`.

Notation (diffusers ``FlowMatchEulerDiscreteScheduler``): ``x_s = (1-s)*x0 +
s*eps``, velocity ``v = eps - x0``; ``dt = s_next - s < 0``;
``x0_hat = x - s*v`` and ``eps_hat = x + (1-s)*v``.

Three variants (``sde_type``), noise level ``a``:

* ``"sde"`` (Flow-GRPO, default ``a = 0.7``)::

      sig = a * sqrt(s / (1 - s))              # at s = 1: 1 - s_1 in the denominator
      mu  = x + dt * [v + sig^2 / (2 s) * (x + (1 - s) v)]
      std = sig * sqrt(-dt);   x' = mu + std * z
      logp = mean_dims[-(x' - mu)^2 / (2 std^2) - log std - log sqrt(2 pi)]

  ``s_1`` is the grid sigma that follows ``s = 1``. Only the first grid point
  of a schedule equals 1, so for that step ``s_1`` is exactly ``sigma_next``;
  this function therefore uses ``1 - sigma_next`` as the denominator wherever
  ``sigma == 1`` (the reference implementation reads ``sigmas[1]``, the same
  number).

* ``"cps"`` (coefficient-preserving sampling, default ``a = 0.8``)::

      sig = s_next * sin(a * pi / 2)
      mu  = (1 - s_next) * x0_hat + sqrt(s_next^2 - sig^2) * eps_hat
      x'  = mu + sig * z;   std = sig
      logp = -mean_dims[(x' - mu)^2]

  The x0 coefficient stays ``1 - s_next`` and the total noise variance stays
  ``s_next^2`` (deterministic part ``s_next^2 - sig^2`` plus fresh ``sig^2``),
  so the sample keeps the marginal of the forward process. The log-prob is the
  *unscaled* squared error used by the reference implementations (no
  ``1/(2 std^2)``, no normaliser). It is not a density, only a score whose
  differences act as log-ratios; because it is not divided by ``2 std^2`` its
  ratios are much closer to 1, which is why cps runs use tiny clip ranges
  (~1e-5).

* ``"dance"`` (DanceGRPO, ``a = eta``, default 0.3): constant ``sig = eta``,
  ``std = eta * sqrt(s - s_next)``, mean as in ``"sde"`` with ``sig = eta``,
  full Gaussian log-density as in ``"sde"``. (The DanceGRPO code drops the
  constant terms by accident; constants cancel in every ratio, so this makes
  no difference to training.)

Deterministic steps: ``noise_level == 0`` returns the Euler step exactly
(``x + dt*v`` computed by :func:`euler_step`) for every ``sde_type``, with
``std = sig = 0`` and ``log_prob = 0``. A point mass has no finite density;
0 is a neutral placeholder that makes any ratio exactly 1. The same rule
(``log_prob = 0`` where ``std == 0``) applies to individual samples whose
step has no noise (e.g. ``dt == 0``).

Precision: the mean, std and log-prob are computed in at least fp32 (fp64
inputs stay fp64). A drawn ``prev_sample`` is first cast to the dtype of
``sample`` and its log-prob is computed from that cast value, so that the
learner's recompute from the stored latent reproduces the rollout's log-prob
bit for bit.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["SDE_TYPES", "SDEStepOutput", "euler_step", "sde_step_with_logprob"]

SDE_TYPES = ("sde", "cps", "dance")
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


class SDEStepOutput(NamedTuple):
    """Result of one denoising step.

    Attributes:
        prev_sample: the next latent ``x'`` (dtype of the input ``sample``).
        log_prob: ``[B]`` log-probability of ``prev_sample`` (mean over non-batch dims).
        mean: the Gaussian mean ``mu`` (fp32 or wider), same shape as ``sample``.
        std: ``[B]`` standard deviation of the added noise (``sig*sqrt(-dt)``; cps: ``sig``).
        sig: ``[B]`` the SDE diffusion coefficient ``sig`` of the step.
        dt: ``[B]`` ``sigma_next - sigma`` (negative when denoising).
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    sig: torch.Tensor
    dt: torch.Tensor


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _as_batch(value, name: str, batch: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Turn a float, 0-d tensor or ``[B]`` tensor into a ``[B]`` tensor."""
    t = torch.as_tensor(value, dtype=dtype, device=device)
    if t.ndim == 0:
        return t.expand(batch).clone()
    t = t.reshape(-1)
    if t.numel() == 1:
        return t.expand(batch).clone()
    if t.numel() != batch:
        raise ValueError(f"`{name}` has {t.numel()} values but the batch has {batch} samples; "
                         f"pass one float or a Tensor[{batch}].")
    return t


def _bcast(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """View a ``[B]`` tensor as ``[B, 1, ..., 1]`` to broadcast against ``like``."""
    return t.view(-1, *([1] * (like.ndim - 1)))


def _mean_dims(t: torch.Tensor) -> torch.Tensor:
    return t.mean(dim=tuple(range(1, t.ndim))) if t.ndim > 1 else t


def euler_step(velocity: torch.Tensor, sigma, sigma_next, sample: torch.Tensor) -> torch.Tensor:
    """Deterministic (ODE) flow-matching step ``x_next = x + (sigma_next - sigma) * v``.

    ``sigma``/``sigma_next`` are floats or ``Tensor[B]``. Computed in at least
    fp32 and returned in the dtype of ``sample``.
    """
    dtype = _compute_dtype(sample)
    b = sample.shape[0]
    s = _as_batch(sigma, "sigma", b, dtype, sample.device)
    s_next = _as_batch(sigma_next, "sigma_next", b, dtype, sample.device)
    x = sample.to(dtype)
    v = velocity.to(dtype)
    return (x + _bcast(s_next - s, x) * v).to(sample.dtype)


def _validate(velocity, sample, s, s_next, noise_level, sde_type, prev_sample, noise):
    if sde_type not in SDE_TYPES:
        raise ValueError(f"`sde_type` = {sde_type!r} is not known; use one of {list(SDE_TYPES)}.")
    if velocity.shape != sample.shape:
        raise ValueError(f"`velocity` shape {tuple(velocity.shape)} != `sample` shape {tuple(sample.shape)}; "
                         "the model must predict a velocity in the latent layout.")
    for name, t in (("prev_sample", prev_sample), ("noise", noise)):
        if t is not None and t.shape != sample.shape:
            raise ValueError(f"`{name}` shape {tuple(t.shape)} != `sample` shape {tuple(sample.shape)}.")
    nl = float(noise_level)
    if not math.isfinite(nl) or nl < 0:
        raise ValueError(f"`noise_level` = {noise_level!r}: must be a finite number >= 0 (0 = ODE step).")
    if sde_type == "cps" and nl > 1:
        raise ValueError(f"`noise_level` = {noise_level!r} with sde_type='cps': must be in [0, 1] "
                         "(sig = s_next*sin(a*pi/2) must not exceed s_next).")
    if bool((s_next > s).any()):
        raise ValueError(f"`sigma_next` > `sigma` (sigma={s.tolist()}, sigma_next={s_next.tolist()}): "
                         "denoising runs from sigma=1 to 0, so sigma_next must be <= sigma.")
    if bool((s > 1).any()) or bool((s_next < 0).any()):
        raise ValueError(f"sigmas must lie in [0, 1] (sigma={s.tolist()}, sigma_next={s_next.tolist()}).")
    if nl > 0 and sde_type in ("sde", "dance") and bool((s <= 0).any()):
        raise ValueError(f"`sigma` = {s.tolist()} contains 0: an SDE step cannot start at sigma=0 "
                         "(the grid's last sigma is the end point, not a step).")
    return nl


def sde_step_with_logprob(
    velocity: torch.Tensor,
    sigma,
    sigma_next,
    sample: torch.Tensor,
    *,
    noise_level: float,
    sde_type: str = "sde",
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> SDEStepOutput:
    """Take one SDE denoising step and return the next latent with its log-prob.

    Args:
        velocity: model velocity prediction ``v``, same shape as ``sample`` (any layout, batch first).
        sigma, sigma_next: current and next sigma; float or ``Tensor[B]``.
        sample: current latent ``x`` (batch first).
        noise_level: ``a`` of the chosen ``sde_type`` (``eta`` for ``"dance"``); 0 = Euler step.
        sde_type: ``"sde"``, ``"cps"`` or ``"dance"`` (see the module docstring).
        prev_sample: if given, no noise is drawn and the log-prob of this latent
            under the step's Gaussian is returned (training-time recompute).
        generator: RNG for the noise when neither ``prev_sample`` nor ``noise`` is given.
        noise: explicit standard-normal noise ``z`` (same shape as ``sample``).

    Returns:
        :class:`SDEStepOutput` (``prev_sample, log_prob [B], mean, std [B], sig [B], dt [B]``).
        Gradients flow into ``log_prob`` through ``mean`` (i.e. through
        ``velocity``); ``prev_sample`` is treated as data (detached).
    """
    dtype = _compute_dtype(sample)
    device = sample.device
    b = sample.shape[0]
    s = _as_batch(sigma, "sigma", b, dtype, device)
    s_next = _as_batch(sigma_next, "sigma_next", b, dtype, device)
    a = _validate(velocity, sample, s, s_next, noise_level, sde_type, prev_sample, noise)
    dt = s_next - s

    # 1. Deterministic step: the Euler update, exactly.
    if a == 0.0:
        mean = sample.to(dtype) + _bcast(dt, sample) * velocity.to(dtype)  # same arithmetic as euler_step
        zeros = torch.zeros(b, dtype=dtype, device=device)
        out = mean.to(sample.dtype) if prev_sample is None else prev_sample
        return SDEStepOutput(out, zeros, mean, zeros.clone(), zeros.clone(), dt)

    x = sample.to(dtype)
    v = velocity.to(dtype)
    s_b, s_next_b, dt_b = _bcast(s, x), _bcast(s_next, x), _bcast(dt, x)

    # 2. Mean and noise scale of the Gaussian transition.
    if sde_type == "cps":
        sig = s_next * math.sin(a * math.pi / 2.0)
        x0_hat = x - s_b * v
        eps_hat = x + (1.0 - s_b) * v
        keep = torch.sqrt(torch.clamp(s_next**2 - sig**2, min=0.0))
        mean = (1.0 - s_next_b) * x0_hat + _bcast(keep, x) * eps_hat
        std = sig
    else:
        if sde_type == "sde":
            denom = 1.0 - torch.where(s >= 1.0, s_next, s)
            sig = a * torch.sqrt(s / denom)
        else:  # dance
            sig = torch.full_like(s, a)
        sig_b = _bcast(sig, x)
        mean = x + dt_b * (v + sig_b**2 / (2.0 * s_b) * (x + (1.0 - s_b) * v))
        std = sig * torch.sqrt(torch.clamp(-dt, min=0.0))

    # 3. Draw the next latent (or take the given one), in the sample's dtype.
    if prev_sample is None:
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, device=device, dtype=dtype)
        prev_sample = (mean + _bcast(std, x) * noise.to(dtype)).to(sample.dtype)
    target = prev_sample.detach().to(dtype)

    # 4. Log-probability, averaged over the non-batch dims.
    sq = (target - mean) ** 2
    if sde_type == "cps":
        log_prob = -_mean_dims(sq)
    else:
        noisy = std > 0
        safe_std = torch.where(noisy, std, torch.ones_like(std))
        std_b = _bcast(safe_std, x)
        per_elem = -sq / (2.0 * std_b**2) - torch.log(std_b) - _LOG_SQRT_2PI
        log_prob = torch.where(noisy, _mean_dims(per_elem), torch.zeros_like(std))
    return SDEStepOutput(prev_sample, log_prob, mean, std, sig, dt)
