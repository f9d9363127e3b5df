"""The time and payload model of ``bench_scale.py``: what a real job's stages take and weigh, with sources.

:class:`TimeModel` holds the modelled durations (model seconds) and the batch shape, and computes the ideal
overlap bound the simulation is measured against; :class:`PayloadModel` the bytes of one stored sample and of one
published LoRA; :class:`SimSpec` bundles both with the run's compression and the worker protocol knobs (it is
sent to every simulated-worker actor, so ``bench_scale.py`` registers this module to be pickled by value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["MiB", "TimeModel", "PayloadModel", "SimSpec"]

MiB = 1024**2


@dataclass(frozen=True)
class TimeModel:
    """Durations in model seconds (what the real job would take), and the batch shape.

    Sources ("public reports") and assumptions:

    * group size 16, 32 prompt groups per learner step (512 images per step): the batch of VeRL-Omni's
      FlowGRPO reference runs (verl-omni.readthedocs.io, "Performance Reference": "Training images per
      step = batch size x images per prompt = 32 x 16 = 512"). The same page reports 420 s per step for a
      synchronous LoRA run of Qwen-Image on 4 H800 GPUs (0.305 images/GPU/s), i.e. ~3.3 GPU-seconds per
      trained image for rollout and update together; the split below stays within that total.
    * 10 denoising steps per rollout and an SDE window of 3 trained steps: Flow-GRPO's public configs
      (github.com/yifan123/flow_grpo, config/grpo.py: ``sample.num_steps = 10``, fast variants
      ``sde_window_size = 3``); those configs train SD3.5-Medium at 512 px with groups of 24.
    * ``gen_s`` = 24 s per group of 16 images at 1024 px on one GPU (1.5 s per image): an ASSUMPTION, from
      a FLOP estimate for a ~2.5 B-parameter MMDiT at 4096 image tokens, 10 steps with CFG, plus VAE decode;
      not a measured figure. Jitter lognormal, sigma 0.10 (ASSUMPTION).
    * ``reward_median_s`` = 2 s per group from a remote scorer with a long tail, lognormal sigma 1.0
      (p99 ~ 20 s): an ASSUMPTION (no public latency distribution found).
    * ``update_s`` = 60 s per learner step of 512 samples on 8 GPUs (~0.94 GPU-s per image for 3 trained
      steps with a proximal recompute): an ASSUMPTION, within the 3.3 GPU-s per image total above.
    """

    group_size: int = 16
    batch_groups: int = 32
    gen_s: float = 24.0
    gen_sigma: float = 0.10
    reward_median_s: float = 2.0
    reward_sigma: float = 1.0
    update_s: float = 60.0
    update_sigma: float = 0.03
    scoring_threads: int = 4  # RolloutWorker.max_inflight_scores: groups scored while the next one is sampled

    # ---- expectations
    def reward_mean_s(self) -> float:
        return self.reward_median_s * math.exp(self.reward_sigma ** 2 / 2)

    def worker_group_s(self) -> float:
        """Model seconds per group of one worker in steady state: sampling, unless scoring is the slower stage."""
        return max(self.gen_s, self.reward_mean_s() / self.scoring_threads)

    def capacity(self, workers: int) -> float:
        """Samples per model second that ``workers`` rollout workers can generate."""
        return workers * self.group_size / self.worker_group_s()

    def demand(self) -> float:
        """Samples per model second the learner can train."""
        return self.batch_groups * self.group_size / self.update_s

    def ideal(self, workers: int) -> float:
        """The ideal overlap bound: rollout and learning fully overlapped, no control-plane cost."""
        return min(self.capacity(workers), self.demand())

    def learner_bound(self, workers: int) -> bool:
        return self.capacity(workers) > self.demand()

    def step_s(self, workers: int) -> float:
        """Model seconds per learner step at the ideal bound."""
        return self.batch_groups * self.group_size / self.ideal(workers)

    # ---- draws (mean-preserving lognormal jitter for the GPU stages, median-anchored for the scorer)
    def draw_gen(self, rng: np.random.Generator) -> float:
        return self.gen_s * float(rng.lognormal(-self.gen_sigma ** 2 / 2, self.gen_sigma))

    def draw_reward(self, rng: np.random.Generator) -> float:
        return self.reward_median_s * float(rng.lognormal(0.0, self.reward_sigma))

    def draw_update(self, rng: np.random.Generator) -> float:
        return self.update_s * float(rng.lognormal(-self.update_sigma ** 2 / 2, self.update_sigma))


@dataclass(frozen=True)
class PayloadModel:
    """Bytes of one sample as this project's rollout worker stores it (``RolloutBatch.to_fields`` plus the
    prompt embeddings, float32), for a 1024 px SD3.5-class model, and of one published LoRA.

    Shapes: SD3's VAE has 16 latent channels at 1/8 resolution; its pipelines concatenate 77 CLIP tokens
    and ``max_sequence_length`` = 256 T5 tokens of width 4096 (diffusers' default), pooled width 2048.
    LoRA: rank 32 on the 8 attention projections of each of 24 blocks of width 1536 (SD3.5-Medium-like);
    the rank and targets are an ASSUMPTION.
    """

    resolution: int = 1024
    latent_channels: int = 16
    vae_factor: int = 8
    trained_steps: int = 3
    text_tokens: int = 77 + 256
    text_dim: int = 4096
    pooled_dim: int = 2048
    lora_rank: int = 32
    lora_blocks: int = 24
    lora_projections: int = 8
    lora_width: int = 1536

    def fields(self) -> dict[str, tuple[int, np.dtype]]:
        """Field -> (elements per sample, dtype) at full size."""
        lat = self.latent_channels * (self.resolution // self.vae_factor) ** 2
        k = self.trained_steps
        f32 = np.dtype(np.float32)
        return {"images": (self.resolution ** 2 * 3, np.dtype(np.uint8)), "latents": (k * lat, f32),
                "next_latents": (k * lat, f32), "means": (k * lat, f32), "log_probs": (k, f32),
                "sigmas": (k, f32), "sigmas_next": (k, f32), "step_indices": (k, np.dtype(np.int64)),
                "emb.prompt_embeds": (self.text_tokens * self.text_dim, f32),
                "emb.pooled_prompt_embeds": (self.pooled_dim, f32)}

    def sample_bytes(self) -> int:
        return sum(n * dt.itemsize for n, dt in self.fields().values())

    def lora_tensors(self) -> int:
        return 2 * self.lora_blocks * self.lora_projections  # A and B of each adapted projection

    def lora_params(self) -> int:
        return self.lora_blocks * self.lora_projections * self.lora_rank * 2 * self.lora_width

    def lora_bytes(self) -> int:
        return 4 * self.lora_params()


@dataclass(frozen=True)
class SimSpec:
    """Everything a stand-in needs in its actor: the models, the compression and the worker protocol knobs."""

    time: TimeModel = field(default_factory=TimeModel)
    payload: PayloadModel = field(default_factory=PayloadModel)
    time_scale: float = 20.0
    payload_scale: float = 1 / 20
    poll_s: float = 0.02  # RolloutWorker.run_loop's default: sleep after a lease that admission refused
    lease_wait_s: float = 2.0  # RolloutWorker.run_loop's default: a refused lease waits this long in the dispatcher
    sample_ahead: bool = True  # SeparateAsyncTrainer's default: sample the next batch while an update runs
    land: bool = False  # take the next batch's groups as they land (SeparateAsyncTrainer.land_every_s; off by default)
    back_to_back: bool = True  # SeparateAsyncTrainer's default: start the next update as soon as one ends (staged)
    seed: int = 0

    def real(self, model_s: float) -> float:
        return model_s / self.time_scale

    def group_payload(self, n: int, fill: int) -> dict[str, np.ndarray]:
        """The arrays of one group at ``payload_scale`` of the modelled size (flattened per sample)."""
        out = {}
        for name, (elems, dtype) in self.payload.fields().items():
            k = elems if elems < 1024 else max(1, int(elems * self.payload_scale))
            out[name] = np.full((n, k), fill % 251, dtype=dtype)
        return out

    def weights(self, version: int) -> dict[str, np.ndarray]:
        """One LoRA state at ``payload_scale`` of its modelled size, as many tensors as the real one."""
        count = self.payload.lora_tensors()
        per = max(1, int(self.payload.lora_params() * self.payload_scale / count))
        return {f"lora.{i}": np.full(per, float(version), np.float32) for i in range(count)}
