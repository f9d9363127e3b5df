"""Shared pieces of the direct-preference (flow-matching) losses.

The learner draws per sample a sigma ``t`` in (0, 1) and fresh noise ``eps``
and evaluates the velocities at ``x_t = (1-t)*x0 + t*eps``; the flow-matching
target velocity is ``eps - x0`` and a velocity ``v`` predicts the clean latent
``x0_hat = x_t - t*v``. These helpers check the shapes of that contract and
broadcast ``t`` over the latent dims.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["compute_dtype", "check_velocity_inputs", "expand_t", "noisy_latent", "target_velocity"]


def compute_dtype(v: torch.Tensor) -> torch.dtype:
    """Arithmetic dtype: at least fp32 (bf16/fp16 velocities are promoted), fp64 stays fp64."""
    return torch.promote_types(v.dtype, torch.float32)


def check_velocity_inputs(loss_name: str, model_output: Mapping, data: Mapping,
                          mo_keys: tuple[str, ...], data_keys: tuple[str, ...] = ("x0", "eps")) -> None:
    """Every named ``[B, ...]`` tensor has the shape of ``model_output['v']``; ``data['t']`` is ``[B]``."""
    v = model_output["v"]
    if v.ndim < 1:
        raise ValueError(f"loss {loss_name!r}: `model_output['v']` must be [B, ...], got a scalar.")
    for where, keys, d in (("model_output", mo_keys, model_output), ("data", data_keys, data)):
        for k in keys:
            if d[k].shape != v.shape:
                raise ValueError(f"loss {loss_name!r}: `{where}[{k!r}]` shape {tuple(d[k].shape)} != "
                                 f"`model_output['v']` shape {tuple(v.shape)}; all velocities and latents "
                                 "of one step share [B, *latent].")
    t = data["t"]
    if t.shape != (v.shape[0],):
        raise ValueError(f"loss {loss_name!r}: `data['t']` shape {tuple(t.shape)} must be [B] = "
                         f"({v.shape[0]},): one sigma per sample.")


def expand_t(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t [B]`` reshaped to ``[B, 1, ..., 1]`` to broadcast against ``like [B, ...]``."""
    return t.detach().to(like.dtype).reshape(-1, *([1] * (like.ndim - 1)))


def noisy_latent(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Forward process ``x_t = (1-t)*x0 + t*eps`` (``t`` is ``[B]``)."""
    tb = expand_t(t, x0)
    return (1.0 - tb) * x0 + tb * eps


def target_velocity(x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """Flow-matching target ``eps - x0``."""
    return eps - x0
