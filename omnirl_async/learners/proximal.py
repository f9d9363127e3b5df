"""The proximal ("old") log-probs read off the update's own forward pass.

Decoupled rollout correction (``algorithm.rollout_correction.bypass_mode =
false``) compares three policies: the behaviour policy that generated a
sample, the proximal policy (the learner's weights when the update starts)
and the current weights. The PPO ratio is taken against the proximal policy,
so a stale sample is not clipped merely for being stale; the importance weight
``pi_proximal / pi_behaviour`` corrects for its staleness instead. In bypass
mode the ratio is taken against the behaviour policy: with FlowGRPO's clip
range (1e-4, or 1e-5 with CPS steps) a sample one update old already sits
outside it on many steps and those steps train nothing.

The proximal log-probs normally cost one no-grad pass over the batch before
the update. When the weights cannot move before every (sample, step) of the
batch has had its forward – one epoch, one mini-batch, every stored step
trained in it – that pass computes exactly the numbers the update's first
forward computes, so :class:`~omnirl_async.learners.learner.Learner` takes
them from there (gradient detached) and the decoupled mode costs no more than
bypass mode. This needs the correction to be decidable one step at a time:
token-level IS and rejection criteria, without batch normalisation of the
weights. Otherwise, or with ``Learner.fuse_proximal = False``, the separate
pass runs.
"""

from __future__ import annotations

from typing import Any

import torch

from omnirl_async.algos.rollout_correction import correction_weights, sequence_level_options

#: The batch fields a fused update fills step by step (proximal log-probs and means, correction weights).
FILLED = ("old_log_probs", "old_means", "is_weights")


def can_fuse(rc, *, ppo_epochs: int, num_minibatches: int, steps_trained: int, num_steps: int) -> bool:
    """Whether the update's first forward sees every (row, step) at the proximal weights and the
    correction ``rc`` (``algorithm.rollout_correction``) can be computed one step at a time."""
    return (not rc.bypass_mode and ppo_epochs == 1 and num_minibatches == 1 and steps_trained == num_steps
            and not rc.rollout_is_batch_normalize and not sequence_level_options(rc))


def prepare(b: dict[str, Any]) -> None:
    """Placeholders for :data:`FILLED`, written row by row as the update's micro-batches run."""
    behaviour = b["log_probs"].float()
    b["old_log_probs"] = torch.zeros_like(behaviour)
    b["old_means"] = torch.zeros_like(b["means"], dtype=torch.float32)
    b["is_weights"] = torch.ones_like(behaviour)


def fill_step(mb: dict[str, torch.Tensor], j: int, out, rc) -> None:
    """Step ``j`` of micro-batch ``mb``: proximal log-prob and mean = the forward ``out`` (detached), and the
    token-level correction weight of that step against the stored behaviour log-prob (the batch's
    ``rollout_corr/*`` metrics are computed once, after the update)."""
    old = out.log_prob.detach().float()
    behaviour = mb["log_probs"][:, j].float().to(old.device)
    weights = correction_weights(old[:, None], behaviour[:, None], None, rc)[:, 0]
    mb["old_log_probs"][:, j] = old.cpu()
    mb["old_means"][:, j] = out.mean.detach().float().cpu()
    mb["is_weights"][:, j] = weights.to(mb["is_weights"].dtype).cpu()


def write_back(b: dict[str, Any], mb: dict[str, torch.Tensor], rows) -> None:
    """Copy what a micro-batch filled into the batch (``mb`` holds copies of ``b``'s rows)."""
    for k in FILLED:
        b[k][rows] = mb[k]
