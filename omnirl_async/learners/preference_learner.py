"""The direct-preference learner: DiffusionNFT, Diffusion-DPO and AWM (``algorithm.trainer_type=direct_preference``).

The same chain of steps as :class:`~omnirl_async.learners.learner.Learner`
(prepare -> proximal -> losses -> gradients -> optimizer), with what differs
for losses on the *forward* (noising) process:

* a sample carries its clean latents ``x0``, its reward and its prompt
  embedding; no per-step log-probs or trajectories (rollout workers store only
  those, see ``RolloutBatch.to_fields(trajectory=False)``);
* :meth:`prepare_batch` draws, per sample, ``T = ceil(N * timestep_fraction)``
  distinct sigmas of the scheduler's N-step grid (shuffled) and fresh noise
  ``eps`` for each; the loss sees ``x_t = (1 - t) * x0 + t * eps``. With
  ``algorithm.paired_preference`` (Diffusion-DPO) the batch becomes the best
  and worst sample of each group, interleaved (rows ``2i``, ``2i+1``), and the
  two members of a pair share ``t`` and ``eps``; groups whose best and worst
  tie carry no preference and are skipped (``actor/dpo/tie_frac``);
* the unit a permutation shuffles is a pair then, so a pair is never split
  across mini-batches, micro-batches or learner ranks;
* :meth:`compute_proximal` computes, for AWM only, the velocity of the policy
  before this update at the same ``x_t`` (``v_prox``, the ratio's denominator);
* :meth:`compute_losses` runs only the forwards the loss names in
  ``model_output_keys``: ``v`` (trained), ``v_old`` (the ``old`` adapter),
  ``v_ref`` (adapter disabled); with ``actor.use_distill_loss`` it adds
  :meth:`~omnirl_async.learners.learner.Learner.distill_loss` at the same
  ``x_t``, ``t`` and embeddings (distill_kl: the SDE steps ``t -> t_next``, the
  grid's next sigma, with the rollout's noise level).

The **old adapter** (``actor_rollout_ref.model.policy_state_adapters`` holds
``old``) is a second LoRA adapter on the same base (see
:mod:`omnirl_async.models.adapters`). After every
``algorithm.old_policy_update_interval``-th applied optimizer step it moves
``old <- d * old + (1 - d) * default`` with ``d`` from
``algorithm.old_policy_decay`` or ``old_policy_decay_schedule`` evaluated at
the 0-based index of that optimizer step. ``rollout.rollout_adapter=old``
publishes the old adapter to the rollout workers; the published weights carry
both adapters' versions (:meth:`adapter_versions`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from omnirl_async.algos import decay_at, interleave, select_online_pairs
from omnirl_async.learners.learner import Learner, _embeds_from_fields
from omnirl_async.models.adapters import OLD_ADAPTER

__all__ = ["PreferenceLearner"]


class PreferenceLearner(Learner):
    """Owns the policy (and its old adapter), the optimizer and a direct-preference loss of one rank."""

    def __init__(self, config, *, rank: int = 0, world_size: int = 1, device: str | None = None):
        super().__init__(config, rank=rank, world_size=world_size, device=device)
        if self.loss_fn.trainer_type != "direct_preference":
            raise ValueError(f"`actor_rollout_ref.actor.diffusion_loss.loss_mode` = {self.loss_fn.name!r} is a "
                             "policy-gradient loss; `algorithm.trainer_type` = direct_preference needs "
                             "diffusion_nft, dpo or awm.")
        states = list(config.actor_rollout_ref.model.policy_state_adapters or ["default"])
        self.has_old = OLD_ADAPTER in states
        if self.has_old:
            self.policy.add_policy_state(OLD_ADAPTER)
        self.rollout_adapter = self.rollout_cfg.rollout_adapter
        self.pairwise = bool(self.algo_cfg.paired_preference)
        self.rows_per_unit = 2 if self.pairwise else 1
        pcfg = self.rollout_cfg.pipeline
        # the scheduler's inference grid without its final 0: the sigmas a rollout visits; and each one's next sigma
        grid = self.policy.make_sigmas(pcfg.num_inference_steps, pcfg.height, pcfg.width).float().cpu()
        self.sigma_grid, self.sigma_grid_next = grid[:-1], grid[1:]
        self.optimizer_steps = 0  # applied optimizer steps (the old-policy schedule's clock)
        self.old_version = 0  # learner update whose weights the old adapter last absorbed
        self.old_decay = 0.0

    # ---------------------------------------------------------------- 1. batch
    def mini_batch_units(self) -> int:
        """Pairs per mini-batch with pairwise losses (one pair per group), else samples."""
        if self.pairwise:
            return self.actor_cfg.ppo_mini_batch_size
        return super().mini_batch_units()

    def prepare_batch(self, fields: dict[str, np.ndarray], group_ids: list[str]) -> dict[str, Any]:
        batch = super().prepare_batch(fields, group_ids)
        if self.pairwise:
            pairs = select_online_pairs(batch["advantages"], list(group_ids))
            order = interleave(pairs.winners, pairs.losers)
            metrics = batch["_metrics"]
            batch = {k: v[order] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            metrics["actor/dpo/tie_frac"] = pairs.num_tie_groups / max(pairs.num_groups, 1)
            metrics["actor/dpo/num_pairs"] = float(len(pairs.winners))
        self._draw_timesteps(batch)
        return batch

    def _draw_timesteps(self, b: dict[str, Any]) -> None:
        """``b['t']`` [B, T] and ``b['eps']`` [B, T, *latent]; the two rows of a pair share both.

        With a teacher, also ``b['t_next']`` [B, T]: the grid sigma after each ``t`` (distill_kl's step)."""
        x0 = b["x0"].float()
        units = x0.shape[0] // self.rows_per_unit
        n = len(self.sigma_grid)
        steps = max(1, int(math.ceil(n * self.algo_cfg.timestep_fraction)))
        idx = torch.stack([torch.randperm(n, generator=self.rng)[:steps] for _ in range(units)]) if units else \
            torch.zeros(0, steps, dtype=torch.long)
        t = self.sigma_grid[idx]
        eps = torch.randn((units, steps, *x0.shape[1:]), generator=self.rng)
        k = self.rows_per_unit
        if self.teacher is not None:
            b["t_next"] = self.sigma_grid_next[idx].repeat_interleave(k, dim=0)
        b["t"] = t.repeat_interleave(k, dim=0)
        b["eps"] = eps.repeat_interleave(k, dim=0)

    def num_steps(self, b: dict[str, Any]) -> int:
        return int(b["t"].shape[1])

    def steps_per_minibatch(self, num_steps: int) -> int:
        return num_steps  # timestep_fraction already chose each sample's timesteps

    # ---------------------------------------------------------------- 2. proximal
    def _velocity(self, mb: dict[str, torch.Tensor], j: int, embeds) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``v`` at ``x_t`` of trained timestep j, and the inputs the loss reads."""
        x0 = mb["x0"].to(self.device).float()
        eps = mb["eps"][:, j].to(self.device).float()
        t = mb["t"][:, j].to(self.device).float()
        tb = t.view(-1, *([1] * (x0.ndim - 1)))
        x_t = (1.0 - tb) * x0 + tb * eps
        v = self.velocity(self.policy, x_t, t, embeds)
        return v, {"x_t": x_t, "x0": x0, "eps": eps, "t": t}

    def compute_proximal(self, b: dict[str, Any], minibatches) -> None:
        """AWM's ``v_prox`` [B, T, *latent]: the pre-update policy's velocity at each drawn ``(t, eps)``."""
        if "v_prox" not in self.loss_fn.data_keys:
            return
        with torch.no_grad():
            prox = torch.zeros_like(b["eps"], dtype=torch.float32)
            for micro_list in minibatches:
                for rows in micro_list:
                    mb = self._rows(b, rows)
                    emb = _embeds_from_fields(mb).to(self.device)
                    for j in range(prox.shape[1]):
                        prox[rows, j] = self._velocity(mb, j, emb)[0].cpu()
            if self.world_size > 1 and dist.is_initialized():
                prox = self._all_reduce(prox, dist.ReduceOp.SUM)  # each row was computed by one rank
        b["v_prox"] = prox

    # ---------------------------------------------------------------- 3. losses
    def compute_losses(self, mb: dict[str, torch.Tensor], steps: list[int], scale: float) -> dict[str, float]:
        emb = _embeds_from_fields(mb).to(self.device)
        wanted = self.loss_fn.model_output_keys
        sums: dict[str, float] = {}
        for j in steps:
            model_output: dict[str, torch.Tensor] = {}
            with torch.no_grad():
                if "v_old" in wanted:
                    with self.policy.use_adapter(OLD_ADAPTER):
                        model_output["v_old"] = self._velocity(mb, j, emb)[0]
                if "v_ref" in wanted:
                    with self.policy.disable_adapter():
                        model_output["v_ref"] = self._velocity(mb, j, emb)[0]
            v, inputs = self._velocity(mb, j, emb)
            model_output["v"] = v
            data = {"x0": inputs["x0"], "eps": inputs["eps"], "t": inputs["t"],
                    "advantages": mb["advantages"].to(self.device)}
            if "v_prox" in self.loss_fn.data_keys:
                data["v_prox"] = mb["v_prox"][:, j].to(self.device)
            res = self.loss_fn(model_output, data)
            loss = res.loss
            metrics = dict(res.metrics)
            if self.teacher is not None:  # at the same x_t, t and embeddings
                t_next = mb["t_next"][:, j].to(self.device)
                d_loss, d_metrics = self.distill_loss(v, inputs["x_t"], inputs["t"], t_next, emb)
                loss = loss + d_loss
                metrics.update(d_metrics)
            (loss * scale).backward()
            metrics["actor/loss"] = float(loss.detach())
            for k, val in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(val)
        return sums

    # ---------------------------------------------------------------- 5. after the step
    def after_optimizer_step(self) -> dict[str, float]:
        """Refresh the old adapter every ``old_policy_update_interval`` applied optimizer steps."""
        step = self.optimizer_steps
        self.optimizer_steps += 1
        if not self.has_old or self.optimizer_steps % int(self.algo_cfg.old_policy_update_interval):
            return {}
        self.old_decay = decay_at(step, self.algo_cfg.old_policy_decay_schedule, self.algo_cfg.old_policy_decay)
        self.policy.ema_policy_state(OLD_ADAPTER, self.old_decay)
        self.old_version = self.global_step + 1  # the update in progress
        return {}

    def update_metrics(self) -> dict[str, float]:
        if not self.has_old:
            return {}
        return {"actor/old_policy/version": float(self.old_version), "actor/old_policy/decay": float(self.old_decay)}

    # ---------------------------------------------------------------- weights & state
    def get_weights(self) -> dict[str, torch.Tensor]:
        """The adapter rollouts generate with (``rollout.rollout_adapter``)."""
        return self.policy.lora_state_dict(self.rollout_adapter)

    def adapter_versions(self) -> dict[str, int]:
        versions = {"default": self.global_step}
        if self.has_old:
            versions[OLD_ADAPTER] = self.old_version
        return versions

    def get_state(self) -> dict[str, Any]:
        state = super().get_state()
        if self.has_old:
            state["old_policy"] = {"weights": self.policy.lora_state_dict(OLD_ADAPTER),
                                   "optimizer_steps": self.optimizer_steps, "version": self.old_version,
                                   "decay": self.old_decay}
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        old = state.get("old_policy")
        if self.has_old:
            if old is None:
                raise ValueError("the checkpoint has no `old` adapter state, but `actor_rollout_ref.model."
                                 "policy_state_adapters` holds 'old'; resume with the adapters it was trained with.")
            self.policy.load_lora_state_dict(old["weights"], OLD_ADAPTER)
            self.optimizer_steps = int(old["optimizer_steps"])
            self.old_version = int(old["version"])
            self.old_decay = float(old["decay"])
