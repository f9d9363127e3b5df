"""The diffusion policy-gradient learner.

One :meth:`Learner.update` call trains on one batch of whole GRPO groups. It
is a chain of steps, each overridable and testable alone (RLlib's template):

1. :meth:`prepare_batch` – numpy fields → tensors, advantages from rewards,
2. :meth:`compute_proximal_log_probs` – the "old" log-probs recomputed with the
   current weights before any update (``bypass_mode`` skips this and uses the
   behaviour log-probs), then rollout correction weights,
3. :meth:`compute_losses` – per mini-batch / micro-batch / trained SDE step:
   velocity → SDE log-prob of the stored next latents → loss,
4. :meth:`postprocess_gradients` – average across learners, clip the norm,
5. :meth:`apply_gradients` – optimizer and LR-scheduler step.

With several learners (``learner.num_workers``), every rank receives the same
full batch (advantages need every group), takes its slice of each mini-batch,
and averages gradients with ``torch.distributed.all_reduce`` – DDP restricted
to the trainable (LoRA) parameters, which is all that changes.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from omnirl_async.algos import compute_rollout_correction, get_diffusion_adv_estimator_fn, get_diffusion_loss_fn
from omnirl_async.models.data_parallel import Group
from omnirl_async.models.policy import FlowMatchPolicy, PromptEmbeds
from omnirl_async.models.resolve import resolve_model_path
from omnirl_async.models.sde import sde_step_with_logprob

__all__ = ["Learner", "build_policy", "pick_device"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("`trainer.device` = 'cuda' but no CUDA device is visible; use auto or cpu.")
    return torch.device(name)


def quiet_hf_logging() -> None:
    """Silence per-component loading bars and warnings in worker logs."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def build_policy(model_cfg, device: torch.device, *, seed: int = 0) -> FlowMatchPolicy:
    """Load the pipeline and wrap it with LoRA as ``actor_rollout_ref.model`` says.

    The LoRA init draws from a generator seeded with ``seed`` (and leaves the
    global RNG as it was), so every process builds the same initial adapter.
    """
    quiet_hf_logging()
    policy = FlowMatchPolicy.from_pretrained(resolve_model_path(model_cfg.path),
                                             transformer_subfolder=model_cfg.transformer_subfolder,
                                             device=device, dtype=_DTYPES[model_cfg.dtype])
    # rank 0 (without an adapter path) makes the whole transformer trainable
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _add_lora(policy, model_cfg)
    if model_cfg.enable_gradient_checkpointing and hasattr(policy.transformer, "enable_gradient_checkpointing"):
        policy.transformer.enable_gradient_checkpointing()
    return policy


def _add_lora(policy: FlowMatchPolicy, model_cfg) -> None:
    policy.add_lora(rank=model_cfg.lora_rank, alpha=model_cfg.lora_alpha,
                    init_weights=model_cfg.lora_init_weights, target_modules=model_cfg.target_modules,
                    exclude_modules=model_cfg.exclude_modules, adapter_path=model_cfg.lora_adapter_path,
                    lora_dtype=model_cfg.lora_dtype)


def _embeds_from_fields(fields: dict[str, torch.Tensor]) -> PromptEmbeds:
    return PromptEmbeds.from_numpy({k[len("emb."):]: v for k, v in fields.items() if k.startswith("emb.")})


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
        self.optimizer = self.configure_optimizer()
        self.scheduler = self.configure_lr_scheduler()
        self.loss_fn = get_diffusion_loss_fn(self.actor_cfg.diffusion_loss.loss_mode)(
            self.actor_cfg.diffusion_loss, self.actor_cfg)
        self.adv_fn = get_diffusion_adv_estimator_fn(self.algo_cfg.adv_estimator)
        self.global_step = 0
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

    def configure_lr_scheduler(self):
        o = self.actor_cfg.optim
        total = o.total_training_steps or self.config.trainer.total_training_steps or 10**9

        def factor(step: int) -> float:
            if o.lr_warmup_steps and step < o.lr_warmup_steps:
                return (step + 1) / o.lr_warmup_steps
            if o.lr_scheduler_type == "cosine":
                progress = min(1.0, (step - o.lr_warmup_steps) / max(1, total - o.lr_warmup_steps))
                return 0.5 * (1 + math.cos(math.pi * progress))
            return 1.0

        return torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)

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

    def _step_forward(self, mb: dict[str, torch.Tensor], j: int, embeds: PromptEmbeds, *, reference: bool = False):
        """Velocity at trained step j and the SDE log-prob of the stored next latents."""
        x = mb["latents"][:, j].to(self.device)
        s, s_next = mb["sigmas"][:, j].to(self.device), mb["sigmas_next"][:, j].to(self.device)
        pcfg, acfg = self.rollout_cfg.pipeline, self.rollout_cfg.algo
        v = self.policy.predict_velocity(x, s, embeds, true_cfg_scale=pcfg.true_cfg_scale,
                                         guidance_scale=pcfg.guidance_scale)
        out = sde_step_with_logprob(v.float(), s, s_next, x.float(), noise_level=acfg.noise_level,
                                    sde_type=acfg.sde_type, prev_sample=mb["next_latents"][:, j].to(self.device))
        return out

    def _micro_batches(self, perm: torch.Tensor) -> list[list[torch.Tensor]]:
        """Split an epoch permutation into mini-batches (this rank's slice) and micro-batches."""
        n = self.rollout_cfg.n
        mini = self.actor_cfg.ppo_mini_batch_size * n
        micro = self.actor_cfg.ppo_micro_batch_size_per_gpu
        out = []
        for start in range(0, len(perm), mini):
            rows = perm[start:start + mini]
            per_rank = len(rows) // self.world_size
            rows = rows[self.rank * per_rank:(self.rank + 1) * per_rank]
            size = micro or len(rows)
            out.append([rows[i:i + size] for i in range(0, len(rows), size)])
        return out

    # ---------------------------------------------------------------- 2. proximal
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
                dist.all_reduce(old, op=dist.ReduceOp.SUM)
                dist.all_reduce(old_means, op=dist.ReduceOp.SUM)
            b["old_log_probs"], b["old_means"] = old, old_means
        rc = compute_rollout_correction(b["old_log_probs"], behaviour, None, self.algo_cfg.rollout_correction)
        b["is_weights"] = rc.weights  # IS weight x rejection keep-mask
        b["_metrics"].update(rc.metrics)

    # ---------------------------------------------------------------- 3. losses
    def compute_losses(self, mb: dict[str, torch.Tensor], steps: list[int], scale: float) -> dict[str, float]:
        """Forward + backward over the trained steps of one micro-batch; returns summed metrics."""
        emb = _embeds_from_fields(mb).to(self.device)
        sums: dict[str, float] = {}
        for j in steps:
            out = self._step_forward(mb, j, emb)
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
            (loss * scale).backward()
            metrics["actor/loss"] = float(loss.detach())
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        return sums

    # ---------------------------------------------------------------- 4.-5. grads
    def postprocess_gradients(self) -> dict[str, float]:
        if dist.is_initialized():
            Group(self.rank, self.world_size).average_gradients(self.params)
        clip = self.actor_cfg.grad_clip
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(self.params, clip if clip > 0 else float("inf")) if grads else 0.0
        return {"actor/grad_norm": float(norm)}

    def apply_gradients(self) -> dict[str, float]:
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"actor/lr": self.optimizer.param_groups[0]["lr"]}

    # ---------------------------------------------------------------- the chain
    def update(self, fields: dict[str, np.ndarray], group_ids: list[str]) -> dict[str, float]:
        """Train on one batch (whole groups, identical on every rank). Returns averaged metrics."""
        t0 = time.perf_counter()
        b = self.prepare_batch(fields, group_ids)
        num = len(group_ids)
        num_steps = b["log_probs"].shape[1]
        n_train = max(1, int(math.ceil(num_steps * self.algo_cfg.timestep_fraction)))
        perms = [torch.randperm(num, generator=self.rng) if self.actor_cfg.shuffle else torch.arange(num)
                 for _ in range(self.actor_cfg.ppo_epochs)]
        self.compute_proximal_log_probs(b, self._micro_batches(perms[0]))
        t_old = time.perf_counter() - t0
        totals: dict[str, float] = {}
        count = 0
        updates = 0
        for epoch in range(self.actor_cfg.ppo_epochs):
            for micro_list in self._micro_batches(perms[epoch]):
                steps = sorted(torch.randperm(num_steps, generator=self.rng)[:n_train].tolist()) \
                    if n_train < num_steps else list(range(num_steps))
                scale = 1.0 / (len(steps) * len(micro_list))
                for rows in micro_list:
                    sums = self.compute_losses(self._rows(b, rows), steps, scale)
                    for k, v in sums.items():
                        totals[k] = totals.get(k, 0.0) + v
                    count += len(steps)
                grads = self.postprocess_gradients()
                grads.update(self.apply_gradients())
                for k, v in grads.items():
                    totals[k] = totals.get(k, 0.0) + v * len(steps) * len(micro_list)
                updates += 1
        self.global_step += 1
        metrics = {k: v / max(count, 1) for k, v in totals.items()}
        metrics.update(b["_metrics"])
        metrics["actor/num_updates"] = float(updates)
        metrics["timing_s/old_log_prob"] = t_old
        metrics["timing_s/update_actor"] = time.perf_counter() - t0 - t_old
        return metrics

    # ---------------------------------------------------------------- weights & state
    def get_weights(self) -> dict[str, torch.Tensor]:
        """What rollout workers need: the LoRA state (or the full transformer when lora_rank=0)."""
        if self.config.actor_rollout_ref.model.lora_rank > 0:
            return self.policy.lora_state_dict()
        return self.policy.full_state_dict()

    def get_state(self) -> dict[str, Any]:
        return {"weights": self.get_weights(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "global_step": self.global_step,
                "rng": self.rng.get_state(), "torch_rng": torch.get_rng_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        if self.config.actor_rollout_ref.model.lora_rank > 0:
            self.policy.load_lora_state_dict(state["weights"])
        else:
            self.policy.load_full_state_dict(state["weights"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = int(state["global_step"])
        self.rng.set_state(state["rng"])
        torch.set_rng_state(state["torch_rng"])

    def save_lora(self, folder) -> None:
        if self.config.actor_rollout_ref.model.lora_rank > 0:
            self.policy.save_lora(folder)
