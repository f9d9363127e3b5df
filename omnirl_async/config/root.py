"""The whole diffusion trainer config, as composed by ``omnirl_async/configs/diffusion_trainer.yaml``."""

from __future__ import annotations

from dataclasses import dataclass, field

from omnirl_async.config.actor import DiffusionActorConfig
from omnirl_async.config.algorithm import PREFERENCE_LOSSES, DiffusionAlgoConfig
from omnirl_async.config.buffer import BufferConfig, TransferQueueConfig
from omnirl_async.config.data import DataConfig, RewardConfig
from omnirl_async.config.model import DiffusionModelConfig, pixel_step
from omnirl_async.config.rollout import DiffusionRolloutConfig
from omnirl_async.config.trainer import LearnerConfig, RayKwargsConfig, TrainerConfig

__all__ = ["ActorRolloutRefConfig", "DiffusionTrainerConfig"]


@dataclass
class ActorRolloutRefConfig:
    model: DiffusionModelConfig = field(default_factory=DiffusionModelConfig)
    actor: DiffusionActorConfig = field(default_factory=DiffusionActorConfig)
    rollout: DiffusionRolloutConfig = field(default_factory=DiffusionRolloutConfig)


@dataclass
class DiffusionTrainerConfig:
    # actor_rollout_ref comes first so that a bad model.algorithm is reported
    # before the keys that interpolate it (algorithm.adv_estimator, loss_mode).
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    algorithm: DiffusionAlgoConfig = field(default_factory=DiffusionAlgoConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    transfer_queue: TransferQueueConfig = field(default_factory=TransferQueueConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    ray_kwargs: RayKwargsConfig = field(default_factory=RayKwargsConfig)

    def validate(self, path: str) -> None:
        aro = self.actor_rollout_ref
        n = aro.rollout.n
        if aro.actor.ppo_mini_batch_size > self.data.train_batch_size:
            raise ValueError(f"`actor_rollout_ref.actor.ppo_mini_batch_size` = {aro.actor.ppo_mini_batch_size} "
                             f"exceeds `data.train_batch_size` = {self.data.train_batch_size}; a mini-batch is a "
                             "number of prompts taken from one training batch.")
        if self.data.train_batch_size % aro.actor.ppo_mini_batch_size:
            raise ValueError(f"`data.train_batch_size` = {self.data.train_batch_size} must be a multiple of "
                             f"`actor_rollout_ref.actor.ppo_mini_batch_size` = {aro.actor.ppo_mini_batch_size}.")
        self._check_trainer_type()
        if self.algorithm.adv_estimator in ("flow_grpo", "mix_grpo", "dance_grpo", "grpo_guard", "flow_dppo",
                                            "diffusion_nft", "dpo", "awm") and n < 2:
            raise ValueError(f"`actor_rollout_ref.rollout.n` = {n}: group advantages need at least 2 samples "
                             "per prompt.")
        nsteps = aro.rollout.pipeline.num_inference_steps
        win = aro.rollout.algo.sde_window_size
        if win is not None and win > nsteps:
            raise ValueError(f"`actor_rollout_ref.rollout.algo.sde_window_size` = {win} exceeds "
                             f"`actor_rollout_ref.rollout.pipeline.num_inference_steps` = {nsteps}.")
        rng = aro.rollout.algo.sde_window_range
        if rng is not None and rng[1] > nsteps:
            raise ValueError(f"`actor_rollout_ref.rollout.algo.sde_window_range` = {list(rng)!r} ends past "
                             f"num_inference_steps = {nsteps}.")
        self._check_image_size()
        if (aro.actor.ppo_mini_batch_size * n) % self.learner.num_workers:
            raise ValueError(f"`learner.num_workers` = {self.learner.num_workers} must divide the samples of one "
                             f"mini-batch (ppo_mini_batch_size x rollout.n = {aro.actor.ppo_mini_batch_size * n}).")
        if (self.ray_kwargs.role_resources or {}).get("reward") and self.reward.num_workers == 0:
            raise ValueError("`ray_kwargs.role_resources.reward` places reward workers, but `reward.num_workers` = 0 "
                             "scores inline in the rollout workers: place those with "
                             "`ray_kwargs.role_resources.rollout`, or set `reward.num_workers` > 0.")
        if aro.rollout.algo.sde_type == "cps" and aro.actor.diffusion_loss.clip_ratio > 1e-3:
            import warnings

            warnings.warn("sde_type=cps uses unscaled log-probs (-mean((x'-mu)^2)); clip_ratio "
                          f"{aro.actor.diffusion_loss.clip_ratio} will hardly ever clip. References use ~1e-5.",
                          stacklevel=2)
        self._warn_bypass_with_stale_samples()

    def _check_image_size(self) -> None:
        """Height and width of generation and of validation: multiples of the model's VAE scale x patch (found
        here, at start-up, rather than in the first rollout worker's first generation)."""
        model = self.actor_rollout_ref.model
        step = pixel_step(model.path, model.transformer_subfolder)
        if step is None:
            return
        ro = "actor_rollout_ref.rollout"
        for where, pipe in ((f"{ro}.pipeline", self.actor_rollout_ref.rollout.pipeline),
                            (f"{ro}.val_kwargs.pipeline", self.actor_rollout_ref.rollout.val_kwargs.pipeline)):
            for key in ("height", "width"):
                value = getattr(pipe, key)
                if value % step:
                    near = [v for v in (value - value % step, value - value % step + step) if v > 0]
                    raise ValueError(f"`{where}.{key}` = {value} must be a multiple of {step} for the model "
                                     f"`actor_rollout_ref.model.path` = {model.path!r} (its VAE scale x patch); "
                                     f"use {' or '.join(map(str, near))}.")

    def _warn_bypass_with_stale_samples(self) -> None:
        """Bypass-mode correction clips stale samples away under FlowGRPO-family clip ranges (a warning: valid)."""
        rc, mode = self.algorithm.rollout_correction, self.trainer.v1.trainer_mode
        threshold = self.trainer.v1.sampler.max_off_policy_threshold
        if not rc.bypass_mode or mode != "separate_async" or threshold == 0 \
                or self.algorithm.trainer_type != "policy_gradient":
            return
        import warnings

        clip = self.actor_rollout_ref.actor.diffusion_loss.clip_ratio
        warnings.warn(f"`algorithm.rollout_correction.bypass_mode` = true in separate_async with "
                      f"`trainer.v1.sampler.max_off_policy_threshold` = {threshold!r}: the PPO ratio is then taken "
                      f"against the behaviour policy, and with `clip_ratio` = {clip:g} a sample generated before the "
                      "latest update is clipped on many of its steps, which then train nothing (measured on the "
                      "embedded model: ~40 % of steps clipped, half the per-update progress; README, 'Time to "
                      "accuracy'). Set bypass_mode=false (with rollout_is=token): the ratio is then taken against the "
                      "learner's weights at the update's start and the staleness is corrected by IS weights; with one "
                      "epoch and one mini-batch per update it costs no extra forward pass.", stacklevel=2)

    def _check_trainer_type(self) -> None:
        """The loss, the trainer type, the adapters and the pairing must agree (refused here, with the fix)."""
        from omnirl_async.algos.losses import get_diffusion_loss_fn

        aro, algo = self.actor_rollout_ref, self.algorithm
        loss = aro.actor.diffusion_loss.loss_mode
        kind = getattr(get_diffusion_loss_fn(loss), "trainer_type", "policy_gradient")
        lp = "`actor_rollout_ref.actor.diffusion_loss.loss_mode`"
        if kind != algo.trainer_type:
            fix = ("set `algorithm.trainer_type=direct_preference`" if kind == "direct_preference" else
                   f"use a direct-preference loss ({', '.join(PREFERENCE_LOSSES)})")
            raise ValueError(f"{lp} = {loss!r} is a {kind.replace('_', '-')} loss but `algorithm.trainer_type` = "
                             f"{algo.trainer_type}; {fix} (or pick both with `actor_rollout_ref.model.algorithm`).")
        states = aro.model.policy_state_adapters or ["default"]
        mp = "`actor_rollout_ref.model.policy_state_adapters`"
        if aro.rollout.rollout_adapter == "old" and "old" not in states:
            raise ValueError(f"`actor_rollout_ref.rollout.rollout_adapter` = old, but {mp} = {list(states)} has no "
                             "'old' adapter to generate with; set it to [default,old] (DiffusionNFT) or use "
                             "rollout_adapter=default.")
        if loss == "diffusion_nft" and "old" not in states:
            raise ValueError(f"{lp} = diffusion_nft mixes the trained velocity with the old policy's, but {mp} = "
                             f"{list(states)} has no 'old' adapter; set {mp}=[default,old] (and usually "
                             "`actor_rollout_ref.rollout.rollout_adapter=old`).")
        if loss == "awm" and aro.actor.diffusion_loss.old_kl_coef > 0 and "old" not in states:
            raise ValueError("`actor_rollout_ref.actor.diffusion_loss.old_kl_coef` = "
                             f"{aro.actor.diffusion_loss.old_kl_coef} regularises AWM towards the EMA policy, the "
                             f"'old' adapter, but {mp} = {list(states)} has none; set {mp}=[default,old] or "
                             "old_kl_coef=0.")
        pairwise = loss == "dpo"
        if bool(algo.paired_preference) != pairwise:
            raise ValueError(f"`algorithm.paired_preference` = {str(algo.paired_preference).lower()} with {lp} = "
                             f"{loss!r}: " + ("Diffusion-DPO trains on (winner, loser) pairs; set "
                                              "`algorithm.paired_preference=true`." if pairwise else
                                              "only the pair-based loss (dpo) reads pairs; set it to false."))
        clip = aro.actor.diffusion_loss.adv_clip_max
        if algo.offline_advantage is not None and algo.offline_advantage > clip:
            raise ValueError(f"`algorithm.offline_advantage` = {algo.offline_advantage:g} exceeds "
                             f"`actor_rollout_ref.actor.diffusion_loss.adv_clip_max` = {clip:g}, where every advantage "
                             "is clipped; use a value up to it (null = the clip itself: r = 1 / 0).")
        if algo.trainer_type == "direct_preference":
            rc = algo.rollout_correction
            on = [k for k, v in (("rollout_is", rc.rollout_is), ("rollout_rs", rc.rollout_rs),
                                 ("bypass_mode", rc.bypass_mode)) if v not in (None, False)]
            if on:
                raise ValueError(f"`algorithm.rollout_correction.{on[0]}` is set, but direct-preference losses have "
                                 "no per-step behaviour log-probs to correct (their samples carry only x0 and the "
                                 "reward); leave algorithm.rollout_correction at its defaults.")
