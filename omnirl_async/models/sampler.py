"""The rollout denoising loop, written out so that per-step log-probs stay visible.

One call generates a batch of trajectories with a :class:`FlowMatchPolicy`:

1. draw the initial noise x_1 (seeded per sample),
2. walk the shifted sigma grid s_0 = 1 > s_1 > ... > s_N = 0,
3. inside the SDE window take a stochastic step and record what the learner
   needs to recompute its log-prob (x, x', log p, mean, sigma, sigma_next);
   outside it take the deterministic Euler (ODE) step,
4. decode the final latents to uint8 images.

Only window steps are stored and trained (Flow-GRPO-Fast / MixGRPO). Without a
window every step is an SDE step, as in Flow-GRPO.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from omnirl_async.models.sde import euler_step, sde_step_with_logprob

__all__ = ["RolloutBatch", "sample_with_logprob", "make_generators"]


@dataclass
class RolloutBatch:
    """Trajectories of one generation call; every tensor is batch-first, on CPU, fp32.

    ``latents[:, j]`` is the state before trained step j and ``next_latents[:, j]``
    the state after it; ``sigmas[:, j] > sigmas_next[:, j]`` are the noise levels
    of that step; ``step_indices[j]`` is its position in the full grid.
    """

    images: np.ndarray  # uint8 [B, H, W, 3]
    latents: torch.Tensor  # [B, T, *latent]
    next_latents: torch.Tensor  # [B, T, *latent]
    log_probs: torch.Tensor  # [B, T]
    means: torch.Tensor  # [B, T, *latent]
    sigmas: torch.Tensor  # [B, T]
    sigmas_next: torch.Tensor  # [B, T]
    step_indices: np.ndarray  # int64 [T]
    x0: torch.Tensor | None = None  # [B, *latent]: the final (clean) latents, model layout

    def to_fields(self, *, trajectory: bool = True) -> dict[str, np.ndarray]:
        """What a sample carries: the trained steps (policy gradient), or only the clean latents
        ``x0`` (direct preference: its losses re-noise ``x0`` themselves). Images always (the reward reads them)."""
        if not trajectory:
            if self.x0 is None:
                raise ValueError("this RolloutBatch has no `x0`: generate with `sample_with_logprob(...)`.")
            return {"images": self.images, "x0": self.x0.numpy()}
        return {
            "images": self.images,
            "latents": self.latents.numpy(),
            "next_latents": self.next_latents.numpy(),
            "log_probs": self.log_probs.numpy(),
            "means": self.means.numpy(),
            "sigmas": self.sigmas.numpy(),
            "sigmas_next": self.sigmas_next.numpy(),
            "step_indices": np.broadcast_to(self.step_indices, (len(self.images), len(self.step_indices))).copy(),
        }


def make_generators(seeds: list[int | None], device: str | torch.device = "cpu") -> list[torch.Generator | None]:
    """One generator per sample, so a sample's noise depends only on its own seed."""
    gens = []
    for s in seeds:
        if s is None:
            gens.append(None)
        else:
            g = torch.Generator(device=device)
            g.manual_seed(int(s))
            gens.append(g)
    return gens


def _per_sample_randn(shape_one: tuple[int, ...], generators: list[torch.Generator | None],
                      device) -> torch.Tensor:
    return torch.stack([torch.randn(shape_one, generator=g, device=device) for g in generators])


@torch.no_grad()
def sample_with_logprob(policy, embeds, *, seeds: list[int | None], height: int, width: int,
                        num_inference_steps: int, noise_level: float, sde_type: str = "sde",
                        window: tuple[int, int] | None = None, true_cfg_scale: float = 1.0,
                        guidance_scale: float | None = None, shared_noise_groups: list[int] | None = None,
                        keep_trajectory: bool = True) -> RolloutBatch:
    """Generate ``len(seeds)`` trajectories conditioned on ``embeds`` (one row per sample).

    ``window=(start, end)`` limits SDE steps (and stored steps) to ``start <= i < end``.
    ``shared_noise_groups`` gives each sample a group id; samples of a group then start
    from the same initial noise (DanceGRPO), drawn from the first member's seed.
    ``keep_trajectory=False`` stores no step (the returned step tensors have T = 0);
    ``x0`` (the final latents) is always returned.
    """
    batch = len(seeds)
    device = policy.device
    gens = make_generators(seeds, device)
    # 1. initial noise, one generator per sample
    first = policy.prepare_latents(1, height, width, gens[0])
    latent_shape = tuple(first.shape[1:])
    x = torch.cat([first, _per_sample_randn(latent_shape, gens[1:], device)]) if batch > 1 else first
    if shared_noise_groups is not None:
        leader: dict[int, int] = {}
        for i, gid in enumerate(shared_noise_groups):
            x[i] = x[leader.setdefault(gid, i)]
    sigmas = policy.make_sigmas(num_inference_steps, height, width).to(device=device, dtype=torch.float32)
    start, end = window if window is not None else (0, num_inference_steps)
    if not 0 <= start < end <= num_inference_steps:
        raise ValueError(f"`window` = {window!r} must satisfy 0 <= start < end <= {num_inference_steps}.")

    stored: dict[str, list[torch.Tensor]] = {k: [] for k in ("x", "x_next", "logp", "mean", "s", "s_next")}
    # 2.-3. the denoising loop
    for i in range(num_inference_steps):
        s, s_next = sigmas[i], sigmas[i + 1]
        s_b = s.expand(batch)
        v = policy.predict_velocity(x, s_b, embeds, true_cfg_scale=true_cfg_scale,
                                    guidance_scale=guidance_scale).float()
        if start <= i < end:
            noise = _per_sample_randn(latent_shape, gens, device) if gens[0] is not None else None
            out = sde_step_with_logprob(v, s_b, s_next.expand(batch), x.float(), noise_level=noise_level,
                                        sde_type=sde_type, noise=noise)
            if not keep_trajectory:
                x = out.prev_sample.to(x.dtype)
                continue
            stored["x"].append(x.float().cpu())
            stored["x_next"].append(out.prev_sample.cpu())
            stored["logp"].append(out.log_prob.cpu())
            stored["mean"].append(out.mean.cpu())
            stored["s"].append(s_b.cpu())
            stored["s_next"].append(s_next.expand(batch).cpu())
            x = out.prev_sample.to(x.dtype)
        else:
            x = euler_step(v, s_b, s_next.expand(batch), x.float()).to(x.dtype)

    # 4. decode
    images = policy.decode(x, height, width)
    if not keep_trajectory:
        empty = torch.zeros(batch, 0, *latent_shape)
        flat = torch.zeros(batch, 0)
        return RolloutBatch(images=images, latents=empty, next_latents=empty, log_probs=flat, means=empty,
                            sigmas=flat, sigmas_next=flat, step_indices=np.zeros(0, dtype=np.int64),
                            x0=x.float().cpu())
    return RolloutBatch(
        images=images,
        latents=torch.stack(stored["x"], 1),
        next_latents=torch.stack(stored["x_next"], 1),
        log_probs=torch.stack(stored["logp"], 1),
        means=torch.stack(stored["mean"], 1),
        sigmas=torch.stack(stored["s"], 1),
        sigmas_next=torch.stack(stored["s_next"], 1),
        step_indices=np.arange(start, end, dtype=np.int64),
        x0=x.float().cpu(),
    )
