"""`trainer.*`, `learner.*`, `ray_kwargs.*`: the run itself and where it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnirl_async.config.buffer import wait_no_effect
from omnirl_async.config.fields import NoEffect, opt

__all__ = ["SeparateAsyncConfig", "CustomSamplerConfig", "AutoThresholdConfig", "V1SamplerConfig", "V1Config",
           "TrainerConfig", "LearnerConfig", "RayKwargsConfig", "AUTO"]

#: The value of ``trainer.v1.sampler.max_off_policy_threshold`` that hands it to the controller
#: (:mod:`omnirl_async.trainer.auto_threshold`).
AUTO = "auto"


def _sync(reason: str, **kw) -> NoEffect:
    """No effect under ``trainer.v1.trainer_mode`` = sync, for ``reason``."""
    return NoEffect(reason, modes=("sync",), **kw)


def _no_rollout_dump(trainer, root) -> str | None:
    freq = trainer.rollout_data_save_freq
    return f"while `trainer.rollout_data_save_freq` = {freq} (no dump)" if freq <= 0 else None


@dataclass
class SeparateAsyncConfig:
    num_warmup_batches: int = opt(1, "Prompt batches queued before training starts.", ge=0,
                                  no_effect=_sync("sync generates each batch right before training on it, so no batch "
                                                  "is queued ahead"))
    parameter_sync_step: int = opt(1, "Optimizer updates between weight publications.", gt=0,
                                   no_effect=_sync("sync publishes the weights after every update"))
    sync_compatible: bool = opt(False, "Pause rollout while the learner trains.",
                                no_effect=_sync("sync never generates while the learner trains, so there is nothing "
                                                "to pause"))


@dataclass
class CustomSamplerConfig:
    path: Any = opt(None, "Python file defining a custom buffer sampler class.", string=True,
                    no_effect=wait_no_effect("a custom sampler would never be asked",
                                             fix="unset it, or use the drop strategy"))
    name: Any = opt(None, "Class name in that file.", string=True)


def _fixed_threshold(section, root) -> str | None:
    """The condition of the ``auto.*`` refusals: ``max_off_policy_threshold`` is a number."""
    t = root.trainer.v1.sampler.max_off_policy_threshold
    return None if t == AUTO else f"while `trainer.v1.sampler.max_off_policy_threshold` = {t!r} (a fixed number)"


def _preference_trainer(section, root) -> str | None:
    return ("with `algorithm.trainer_type` = direct_preference"
            if root.algorithm.trainer_type == "direct_preference" else None)


#: ``auto.*``: no threshold to tune in sync; nothing tunes a fixed one.
_AUTO_ONLY = (
    _sync("sync trains on-policy (threshold 0), so there is no threshold for `auto` to tune"),
    NoEffect("a fixed threshold is never tuned", modes=("separate_async",), when=_fixed_threshold,
             when_doc="while `trainer.v1.sampler.max_off_policy_threshold` is a number",
             fix="leave it at its default ({default}), or set `trainer.v1.sampler.max_off_policy_threshold` = auto"),
)


@dataclass
class AutoThresholdConfig:
    """``trainer.v1.sampler.auto``: the controller of ``max_off_policy_threshold: auto`` (docs/AUTO_THRESHOLD.md)."""

    min: int = opt(0, "Smallest threshold auto may choose; the run starts at it.", ge=0, no_effect=_AUTO_ONLY)
    max: int = opt(4, "Largest threshold auto may choose.", ge=0, no_effect=_AUTO_ONLY)
    target_mismatch: float = opt(
        1e-3, "Rollout/learner mismatch auto keeps the threshold under: the larger of the window's mean "
        "rollout_corr/kl and the KL its IS effective sample size implies (-ln(rollout_corr/ess)/2). Over it lowers "
        "the threshold; raising needs it under half of it.", gt=0, no_effect=_AUTO_ONLY)
    window: int = opt(4, "Learner updates between two decisions (the signals are averaged over them).", gt=0,
                      no_effect=_AUTO_ONLY)


@dataclass
class V1SamplerConfig:
    max_off_policy_threshold: Any = opt(
        1, "Max version lag of a trained sample (0 = on-policy), or auto: tuned during the run within [auto.min, "
        "auto.max] from the learner's and the rollout's idle time and the rollout/learner mismatch.",
        no_effect=(_sync("sync trains on-policy (threshold 0): every sample is trained by the weights that generated "
                         "it", accept=(0,)),
                   NoEffect("direct-preference losses use no behaviour log-probs, so the rollout/learner mismatch "
                            "that `auto` steers by is never measured", modes=("separate_async",),
                            accept=lambda v: v != AUTO, accept_doc="any number", when=_preference_trainer,
                            when_doc="with `algorithm.trainer_type` = direct_preference",
                            fix="give a number (e.g. 1)")))
    max_off_policy_strategy: str = opt("wait", "wait (admission control) or drop (evict and count).",
                                       choices=("wait", "drop"),
                                       no_effect=_sync("sync trains on-policy (threshold 0), so no sample is ever "
                                                       "stale: there is nothing to wait for or drop"))
    auto: AutoThresholdConfig = field(default_factory=AutoThresholdConfig)
    drop_incomplete_groups: bool = opt(False, "Evict a group with a failed member and refill it.")
    max_incomplete_group_refill_rounds: int = opt(3, "Refill attempts per evicted group.", ge=0)
    custom_sampler: CustomSamplerConfig = field(default_factory=CustomSamplerConfig)
    sampler_kwargs: dict = opt(factory=dict, help="Keyword arguments for the sampler.")

    def validate(self, path: str) -> None:
        t = self.max_off_policy_threshold
        if t == AUTO:
            a = self.auto
            if a.min > a.max:
                raise ValueError(f"`{path}.auto.min` = {a.min} > `{path}.auto.max` = {a.max}: auto would have no "
                                 "threshold to choose; lower auto.min or raise auto.max.")
        elif isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"`{path}.max_off_policy_threshold` = {t!r}: give an integer >= 0 (0 = on-policy) or "
                             f"auto (tuned within [`{path}.auto.min`, `{path}.auto.max`]).")
        cs = self.custom_sampler
        if (cs.path is None) != (cs.name is None):
            raise ValueError(f"`{path}.custom_sampler` needs both path and name (got path={cs.path!r}, "
                             f"name={cs.name!r}).")


@dataclass
class V1Config:
    trainer_mode: str = opt("sync", "sync (generate -> train -> publish) or separate_async.",
                            choices=("sync", "separate_async", "omni_sync"),
                            not_built={"omni_sync": "omni (autoregressive) training is not built yet"})
    separate_async: SeparateAsyncConfig = field(default_factory=SeparateAsyncConfig)
    sampler: V1SamplerConfig = field(default_factory=V1SamplerConfig)


@dataclass
class TrainerConfig:
    project_name: str = opt("omnirl_async", "Project name (log folder).")
    experiment_name: str = opt("default", "Experiment name (log folder).")
    logger: Any = opt(factory=lambda: ["console", "tensorboard"], help="Any of console, tensorboard, wandb.")
    log_dir: Any = opt(None, "TensorBoard folder, and W&B's under it (<log_dir>/wandb; W&B project = project_name, "
                       "run = experiment_name); null = $TENSORBOARD_DIR or "
                       "tensorboard_log/<project_name>/<experiment_name>.")
    device: str = opt("auto", "auto (cuda when available), cpu or cuda.", choices=("auto", "cpu", "cuda"))
    total_epochs: int = opt(100, "Passes over the prompt set.", gt=0)
    total_training_steps: Any = opt(None, "Stop after this many learner steps; null = total_epochs.", gt=0)
    total_time_minutes: Any = opt(None, "Stop after this much training time (minutes of the training loop, "
                                  "counted across resumes); null = no limit.", gt=0)
    save_freq: int = opt(-1, "Checkpoint every N steps; <= 0 only at the end.")
    test_freq: int = opt(-1, "Validate every N steps; <= 0 never during training.")
    val_before_train: bool = opt(False, "Validate once before training.")
    resume_mode: str = opt("auto", "auto (latest checkpoint in default_local_dir), disable (a fresh run: an earlier "
                                   "run's checkpoints there move to default_local_dir/superseded/<time>/), or "
                                   "resume_path.", choices=("auto", "disable", "resume_path"))
    resume_from_path: Any = opt(None, "Checkpoint folder for resume_mode=resume_path.", string=True)
    default_local_dir: str = opt("checkpoints/${trainer.project_name}/${trainer.experiment_name}",
                                 "Where checkpoints go.")
    max_actor_ckpt_to_keep: Any = opt(None, "Keep this many newest checkpoints; null = all.", gt=0)
    rollout_data_save_freq: int = opt(0, "Dump rollout images every N steps; <= 0 never.")
    rollout_data_max_samples: Any = opt(16, "Cap on dumped samples per step.", gt=0,
                                        no_effect=NoEffect("rollout samples are dumped only with "
                                                           "`trainer.rollout_data_save_freq` > 0",
                                                           when=_no_rollout_dump,
                                                           when_doc="while `rollout_data_save_freq` <= 0",
                                                           fix="leave it at its default ({default}), or set "
                                                               "`trainer.rollout_data_save_freq` > 0 (dump every N "
                                                               "steps)"))
    validation_data_max_samples: Any = opt(None, "Cap on dumped validation samples.", gt=0)
    video_fps: int = opt(8, "FPS of dumped videos (VeRL-Omni); this project generates images only.", gt=0,
                         no_effect="this project generates images only (`pipeline.num_frames` = 1), so no video is "
                                   "ever written")
    progress_bar: bool = opt(True, "Show a progress bar on the console.")
    wait_timeout_s: float = opt(600.0, "Longest any blocking wait of the driver (a batch of samples, a "
                                "generation round, weights, a checkpoint quiesce) may take before the job stops "
                                "with a diagnosis of what was awaited.", gt=0)
    use_v1: bool = opt(True, "This project has only the V1 path (transfer queue + replay buffer).",
                       not_built={False: "the legacy v0 trainer does not exist in this project"})
    v1: V1Config = field(default_factory=V1Config)

    def validate(self, path: str) -> None:
        from omnirl_async.metrics.loggers import LOGGERS, wandb_installed, wandb_missing_message

        loggers = [self.logger] if isinstance(self.logger, str) else list(self.logger or [])
        bad = [x for x in loggers if x not in LOGGERS]
        if bad:
            raise ValueError(f"`{path}.logger` = {loggers!r}: unknown logger(s) {bad}; allowed: {list(LOGGERS)}.")
        if "wandb" in loggers and not wandb_installed():
            raise ValueError(wandb_missing_message(loggers).replace("`trainer.logger`", f"`{path}.logger`"))
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ValueError(f"`{path}.resume_mode` = resume_path needs `{path}.resume_from_path`.")


@dataclass
class LearnerConfig:
    num_workers: int = opt(1, "Learner actors forming one torch.distributed group.", gt=0)
    backend: str = opt("auto", "Process-group backend: auto (nccl on GPU, gloo on CPU), gloo or nccl.",
                       choices=("auto", "gloo", "nccl"))
    num_cpus_per_worker: float = opt(1.0, "Ray CPUs reserved per learner.", gt=0)
    num_gpus_per_worker: float = opt(0.0, "Ray GPUs reserved per learner.", ge=0)
    max_consecutive_nonfinite: int = opt(3, "A step whose loss or gradient is NaN/inf is skipped and counted "
                                         "(training/nonfinite_steps); this many in a row stop the job.", gt=0)


@dataclass
class RayKwargsConfig:
    address: Any = opt(None, "Ray cluster to join: auto or host:port (also ray://host:10001); local = always start "
                       "a new one; null = join the cluster that $RAY_ADDRESS, `ray job submit` or a `ray start` on "
                       "this machine names, else start a local one.")
    num_cpus: Any = opt(None, "CPUs of a local Ray this run starts; null = all (at least what the roles ask for). "
                        "Not used when joining a cluster (its nodes' `ray start --num-cpus` set them).", gt=0)
    ray_init: dict = opt(factory=dict, help="Extra keyword arguments for ray.init (start-only ones, such as "
                         "num_cpus, resources or _system_config, are dropped with a note when joining a cluster).")
    role_resources: dict = opt(factory=dict, help="Custom Ray resources each actor of a role asks for, by role "
                               "(learner, rollout, reward, storage = transfer-queue storage units), e.g. {rollout: "
                               "{node2: 1}} runs the rollout workers on nodes started with `ray start "
                               "--resources='{\"node2\": 4}'`. CPUs and GPUs come from the roles' "
                               "num_cpus_per_worker / num_gpus_per_worker.")
    placement_timeout_s: float = opt(300.0, "Longest wait for the cluster to place a role's actors (one placement "
                                     "group per role); then the run stops, naming the role, what it asked for, "
                                     "what each node has and the keys to change. Raise it on an autoscaling "
                                     "cluster.", gt=0)

    def validate(self, path: str) -> None:
        from omnirl_async.placement import check_role_resources

        check_role_resources(self.role_resources, f"{path}.role_resources")
