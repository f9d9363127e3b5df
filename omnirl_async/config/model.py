"""`actor_rollout_ref.model.*`: which diffusion pipeline to load and how LoRA wraps it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from omnirl_async.config.algorithm import DIRECT_PREFERENCE_TRAINER
from omnirl_async.config.fields import NoEffect, opt

__all__ = ["DiffusionModelConfig", "DEFAULT_MODEL_PATH", "EMBEDDED_PIXEL_STEP", "pixel_step"]

#: ``embedded:<name>`` resolves to a model shipped with (or built by) the package,
#: see :func:`omnirl_async.models.resolve_model_path`.
DEFAULT_MODEL_PATH = "embedded:shapes"

#: Image sizes of the embedded models step by (VAE scale x transformer patch; the models' own ``latent_grid`` checks
#: it again, and tests/config checks this table against them).
EMBEDDED_PIXEL_STEP = {"shapes": 4, "tiny-sd3": 8, "tiny-flux": 8}


def pixel_step(path: Any, transformer_subfolder: Any = "transformer") -> int | None:
    """What image height and width must be a multiple of for the model at ``path`` (an ``embedded:`` name, or a
    diffusers pipeline folder whose JSON configs are read); None when that cannot be told from here (a missing or
    broken folder is the driver's input check to report)."""
    if not isinstance(path, str):
        return None
    if path.startswith("embedded:"):
        return EMBEDDED_PIXEL_STEP.get(path.split(":", 1)[1])
    folder = os.path.expanduser(path)
    try:
        with open(os.path.join(folder, "model_index.json")) as f:
            pipeline = json.load(f).get("_class_name", "")
        with open(os.path.join(folder, "vae", "config.json")) as f:
            scale = 2 ** (len(json.load(f)["block_out_channels"]) - 1)
        with open(os.path.join(folder, str(transformer_subfolder), "config.json")) as f:
            patch = int(json.load(f).get("patch_size", 2)) if "Flux" not in str(pipeline) else 2  # Flux packs 2x2
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return scale * patch


_OUTSIDE_PIPELINE = ("loading components from outside the pipeline folder is not built yet; put them under "
                     "`actor_rollout_ref.model.path`")

_ALGORITHMS = ("flow_grpo", "mix_grpo", "dance_grpo", "grpo_guard", "flow_dppo",
               "diffusion_nft", "dpo", "awm")


@dataclass
class DiffusionModelConfig:
    model_type: str = opt("diffusion_model", "Dispatch key; this trainer needs diffusion_model.",
                          choices=("diffusion_model",))
    path: str = opt(DEFAULT_MODEL_PATH, "Local diffusers pipeline folder (model_index.json inside), "
                    "or embedded:tiny-sd3 / embedded:tiny-flux for the models the project builds.")
    algorithm: str = opt("flow_grpo", "RL algorithm; drives the default loss_mode and adv_estimator, and applies "
                         "its preset (the algorithm's documented defaults, e.g. grpo_guard: clip_ratio 2e-6 and "
                         "per-group std) to the keys a recipe or the command line does not set: "
                         "omnirl_async/config/presets.py.",
                         choices=_ALGORITHMS)
    tokenizer_path: Any = opt(None, "Tokenizer folder if not inside path (falls back to <path>/tokenizer).",
                              no_effect=_OUTSIDE_PIPELINE)
    config_path: Any = opt(None, "Transformer config folder; null = <path>/<transformer_subfolder>.",
                           no_effect=_OUTSIDE_PIPELINE)
    transformer_subfolder: str = opt("transformer", "Subfolder holding the diffusion transformer.")
    attn_backend: str = opt("native", "Diffusers attention backend.",
                            choices=("native", "_native_npu", "_flash_3_varlen_hub"),
                            not_built={"_native_npu": "NPU attention is not supported by this project",
                                       "_flash_3_varlen_hub": "flash-attention 3 from the hub cannot be fetched here; use native"})
    enable_gradient_checkpointing: bool = opt(False, "Recompute activations in backward to save memory.")
    lora_rank: int = opt(8, "LoRA rank; 0 trains all transformer weights (full-weight publishing).", ge=0)
    lora_alpha: float = opt(16.0, "LoRA scaling numerator (scale = alpha / rank).", gt=0)
    lora_init_weights: Any = opt("gaussian", "LoRA init (peft init_lora_weights): gaussian, true, false, orthogonal, "
                                 "pissa, pissa_niter_<n>, olora.")
    target_modules: Any = opt("all-linear", "LoRA targets: all-linear or a list of module-name patterns.")
    target_parameters: Any = opt(None, "nn.Parameter names for LoRA.",
                                 no_effect=NoEffect("LoRA on raw parameters is not built yet; use target_modules",
                                                    accept=([],)))
    exclude_modules: Any = opt(None, "Module-name patterns excluded from LoRA (list or regex string).")
    lora_adapter_path: Any = opt(None, "PEFT adapter folder to continue training from.", string=True)
    policy_state_adapters: Any = opt(None, "Named LoRA policy states the algorithm needs; null = ['default']. "
                                     "[default, old] adds DiffusionNFT's old (EMA) adapter on the same base; "
                                     "'reference' (the base, adapter disabled) is always available.",
                                     no_effect=NoEffect(
                                         f"named LoRA policy states (e.g. 'old' for DiffusionNFT) are used by "
                                         f"{DIRECT_PREFERENCE_TRAINER}; the reference policy is always the base "
                                         "model with the adapter disabled",
                                         accept=(["default"], ["default", "reference"]),
                                         when=lambda m, root: (None if root.algorithm.trainer_type == "direct_preference"
                                                               else "with `algorithm.trainer_type` = policy_gradient"),
                                         when_doc="with `algorithm.trainer_type` = policy_gradient"))
    lora_dtype: Any = opt(None, "Cast LoRA params to this dtype; null = keep.",
                          choices=(None, "fp32", "float32", "bf16", "bfloat16", "fp16", "float16"))
    fsdp_layer_prefixes: Any = opt(None, "FSDP wrap prefixes (VeRL-Omni); this project does not shard with FSDP.",
                                   no_effect="this project does not shard with FSDP "
                                             "(`actor_rollout_ref.actor.strategy` = ddp), so nothing reads it")
    dtype: str = opt("fp32", "Compute dtype of the base weights. Log-probs are always computed in fp32.",
                     choices=("fp32", "bf16", "fp16"))

    def validate(self, path: str) -> None:
        states = self.policy_state_adapters
        if states is not None:
            known = ("default", "old", "reference")
            if isinstance(states, str) or not all(isinstance(x, str) for x in states) or \
                    any(x not in known for x in states) or "default" not in states or len(set(states)) != len(states):
                raise ValueError(f"`{path}.policy_state_adapters` = {states!r}: expected a list of distinct names "
                                 f"from {list(known)} that holds 'default', e.g. [default, old].")
            if "old" in states and self.lora_rank == 0 and self.lora_adapter_path is None:
                raise ValueError(f"`{path}.policy_state_adapters` holds 'old', a second LoRA adapter, but "
                                 f"`{path}.lora_rank` = 0 trains all weights; set lora_rank > 0.")
        init = self.lora_init_weights
        allowed = (True, False, "gaussian", "orthogonal", "pissa", "olora")
        if not (init in allowed or (isinstance(init, str) and init.startswith("pissa_niter_"))):
            why = (" (loftq quantises the base model, which this project does not load)" if init == "loftq" else "")
            raise ValueError(f"`{path}.lora_init_weights` = {init!r} is not supported{why}; choose one of "
                             f"{list(allowed)} or 'pissa_niter_<n>'.")
