"""Diffusion-DPO for flow matching (online pairs: best and worst of each group).

Batch layout (the learner's contract): interleaved pairs, row ``2i`` is the
winner ``w`` and row ``2i+1`` the loser ``l`` of pair ``i``; both rows share
``eps`` and ``t`` (so ``B`` is even). With the target velocity ``eps - x0`` and
per-sample squared errors of the policy and the reference (adapter disabled)::

    e     = mean_dims((v     - (eps - x0))^2)
    e_ref = mean_dims((v_ref - (eps - x0))^2)
    m     = (e_w - e_ref_w) - (e_l - e_ref_l)
    L     = mean_pairs( -logsigmoid(-0.5*beta*m) * w_is )

``beta`` is ``dpo_beta``. ``w_is`` is the *winner's* entry of
``data['is_weights']`` (``is_weights[2i]``; the loser's entry is ignored): a
pair is one training example, and the winner row carries its weight.

The implicit reward of a sample is ``-0.5*beta*(e - e_ref)``: the policy
prefers the winner when it improved on the reference more for the winner
than for the loser. At initialisation (policy = reference) ``m = 0`` and
``L = log 2`` exactly.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from omnirl_async.algos.losses.base import DiffusionLossFn, DiffusionLossResult, mean_dims, register_diffusion_loss
from omnirl_async.algos.losses.matching import check_velocity_inputs, compute_dtype, target_velocity

__all__ = ["DiffusionDPOLoss", "check_interleaved_pairs"]


def check_interleaved_pairs(loss_name: str, t: torch.Tensor) -> int:
    """Validate the pair layout from ``t [B]``: ``B`` even and ``t[2i] == t[2i+1]``. Returns the pair count."""
    b = t.shape[0]
    if b % 2:
        raise ValueError(f"loss {loss_name!r}: batch size {b} is odd; the batch must be interleaved pairs "
                         "(row 2i = winner, row 2i+1 = loser, sharing eps and t).")
    if not torch.equal(t[0::2], t[1::2]):
        bad = int((t[0::2] != t[1::2]).nonzero()[0, 0])
        raise ValueError(f"loss {loss_name!r}: pair {bad} has t = {float(t[2 * bad])} (winner, row {2 * bad}) != "
                         f"{float(t[2 * bad + 1])} (loser, row {2 * bad + 1}); the batch must be interleaved pairs "
                         "(row 2i = winner, row 2i+1 = loser) sharing eps and t.")
    return b // 2


@register_diffusion_loss("dpo")
class DiffusionDPOLoss(DiffusionLossFn):
    """Diffusion-DPO loss on interleaved (winner, loser) rows.

    Config (``diffusion_loss``): ``dpo_beta`` (> 0).

    Metrics: ``actor/pg_loss``; ``actor/dpo/implicit_acc`` (fraction of pairs
    with ``e_w - e_ref_w < e_l - e_ref_l``, ties count 0.5);
    ``actor/dpo/chosen_reward`` / ``actor/dpo/rejected_reward`` (pair means of
    ``-0.5*beta*(e - e_ref)`` for winners / losers);
    ``actor/dpo/reward_margin`` (their difference, ``mean(-0.5*beta*m)``);
    ``actor/dpo/mse_chosen`` / ``actor/dpo/mse_rejected`` (pair means of ``e_w`` / ``e_l``).
    """

    name = "dpo"
    trainer_type = "direct_preference"
    required_model_outputs = ("v", "v_ref")
    required_data_keys = ("x0", "eps", "t")

    def __init__(self, loss_config, actor_config=None) -> None:
        super().__init__(loss_config, actor_config)
        self.beta = float(self._loss_opt("dpo_beta", gt=0.0))

    def compute(self, model_output: Mapping, data: Mapping) -> DiffusionLossResult:
        check_velocity_inputs(self.name, model_output, data, self.model_output_keys)
        check_interleaved_pairs(self.name, data["t"])
        v = model_output["v"]
        dtype = compute_dtype(v)
        target = target_velocity(data["x0"].detach().to(dtype), data["eps"].detach().to(dtype))
        err = mean_dims((v.to(dtype) - target) ** 2)
        err_ref = mean_dims((model_output["v_ref"].detach().to(dtype) - target) ** 2)
        diff = err - err_ref                       # [B]: policy improvement over the reference (lower = better)
        diff_w, diff_l = diff[0::2], diff[1::2]    # [P]
        logits = -0.5 * self.beta * (diff_w - diff_l)
        per_pair = -F.logsigmoid(logits)

        w = data.get("is_weights")
        if w is not None:
            if w.shape != err.shape:
                raise ValueError(f"`data['is_weights']` shape {tuple(w.shape)} != batch shape "
                                 f"{tuple(err.shape)}; pass one weight per row (the winner's is used per pair).")
            pair_data = {"is_weights": w[0::2]}
        else:
            pair_data = {}
        loss = self._weighted_mean(per_pair, pair_data)

        dw, dl = diff_w.detach(), diff_l.detach()
        acc = (dw < dl).to(dtype) + 0.5 * (dw == dl).to(dtype)
        chosen = -0.5 * self.beta * dw
        rejected = -0.5 * self.beta * dl
        metrics = {
            "actor/pg_loss": float(loss.detach()),
            "actor/dpo/implicit_acc": float(acc.mean()),
            "actor/dpo/reward_margin": float((chosen - rejected).mean()),
            "actor/dpo/chosen_reward": float(chosen.mean()),
            "actor/dpo/rejected_reward": float(rejected.mean()),
            "actor/dpo/mse_chosen": float(err[0::2].detach().mean()),
            "actor/dpo/mse_rejected": float(err[1::2].detach().mean()),
        }
        return DiffusionLossResult(loss, metrics)
