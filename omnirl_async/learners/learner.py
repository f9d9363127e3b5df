"""The diffusion policy-gradient learner.

One :meth:`Learner.update` call trains on one batch of whole GRPO groups. It
is a chain of steps, each overridable and testable alone (RLlib's template):

1. :meth:`prepare_batch` – numpy fields → tensors, advantages from rewards,
2. :meth:`compute_proximal_log_probs` – the "old" log-probs recomputed with the
   current weights before any update (``bypass_mode`` skips this and uses the
   behaviour log-probs), then rollout correction weights; when the update's
   own first forward provably sees the same weights (one epoch, one
   mini-batch: :mod:`.proximal`), they are read off that forward instead,
3. :meth:`compute_losses` – per mini-batch / micro-batch / trained SDE step:
   velocity → SDE log-prob of the stored next latents → loss (plus, with
   ``actor.use_distill_loss``, :meth:`distill_loss`: ``distill_loss_coef`` times
   a term towards a frozen teacher pipeline, computed at the same latent),
4. :meth:`average_gradients` – average across learners; :meth:`find_nonfinite` –
   the step's loss and gradients must be finite (see below);
   :meth:`postprocess_gradients` – clip the norm,
5. :meth:`apply_gradients` – optimizer step.

The learning rate of an update is set before its first optimizer step
(:meth:`set_learning_rate`, :func:`lr_factor`): the schedule counts learner
updates, as ``trainer.total_training_steps`` does, whatever the number of
optimizer steps (``ppo_epochs`` x mini-batches) an update makes.

With several learners (``learner.num_workers``), every rank receives the same
full batch (advantages need every group), takes its slice of each mini-batch,
and averages gradients with ``torch.distributed.all_reduce`` – DDP restricted
to the trainable (LoRA) parameters, which is all that changes.

Numerical faults are handled per **optimizer step** (one mini-batch of one
epoch; an update makes ``ppo_epochs x mini-batches`` of them, counted in
``actor/num_updates``). A step whose loss (any micro-batch) or any averaged
gradient is NaN/inf is skipped: its gradients are dropped and the weights,
optimizer moments stay as they were. The decision is taken
after the gradient all-reduce and shared with one more tiny all-reduce, so
every rank skips the same steps. Metrics: ``training/nonfinite_steps`` (skipped
steps so far, kept in :meth:`Learner.get_state`) and ``training/skipped_nonfinite``
(the fraction of this update's optimizer steps that were skipped: 1.0 or 0.0
with one step per update). ``learner.max_consecutive_nonfinite`` skipped steps
in a row (across updates; any applied step resets the run) raise
:class:`NonFiniteError`. Skipped steps add nothing to the averaged ``actor/*``
metrics.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from omnirl_async.algos import compute_rollout_correction, get_diffusion_adv_estimator_fn, get_diffusion_loss_fn
from omnirl_async.algos.losses.distill import DISTILL_METRIC, distill_term
from omnirl_async.learners import proximal
from omnirl_async.models.data_parallel import Group
from omnirl_async.models.policy import PromptEmbeds
from omnirl_async.models.sde import SDEStepOutput, sde_step_with_logprob
from omnirl_async.models.setup import build_policy, build_teacher, pick_device

__all__ = ["Learner", "NonFiniteError", "lr_factor"]

logger = logging.getLogger(__name__)


def _kind(x) -> str:
    """``nan`` when ``x`` (a number or tensor known to be non-finite) holds a NaN, else ``inf``."""
    return "nan" if bool(torch.isnan(torch.as_tensor(x)).any()) else "inf"


def _embeds_from_fields(fields: dict[str, torch.Tensor]) -> PromptEmbeds:
    return PromptEmbeds.from_numpy({k[len("emb."):]: v for k, v in fields.items() if k.startswith("emb.")})


class NonFiniteError(RuntimeError):
    """``learner.max_consecutive_nonfinite`` optimizer steps in a row had a NaN/inf loss or gradient.

    ``quantity`` names what was non-finite last (the loss, or the gradient of
    which parameter), ``step`` is the learner update it happened in and
    ``count`` the number of consecutive skipped optimizer steps.
    """

    def __init__(self, message: str, *, quantity: str = "", step: int = -1, count: int = 0):
        super().__init__(message)
        self.quantity, self.step, self.count = quantity, step, count


def lr_factor(optim_cfg, step: int, run_progress: float | None) -> float:
    """The learning-rate multiplier of learner update ``step`` (0-based).

    A linear warm-up over ``optim.lr_warmup_steps`` updates (``(step + 1) / warmup``), then 1 (``constant``) or a
    cosine from 1 to 0 (``cosine``: ``0.5 * (1 + cos(pi * progress))``). The cosine's progress is
    ``(step - warmup) / (optim.total_training_steps - warmup)`` when that horizon is set, else ``run_progress``,
    the fraction of the run done (by ``trainer.total_training_steps`` or ``total_epochs`` updates, or by
    ``trainer.total_time_minutes`` of training time, whichever ends first); clipped to [0, 1]."""
    warmup = int(optim_cfg.lr_warmup_steps)
    if warmup and step < warmup:
        return (step + 1) / warmup
    if optim_cfg.lr_scheduler_type != "cosine":
        return 1.0
    if optim_cfg.total_training_steps:
        progress = (step - warmup) / max(1, int(optim_cfg.total_training_steps) - warmup)
    else:
        progress = float(run_progress or 0.0)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))


class Learner:
    """Owns the trainable policy, the optimizer and the loss of one rank."""

    def __init__(self, config, *, rank: int = 0, world_size: int = 1, device: str | None = None):
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.device = pick_device(device or config.trainer.device)
        aro = config.actor_rollout_ref
        self.actor_cfg, self.rollout_cfg, self.algo_cfg = aro.actor, aro.rollout, config.algorithm
        self.policy = build_policy(aro.model, self.device, seed=config.data.seed)
        self.params = [p for p in self.policy.trainable_parameters()]
        if not self.params:
            raise RuntimeError("the policy has no trainable parameters; set "
                               "`actor_rollout_ref.model.lora_rank` > 0 or 0 for full training.")
        # distillation teacher: frozen, no LoRA, the policy's device and dtype (None without use_distill_loss)
        self.teacher = (build_teacher(self.actor_cfg.distill_teacher_path, aro.model, self.device, policy=self.policy)
                        if self.actor_cfg.use_distill_loss else None)
        names = {id(p): n for n, p in self.policy.transformer.named_parameters()}
        self.param_names = [names.get(id(p), f"param[{i}]") for i, p in enumerate(self.params)]
        self.optimizer = self.configure_optimizer()
        self.loss_fn = get_diffusion_loss_fn(self.actor_cfg.diffusion_loss.loss_mode)(
            self.actor_cfg.diffusion_loss, self.actor_cfg)
        self.adv_fn = get_diffusion_adv_estimator_fn(self.algo_cfg.adv_estimator)
        self.global_step = 0
        self._fused_proximal = False  # True while an update reads its proximal log-probs off its own forward
        self.nonfinite_steps = 0  # skipped optimizer steps so far
        self.consecutive_nonfinite = 0  # skipped optimizer steps since the last applied one
        # the same on every rank: ranks must agree on mini-batch permutations and trained steps
        self.rng = torch.Generator().manual_seed(int(config.data.seed) * 1000 + 17)

    # ---------------------------------------------------------------- set-up
    def configure_optimizer(self) -> torch.optim.Optimizer:
        o = self.actor_cfg.optim
        betas = tuple(o.betas) if o.betas is not None else (0.9, 0.999)
        if o.optimizer == "sgd":
            return torch.optim.SGD(self.params, lr=o.lr, weight_decay=o.weight_decay)
        cls = torch.optim.AdamW if o.optimizer == "adamw" else torch.optim.Adam
        return cls(self.params, lr=o.lr, betas=betas, eps=o.eps, weight_decay=o.weight_decay)

    def set_learning_rate(self, run_progress: float | None) -> float:
        """Set the learning rate of the update about to run (update ``global_step``; see :func:`lr_factor`)."""
        lr = float(self.actor_cfg.optim.lr) * lr_factor(self.actor_cfg.optim, self.global_step, run_progress)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    # ---------------------------------------------------------------- 1. batch
    def prepare_batch(self, fields: dict[str, np.ndarray], group_ids: list[str]) -> dict[str, Any]:
        # copies: arrays from the object store are read-only views
        batch = {k: torch.from_numpy(np.array(v)) for k, v in fields.items() if k != "images"}
        rewards = batch["rewards"].float()
        adv, adv_metrics = self.adv_fn(
            rewards, group_ids, norm_adv_by_std_in_grpo=self.algo_cfg.norm_adv_by_std_in_grpo,
            global_std=self.algo_cfg.global_std, adv_clip_max=self.actor_cfg.diffusion_loss.adv_clip_max,
            adv_mode=self.algo_cfg.adv_mode)
        batch["advantages"] = adv.float()
        adv_np = adv.float().numpy()
        batch["_metrics"] = {**adv_metrics, "critic/advantages/mean": float(adv_np.mean()),
                             "critic/advantages/max": float(adv_np.max()),
                             "critic/advantages/min": float(adv_np.min())}
        return batch

    def _rows(self, b: dict[str, Any], idx: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: v[idx] for k, v in b.items() if isinstance(v, torch.Tensor)}

    def _step_forward(self, mb: dict[str, torch.Tensor], j: int, embeds: PromptEmbeds, *, reference: bool = False,
                      with_velocity: bool = False):
        """Velocity at trained step j and the SDE log-prob of the stored next latents.

        Returns the :class:`SDEStepOutput`; with ``with_velocity`` the pair ``(output, v)``."""
        x = mb["latents"][:, j].to(self.device)
        s, s_next = mb["sigmas"][:, j].to(self.device), mb["sigmas_next"][:, j].to(self.device)
        v = self.velocity(self.policy, x, s, embeds)
        out = self._sde_step(v, x, s, s_next, mb["next_latents"][:, j].to(self.device))
        return (out, v) if with_velocity else out

    def velocity(self, model, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        """``model``'s velocity (fp32) at ``x``, with the rollout's guidance settings (policy or teacher alike)."""
        pcfg = self.rollout_cfg.pipeline
        return model.predict_velocity(x, sigma, embeds, true_cfg_scale=pcfg.true_cfg_scale,
                                      guidance_scale=pcfg.guidance_scale).float()

    def _sde_step(self, v, x, s, s_next, prev_sample) -> SDEStepOutput:
        """The rollout's SDE step (``rollout.algo`` noise level and type) from ``x`` with velocity ``v``."""
        acfg = self.rollout_cfg.algo
        return sde_step_with_logprob(v.float(), s, s_next, x.float(), noise_level=acfg.noise_level,
                                     sde_type=acfg.sde_type, prev_sample=prev_sample)

    def distill_loss(self, v: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
                     embeds: PromptEmbeds, *, student_step: SDEStepOutput | None = None
                     ) -> tuple[torch.Tensor, dict[str, float]]:
        """``distill_loss_coef * term`` (with the student's gradient) and ``{actor/distill_loss: term}``.

        The teacher runs at the student's own latent ``x``, ``sigma`` and ``embeds`` (no gradient).
        distill_fm_mse compares the velocities; distill_kl the two SDE steps ``sigma -> sigma_next`` of the
        rollout's noise level and type (``student_step``: the student's step when already computed).
        See :mod:`omnirl_async.algos.losses.distill`.
        """
        a = self.actor_cfg
        with torch.no_grad():
            v_teacher = self.velocity(self.teacher, x, sigma, embeds)
        if a.distill_loss_mode == "distill_kl":
            x = x.float()
            # the means do not depend on prev_sample: pass x rather than draw noise
            student = self._sde_step(v, x, sigma, sigma_next, x) if student_step is None else student_step
            teacher = self._sde_step(v_teacher, x, sigma, sigma_next, x)
            term = distill_term("distill_kl", mean_student=student.mean, mean_teacher=teacher.mean, sig=student.sig)
        else:
            term = distill_term(a.distill_loss_mode, v_student=v, v_teacher=v_teacher)
        return float(a.distill_loss_coef) * term, {DISTILL_METRIC: float(term.detach())}

    # the unit a permutation shuffles: one sample here; a (winner, loser) pair for the pairwise losses
    rows_per_unit = 1

    def mini_batch_units(self) -> int:
        """Units per mini-batch: ``ppo_mini_batch_size`` groups of ``rollout.n`` samples."""
        return self.actor_cfg.ppo_mini_batch_size * self.rollout_cfg.n

    def unit_rows(self, units: torch.Tensor) -> torch.Tensor:
        """Batch rows of these units (unit ``u`` = rows ``u*k .. u*k+k-1``, k = ``rows_per_unit``)."""
        k = self.rows_per_unit
        if k == 1:
            return units
        return (units[:, None] * k + torch.arange(k)).reshape(-1)

    def _micro_batches(self, perm: torch.Tensor) -> list[list[torch.Tensor]]:
        """Split an epoch permutation of units into mini-batches (this rank's slice) and micro-batches of rows.

        A unit is never split: not across mini-batches, ranks or micro-batches (pairs stay whole)."""
        mini = self.mini_batch_units()
        micro = self.actor_cfg.ppo_micro_batch_size_per_gpu
        micro_units = max(1, micro // self.rows_per_unit) if micro else None
        out = []
        for start in range(0, len(perm), mini):
            units = perm[start:start + mini]
            per_rank = len(units) // self.world_size
            if per_rank == 0:
                continue  # fewer units than ranks (a batch shrunk by failed samples): every rank skips it alike
            units = units[self.rank * per_rank:(self.rank + 1) * per_rank]
            size = micro_units or len(units)
            out.append([self.unit_rows(units[i:i + size]) for i in range(0, len(units), size)])
        return out

    # ---------------------------------------------------------------- 2. proximal
    def num_units(self, b: dict[str, Any]) -> int:
        """How many units (samples, or pairs) the batch holds."""
        return int(b["rewards"].shape[0]) // self.rows_per_unit

    def num_steps(self, b: dict[str, Any]) -> int:
        """Trained steps (timesteps) each sample carries."""
        return int(b["log_probs"].shape[1])

    def steps_per_minibatch(self, num_steps: int) -> int:
        """How many of a sample's steps one mini-batch trains (``algorithm.timestep_fraction``)."""
        return max(1, int(math.ceil(num_steps * self.algo_cfg.timestep_fraction)))

    #: Read the proximal log-probs off the update's first forward when that gives the same numbers
    #: (:func:`.proximal.can_fuse`); False always runs the separate no-grad pass.
    fuse_proximal: bool = True

    def compute_proximal(self, b: dict[str, Any], minibatches) -> None:
        """Step 2: what the loss compares the current policy with, computed before any weight moves."""
        num_steps = self.num_steps(b)
        self._fused_proximal = self.fuse_proximal and proximal.can_fuse(
            self.algo_cfg.rollout_correction, ppo_epochs=self.actor_cfg.ppo_epochs, num_minibatches=len(minibatches),
            steps_trained=self.steps_per_minibatch(num_steps), num_steps=num_steps)
        if self._fused_proximal:
            proximal.prepare(b)  # filled by compute_losses, finished by finish_proximal
        else:
            self.compute_proximal_log_probs(b, minibatches)

    def finish_proximal(self, b: dict[str, Any]) -> None:
        """After a fused update: the batch's ``rollout_corr/*`` metrics, from every rank's rows."""
        if not self._fused_proximal:
            return
        self._fused_proximal = False
        old = b["old_log_probs"]
        if self._distributed():  # each row was filled by exactly one rank; the others hold zeros
            old = self._all_reduce(old, dist.ReduceOp.SUM)
        rc = compute_rollout_correction(old, b["log_probs"].float(), None, self.algo_cfg.rollout_correction)
        b["_metrics"].update(rc.metrics)  # as the separate pass reports them

    @torch.no_grad()
    def compute_proximal_log_probs(self, b: dict[str, Any], minibatches) -> None:
        """Fill ``b['old_log_probs']`` [B, T] (and ``old_means``) using the exact micro-batches of epoch 0."""
        behaviour = b["log_probs"].float()
        if self.algo_cfg.rollout_correction.bypass_mode:
            b["old_log_probs"], b["old_means"] = behaviour.clone(), b["means"].float()
        else:
            old = torch.zeros_like(behaviour)
            old_means = torch.zeros_like(b["means"], dtype=torch.float32)
            for micro_list in minibatches:
                for rows in micro_list:
                    mb = self._rows(b, rows)
                    emb = _embeds_from_fields(mb).to(self.device)
                    for j in range(behaviour.shape[1]):
                        out = self._step_forward(mb, j, emb)
                        old[rows, j] = out.log_prob.float().cpu()
                        old_means[rows, j] = out.mean.float().cpu()
            if self.world_size > 1 and dist.is_initialized():
                # each row was computed by exactly one rank (its epoch-0 slice): a sum shares them all,
                # so later epochs, whose slices differ, still find every row's old log-prob
                old = self._all_reduce(old, dist.ReduceOp.SUM)
                old_means = self._all_reduce(old_means, dist.ReduceOp.SUM)
            b["old_log_probs"], b["old_means"] = old, old_means
        if self.algo_cfg.rollout_correction.bypass_mode:  # the loss corrects current vs behaviour (losses/base.py)
            b["is_weights"] = torch.ones_like(behaviour)
            return
        rc = compute_rollout_correction(b["old_log_probs"], behaviour, None, self.algo_cfg.rollout_correction)
        b["is_weights"] = rc.weights  # IS weight x rejection keep-mask
        b["_metrics"].update(rc.metrics)

    # ---------------------------------------------------------------- 3. losses
    def compute_losses(self, mb: dict[str, torch.Tensor], steps: list[int], scale: float) -> dict[str, float]:
        """Forward + backward over the trained steps of one micro-batch; returns summed metrics."""
        emb = _embeds_from_fields(mb).to(self.device)
        sums: dict[str, float] = {}
        fused = self._fused_proximal
        for j in steps:
            out, v = self._step_forward(mb, j, emb, with_velocity=True)
            if fused:  # this forward runs at the proximal weights: it is the proximal pass
                proximal.fill_step(mb, j, out, self.algo_cfg.rollout_correction)
            model_output = {"log_prob": out.log_prob, "mean": out.mean, "std": out.std, "sig": out.sig, "dt": out.dt}
            if self.actor_cfg.use_kl_loss:  # reference = base weights (adapter disabled)
                with self.policy.disable_adapter(), torch.no_grad():
                    model_output["ref_mean"] = self._step_forward(mb, j, emb).mean
            data = {"old_log_prob": mb["old_log_probs"][:, j].to(self.device),
                    "advantages": mb["advantages"].to(self.device),
                    "old_mean": mb["old_means"][:, j].to(self.device),
                    "is_weights": mb["is_weights"][:, j].to(self.device)}
            res = self.loss_fn(model_output, data)
            loss = res.loss
            metrics = dict(res.metrics)
            if self.teacher is not None:  # at the stored latent of step j: same sigma, same embeddings
                x, s, s_next = (mb[k][:, j].to(self.device) for k in ("latents", "sigmas", "sigmas_next"))
                d_loss, d_metrics = self.distill_loss(v, x, s, s_next, emb, student_step=out)
                loss = loss + d_loss
                metrics.update(d_metrics)
            (loss * scale).backward()
            metrics["actor/loss"] = float(loss.detach())
            for k, val in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(val)
        return sums

    # ---------------------------------------------------------------- 4.-5. grads
    def _distributed(self) -> bool:
        return self.world_size > 1 and dist.is_initialized()

    def _all_reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        """``t`` reduced over ranks, on the device the backend needs (NCCL: the GPU), back on ``t``'s device."""
        on = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        out = t.to(on)
        dist.all_reduce(out, op=op)
        return out.to(t.device)

    def average_gradients(self) -> None:
        if dist.is_initialized():
            Group(self.rank, self.world_size).average_gradients(self.params)

    def find_nonfinite(self, loss_fault: str | None = None) -> str | None:
        """What is non-finite in this optimizer step (None: nothing), the same verdict on every rank.

        Call after :meth:`average_gradients`: a NaN/inf gradient on any rank is
        then in every rank's averaged gradient; a non-finite loss of one rank
        (``loss_fault``) is shared by a max-reduce of a flag.
        """
        fault = loss_fault or self._nonfinite_gradient()
        if self._distributed():
            flag = self._all_reduce(torch.tensor([0.0 if fault is None else 1.0]), dist.ReduceOp.MAX)
            if flag.item() > 0 and fault is None:
                fault = "the loss on another learner rank"
        return fault

    def _nonfinite_gradient(self) -> str | None:
        named = [(n, p.grad) for n, p in zip(self.param_names, self.params) if p.grad is not None]
        if not named:
            return None
        finite = torch.stack([torch.isfinite(g).all() for _, g in named]).cpu()  # one device sync
        if bool(finite.all()):
            return None
        name, grad = named[int((~finite).nonzero()[0])]
        return f"the gradient of parameter `{name}` ({_kind(grad)})"

    def skip_nonfinite_step(self, fault: str, where: str) -> None:
        """Drop this step's gradients (weights and optimizer state untouched), count it, stop at the limit."""
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_steps += 1
        self.consecutive_nonfinite += 1
        limit = int(self.config.learner.max_consecutive_nonfinite)
        if self.rank == 0:
            logger.warning("skipped the optimizer step of %s: %s is non-finite (%d in a row; "
                           "`learner.max_consecutive_nonfinite` = %d)", where, fault, self.consecutive_nonfinite, limit)
        if self.consecutive_nonfinite >= limit:
            raise NonFiniteError(self._nonfinite_message(fault, where, limit), quantity=fault,
                                 step=self.global_step + 1, count=self.consecutive_nonfinite)

    def _nonfinite_message(self, fault: str, where: str, limit: int) -> str:
        a, dtype = self.actor_cfg, self.config.actor_rollout_ref.model.dtype
        half = (f"; (4) half-precision overflow: `actor_rollout_ref.model.dtype` = {dtype} (try fp32, or bf16 "
                "instead of fp16)") if dtype != "fp32" else ""
        return (f"{self.consecutive_nonfinite} optimizer step(s) in a row had a non-finite (NaN/inf) loss or gradient "
                f"(`learner.max_consecutive_nonfinite` = {limit}); training stops. Last: {fault} at {where}; "
                f"{self.nonfinite_steps} non-finite step(s) skipped in total. Skipped steps changed nothing: the "
                "weights and optimizer state are those of the last finite step. Likely causes and fixes: "
                f"(1) the learning rate is too high: `actor_rollout_ref.actor.optim.lr` = {a.optim.lr}; lower it "
                f"(e.g. 10x) or warm up (`actor_rollout_ref.actor.optim.lr_warmup_steps` = {a.optim.lr_warmup_steps}); "
                "(2) rewards with huge or NaN/inf values: check the reward function and the `critic/rewards/*` "
                f"metrics; (3) loose clipping: `actor_rollout_ref.actor.grad_clip` = {a.grad_clip} (<= 0 disables it), "
                f"`actor_rollout_ref.actor.diffusion_loss.adv_clip_max` = {a.diffusion_loss.adv_clip_max}{half}. "
                "Resume from the last checkpoint after the fix.")

    def postprocess_gradients(self) -> dict[str, float]:
        """Clip the norm of the (averaged, finite) gradients."""
        clip = self.actor_cfg.grad_clip
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(self.params, clip if clip > 0 else float("inf")) if grads else 0.0
        return {"actor/grad_norm": float(norm)}

    def apply_gradients(self) -> dict[str, float]:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"actor/lr": self.optimizer.param_groups[0]["lr"]}

    def after_optimizer_step(self) -> dict[str, float]:
        """Hook after an applied (finite) optimizer step; returns metrics (e.g. an EMA policy's refresh)."""
        return {}

    def optimizer_step(self, loss_fault: str | None, where: str) -> dict[str, float] | None:
        """Steps 4-5 for one mini-batch; None when the step was skipped as non-finite."""
        self.average_gradients()
        fault = self.find_nonfinite(loss_fault)
        if fault is not None:
            self.skip_nonfinite_step(fault, where)
            return None
        metrics = self.postprocess_gradients()
        metrics.update(self.apply_gradients())
        self.consecutive_nonfinite = 0
        return metrics

    # ---------------------------------------------------------------- the chain
    def update(self, fields: dict[str, np.ndarray], group_ids: list[str],
               run_progress: float | None = None) -> dict[str, float]:
        """Train on one batch (whole groups, identical on every rank). Returns averaged metrics.

        ``run_progress``: the fraction of the run done when this update starts (the trainer's
        :meth:`~omnirl_async.trainer.base.BaseTrainer.schedule_progress`), the horizon of a cosine learning-rate
        schedule without ``optim.total_training_steps``; None counts as 0."""
        t0 = time.perf_counter()
        self.set_learning_rate(run_progress)
        b = self.prepare_batch(fields, group_ids)
        num = self.num_units(b)
        num_steps = self.num_steps(b)
        n_train = self.steps_per_minibatch(num_steps)
        perms = [torch.randperm(num, generator=self.rng) if self.actor_cfg.shuffle else torch.arange(num)
                 for _ in range(self.actor_cfg.ppo_epochs)]
        self.compute_proximal(b, self._micro_batches(perms[0]))
        t_old = time.perf_counter() - t0
        totals: dict[str, float] = {}
        count = updates = skipped = 0
        epochs = self.actor_cfg.ppo_epochs
        for epoch in range(epochs):
            minibatches = self._micro_batches(perms[epoch])
            for m, micro_list in enumerate(minibatches):
                steps = sorted(torch.randperm(num_steps, generator=self.rng)[:n_train].tolist()) \
                    if n_train < num_steps else list(range(num_steps))
                scale = 1.0 / (len(steps) * len(micro_list))
                step_sums, loss_fault = self._mini_batch_losses(b, micro_list, steps, scale)
                where = (f"learner update {self.global_step + 1} (epoch {epoch + 1}/{epochs}, "
                         f"mini-batch {m + 1}/{len(minibatches)})")
                grads = self.optimizer_step(loss_fault, where)
                if grads is None:
                    skipped += 1
                    continue
                grads.update(self.after_optimizer_step())
                weight = len(steps) * len(micro_list)
                for k, v in [*step_sums.items(), *((k, v * weight) for k, v in grads.items())]:
                    totals[k] = totals.get(k, 0.0) + v
                count += weight
                updates += 1
        self.finish_proximal(b)
        self.global_step += 1
        metrics = {k: v / max(count, 1) for k, v in totals.items()}
        metrics.update(b["_metrics"])
        metrics.update(self.update_metrics())
        metrics["actor/num_updates"] = float(updates)
        metrics["training/nonfinite_steps"] = float(self.nonfinite_steps)
        metrics["training/skipped_nonfinite"] = skipped / max(updates + skipped, 1)
        metrics["timing_s/old_log_prob"] = t_old
        metrics["timing_s/update_actor"] = time.perf_counter() - t0 - t_old
        return metrics

    def update_metrics(self) -> dict[str, float]:
        """Metrics of the learner's state after an update (hook)."""
        return {}

    def _mini_batch_losses(self, b, micro_list, steps, scale) -> tuple[dict[str, float], str | None]:
        """Forward/backward of one mini-batch's micro-batches: summed metrics and the first non-finite loss."""
        sums: dict[str, float] = {}
        fault = None
        for i, rows in enumerate(micro_list):
            mb = self._rows(b, rows)
            part = self.compute_losses(mb, steps, scale)
            if self._fused_proximal:
                proximal.write_back(b, mb, rows)
            loss = part.get("actor/loss", 0.0)
            if fault is None and not math.isfinite(loss):
                fault = f"the loss `actor/loss` ({_kind(loss)}) of micro-batch {i + 1}/{len(micro_list)}"
            for k, v in part.items():
                sums[k] = sums.get(k, 0.0) + v
        return sums, fault

    # ---------------------------------------------------------------- weights & state
    def get_weights(self) -> dict[str, torch.Tensor]:
        """What rollout workers need: the LoRA state (or the full transformer when lora_rank=0)."""
        return self._trained_weights()

    def adapter_versions(self) -> dict[str, int]:
        """The learner update each published policy state holds (one here: the trained weights)."""
        return {"default": self.global_step}

    def _trained_weights(self) -> dict[str, torch.Tensor]:
        if self.config.actor_rollout_ref.model.lora_rank > 0:
            return self.policy.lora_state_dict()
        return self.policy.full_state_dict()

    def get_state(self) -> dict[str, Any]:
        return {"weights": self._trained_weights(), "optimizer": self.optimizer.state_dict(),
                "global_step": self.global_step,
                "rng": self.rng.get_state(), "torch_rng": torch.get_rng_state(),
                "nonfinite": {"total": self.nonfinite_steps, "consecutive": self.consecutive_nonfinite}}

    def set_state(self, state: dict[str, Any]) -> None:
        if self.config.actor_rollout_ref.model.lora_rank > 0:
            self.policy.load_lora_state_dict(state["weights"])
        else:
            self.policy.load_full_state_dict(state["weights"])
        self.optimizer.load_state_dict(state["optimizer"])
        # (checkpoints written before the schedule counted updates also hold a "scheduler" entry: the learning
        # rate is a function of global_step and the run's progress, so it is not needed)
        self.global_step = int(state["global_step"])
        self.rng.set_state(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        nonfinite = state.get("nonfinite", {})  # absent in checkpoints written before the counter existed
        self.nonfinite_steps = int(nonfinite.get("total", 0))
        self.consecutive_nonfinite = int(nonfinite.get("consecutive", 0))

    def save_lora(self, folder) -> None:
        if self.config.actor_rollout_ref.model.lora_rank > 0:
            self.policy.save_lora(folder)
