"""KL penalty between the current policy's SDE step and the reference policy's.

Both policies propose the next latent from the same ``x_t`` with Gaussians that
share the noise scale and differ only in their means, so the KL has a closed
form that needs no sampling::

    KL = mean_dims((mu_theta - mu_ref)^2) / (2 sig^2)

``sig`` is the step's SDE diffusion coefficient (``model_output['sig']``),
as in Flow-GRPO. The reference policy is the base model with the LoRA adapter
disabled; the learner fills ``model_output['ref_mean']`` from that forward
pass (no gradient).

:class:`KLLoss` can be used on its own (its loss is the batch-mean KL), and
:class:`~omnirl_async.algos.losses.flow_grpo.FlowGRPOLoss` adds
``kl_loss_coef * KL`` when ``actor.use_kl_loss`` is set. It is not in the
loss registry: a KL alone is not a training objective.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from omnirl_async.algos.losses.base import DiffusionLossFn, DiffusionLossResult, mean_dims

__all__ = ["compute_mean_kl", "KLLoss"]


def compute_mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor, sig: torch.Tensor) -> torch.Tensor:
    """Per-sample KL ``mean_dims((mean - ref_mean)^2) / (2 sig^2)`` -> ``[B]``.

    Samples with ``sig == 0`` (deterministic steps) have no KL term and get 0.
    """
    if mean.shape != ref_mean.shape:
        raise ValueError(f"`model_output['mean']` shape {tuple(mean.shape)} != `model_output['ref_mean']` "
                         f"shape {tuple(ref_mean.shape)}; both come from the same SDE step.")
    drift = mean_dims((mean - ref_mean.detach().to(mean.dtype)) ** 2)
    sig = sig.detach().to(drift.dtype).reshape(-1)
    noisy = sig > 0
    safe = torch.where(noisy, sig, torch.ones_like(sig))
    return torch.where(noisy, drift / (2.0 * safe**2), torch.zeros_like(drift))


class KLLoss(DiffusionLossFn):
    """Batch-mean analytic KL to the reference policy; metric ``actor/kl_loss``."""

    name = "kl"
    required_model_outputs = ("mean", "ref_mean", "sig")
    required_data_keys = ()

    def compute(self, model_output: Mapping, data: Mapping) -> DiffusionLossResult:
        kl = compute_mean_kl(model_output["mean"], model_output["ref_mean"], model_output["sig"]).mean()
        return DiffusionLossResult(kl, {"actor/kl_loss": float(kl.detach())})
