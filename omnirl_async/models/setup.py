"""Model set-up shared by every process that holds a policy: the device and the policy with its adapter.

:func:`build_policy` is what rollout workers, learners, ``omnirl-async eval``
and the benchmarks call to turn ``actor_rollout_ref.model`` into a
:class:`~omnirl_async.models.policy.FlowMatchPolicy` on a device; every process
gets the same initial LoRA adapter for the same seed.
"""

from __future__ import annotations

import torch

from omnirl_async.models.policy import FlowMatchPolicy
from omnirl_async.models.resolve import resolve_model_path

__all__ = ["build_policy", "pick_device", "quiet_hf_logging"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def pick_device(name: str) -> torch.device:
    """``trainer.device``: ``auto`` (CUDA when visible, else CPU), ``cuda`` (refused without one) or any torch name."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("`trainer.device` = 'cuda' but no CUDA device is visible; use auto or cpu.")
    return torch.device(name)


def quiet_hf_logging() -> None:
    """Silence per-component loading bars and warnings in worker logs."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def build_policy(model_cfg, device: torch.device, *, seed: int = 0) -> FlowMatchPolicy:
    """Load the pipeline and wrap it with LoRA as ``actor_rollout_ref.model`` says.

    The LoRA init draws from a generator seeded with ``seed`` (and leaves the
    global RNG as it was), so every process builds the same initial adapter.
    """
    quiet_hf_logging()
    policy = FlowMatchPolicy.from_pretrained(resolve_model_path(model_cfg.path),
                                             transformer_subfolder=model_cfg.transformer_subfolder,
                                             device=device, dtype=_DTYPES[model_cfg.dtype])
    # rank 0 (without an adapter path) makes the whole transformer trainable
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _add_lora(policy, model_cfg)
    if model_cfg.enable_gradient_checkpointing and hasattr(policy.transformer, "enable_gradient_checkpointing"):
        policy.transformer.enable_gradient_checkpointing()
    return policy


def _add_lora(policy: FlowMatchPolicy, model_cfg) -> None:
    policy.add_lora(rank=model_cfg.lora_rank, alpha=model_cfg.lora_alpha,
                    init_weights=model_cfg.lora_init_weights, target_modules=model_cfg.target_modules,
                    exclude_modules=model_cfg.exclude_modules, adapter_path=model_cfg.lora_adapter_path,
                    lora_dtype=model_cfg.lora_dtype)
