"""Model adapters: the flow-matching policy, its LoRA weights and tiny test models.

``FlowMatchPolicy`` (policy.py) wraps a diffusers SD3 / Flux pipeline behind the
five primitives the RL loop needs; ``lora.py`` holds the adapter mechanics;
``tiny.py`` builds random-weight pipelines small enough for CPU tests;
``setup.py`` turns ``actor_rollout_ref.model`` into a policy on a device
(``build_policy``, ``pick_device``) for every process that holds one;
``evaluate.py`` generates and scores a prompt set (``evaluate_policy``).
Importing this package does not import diffusers; that happens on first load.
"""

from omnirl_async.models.policy import SUPPORTED_PIPELINES, FlowMatchPolicy, PromptEmbeds
from omnirl_async.models.tiny import (
    TINY_KINDS,
    build_tiny_flux,
    build_tiny_pipeline,
    build_tiny_sd3,
    ensure_tiny_model,
)

__all__ = [
    "SUPPORTED_PIPELINES",
    "TINY_KINDS",
    "FlowMatchPolicy",
    "PromptEmbeds",
    "build_tiny_flux",
    "build_tiny_pipeline",
    "build_tiny_sd3",
    "ensure_tiny_model",
]
