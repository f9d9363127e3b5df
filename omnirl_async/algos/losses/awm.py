"""AWM: advantage-weighted matching (a PPO-style surrogate on flow-matching errors).

The learner draws ``t`` (stratified) and fresh ``eps`` per sample and evaluates
at ``x_t = (1-t)*x0 + t*eps`` the current policy ``v`` (with gradients) and
the proximal policy ``v_prox`` (the policy *before this update*, no gradient;
stored in ``data``), plus the reference ``v_ref`` (adapter disabled) and the
EMA policy ``v_old`` (the old adapter) when their coefficients are > 0::

    l      = mean_dims((v - (eps - x0))^2)
    lp     = -t * ((l + 1e-10)^p - (1e-10)^p) / p           p = 0.25
    lp_old = the same from sg(v_prox)
    rho    = exp(lp - lp_old)
    A      = clamp(advantages, -adv_clip_max, adv_clip_max) / adv_clip_max
    L = mean_B( max(-A*rho, -A*clamp(rho, 0, 2)) * w_is )
        + ref_kl_coef * mean((v - sg(v_ref))^2) + old_kl_coef * mean((v - sg(v_old))^2)

``lp`` is a concave surrogate of the log-likelihood (a lower matching error
is a higher "log-prob"). ``w_is`` are ``data['is_weights']`` (default 1; the
two MSE anchors are not weighted).

Sanity check: on-policy (``v == v_prox``) ``rho == 1`` exactly and the
gradient is ``-mean_B(A * grad lp)``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from omnirl_async.algos.losses.base import DiffusionLossFn, DiffusionLossResult, mean_dims, register_diffusion_loss
from omnirl_async.algos.losses.matching import check_velocity_inputs, compute_dtype, target_velocity

__all__ = ["AWMLoss", "AWM_POWER", "AWM_RATIO_CLIP_MAX", "matching_log_prob"]

AWM_POWER = 0.25
AWM_RATIO_CLIP_MAX = 2.0
_EPS = 1e-10


def matching_log_prob(err: torch.Tensor, t: torch.Tensor, p: float = AWM_POWER) -> torch.Tensor:
    """``lp = -t * ((err + 1e-10)^p - (1e-10)^p) / p`` per sample (``err``, ``t``: ``[B]``)."""
    return -t * ((err + _EPS) ** p - _EPS**p) / p


@register_diffusion_loss("awm")
class AWMLoss(DiffusionLossFn):
    """Advantage-weighted matching loss (+ optional MSE anchors to the reference and EMA policies).

    Config (``diffusion_loss``): ``adv_clip_max`` (> 0), ``ref_kl_coef`` (>= 0),
    ``old_kl_coef`` (>= 0).

    Metrics: ``actor/pg_loss``, ``actor/ppo_kl`` (mean ``lp_old - lp``),
    ``actor/ratio_{mean,max,min}``, ``actor/pg_clipfrac`` (fraction with
    ``rho > 2``), ``actor/kl_loss`` (unscaled reference MSE, when
    ``ref_kl_coef > 0``), ``actor/awm/old_mse`` (unscaled EMA-policy MSE, when
    ``old_kl_coef > 0``).
    """

    name = "awm"
    trainer_type = "direct_preference"
    required_model_outputs = ("v",)
    required_data_keys = ("x0", "eps", "t", "advantages", "v_prox")

    def __init__(self, loss_config, actor_config=None) -> None:
        super().__init__(loss_config, actor_config)
        self.adv_clip_max = float(self._loss_opt("adv_clip_max", gt=0.0))
        self.ref_kl_coef = float(self._loss_opt("ref_kl_coef", ge=0.0))
        self.old_kl_coef = float(self._loss_opt("old_kl_coef", ge=0.0))
        if self.ref_kl_coef > 0:
            self.model_output_keys += ("v_ref",)
        if self.old_kl_coef > 0:
            self.model_output_keys += ("v_old",)

    def compute(self, model_output: Mapping, data: Mapping) -> DiffusionLossResult:
        check_velocity_inputs(self.name, model_output, data, self.model_output_keys, ("x0", "eps", "v_prox"))
        v = model_output["v"]
        dtype = compute_dtype(v)
        v = v.to(dtype)
        target = target_velocity(data["x0"].detach().to(dtype), data["eps"].detach().to(dtype))
        t = data["t"].detach().to(dtype)
        lp = matching_log_prob(mean_dims((v - target) ** 2), t)
        lp_old = matching_log_prob(mean_dims((data["v_prox"].detach().to(dtype) - target) ** 2), t)
        log_ratio = lp - lp_old
        ratio = torch.exp(log_ratio)
        adv = self._clipped_advantages(data).to(dtype).reshape(-1) / self.adv_clip_max
        per_sample = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.0, AWM_RATIO_CLIP_MAX))
        pg_loss = self._weighted_mean(per_sample, data)

        metrics = {"actor/pg_loss": float(pg_loss.detach())}
        metrics.update(self._ratio_metrics(ratio, log_ratio))
        metrics["actor/pg_clipfrac"] = float((ratio.detach() > AWM_RATIO_CLIP_MAX).to(dtype).mean())
        loss = pg_loss
        if self.ref_kl_coef > 0:
            ref_mse = ((v - model_output["v_ref"].detach().to(dtype)) ** 2).mean()
            metrics["actor/kl_loss"] = float(ref_mse.detach())
            loss = loss + self.ref_kl_coef * ref_mse
        if self.old_kl_coef > 0:
            old_mse = ((v - model_output["v_old"].detach().to(dtype)) ** 2).mean()
            metrics["actor/awm/old_mse"] = float(old_mse.detach())
            loss = loss + self.old_kl_coef * old_mse
        return DiffusionLossResult(loss, metrics)
