"""Distillation towards a frozen teacher pipeline (``actor.use_distill_loss``): the pure formulas.

The learner runs the teacher (another diffusers pipeline, frozen, no LoRA) on
the student's own samples, at the same latent, sigma and prompt embeddings as
the student's forward pass, and adds ``distill_loss_coef * term`` to whatever
loss runs (metric ``actor/distill_loss``: the term, before the coefficient).
Two terms (``actor.distill_loss_mode``), each per sample ``[B]`` and then
averaged over the batch:

``distill_fm_mse``
    ``mean_dims((v_student - v_teacher)^2)``: the flow-matching MSE between the
    two velocities.
``distill_kl``
    The Gaussian KL between the student's and the teacher's SDE steps from the
    same latent. Both steps share the noise scale (it depends on sigma and the
    noise level only), so the KL is closed-form in their means, exactly as the
    reference KL of :mod:`.kl`: ``mean_dims((mu_s - mu_t)^2) / (2 sig^2)``; a
    step without noise (``sig == 0``) contributes 0.

The teacher's side never carries a gradient (it is detached here as well).
The SDE means come from :func:`omnirl_async.models.sde.sde_step_with_logprob`,
which the learner calls (this module sits below the models layer).
"""

from __future__ import annotations

import torch

from omnirl_async.algos.losses.base import mean_dims
from omnirl_async.algos.losses.kl import compute_mean_kl

__all__ = ["DISTILL_MODES", "DISTILL_METRIC", "distill_fm_mse", "distill_kl", "distill_term"]

#: ``actor_rollout_ref.actor.distill_loss_mode`` values.
DISTILL_MODES = ("distill_kl", "distill_fm_mse")
#: The metric holding the batch-mean term (before ``distill_loss_coef``).
DISTILL_METRIC = "actor/distill_loss"


def distill_fm_mse(v_student: torch.Tensor, v_teacher: torch.Tensor) -> torch.Tensor:
    """Per-sample ``mean_dims((v_student - v_teacher)^2)`` -> ``[B]``; no gradient reaches the teacher."""
    if v_student.shape != v_teacher.shape:
        raise ValueError(f"student velocity shape {tuple(v_student.shape)} != teacher velocity shape "
                         f"{tuple(v_teacher.shape)}; the teacher must share the policy's latent layout "
                         "(`actor_rollout_ref.actor.distill_teacher_path`).")
    return mean_dims((v_student - v_teacher.detach().to(v_student.dtype)) ** 2)


def distill_kl(mean_student: torch.Tensor, mean_teacher: torch.Tensor, sig: torch.Tensor) -> torch.Tensor:
    """Per-sample KL of the two SDE steps, ``mean_dims((mu_s - mu_t)^2) / (2 sig^2)`` -> ``[B]`` (0 where sig = 0)."""
    if mean_student.shape != mean_teacher.shape:
        raise ValueError(f"student SDE mean shape {tuple(mean_student.shape)} != teacher SDE mean shape "
                         f"{tuple(mean_teacher.shape)}; both must come from the same step of the same latent.")
    return compute_mean_kl(mean_student, mean_teacher.detach(), sig)


def distill_term(mode: str, *, v_student: torch.Tensor | None = None, v_teacher: torch.Tensor | None = None,
                 mean_student: torch.Tensor | None = None, mean_teacher: torch.Tensor | None = None,
                 sig: torch.Tensor | None = None) -> torch.Tensor:
    """Batch mean of the ``mode`` term (a scalar carrying the student's gradient)."""
    if mode == "distill_fm_mse":
        if v_student is None or v_teacher is None:
            raise ValueError("distill_fm_mse needs `v_student` and `v_teacher`.")
        return distill_fm_mse(v_student, v_teacher).mean()
    if mode == "distill_kl":
        if mean_student is None or mean_teacher is None or sig is None:
            raise ValueError("distill_kl needs `mean_student`, `mean_teacher` and `sig`.")
        return distill_kl(mean_student, mean_teacher, sig).mean()
    raise ValueError(f"`actor_rollout_ref.actor.distill_loss_mode` = {mode!r}: choose one of {list(DISTILL_MODES)}.")
