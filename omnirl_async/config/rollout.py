"""`actor_rollout_ref.rollout.*`: how rollout workers generate trajectories."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnirl_async.config.fields import NoEffect, opt, section

__all__ = ["DiffusionPipelineConfig", "DiffusionRolloutAlgoConfig", "ValKwargsConfig", "DiffusionRolloutConfig"]


@dataclass
class DiffusionPipelineConfig:
    height: int = opt(32, "Image height in pixels.", gt=0)
    width: int = opt(32, "Image width in pixels.", gt=0)
    num_inference_steps: int = opt(10, "Denoising steps during generation.", gt=0)
    true_cfg_scale: float = opt(1.0, "True classifier-free guidance; > 1 uses negative_prompt.", ge=1.0)
    negative_prompt: str = opt("", "Negative prompt for true CFG.")
    max_sequence_length: int = opt(77, "Max text-encoder tokens.", gt=0)
    guidance_scale: Any = opt(None, "Distilled guidance for models with guidance embeddings (Flux-dev); null disables.", gt=0)
    num_frames: int = opt(1, "Video frames; image models keep 1.", ge=1,
                          no_effect="video generation is not built yet")
    output_type: str = opt("image", "Output modality.", choices=("image",))


@dataclass
class DiffusionRolloutAlgoConfig:
    noise_level: float = opt(0.7, "SDE noise level a inside the window (Flow-GRPO: 0.7; cps: 0.8; dance: eta 0.3; "
                             "the sde_type presets set the latter two unless you set it).", ge=0)
    sde_type: str = opt("sde", "SDE variant: sde, cps (unscaled log-probs: its preset sets clip_ratio 1e-5 and "
                        "noise_level 0.8) or dance (preset: noise_level 0.3); the presets apply with the "
                        "policy-gradient trainer type, to keys you do not set.",
                        choices=("sde", "cps", "dance"))
    sde_window_size: Any = opt(None, "SDE window length in steps; null = every step.", gt=0)
    sde_window_range: Any = opt(None, "[start, end) envelope for the window start; null = whole trajectory.")
    sample_strategy: str = opt("random", "Window placement: random or progressive (MixGRPO).",
                               choices=("random", "progressive"))
    iters_per_group: int = opt(1, "Iterations per progressive window position.", gt=0)
    sde_window_seed: int = opt(0, "Base seed of random window draws.")

    def validate(self, path: str) -> None:
        r = self.sde_window_range
        if r is not None:
            if len(r) != 2 or not all(isinstance(v, int) for v in r) or not 0 <= r[0] < r[1]:
                raise ValueError(f"`{path}.sde_window_range` = {list(r)!r}: expected [start, end) with 0 <= start < end.")
            if self.sde_window_size is not None and self.sde_window_size > r[1] - r[0]:
                raise ValueError(f"`{path}.sde_window_size` = {self.sde_window_size} does not fit in "
                                 f"sde_window_range {list(r)!r}.")


#: Validation (models/evaluate.py: evaluate_policy -> sample_with_logprob without a window) takes every
#: denoising step with ``val_kwargs.algo.noise_level``: 0 (the default) is the deterministic Euler (ODE) step.
_VAL_NO_WINDOW = ("validation denoises every step alike with `val_kwargs.algo.noise_level` (0 = the ODE) and never "
                  "uses an SDE window, so nothing reads it")


def _val_ode(algo, root) -> str | None:
    return "while `actor_rollout_ref.rollout.val_kwargs.algo.noise_level` = 0" if algo.noise_level == 0 else None


@dataclass
class ValKwargsConfig:
    n: int = opt(1, "Generations per prompt during validation.", gt=0)
    pipeline: DiffusionPipelineConfig = field(default_factory=DiffusionPipelineConfig)
    algo: DiffusionRolloutAlgoConfig = section(
        lambda: DiffusionRolloutAlgoConfig(noise_level=0.0),
        no_effect_below={
            **{key: _VAL_NO_WINDOW for key in ("sde_window_size", "sde_window_range", "sde_window_seed",
                                               "sample_strategy", "iters_per_group")},
            "sde_type": NoEffect("with noise level 0 every SDE variant takes the same deterministic Euler (ODE) step",
                                 when=_val_ode, when_doc="while `val_kwargs.algo.noise_level` = 0 (the default)",
                                 fix="leave it at its default ('sde'), or set a noise_level > 0"),
        })


@dataclass
class DiffusionRolloutConfig:
    name: str = opt("hf", "Rollout backend: hf (diffusers components in the worker) or vllm_omni (GPU only).",
                    choices=("hf", "vllm_omni"),
                    not_built={"vllm_omni": "the vLLM-Omni backend is not built yet; it also needs `pip install "
                               "omnirl-async[vllm]` on a GPU machine. Use hf"})
    mode: str = opt("async", "Kept for compatibility; must be async.", choices=("async",))
    n: int = opt(4, "Samples per prompt (GRPO group size).", gt=0)
    seed: Any = opt(42, "Base seed; per step the seed is seed + global_step - 1; null disables seeding.")
    num_workers: int = opt(2, "Rollout worker actors.", gt=0)
    micro_batch_size: Any = opt(None, "Samples per generation forward; null = one whole group (n) at a time.",
                                gt=0)
    calculate_log_probs: bool = opt(True, "Record behaviour log-probs (policy gradient needs them).",
                                    not_built={False: "policy-gradient training needs behaviour log-probs; "
                                               "keep calculate_log_probs=true"})
    rollout_adapter: str = opt("default", "Adapter rollouts generate with: default (the trained policy) or old "
                               "(DiffusionNFT's EMA policy; needs policy_state_adapters=[default,old]).",
                               choices=("default", "old"))
    num_cpus_per_worker: float = opt(1.0, "Ray CPUs reserved per rollout worker.", gt=0)
    num_gpus_per_worker: float = opt(0.0, "Ray GPUs reserved per rollout worker.", ge=0)
    nice: int = opt(0, "CPU niceness added to every rollout worker process (0-19). When workers and learners "
                       "share CPU cores, a positive value keeps the learner - the critical path of separate_async "
                       "- at full speed while workers use the cycles left over. When omnirl-async starts Ray "
                       "itself it then starts Ray's workers at niceness 0 instead of Ray's 15; on a cluster you "
                       "start, set RAY_worker_niceness=0 for the same effect.", ge=0, le=19)
    pipeline: DiffusionPipelineConfig = field(default_factory=DiffusionPipelineConfig)
    algo: DiffusionRolloutAlgoConfig = field(default_factory=DiffusionRolloutAlgoConfig)
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
