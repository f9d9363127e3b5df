"""GRPO-Guard: a ratio that stays centred when the SDE noise scale varies.

In Flow-GRPO the per-step log-ratio is dominated by ``(mu_theta - mu_old)^2 /
(2 std^2)``-type terms whose size depends on the step's noise scale, so the
ratio distribution drifts off 1 and its spread differs wildly across steps;
a fixed clip range then over-clips some steps and never clips others.
GRPO-Guard re-centres and re-scales the ratio with a batch-shared step scale::

    s    = mean_B(sig) * mean_B(sqrt(-dt))
    b    = mean_dims((mu_theta - mu_old)^2) / (2 s^2)
    rho  = exp((logp_theta - logp_old + b) * s)
    L    = mean_B( max(-A*rho, -A*clip(rho, 1-eps, 1+eps)) * w_is ) / mean_B(sqrt(-dt))^2

The final division is the reference's per-step reweighting that evens out
gradient magnitude across timesteps. ``mu_old`` is the stored SDE mean of the
sample (``data['old_mean']``). Recommended settings: ``clip_ratio = 2e-6`` and
``algorithm.global_std = false``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from omnirl_async.algos.losses.base import DiffusionLossFn, DiffusionLossResult, mean_dims, register_diffusion_loss
from omnirl_async.algos.losses.flow_grpo import clipped_surrogate

__all__ = ["GRPOGuardLoss"]


@register_diffusion_loss("grpo_guard")
class GRPOGuardLoss(DiffusionLossFn):
    """GRPO-Guard clipped loss. Metrics as Flow-GRPO plus ``actor/guard_mean_bias``
    (batch mean of ``b``) and ``actor/guard_scale`` (``s``)."""

    name = "grpo_guard"
    required_model_outputs = ("log_prob", "mean", "sig", "dt")
    required_data_keys = ("old_log_prob", "advantages", "old_mean")

    def __init__(self, loss_config, actor_config=None) -> None:
        super().__init__(loss_config, actor_config)
        self.clip_ratio = float(self._loss_opt("clip_ratio", gt=0.0))
        self._loss_opt("adv_clip_max", gt=0.0)

    def compute(self, model_output: Mapping, data: Mapping) -> DiffusionLossResult:
        log_prob, mean = model_output["log_prob"], model_output["mean"]
        old_mean = data["old_mean"].detach().to(mean.dtype)
        if old_mean.shape != mean.shape:
            raise ValueError(f"loss 'grpo_guard': `data['old_mean']` shape {tuple(old_mean.shape)} != "
                             f"`model_output['mean']` shape {tuple(mean.shape)}.")
        adv = self._clipped_advantages(data).to(log_prob.dtype)
        sig = model_output["sig"].detach().to(log_prob.dtype)
        sqrt_neg_dt = torch.sqrt(torch.clamp(-model_output["dt"].detach().to(log_prob.dtype), min=0.0))
        sqrt_dt_mean = sqrt_neg_dt.mean()
        scale = sig.mean() * sqrt_dt_mean
        if not bool(scale > 0):
            raise ValueError("loss 'grpo_guard': the step has no SDE noise (mean(sig)*mean(sqrt(-dt)) = 0); "
                             "train only steps inside the SDE window (noise_level > 0).")

        bias = mean_dims((mean - old_mean) ** 2) / (2.0 * scale**2)
        log_ratio = log_prob - data["old_log_prob"].detach().to(log_prob.dtype)
        ratio = torch.exp((log_ratio + bias) * scale)
        pg_loss = self._weighted_mean(clipped_surrogate(ratio, adv, self.clip_ratio), data) / sqrt_dt_mean**2

        metrics = {"actor/pg_loss": float(pg_loss.detach())}
        metrics.update(self._ratio_metrics(ratio, log_ratio))
        metrics["actor/pg_clipfrac"] = float(((ratio.detach() - 1.0).abs() > self.clip_ratio).float().mean())
        metrics["actor/guard_mean_bias"] = float(bias.detach().mean())
        metrics["actor/guard_scale"] = float(scale)
        return DiffusionLossResult(pg_loss, metrics)
