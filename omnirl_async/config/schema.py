"""Every config dataclass of the diffusion trainer, in one import."""

from omnirl_async.config.actor import DiffusionActorConfig, DiffusionLossConfig, OptimConfig
from omnirl_async.config.algorithm import DiffusionAlgoConfig, RolloutCorrectionConfig
from omnirl_async.config.buffer import BufferConfig, TransferQueueConfig
from omnirl_async.config.data import CustomRewardFunctionConfig, DataConfig, RewardConfig
from omnirl_async.config.model import DEFAULT_MODEL_PATH, DiffusionModelConfig
from omnirl_async.config.root import ActorRolloutRefConfig, DiffusionTrainerConfig
from omnirl_async.config.rollout import (DiffusionPipelineConfig, DiffusionRolloutAlgoConfig,
                                         DiffusionRolloutConfig, ValKwargsConfig)
from omnirl_async.config.trainer import (CustomSamplerConfig, LearnerConfig, RayKwargsConfig, SeparateAsyncConfig,
                                         TrainerConfig, V1Config, V1SamplerConfig)

__all__ = [
    "ActorRolloutRefConfig", "BufferConfig", "CustomRewardFunctionConfig", "CustomSamplerConfig", "DataConfig",
    "DEFAULT_MODEL_PATH", "DiffusionActorConfig", "DiffusionAlgoConfig", "DiffusionLossConfig",
    "DiffusionModelConfig", "DiffusionPipelineConfig", "DiffusionRolloutAlgoConfig", "DiffusionRolloutConfig",
    "DiffusionTrainerConfig", "LearnerConfig", "OptimConfig", "RayKwargsConfig", "RewardConfig",
    "RolloutCorrectionConfig", "SeparateAsyncConfig", "TrainerConfig", "TransferQueueConfig", "V1Config",
    "V1SamplerConfig", "ValKwargsConfig",
]
