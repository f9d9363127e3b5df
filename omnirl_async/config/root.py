"""The whole diffusion trainer config, as composed by ``omnirl_async/configs/diffusion_trainer.yaml``."""

from __future__ import annotations

from dataclasses import dataclass, field

from omnirl_async.config.actor import DiffusionActorConfig
from omnirl_async.config.algorithm import DiffusionAlgoConfig
from omnirl_async.config.buffer import BufferConfig, TransferQueueConfig
from omnirl_async.config.data import DataConfig, RewardConfig
from omnirl_async.config.model import DiffusionModelConfig
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
        if self.algorithm.adv_estimator in ("flow_grpo", "mix_grpo", "dance_grpo", "grpo_guard") and n < 2:
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
        if (aro.actor.ppo_mini_batch_size * n) % self.learner.num_workers:
            raise ValueError(f"`learner.num_workers` = {self.learner.num_workers} must divide the samples of one "
                             f"mini-batch (ppo_mini_batch_size x rollout.n = {aro.actor.ppo_mini_batch_size * n}).")
        if aro.rollout.algo.sde_type == "cps" and aro.actor.diffusion_loss.clip_ratio > 1e-3:
            import warnings

            warnings.warn("sde_type=cps uses unscaled log-probs (-mean((x'-mu)^2)); clip_ratio "
                          f"{aro.actor.diffusion_loss.clip_ratio} will hardly ever clip. References use ~1e-5.",
                          stacklevel=2)
