"""Named LoRA policy states on one base model: the trained ``default`` adapter and a frozen ``old`` one.

DiffusionNFT keeps a second, slowly moving copy of the policy (the "old"
policy, an EMA of the trained one) that generates rollouts and anchors the
loss; AWM uses the same copy as its EMA regulariser. It is a second peft
adapter, named :data:`OLD_ADAPTER`, injected next to :data:`~omnirl_async.models.lora.ADAPTER_NAME`
on the same ``LoraLayer`` modules with the same rank, alpha and targets, so
the base weights are shared and only the small ``A``/``B`` matrices are
duplicated.

Invariants (tested in ``tests/models/test_adapters.py``):

* the default adapter stays the active one and the only one with
  ``requires_grad``; :func:`use_adapter` switches the active adapter inside a
  block and restores both the active adapter and every ``requires_grad`` flag
  after it (peft's ``set_adapter`` flips those flags);
* right after :func:`add_named_adapter` the new adapter holds a copy of the
  default one, so the two policies compute the same function;
* :func:`ema_update` moves the old adapter in place, ``old <- d*old + (1-d)*default``,
  without touching the default adapter or the optimizer's references.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from omnirl_async.models.lora import ADAPTER_NAME, _lora_params

__all__ = ["OLD_ADAPTER", "KNOWN_POLICY_STATES", "add_named_adapter", "use_adapter", "ema_update", "adapter_names"]

OLD_ADAPTER = "old"
#: The names ``actor_rollout_ref.model.policy_state_adapters`` may hold; ``reference`` is the base model
#: (every adapter disabled) and always available.
KNOWN_POLICY_STATES = (ADAPTER_NAME, OLD_ADAPTER, "reference")


def _tuner_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def adapter_names(model: nn.Module) -> list[str]:
    """The LoRA adapters injected into ``model``, sorted."""
    return sorted(getattr(model, "peft_config", {}) or {})


def _activate(layers: list[nn.Module], name: str) -> None:
    for m in layers:
        m.set_adapter(name)


def add_named_adapter(model: nn.Module, name: str) -> None:
    """Inject adapter ``name`` beside the default one (same config), frozen, holding a copy of the default."""
    from peft import inject_adapter_in_model

    names = adapter_names(model)
    if ADAPTER_NAME not in names:
        raise ValueError(f"{type(model).__name__} has no {ADAPTER_NAME!r} LoRA adapter to copy: the policy must be "
                         "trained with LoRA (`actor_rollout_ref.model.lora_rank` > 0) to hold an "
                         f"{name!r} policy state.")
    if name in names:
        raise ValueError(f"adapter {name!r} already exists on {type(model).__name__} (adapters: {names}).")
    grads = {id(p): p.requires_grad for p in model.parameters()}
    config = copy.deepcopy(model.peft_config[ADAPTER_NAME])
    import warnings

    with warnings.catch_warnings():  # peft warns that a second adapter makes a multi-adapter model: intended
        warnings.simplefilter("ignore", UserWarning)
        inject_adapter_in_model(config, model, adapter_name=name)
    _activate(_tuner_layers(model), ADAPTER_NAME)  # injection made the new adapter the active one
    new = _lora_params(model, name)
    for p in new.values():
        p.requires_grad_(False)
    for p in model.parameters():  # parameters that existed before keep their flags
        if id(p) in grads:
            p.requires_grad_(grads[id(p)])
    ema_update(model, name, 0.0)


@contextlib.contextmanager
def use_adapter(model: nn.Module, name: str) -> Iterator[None]:
    """Inside the block ``model`` computes with adapter ``name``; the default is active again after it."""
    if name == ADAPTER_NAME:
        yield
        return
    if name not in adapter_names(model):
        raise ValueError(f"{type(model).__name__} has no LoRA adapter named {name!r} (adapters: "
                         f"{adapter_names(model)}); add {name!r} to `actor_rollout_ref.model.policy_state_adapters`.")
    layers = _tuner_layers(model)
    grads = [(p, p.requires_grad) for m in layers for p in m.parameters()]
    _activate(layers, name)
    try:
        yield
    finally:
        _activate(layers, ADAPTER_NAME)
        for p, flag in grads:
            p.requires_grad_(flag)


@torch.no_grad()
def ema_update(model: nn.Module, name: str, decay: float) -> None:
    """In place: adapter ``name`` <- ``decay`` * itself + (1 - ``decay``) * the default adapter (0 = copy)."""
    if not 0.0 <= float(decay) <= 1.0:
        raise ValueError(f"EMA decay = {decay!r}: must be in [0, 1] (`algorithm.old_policy_decay`).")
    target, source = _lora_params(model, name), _lora_params(model, ADAPTER_NAME)
    if set(target) != set(source):
        raise ValueError(f"adapters {name!r} and {ADAPTER_NAME!r} have different keys; they must share one config.")
    for key, p in target.items():
        p.mul_(float(decay)).add_(source[key].detach().to(p.dtype), alpha=1.0 - float(decay))
