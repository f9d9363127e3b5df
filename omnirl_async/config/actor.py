"""`actor_rollout_ref.actor.*`: the learner's loss, optimizer and mini-batching."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnirl_async.config.algorithm import PREFERENCE_LOSSES
from omnirl_async.config.fields import NoEffect, opt

__all__ = ["DiffusionLossConfig", "OptimConfig", "DiffusionActorConfig", "loss_reads_kl", "losses_ignoring_kl"]


def _losses():
    from omnirl_async.algos.losses import registered_losses

    return registered_losses()


def loss_reads_kl(loss_mode: str, loss_config: Any = None) -> bool | None:
    """Whether the registered loss ``loss_mode`` adds the KL term when ``actor.use_kl_loss`` is on.

    Derived from the loss contract (``algos/losses/base.py``): the learner computes the reference mean
    ``ref_mean`` only when ``use_kl_loss``, and a loss that uses the KL asks for it in its
    ``model_output_keys``. None when the loss cannot be built here (another check reports that).
    """
    from types import SimpleNamespace

    from omnirl_async.algos.losses import get_diffusion_loss_fn

    try:
        cls = get_diffusion_loss_fn(loss_mode)
        probe = SimpleNamespace(use_kl_loss=True, kl_loss_coef=0.001, loss_scale_factor=None, rollout_correction=None)
        loss = cls(loss_config if loss_config is not None else DiffusionLossConfig(), probe)
    except Exception:  # noqa: BLE001 - unknown name or bad loss option: reported by its own check
        return None
    return "ref_mean" in loss.model_output_keys


def losses_ignoring_kl() -> list[str]:
    """Registered losses that never read the KL term."""
    return [name for name in _losses() if loss_reads_kl(name) is False]


def _kl_ignored(actor: Any, root: Any) -> str | None:
    mode = actor.diffusion_loss.loss_mode
    if loss_reads_kl(mode, actor.diffusion_loss) is False:
        return f"with `actor_rollout_ref.actor.diffusion_loss.loss_mode` = {mode!r}"
    return None


def _kl_off(actor: Any, root: Any) -> str | None:
    return None if actor.use_kl_loss else "while `actor_rollout_ref.actor.use_kl_loss` = false"


def _loss_not(*names: str):
    """A ``when`` condition: the key has no effect unless ``diffusion_loss.loss_mode`` is one of ``names``."""
    def when(loss: Any, root: Any) -> str | None:
        return None if loss.loss_mode in names else f"with `actor_rollout_ref.actor.diffusion_loss.loss_mode` = {loss.loss_mode!r}"
    return when


def _only_with(names: tuple[str, ...], what: str) -> NoEffect:
    return NoEffect(f"only {' / '.join(names)} read{'s' if len(names) == 1 else ''} {what}", when=_loss_not(*names),
                    when_doc=f"unless `loss_mode` = {' / '.join(names)}",
                    fix=f"leave it at its default ({{default}}), or use loss_mode {' / '.join(names)}")


def _preference_loss(loss: Any, root: Any) -> str | None:
    return (f"with the direct-preference `loss_mode` = {loss.loss_mode!r}" if loss.loss_mode in PREFERENCE_LOSSES
            else None)


#: policy-gradient ratio options: a direct-preference loss has no per-step log-prob ratio
_PG_ONLY = NoEffect("direct-preference losses have no per-step policy ratio to clip or mask", when=_preference_loss,
                    when_doc="with `loss_mode` = " + " / ".join(PREFERENCE_LOSSES))

def _distill_off(actor: Any, root: Any) -> str | None:
    return None if actor.use_distill_loss else "while `actor_rollout_ref.actor.use_distill_loss` = false"


#: the distillation keys act only with use_distill_loss
_DISTILL_ONLY = NoEffect("distillation is off, so nothing reads it", when=_distill_off,
                         when_doc="while `use_distill_loss` = false",
                         fix="leave it at its default ({default}), or set "
                             "`actor_rollout_ref.actor.use_distill_loss` = true")


def _distill_kl_without_noise(actor: Any, root: Any) -> str | None:
    noise = root.actor_rollout_ref.rollout.algo.noise_level
    if actor.distill_loss_mode == "distill_kl" and noise == 0:
        return ("with `actor_rollout_ref.actor.distill_loss_mode` = 'distill_kl' while "
                "`actor_rollout_ref.rollout.algo.noise_level` = 0")
    return None


#: distill_kl compares two Gaussian SDE steps; at noise level 0 (the direct-preference presets' deterministic
#: rollouts, or an ODE policy-gradient run) both are point masses and the term is identically 0
_DISTILL_KL_NEEDS_NOISE = NoEffect(
    "the Gaussian KL between the student's and the teacher's SDE steps needs the step's noise (sig > 0); at noise "
    "level 0 both steps are deterministic Euler steps, the KL term is 0 for every sample and the teacher would "
    "only cost forward passes",
    when=_distill_kl_without_noise,
    when_doc="with `distill_loss_mode` = distill_kl while `rollout.algo.noise_level` = 0",
    fix="set `actor_rollout_ref.actor.distill_loss_mode=distill_fm_mse` (the velocity MSE, meaningful at any noise "
        "level), or a `actor_rollout_ref.rollout.algo.noise_level` > 0")


@dataclass
class DiffusionLossConfig:
    loss_mode: str = opt("${oc.select:actor_rollout_ref.model.algorithm,flow_grpo}",
                         "Loss registry key; defaults to actor_rollout_ref.model.algorithm.", choices=_losses)
    clip_ratio: float = opt(1e-4, "PPO clip epsilon on the per-step ratio (FlowGRPO uses a tiny one; "
                            "cps log-probs are unscaled, so their sensible range is ~1e-5).", gt=0, no_effect=_PG_ONLY)
    adv_clip_max: float = opt(5.0, "Advantages are clipped to +-adv_clip_max before the loss.", gt=0)
    mix_beta: float = opt(0.5, "DiffusionNFT mixing beta: v+ = beta*v + (1-beta)*v_old.", gt=0,
                          no_effect=_only_with(("diffusion_nft",), "the mixing beta"))
    ref_kl_coef: float = opt(0.0, "DiffusionNFT / AWM: coefficient of mean((v - v_ref)^2), the MSE to the reference "
                             "(base model, adapter disabled).", ge=0,
                             no_effect=_only_with(("diffusion_nft", "awm"), "the reference MSE coefficient"))
    adaptive_weight_min: float = opt(1e-5, "DiffusionNFT adaptive-weight floor.", gt=0,
                                     no_effect=_only_with(("diffusion_nft",), "the adaptive-weight floor"))
    dpo_beta: float = opt(2000.0, "Diffusion-DPO inverse temperature.", gt=0,
                          no_effect=_only_with(("dpo",), "the DPO inverse temperature"))
    old_kl_coef: float = opt(0.0, "AWM: coefficient of mean((v - v_old)^2), the MSE to the EMA policy (the 'old' "
                             "adapter; needs policy_state_adapters=[default,old] when > 0).", ge=0,
                             no_effect=_only_with(("awm",), "the EMA-policy MSE coefficient"))
    kl_mask_threshold: float = opt(1e-5, "Flow-DPPO drift threshold tau.", gt=0,
                                   no_effect=_only_with(("flow_dppo",), "the drift threshold"))
    add_kl_coefficient: bool = opt(True, "Flow-DPPO: normalise the mean drift by the SDE noise scale.",
                                   no_effect=_only_with(("flow_dppo",), "the drift normalisation"))


def _constant_lr(optim: Any, root: Any) -> str | None:
    return (None if optim.lr_scheduler_type == "cosine"
            else f"with `actor_rollout_ref.actor.optim.lr_scheduler_type` = {optim.lr_scheduler_type!r}")


@dataclass
class OptimConfig:
    optimizer: str = opt("adamw", "Optimizer.", choices=("adamw", "adam", "sgd"))
    lr: float = opt(3e-4, "Learning rate.", gt=0)
    weight_decay: float = opt(1e-4, "Decoupled weight decay.", ge=0)
    betas: Any = opt(None, "Adam betas [b1, b2]; null = [0.9, 0.999].")
    eps: float = opt(1e-8, "Adam epsilon.", gt=0)
    lr_warmup_steps: int = opt(0, "Linear warm-up, in learner updates.", ge=0)
    lr_scheduler_type: str = opt("constant", "constant or cosine after warm-up.", choices=("constant", "cosine"))
    total_training_steps: Any = opt(None, "Horizon of the cosine schedule, in learner updates; null = the run's "
                                    "length: trainer.total_training_steps (or total_epochs) updates, or "
                                    "trainer.total_time_minutes of training time, whichever ends first.", gt=0,
                                    no_effect=NoEffect("only the cosine schedule has a horizon; the run's length is "
                                                       "`trainer.total_training_steps`", when=_constant_lr,
                                                       when_doc="unless `lr_scheduler_type` = cosine",
                                                       fix="leave it at its default ({default}), or set "
                                                           "`actor_rollout_ref.actor.optim.lr_scheduler_type=cosine`; "
                                                           "to stop the run after N updates set "
                                                           "`trainer.total_training_steps=N`"))


@dataclass
class DiffusionActorConfig:
    strategy: str = opt("ddp", "Training engine. ddp = torch DDP over trainable params (gloo on CPU, nccl on GPU).",
                        choices=("ddp", "fsdp", "fsdp2", "veomni"),
                        not_built={"fsdp": "FSDP sharding is not built; use ddp (LoRA params are small)",
                                   "fsdp2": "FSDP2 sharding is not built; use ddp",
                                   "veomni": "the VeOmni engine is not built; use ddp"})
    diffusion_loss: DiffusionLossConfig = field(default_factory=DiffusionLossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = opt(8, "Prompts per optimizer step (x rollout.n samples), as in verl.", gt=0)
    ppo_micro_batch_size_per_gpu: Any = opt(None, "Samples per forward/backward; null = whole mini-batch.", gt=0)
    ppo_epochs: int = opt(1, "Passes over each training batch.", gt=0)
    shuffle: bool = opt(True, "Shuffle samples across mini-batches each epoch.")
    grad_clip: float = opt(1.0, "Max gradient norm; <= 0 disables.")
    loss_scale_factor: Any = opt(None, "Global scale on the diffusion loss; null disables.", gt=0)
    use_kl_loss: bool = opt(False, "Add kl_loss_coef x KL to the reference policy (base model, adapter disabled) "
                            "to the loss; only losses that read the KL term (flow_grpo, mix_grpo, dance_grpo) take it.",
                            no_effect=NoEffect(
                                "this loss never reads the KL term (it does not take the reference mean `ref_mean`), "
                                "so the reference forward pass would only cost time",
                                when=_kl_ignored,
                                when_doc=lambda: ("with `diffusion_loss.loss_mode` = "
                                                  + " / ".join(losses_ignoring_kl()) + " (losses without a KL term)"),
                                fix="set it to false, or use a loss_mode with a KL term (flow_grpo, mix_grpo, "
                                    "dance_grpo)"))
    kl_loss_coef: float = opt(0.001, "KL penalty coefficient.", ge=0,
                              no_effect=NoEffect("the KL penalty is off, so nothing reads its coefficient",
                                                 when=_kl_off, when_doc="while `use_kl_loss` = false",
                                                 fix="leave it at its default ({default}), or set "
                                                     "`actor_rollout_ref.actor.use_kl_loss` = true"))
    use_distill_loss: bool = opt(False, "Add distill_loss_coef x a distillation term towards a frozen teacher "
                                 "pipeline (distill_teacher_path) to whatever loss runs (both trainer types); the "
                                 "learner runs the teacher on the student's own samples (same latent, sigma and "
                                 "prompt embeddings). Metric actor/distill_loss. Not scaled by loss_scale_factor.",
                                 no_effect=_DISTILL_KL_NEEDS_NOISE)
    distill_loss_mode: str = opt("distill_kl", "distill_kl: Gaussian KL of the student's and teacher's SDE steps, "
                                 "mean((mu_s - mu_t)^2)/(2 sig^2) (policy gradient: each trained step; direct "
                                 "preference: the step x_t -> next grid sigma with rollout.algo.noise_level); "
                                 "distill_fm_mse: mean((v_s - v_t)^2).",
                                 choices=("distill_kl", "distill_fm_mse"), no_effect=_DISTILL_ONLY)
    distill_loss_coef: float = opt(1.0, "Distillation coefficient.", ge=0, no_effect=_DISTILL_ONLY)
    distill_teacher_path: Any = opt(None, "Teacher pipeline for use_distill_loss: a local diffusers pipeline folder "
                                    "or embedded:<name> (as actor_rollout_ref.model.path), loaded frozen without "
                                    "LoRA with the policy's dtype; its latents and prompt-embedding widths must "
                                    "match the policy's. Required when use_distill_loss=true.",
                                    no_effect=_DISTILL_ONLY)
    rollout_correction: Any = opt("${algorithm.rollout_correction}",
                                  "Read-only copy of algorithm.rollout_correction, which the losses read here; "
                                  "setting it, or a key under it, is refused: set algorithm.rollout_correction.* "
                                  "instead.", mirror_of="algorithm.rollout_correction")

    def validate(self, path: str) -> None:
        teacher = self.distill_teacher_path
        if teacher is not None and (not isinstance(teacher, str) or not teacher.strip()):
            raise ValueError(f"`{path}.distill_teacher_path` = {teacher!r}: expected a local diffusers pipeline "
                             "folder or an embedded model such as embedded:tiny-sd3.")
        if self.use_distill_loss and teacher is None:
            raise ValueError(f"`{path}.use_distill_loss` = true needs a teacher, but `{path}.distill_teacher_path` "
                             "is null; set it to a local diffusers pipeline folder (model_index.json inside) or an "
                             "embedded model (e.g. the policy's own `actor_rollout_ref.model.path`), or set "
                             f"`{path}.use_distill_loss=false`.")
