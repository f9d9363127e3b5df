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

**Offline preference pairs** (``buffer.offline_mix_ratio``,
``algorithm.sample_source=offline``; :mod:`omnirl_async.trainer.offline_mix`)
arrive as rows marked by the bool field ``offline`` (each pair two adjacent
rows, chosen first, rewards 1 and 0). They have no group of rollouts to
normalise against, so :meth:`prepare_batch` computes the group advantages on
the online rows only (the offline rows never shift the online mean or std)
and gives the offline chosen row ``A = +a`` and the rejected one ``A = -a``
with ``a`` = ``algorithm.offline_advantage``, by default ``adv_clip_max``:
DiffusionNFT's ``r`` is then exactly 1 and 0 (``a`` = 1: 0.6 and 0.4, the
scale of a normalised online group), AWM's weight +-a / adv_clip_max, and
Diffusion-DPO pairs them as they are (online pairs are
the best and worst of each group, as without offline data). Metrics per
source (online / offline): ``actor/pg_loss/<source>`` and, for DPO,
``actor/dpo/implicit_acc/<source>`` and ``actor/dpo/reward_margin/<source>``
(the loss on that source's rows of every trained micro-batch, averaged over
its rows and the applied optimizer steps); for DiffusionNFT and AWM
``actor/implicit_acc/<source>``, DPO's implicit-reward accuracy measured
before the update on up to :data:`PROBE_PAIRS` pairs of the batch (online:
best vs worst of a group) at one shared ``(t, eps)`` per pair: the fraction of
pairs whose chosen sample the policy fits better, relative to the reference
(adapter disabled), than the rejected one.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from omnirl_async.algos import decay_at, interleave, select_online_pairs
from omnirl_async.algos.advantage import apply_adv_mode
from omnirl_async.algos.losses.base import mean_dims
from omnirl_async.buffer.offline_table import OFFLINE_FIELD
from omnirl_async.learners.learner import Learner, _embeds_from_fields
from omnirl_async.models.adapters import OLD_ADAPTER

__all__ = ["PreferenceLearner", "PROBE_PAIRS", "SPLIT_METRICS"]

#: pairs per source the implicit-accuracy probe of DiffusionNFT / AWM scores per update
PROBE_PAIRS = 16
#: loss metrics reported per source (online / offline) when a batch holds offline rows
SPLIT_METRICS = ("actor/pg_loss", "actor/dpo/implicit_acc", "actor/dpo/reward_margin")
_SOURCES = ("online", "offline")


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
        self._split: dict[str, list[float]] = {}    # "<metric>/<source>" -> [weighted sum, rows], applied steps
        self._pending: dict[str, list[float]] = {}  # the same for the mini-batch being computed
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
        self._split = {}
        if OFFLINE_FIELD in fields:
            batch = self._prepare_mixed(fields, group_ids)
        else:
            batch = super().prepare_batch(fields, group_ids)
        if self.pairwise:
            off = batch.get(OFFLINE_FIELD)
            on_rows = torch.arange(len(group_ids)) if off is None else (~off).nonzero().reshape(-1)
            pairs = select_online_pairs(batch["advantages"][on_rows], [group_ids[i] for i in on_rows.tolist()])
            order = interleave(on_rows[pairs.winners], on_rows[pairs.losers])
            metrics = batch["_metrics"]
            if off is not None:
                w, l = _offline_pairs(batch["rewards"], off, group_ids)
                order = torch.cat([order, interleave(w, l)])
                metrics["actor/dpo/num_pairs/offline"] = float(len(w))
            batch = {k: v[order] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            metrics["actor/dpo/tie_frac"] = pairs.num_tie_groups / max(pairs.num_groups, 1)
            metrics["actor/dpo/num_pairs"] = float(len(pairs.winners))
        self._draw_timesteps(batch)
        return batch

    def _prepare_mixed(self, fields: dict[str, np.ndarray], group_ids: list[str]) -> dict[str, Any]:
        """A batch with offline rows: online advantages from the online rows alone; offline A = +-``offline_advantage``
        (null: +-adv_clip_max), mapped by ``adv_mode``."""
        batch = {k: torch.from_numpy(np.array(v)) for k, v in fields.items() if k != "images"}
        off = batch[OFFLINE_FIELD].bool()
        batch[OFFLINE_FIELD] = off
        rewards = batch["rewards"].float()
        adv = torch.zeros(len(rewards))
        metrics: dict[str, float] = {}
        on_rows = (~off).nonzero().reshape(-1)
        if len(on_rows):
            a, adv_metrics = self.adv_fn(
                rewards[on_rows], [group_ids[i] for i in on_rows.tolist()],
                norm_adv_by_std_in_grpo=self.algo_cfg.norm_adv_by_std_in_grpo, global_std=self.algo_cfg.global_std,
                adv_clip_max=self.actor_cfg.diffusion_loss.adv_clip_max, adv_mode=self.algo_cfg.adv_mode)
            adv[on_rows] = a.float()
            a_np = a.float().numpy()
            metrics = {**adv_metrics, "critic/advantages/mean": float(a_np.mean()),
                       "critic/advantages/max": float(a_np.max()), "critic/advantages/min": float(a_np.min())}
        c = self.algo_cfg.offline_advantage  # null: +-adv_clip_max, NFT's chosen r = 1, rejected r = 0
        c = float(self.actor_cfg.diffusion_loss.adv_clip_max if c is None else c)
        # and mapped by `algorithm.adv_mode` as online advantages are (positive_only: rejected rows train with 0)
        adv[off] = apply_adv_mode(torch.where(rewards[off] > 0.5, torch.tensor(c), torch.tensor(-c)),
                                  self.algo_cfg.adv_mode)
        batch["advantages"] = adv
        batch["_metrics"] = metrics
        batch["_group_ids"] = list(group_ids)  # the probe's pairs (pointwise losses keep the row order)
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
        """AWM's ``v_prox`` [B, T, *latent]: the pre-update policy's velocity at each drawn ``(t, eps)``.

        With offline rows and a pointwise loss, also the implicit-accuracy probe (:meth:`implicit_accuracy`)."""
        if OFFLINE_FIELD in b and not self.pairwise:
            b["_metrics"].update(self.implicit_accuracy(b))
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

    @torch.no_grad()
    def implicit_accuracy(self, b: dict[str, Any]) -> dict[str, float]:
        """``actor/implicit_acc/<source>``: the pairs the policy prefers as labelled, relative to the reference.

        Up to :data:`PROBE_PAIRS` pairs per source (offline: chosen vs rejected; online: best vs worst of a
        group by advantage), one grid sigma and one noise per pair shared by its two rows; a pair counts when
        ``e_w - e_ref_w < e_l - e_ref_l`` (ties 0.5), ``e`` the flow-matching error. Its own generator
        (seeded by the update): the training draws are not touched.
        """
        off = b[OFFLINE_FIELD]
        gen = torch.Generator().manual_seed(int(self.config.data.seed) * 7919 + self.global_step)
        out = {}
        for name in _SOURCES:
            rows = (off if name == "offline" else ~off).nonzero().reshape(-1)
            if not len(rows):
                continue
            ids = b["_group_ids"]
            if name == "offline":
                w, l = _offline_pairs(b["rewards"][rows], torch.ones(len(rows), dtype=torch.bool),
                                      [ids[i] for i in rows.tolist()])
            else:
                pairs = select_online_pairs(b["advantages"][rows], [ids[i] for i in rows.tolist()])
                w, l = pairs.winners, pairs.losers
            if not len(w):
                continue
            sel = interleave(rows[w[:PROBE_PAIRS]], rows[l[:PROBE_PAIRS]])
            x0 = b["x0"][sel].to(self.device).float()
            emb = _embeds_from_fields({k: v[sel] for k, v in b.items() if k.startswith("emb.")}).to(self.device)
            n = len(sel) // 2
            t = self.sigma_grid[torch.randint(len(self.sigma_grid), (n,), generator=gen)].repeat_interleave(2)
            eps = torch.randn((n, *x0.shape[1:]), generator=gen).repeat_interleave(2, dim=0).to(self.device)
            t = t.to(self.device).float()
            tb = t.view(-1, *([1] * (x0.ndim - 1)))
            x_t = (1.0 - tb) * x0 + tb * eps
            target = eps - x0
            err = mean_dims((self.velocity(self.policy, x_t, t, emb) - target) ** 2)
            with self.policy.disable_adapter():
                err_ref = mean_dims((self.velocity(self.policy, x_t, t, emb) - target) ** 2)
            d = (err - err_ref).cpu()
            acc = (d[0::2] < d[1::2]).float() + 0.5 * (d[0::2] == d[1::2]).float()
            out[f"actor/implicit_acc/{name}"] = float(acc.mean())
        return out

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
            if OFFLINE_FIELD in mb:
                self._stage_split(res.metrics, model_output, data, mb[OFFLINE_FIELD].to(self.device))
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

    def _stage_split(self, metrics: dict[str, float], model_output: dict[str, torch.Tensor],
                     data: dict[str, torch.Tensor], off: torch.Tensor) -> None:
        """The loss metrics of this micro-batch's online and offline rows (no gradient; whole pairs with DPO)."""
        for name in _SOURCES:
            sel = off if name == "offline" else ~off
            n = int(sel.sum())
            if n == 0:
                continue
            if n == len(sel):
                part = metrics
            else:
                with torch.no_grad():
                    part = self.loss_fn({k: v[sel].detach() for k, v in model_output.items()},
                                        {k: v[sel] for k, v in data.items()}).metrics
            for key in SPLIT_METRICS:
                if key in part:
                    acc = self._pending.setdefault(f"{key}/{name}", [0.0, 0.0])
                    acc[0] += float(part[key]) * n
                    acc[1] += n

    def _mini_batch_losses(self, b, micro_list, steps, scale):
        self._pending = {}  # staged until the mini-batch's optimizer step is applied (skipped steps add nothing)
        return super()._mini_batch_losses(b, micro_list, steps, scale)

    # ---------------------------------------------------------------- 5. after the step
    def after_optimizer_step(self) -> dict[str, float]:
        """Count the staged per-source metrics; refresh the old adapter every ``old_policy_update_interval``
        applied optimizer steps."""
        for key, (total, rows) in self._pending.items():
            acc = self._split.setdefault(key, [0.0, 0.0])
            acc[0] += total
            acc[1] += rows
        self._pending = {}
        step = self.optimizer_steps
        self.optimizer_steps += 1
        if not self.has_old or self.optimizer_steps % int(self.algo_cfg.old_policy_update_interval):
            return {}
        self.old_decay = decay_at(step, self.algo_cfg.old_policy_decay_schedule, self.algo_cfg.old_policy_decay)
        self.policy.ema_policy_state(OLD_ADAPTER, self.old_decay)
        self.old_version = self.global_step + 1  # the update in progress
        return {}

    def update_metrics(self) -> dict[str, float]:
        out = {key: total / rows for key, (total, rows) in self._split.items() if rows}
        self._split = {}
        if self.has_old:
            out.update({"actor/old_policy/version": float(self.old_version),
                        "actor/old_policy/decay": float(self.old_decay)})
        return out

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


def _offline_pairs(rewards: torch.Tensor, off: torch.Tensor, group_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the offline pairs' chosen (reward 1) and rejected members: ``(winners [P], losers [P])``."""
    members: dict[str, list[int]] = {}
    for row in off.nonzero().reshape(-1).tolist():
        members.setdefault(group_ids[row], []).append(row)
    winners, losers = [], []
    for gid, rows in members.items():
        if len(rows) != 2 or float(rewards[rows[0]]) == float(rewards[rows[1]]):
            raise ValueError(f"offline group `{gid}` has rows {rows} with rewards "
                             f"{[float(rewards[r]) for r in rows]}; an offline pair is two rows, chosen (1) and "
                             "rejected (0)")
        hi, lo = (rows[0], rows[1]) if float(rewards[rows[0]]) > float(rewards[rows[1]]) else (rows[1], rows[0])
        winners.append(hi)
        losers.append(lo)
    return torch.tensor(winners, dtype=torch.long), torch.tensor(losers, dtype=torch.long)
