"""Algorithms: advantage estimators, diffusion losses, rollout correction, and the
direct-preference helpers (old-policy EMA schedule, online preference pairs).

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
    AWMLoss,
    DiffusionDPOLoss,
    DiffusionLossFn,
    DiffusionLossResult,
    DiffusionNFTLoss,
    FlowDPPOLoss,
    FlowGRPOLoss,
    GRPOGuardLoss,
    KLLoss,
    get_diffusion_loss_fn,
    loss_trainer_type,
    register_diffusion_loss,
    registered_losses,
)
from omnirl_async.algos.old_policy import DECAY_SCHEDULES, decay_at, ema_update_
from omnirl_async.algos.pairs import (
    OnlinePairs,
    interleave,
    pair_chunks,
    pair_minibatches,
    pair_rows,
    rank_pair_rows,
    select_online_pairs,
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
    "DiffusionNFTLoss",
    "DiffusionDPOLoss",
    "AWMLoss",
    "loss_trainer_type",
    "DECAY_SCHEDULES",
    "decay_at",
    "ema_update_",
    "OnlinePairs",
    "select_online_pairs",
    "interleave",
    "pair_rows",
    "pair_chunks",
    "rank_pair_rows",
    "pair_minibatches",
    "compute_rollout_correction",
    "RolloutCorrectionResult",
]
