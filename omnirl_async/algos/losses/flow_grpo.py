"""Flow-GRPO: the PPO clipped surrogate on per-step SDE log-probs.

For one trained SDE step of each sample::

    rho = exp(logp_theta - logp_old)
    L   = mean_B( max(-A*rho, -A*clip(rho, 1-eps, 1+eps)) * w_is ) + beta*KL

``A`` is the sample's group advantage, clipped to ``+-adv_clip_max``; ``eps``
is ``clip_ratio`` (1e-4 by default: per-step log-probs are averages over
thousands of latent elements, so ratios move very little); ``w_is`` are the
rollout-correction weights (``data['is_weights']``, default 1); ``beta*KL`` is
the optional reference penalty (``actor.use_kl_loss``, ``actor.kl_loss_coef``,
see :mod:`.kl`).

Sanity check built into the maths: with one mini-batch, one epoch and
on-policy data, ``logp_theta == logp_old`` so ``rho == 1`` exactly and the
gradient is ``-mean_B(A * grad logp)``: plain REINFORCE with a group baseline.

The same objective serves MixGRPO (``mix_grpo``: only the window differs) and
DanceGRPO (``dance_grpo``: only the sampler and advantage std differ).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from omnirl_async.algos.losses.base import DiffusionLossFn, DiffusionLossResult, register_diffusion_loss
from omnirl_async.algos.losses.kl import compute_mean_kl

__all__ = ["clipped_surrogate", "FlowGRPOLoss"]


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_ratio: float) -> torch.Tensor:
    """Per-element pessimistic PPO objective ``max(-A*rho, -A*clip(rho, 1-eps, 1+eps))``."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    return torch.maximum(unclipped, clipped)


@register_diffusion_loss("flow_grpo")
@register_diffusion_loss("mix_grpo")
@register_diffusion_loss("dance_grpo")
class FlowGRPOLoss(DiffusionLossFn):
    """Flow-GRPO clipped policy loss (+ optional KL to the reference policy).

    Metrics: ``actor/pg_loss``, ``actor/ppo_kl`` (mean of ``old - new``
    log-prob), ``actor/pg_clipfrac`` (fraction with ``|rho - 1| > eps``),
    ``actor/ratio_{mean,max,min}``, and ``actor/kl_loss`` when the KL is on.
    """

    name = "flow_grpo"
    required_model_outputs = ("log_prob",)
    required_data_keys = ("old_log_prob", "advantages")

    def __init__(self, loss_config, actor_config=None) -> None:
        super().__init__(loss_config, actor_config)
        self.clip_ratio = float(self._loss_opt("clip_ratio", gt=0.0))
        self._loss_opt("adv_clip_max", gt=0.0)
        self.use_kl_loss = bool(self._actor_opt("use_kl_loss", False))
        self.kl_loss_coef = float(self._actor_opt("kl_loss_coef", 0.0))
        if self.use_kl_loss:
            if self.kl_loss_coef < 0:
                raise ValueError(f"`actor_rollout_ref.actor.kl_loss_coef` = {self.kl_loss_coef!r}: must be >= 0.")
            self.model_output_keys += ("mean", "ref_mean", "sig")

    def compute(self, model_output: Mapping, data: Mapping) -> DiffusionLossResult:
        log_prob = model_output["log_prob"]
        adv = self._clipped_advantages(data).to(log_prob.dtype)
        log_ratio = log_prob - data["old_log_prob"].detach().to(log_prob.dtype)
        ratio = torch.exp(log_ratio)
        pg_loss = self._weighted_mean(clipped_surrogate(ratio, adv, self.clip_ratio), data)

        metrics = {"actor/pg_loss": float(pg_loss.detach())}
        metrics.update(self._ratio_metrics(ratio, log_ratio))
        metrics["actor/pg_clipfrac"] = float(((ratio.detach() - 1.0).abs() > self.clip_ratio).float().mean())
        loss = pg_loss
        if self.use_kl_loss:
            kl = compute_mean_kl(model_output["mean"], model_output["ref_mean"], model_output["sig"]).mean()
            metrics["actor/kl_loss"] = float(kl.detach())
            loss = loss + self.kl_loss_coef * kl
        return DiffusionLossResult(loss, metrics)
