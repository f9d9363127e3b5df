"""Built-in image rewards that need no model.

* ``jpeg_incompressibility`` – JPEG size in kB (quality 95): rewards detail.
* ``jpeg_compressibility`` – minus that size: rewards flat, simple images.
  These are the aesthetic-free sanity tasks of DDPO and Flow-GRPO: cheap,
  deterministic, and easy to push, so they show whether RL moves anything.
* ``brightness`` – mean pixel value / 255, in [0, 1].

"kB" is 1000 bytes, so ``jpeg_incompressibility`` of a 512×512 photo is in the
tens and of a 32×32 image around one.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from omnirl_async.rewards.base import register_reward

__all__ = ["jpeg_size_kb", "jpeg_compressibility", "jpeg_incompressibility", "brightness"]


def _check_images(images) -> np.ndarray:
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(
            f"`images` must be uint8 [B, H, W, 3], got {images.dtype} {tuple(images.shape)}"
        )
    return images


def jpeg_size_kb(images: np.ndarray, quality: int = 95) -> np.ndarray:
    """JPEG-encoded size of each image in kB (1000 bytes), ``float32 [B]``."""
    images = _check_images(images)
    out = np.empty(len(images), dtype=np.float32)
    for i, img in enumerate(images):
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=int(quality))
        out[i] = buf.tell() / 1000.0
    return out


@register_reward("jpeg_incompressibility")
def jpeg_incompressibility(images: np.ndarray, prompts: list[str], quality: int = 95, **_) -> np.ndarray:
    """Positive JPEG size in kB: larger files (more detail) score higher."""
    return jpeg_size_kb(images, quality)


@register_reward("jpeg_compressibility")
def jpeg_compressibility(images: np.ndarray, prompts: list[str], quality: int = 95, **_) -> np.ndarray:
    """Negative JPEG size in kB: smaller files (simpler images) score higher."""
    return -jpeg_size_kb(images, quality)


@register_reward("brightness")
def brightness(images: np.ndarray, prompts: list[str], **_) -> np.ndarray:
    """Mean pixel value over H, W and channels, divided by 255."""
    images = _check_images(images)
    return (images.reshape(len(images), -1).mean(axis=1, dtype=np.float64) / 255.0).astype(np.float32)
