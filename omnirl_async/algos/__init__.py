"""Algorithms: advantage estimators, diffusion losses and rollout correction.

Each family is a registry so that an algorithm can add its own piece without
touching the learner: ``@register_diffusion_adv_est(name)`` and
``@register_diffusion_loss(name)``; config values name registry keys.
"""

from omnirl_async.algos.advantage import (
    DiffusionAdvantageEstimator,
    compute_dance_grpo_outcome_advantage,
    compute_flow_grpo_outcome_advantage,
    get_diffusion_adv_estimator_fn,
    register_diffusion_adv_est,
    registered_adv_estimators,
)
from omnirl_async.algos.losses import (
    DiffusionLossFn,
    DiffusionLossResult,
    FlowDPPOLoss,
    FlowGRPOLoss,
    GRPOGuardLoss,
    KLLoss,
    get_diffusion_loss_fn,
    register_diffusion_loss,
    registered_losses,
)
from omnirl_async.algos.rollout_correction import RolloutCorrectionResult, compute_rollout_correction

__all__ = [
    "register_diffusion_loss",
    "get_diffusion_loss_fn",
    "registered_losses",
    "DiffusionLossFn",
    "DiffusionLossResult",
    "register_diffusion_adv_est",
    "get_diffusion_adv_estimator_fn",
    "registered_adv_estimators",
    "DiffusionAdvantageEstimator",
    "compute_flow_grpo_outcome_advantage",
    "compute_dance_grpo_outcome_advantage",
    "FlowGRPOLoss",
    "KLLoss",
    "GRPOGuardLoss",
    "FlowDPPOLoss",
    "compute_rollout_correction",
    "RolloutCorrectionResult",
]
