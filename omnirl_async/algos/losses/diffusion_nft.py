"""DiffusionNFT: negative-aware fine-tuning on the forward process.

Samples come from the *old* adapter (deterministic sampler); each keeps its
clean latent ``x0`` and advantage ``A``. The learner draws ``t`` and fresh
``eps``, forms ``x_t = (1-t)*x0 + t*eps`` and evaluates the current policy
``v`` (with gradients), the old adapter ``v_old`` and, when ``ref_kl_coef > 0``,
the reference ``v_ref`` (adapter disabled). Per sample::

    r   = clamp(A / (2*adv_clip_max) + 0.5, 0, 1)          (optimality probability)
    v+  = beta*v + (1-beta)*sg(v_old)                      (implicit positive policy)
    v-  = (1+beta)*sg(v_old) - beta*v                      (implicit negative policy)
    x0± = x_t - t*v±
    w±  = max(sg(mean_dims|x0± - x0|), adaptive_weight_min)
    l   = r*mean_dims((x0+ - x0)^2)/w+ + (1-r)*mean_dims((x0- - x0)^2)/w-

    L = mean_B(l * w_is) / beta + ref_kl_coef * mean((v - sg(v_ref))^2)

``beta`` is ``mix_beta``; ``w_is`` are ``data['is_weights']`` (default 1; the
reference term is not weighted). Gradients reach the current policy only
through ``v`` (``v_old``, ``v_ref`` and the adaptive weights are detached).

Sanity check: with ``beta = 1`` and ``A = adv_clip_max`` (``r = 1``) the loss
is the adaptively weighted x0-prediction loss of the current policy,
``mean_B(mean_dims((x_t - t*v - x0)^2) / max(sg(mean_dims|x_t - t*v - x0|), wmin))``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from omnirl_async.algos.losses.base import DiffusionLossFn, DiffusionLossResult, mean_dims, register_diffusion_loss
from omnirl_async.algos.losses.matching import check_velocity_inputs, compute_dtype, expand_t, noisy_latent

__all__ = ["DiffusionNFTLoss", "optimality_probability"]


def optimality_probability(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """``r = clamp(A / (2*adv_clip_max) + 0.5, 0, 1)``: ``A = -c -> 0``, ``A = 0 -> 0.5``, ``A = c -> 1``."""
    return (advantages / (2.0 * adv_clip_max) + 0.5).clamp(0.0, 1.0)


@register_diffusion_loss("diffusion_nft")
class DiffusionNFTLoss(DiffusionLossFn):
    """DiffusionNFT loss (+ optional reference velocity MSE).

    Config (``diffusion_loss``): ``mix_beta`` (beta > 0), ``ref_kl_coef`` (>= 0),
    ``adaptive_weight_min`` (> 0), ``adv_clip_max`` (> 0).

    Metrics: ``actor/pg_loss`` (the policy term ``mean(l*w_is)/beta``),
    ``actor/nft/x0_err_pos`` / ``actor/nft/x0_err_neg`` (batch means of
    ``mean_dims((x0± - x0)^2)``), ``actor/nft/weight_pos`` / ``actor/nft/weight_neg``
    (batch means of ``w±``), ``actor/nft/r_mean``, and ``actor/kl_loss`` (the
    unscaled reference MSE) when ``ref_kl_coef > 0``.
    """

    name = "diffusion_nft"
    trainer_type = "direct_preference"
    required_model_outputs = ("v", "v_old")
    required_data_keys = ("x0", "eps", "t", "advantages")

    def __init__(self, loss_config, actor_config=None) -> None:
        super().__init__(loss_config, actor_config)
        self.beta = float(self._loss_opt("mix_beta", gt=0.0))
        self.ref_kl_coef = float(self._loss_opt("ref_kl_coef", ge=0.0))
        self.weight_min = float(self._loss_opt("adaptive_weight_min", gt=0.0))
        self.adv_clip_max = float(self._loss_opt("adv_clip_max", gt=0.0))
        if self.ref_kl_coef > 0:
            self.model_output_keys += ("v_ref",)

    def compute(self, model_output: Mapping, data: Mapping) -> DiffusionLossResult:
        check_velocity_inputs(self.name, model_output, data, self.model_output_keys)
        v = model_output["v"]
        dtype = compute_dtype(v)
        v = v.to(dtype)
        v_old = model_output["v_old"].detach().to(dtype)
        x0 = data["x0"].detach().to(dtype)
        eps = data["eps"].detach().to(dtype)
        t = data["t"].detach().to(dtype)
        adv = data["advantages"].detach().to(dtype).reshape(-1)

        x_t = noisy_latent(x0, eps, t)
        tb = expand_t(t, x0)
        v_pos = self.beta * v + (1.0 - self.beta) * v_old
        v_neg = (1.0 + self.beta) * v_old - self.beta * v
        err_pos = x_t - tb * v_pos - x0
        err_neg = x_t - tb * v_neg - x0
        w_pos = mean_dims(err_pos.detach().abs()).clamp_min(self.weight_min)
        w_neg = mean_dims(err_neg.detach().abs()).clamp_min(self.weight_min)
        mse_pos = mean_dims(err_pos**2)
        mse_neg = mean_dims(err_neg**2)
        r = optimality_probability(adv, self.adv_clip_max)
        per_sample = r * mse_pos / w_pos + (1.0 - r) * mse_neg / w_neg
        pg_loss = self._weighted_mean(per_sample, data) / self.beta

        metrics = {
            "actor/pg_loss": float(pg_loss.detach()),
            "actor/nft/x0_err_pos": float(mse_pos.detach().mean()),
            "actor/nft/x0_err_neg": float(mse_neg.detach().mean()),
            "actor/nft/weight_pos": float(w_pos.mean()),
            "actor/nft/weight_neg": float(w_neg.mean()),
            "actor/nft/r_mean": float(r.mean()),
        }
        loss = pg_loss
        if self.ref_kl_coef > 0:
            ref_mse = ((v - model_output["v_ref"].detach().to(dtype)) ** 2).mean()
            metrics["actor/kl_loss"] = float(ref_mse.detach())
            loss = loss + self.ref_kl_coef * ref_mse
        return DiffusionLossResult(loss, metrics)
