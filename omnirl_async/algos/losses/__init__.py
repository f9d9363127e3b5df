"""Diffusion policy losses: a registry of :class:`DiffusionLossFn` subclasses.

Built-in registrations (``actor_rollout_ref.actor.diffusion_loss.loss_mode``):
``flow_grpo`` (aliases ``mix_grpo``, ``dance_grpo``), ``grpo_guard``,
``flow_dppo`` (trainer_type ``policy_gradient``); ``diffusion_nft``, ``dpo``,
``awm`` (trainer_type ``direct_preference``, see :func:`loss_trainer_type`). :class:`KLLoss` is a component (added by Flow-GRPO when
``actor.use_kl_loss``), usable directly but not registered.
"""

from omnirl_async.algos.losses.base import (
    DiffusionLossFn,
    DiffusionLossResult,
    TRAINER_TYPES,
    get_diffusion_loss_fn,
    loss_trainer_type,
    mean_dims,
    register_diffusion_loss,
    registered_losses,
)
from omnirl_async.algos.losses.kl import KLLoss, compute_mean_kl
from omnirl_async.algos.losses.flow_grpo import FlowGRPOLoss, clipped_surrogate
from omnirl_async.algos.losses.grpo_guard import GRPOGuardLoss
from omnirl_async.algos.losses.flow_dppo import FlowDPPOLoss
from omnirl_async.algos.losses.diffusion_nft import DiffusionNFTLoss
from omnirl_async.algos.losses.dpo import DiffusionDPOLoss
from omnirl_async.algos.losses.awm import AWMLoss

__all__ = [
    "DiffusionLossFn",
    "DiffusionLossResult",
    "register_diffusion_loss",
    "get_diffusion_loss_fn",
    "registered_losses",
    "mean_dims",
    "loss_trainer_type",
    "TRAINER_TYPES",
    "KLLoss",
    "compute_mean_kl",
    "FlowGRPOLoss",
    "clipped_surrogate",
    "GRPOGuardLoss",
    "FlowDPPOLoss",
    "DiffusionNFTLoss",
    "DiffusionDPOLoss",
    "AWMLoss",
]
