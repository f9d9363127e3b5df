"""Images -> latents with the policy's VAE: the inverse of ``FlowMatchPolicy.decode``.

The learner's direct-preference losses train on ``x0``, the clean latents in
the transformer's layout that a rollout ends with (``RolloutBatch.x0``): SD3
``[C, h, w]``, Flux packed ``[(h/2)(w/2), 4C]``, fp32, VAE-normalised
(``(z - shift_factor) * scaling_factor``). :func:`encode_images` maps
``uint8 [B, H, W, 3]`` images to exactly that layout, so that offline images
and online samples look alike to the learner; ``policy.decode`` of the result
gives the images back up to the VAE's reconstruction error. The VAE's
posterior mean is used (no sampling), so encoding is deterministic.

:func:`folder_latent_shape` gives one sample's latent shape from a pipeline
folder's JSON configs without loading any weight (the dataset checks run
before the model is loaded).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from omnirl_async.models.policy import SUPPORTED_PIPELINES, FlowMatchPolicy

__all__ = ["encode_images", "latent_shape", "folder_latent_shape"]


def latent_shape(policy: FlowMatchPolicy, height: int, width: int) -> tuple[int, ...]:
    """One sample's latent shape (model layout) for ``height`` x ``width`` images."""
    h, w = policy.latent_grid(height, width)
    c = policy.latent_channels
    return (c, h, w) if policy.family == "sd3" else ((h // 2) * (w // 2), 4 * c)


def folder_latent_shape(folder: str | Path, height: int, width: int,
                        transformer_subfolder: str = "transformer") -> tuple[str, tuple[int, ...]]:
    """``(family, one sample's latent shape)`` of the pipeline folder ``folder``, from its configs only.

    ``ValueError`` when ``height`` / ``width`` are not multiples of the model's latent step.
    """
    folder = Path(folder)
    index = json.loads((folder / "model_index.json").read_text())
    family = SUPPORTED_PIPELINES.get(index.get("_class_name"))
    if family is None:
        raise ValueError(f"{folder} holds a {index.get('_class_name')!r} pipeline; supported pipeline classes are "
                         f"{sorted(SUPPORTED_PIPELINES)}.")
    vae = json.loads((folder / "vae" / "config.json").read_text())
    transformer = json.loads((folder / transformer_subfolder / "config.json").read_text())
    scale = 2 ** (len(vae["block_out_channels"]) - 1)
    patch = int(transformer.get("patch_size", 2)) if family == "sd3" else 2
    for name, value in (("height", height), ("width", width)):
        if int(value) <= 0 or int(value) % (scale * patch):
            raise ValueError(f"`actor_rollout_ref.rollout.pipeline.{name}` = {value!r} must be a positive multiple "
                             f"of {scale * patch} for this {family} model (VAE scale {scale} x patch {patch}).")
    c, h, w = int(vae["latent_channels"]), int(height) // scale, int(width) // scale
    return family, ((c, h, w) if family == "sd3" else ((h // 2) * (w // 2), 4 * c))


@torch.no_grad()
def encode_images(policy: FlowMatchPolicy, images: np.ndarray, *, batch_size: int = 16) -> torch.Tensor:
    """``uint8 [B, H, W, 3]`` images -> fp32 latents ``[B, *latent]`` in the model layout, on the CPU.

    Runs the VAE encoder in batches of ``batch_size`` with no gradient, in the VAE's dtype and device.
    """
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"`images` must be uint8 [B, H, W, 3], got {images.dtype} {tuple(images.shape)}.")
    height, width = int(images.shape[1]), int(images.shape[2])
    policy.latent_grid(height, width)  # validates the size
    vae, cfg = policy.vae, policy.vae.config
    shift = cfg.shift_factor or 0.0
    out = []
    for lo in range(0, len(images), max(int(batch_size), 1)):
        x = torch.from_numpy(np.ascontiguousarray(images[lo:lo + batch_size])).permute(0, 3, 1, 2).float()
        x = (x / 127.5 - 1.0).to(vae.device, vae.dtype)
        z = vae.encode(x).latent_dist.mode()
        z = ((z.float() - shift) * cfg.scaling_factor).cpu()
        out.append(policy.pack(z) if policy.family == "flux" else z)
    if not out:
        return torch.zeros((0, *latent_shape(policy, height, width)), dtype=torch.float32)
    return torch.cat(out).contiguous()
