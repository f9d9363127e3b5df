"""Model set-up shared by every process that holds a policy: the device and the policy with its adapter.

:func:`build_policy` is what rollout workers, learners, ``omnirl-async eval``
and the benchmarks call to turn ``actor_rollout_ref.model`` into a
:class:`~omnirl_async.models.policy.FlowMatchPolicy` on a device; every process
gets the same initial LoRA adapter for the same seed.

:func:`build_teacher` loads the distillation teacher
(``actor_rollout_ref.actor.distill_teacher_path``) through the same loading code,
frozen and without LoRA, with the policy's dtype. :func:`latent_signature`
(of a loaded policy) and :func:`folder_latent_signature` (of a pipeline folder,
from its JSON configs only) describe what a teacher must share with the policy
to be run on the policy's latents and prompt embeddings;
:func:`signature_mismatches` names the differences. The driver's preflight
compares the folders before Ray starts, the learner the loaded models.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from omnirl_async.models.policy import SUPPORTED_PIPELINES, FlowMatchPolicy
from omnirl_async.models.resolve import EMBEDDED_MODELS, resolve_model_path

__all__ = ["build_policy", "build_teacher", "resolve_teacher_path", "pick_device", "quiet_hf_logging",
           "latent_signature", "folder_latent_signature", "signature_mismatches", "teacher_mismatch_message",
           "TEACHER_KEY"]

#: The config key of the distillation teacher's pipeline.
TEACHER_KEY = "actor_rollout_ref.actor.distill_teacher_path"

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
    policy = _load(resolve_model_path(model_cfg.path), model_cfg.transformer_subfolder, device, model_cfg.dtype)
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


def _load(folder: Path, transformer_subfolder: str, device: torch.device, dtype: str) -> FlowMatchPolicy:
    """The frozen pipeline at ``folder`` (every parameter ``requires_grad=False``)."""
    quiet_hf_logging()
    return FlowMatchPolicy.from_pretrained(folder, transformer_subfolder=transformer_subfolder, device=device,
                                           dtype=_DTYPES[dtype])


# --------------------------------------------------------------------------- distillation teacher
_TEACHER_FIX = ("set it to a local diffusers pipeline folder (model_index.json inside) or an embedded model such as "
                "embedded:tiny-sd3 whose latents match the policy's, or set "
                "`actor_rollout_ref.actor.use_distill_loss=false`")


def resolve_teacher_path(path: Any, *, key: str = TEACHER_KEY) -> Path:
    """The local folder of the teacher ``path`` (``embedded:<name>`` or a folder); errors name ``key``."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"`{key}` = {path!r}: expected a pipeline folder or an embedded model; {_TEACHER_FIX}.")
    if path.startswith("embedded:"):
        name = path.split(":", 1)[1]
        if name not in EMBEDDED_MODELS:
            raise ValueError(f"`{key}` = {path!r}: unknown embedded model {name!r}; choose one of "
                             f"{['embedded:' + m for m in EMBEDDED_MODELS]}, or give a local diffusers pipeline "
                             "folder.")
        return resolve_model_path(path)
    folder = Path(path).expanduser()
    if not (folder / "model_index.json").is_file():
        raise FileNotFoundError(f"`{key}` = {path!r} is not a diffusers pipeline folder (no model_index.json "
                                f"there); {_TEACHER_FIX}.")
    return folder.resolve()


def build_teacher(path: str, model_cfg, device: torch.device, *, key: str = TEACHER_KEY,
                  policy: FlowMatchPolicy | None = None) -> FlowMatchPolicy:
    """Load the distillation teacher at ``path``: frozen, no LoRA, ``model_cfg.dtype``, on ``device``.

    With ``policy`` given, a teacher whose latents or prompt-embedding widths differ from the policy's is
    refused (:func:`signature_mismatches`), naming ``key``.
    """
    folder = resolve_teacher_path(path, key=key)
    try:
        teacher = _load(folder, "transformer", device, model_cfg.dtype)
    except Exception as err:  # noqa: BLE001 - any loading failure is the teacher path's problem
        raise RuntimeError(f"`{key}` = {path!r}: the teacher pipeline at {folder} does not load "
                           f"({type(err).__name__}: {err}); {_TEACHER_FIX}.") from err
    if policy is not None:
        diffs = signature_mismatches(latent_signature(policy), latent_signature(teacher))
        if diffs:
            raise ValueError(teacher_mismatch_message(path, model_cfg.path, diffs, key=key))
    return teacher


def teacher_mismatch_message(path: Any, policy_path: Any, diffs: list[str], *, key: str = TEACHER_KEY) -> str:
    return (f"`{key}` = {path!r}: the teacher cannot be run on the policy's latents and prompt embeddings "
            f"(`actor_rollout_ref.model.path` = {policy_path!r}): {'; '.join(diffs)}. Use a teacher of the same "
            "family with the same latent channels, VAE scale, patch size and text-embedding widths (e.g. a larger "
            "or differently trained checkpoint of the same architecture family), or set "
            "`actor_rollout_ref.actor.use_distill_loss=false`.")


#: what a teacher must share with the policy, with how each reads in an error
_SIGNATURE = {"family": "pipeline family", "latent_channels": "latent channels (VAE)",
              "vae_scale_factor": "VAE scale factor (latent size per image pixel)",
              "in_channels": "transformer input channels", "out_channels": "transformer output channels",
              "patch_size": "transformer patch size", "joint_attention_dim": "prompt-embedding width",
              "pooled_projection_dim": "pooled prompt-embedding width"}


def _signature(family: str, vae_config: Mapping, transformer_config: Mapping) -> dict[str, Any]:
    blocks = vae_config.get("block_out_channels") or ()
    out = {"family": family, "latent_channels": vae_config.get("latent_channels"),
           "vae_scale_factor": 2 ** (len(blocks) - 1) if blocks else None}
    for name in ("in_channels", "out_channels", "patch_size", "joint_attention_dim", "pooled_projection_dim"):
        out[name] = transformer_config.get(name)
    if out["out_channels"] is None:  # diffusers: out_channels defaults to in_channels
        out["out_channels"] = out["in_channels"]
    return out


def latent_signature(policy: FlowMatchPolicy) -> dict[str, Any]:
    """What a loaded pipeline's latents and conditioning look like (see :func:`signature_mismatches`)."""
    return _signature(policy.family, dict(policy.vae.config), dict(policy.transformer.config))


def folder_latent_signature(folder: str | Path, transformer_subfolder: str = "transformer") -> dict[str, Any]:
    """:func:`latent_signature` of the pipeline folder ``folder``, read from its JSON configs (no weights loaded)."""
    folder = Path(folder)
    index = json.loads((folder / "model_index.json").read_text())
    family = SUPPORTED_PIPELINES.get(index.get("_class_name"), index.get("_class_name"))
    vae = json.loads((folder / "vae" / "config.json").read_text())
    transformer = json.loads((folder / transformer_subfolder / "config.json").read_text())
    return _signature(family, vae, transformer)


def signature_mismatches(policy: Mapping[str, Any], teacher: Mapping[str, Any]) -> list[str]:
    """One line per field where the teacher differs from the policy (empty: compatible)."""
    return [f"{label}: policy {policy.get(name)!r}, teacher {teacher.get(name)!r}"
            for name, label in _SIGNATURE.items() if policy.get(name) != teacher.get(name)]
