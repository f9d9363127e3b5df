"""Flow-DPPO: a divergence trust region instead of ratio clipping.

PPO's clip looks at the ratio of one sampled latent, a noisy proxy for how
far the policy moved. For Gaussian SDE steps the real divergence between the
current and the old step is known in closed form, so Flow-DPPO masks on it::

    rho  = exp(logp_theta - logp_old)
    D    = mean_dims((mu_theta - mu_old)^2 / (2 std^2))      (add_kl_coefficient = true)
         = mean_dims((mu_theta - mu_old)^2) / 2               (add_kl_coefficient = false)
    drop = D >= tau  and  ((rho > 1 and A > 0) or (rho < 1 and A < 0))
    L    = mean_B( -A * rho * (1 - drop) * w_is )              (no clipping)

An element is dropped only when the step has already moved more than ``tau``
(``kl_mask_threshold``) *and* the gradient would push it further out; updates
that pull back towards the old policy always pass.

About ``std``: the divergence is normalised by the transition's noise std
``model_output['std'] = sig * sqrt(-dt)`` (the exact Gaussian KL per element),
as upstream VeRL-Omni does (``std_dev_t * sqrt_dt``). ALGORITHMS.md writes
this as ``2 sig^2``; the project's ``sig`` is the diffusion coefficient
without the ``sqrt(-dt)``, which would measure a different quantity and make
``tau = 1e-5`` mean something else. Hence ``std``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from omnirl_async.algos.losses.base import DiffusionLossFn, DiffusionLossResult, mean_dims, register_diffusion_loss

__all__ = ["FlowDPPOLoss"]


@register_diffusion_loss("flow_dppo")
class FlowDPPOLoss(DiffusionLossFn):
    """Flow-DPPO loss. Metrics: ``actor/pg_loss``, ``actor/ppo_kl``, ``actor/ratio_*``,
    ``actor/pg_clipfrac`` (fraction dropped by the trust region),
    ``actor/kl_mask_fraction`` (fraction with ``D >= tau``), ``actor/kl_new_old_{mean,max}``."""

    name = "flow_dppo"
    required_model_outputs = ("log_prob", "mean", "std")
    required_data_keys = ("old_log_prob", "advantages", "old_mean")

    def __init__(self, loss_config, actor_config=None) -> None:
        super().__init__(loss_config, actor_config)
        self.threshold = float(self._loss_opt("kl_mask_threshold", gt=0.0))
        self._loss_opt("adv_clip_max", gt=0.0)
        self.add_kl_coefficient = bool(getattr(loss_config, "add_kl_coefficient", True))

    def divergence(self, mean: torch.Tensor, old_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        """Per-sample drift ``D`` ``[B]`` (see the module docstring)."""
        sq = (mean.detach() - old_mean.detach().to(mean.dtype)) ** 2
        if not self.add_kl_coefficient:
            return mean_dims(sq) / 2.0
        std = std.detach().to(sq.dtype).reshape(-1)
        noisy = std > 0
        safe = torch.where(noisy, std, torch.ones_like(std))
        d = mean_dims(sq / (2.0 * safe.view(-1, *([1] * (sq.ndim - 1))) ** 2))
        # A noiseless step with any drift is infinitely far; with none it has not moved.
        inf = torch.full_like(d, float("inf"))
        return torch.where(noisy, d, torch.where(d > 0, inf, torch.zeros_like(d)))

    def compute(self, model_output: Mapping, data: Mapping) -> DiffusionLossResult:
        log_prob, mean = model_output["log_prob"], model_output["mean"]
        old_mean = data["old_mean"]
        if old_mean.shape != mean.shape:
            raise ValueError(f"loss 'flow_dppo': `data['old_mean']` shape {tuple(old_mean.shape)} != "
                             f"`model_output['mean']` shape {tuple(mean.shape)}.")
        adv = self._clipped_advantages(data).to(log_prob.dtype)
        log_ratio = log_prob - data["old_log_prob"].detach().to(log_prob.dtype)
        ratio = torch.exp(log_ratio)

        div = self.divergence(mean, old_mean, model_output["std"])
        far = div >= self.threshold
        r = ratio.detach()
        drop = far & (((r > 1.0) & (adv > 0)) | ((r < 1.0) & (adv < 0)))
        keep = (~drop).to(ratio.dtype)
        pg_loss = self._weighted_mean(-adv * ratio * keep, data)

        metrics = {"actor/pg_loss": float(pg_loss.detach())}
        metrics.update(self._ratio_metrics(ratio, log_ratio))
        metrics["actor/pg_clipfrac"] = float(drop.float().mean())
        metrics["actor/kl_mask_fraction"] = float(far.float().mean())
        metrics["actor/kl_new_old_mean"] = float(div.mean())
        metrics["actor/kl_new_old_max"] = float(div.max())
        return DiffusionLossResult(pg_loss, metrics)
