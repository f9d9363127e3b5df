"""The loss contract and the loss registry.

A diffusion policy loss sees one *trained SDE step* at a time for a batch of
``B`` samples. The learner re-runs the model on the stored latent ``x_t``,
re-scores the stored next latent with :func:`omnirl_async.models.sde.sde_step_with_logprob`
and hands the loss two dicts:

``model_output`` (current policy, carries gradients)
    ``log_prob [B]``, ``mean [B, ...]``, ``std [B]``, ``sig [B]``, ``dt [B]``,
    optionally ``ref_mean [B, ...]`` (same step with the adapter disabled).
``data`` (stored with the sample, no gradients)
    ``old_log_prob [B]``, ``advantages [B]``, optionally ``old_mean [B, ...]``
    and ``is_weights [B]`` (rollout-correction multipliers: IS weight times
    rejection mask; a rejected step has weight 0 but still counts in the
    mean's denominator, so rejection does not inflate the other samples).

Each loss class declares the keys it reads (``required_model_outputs``,
``required_data_keys``); :meth:`DiffusionLossFn.__call__` checks them before
any arithmetic, so a missing tensor fails with its name instead of a
``KeyError`` deep inside a formula. Then :meth:`compute` runs, and the actor's
``loss_scale_factor`` (when not None) multiplies the returned loss.

Configs are duck-typed: ``loss_config`` needs the ``DiffusionLossConfig``
attributes a loss reads (``clip_ratio``, ``adv_clip_max``, ...), and
``actor_config`` the actor extras (``use_kl_loss``, ``kl_loss_coef``,
``loss_scale_factor``, ``rollout_correction``); a missing ``actor_config``
means all extras off.

Rollout correction in bypass mode (``actor_config.rollout_correction.bypass_mode``):
there ``data['old_log_prob']`` *is* the behaviour log-prob, and
:meth:`DiffusionLossFn.__call__` computes the correction before :meth:`compute`
from ``(model_output['log_prob'].detach(), data['old_log_prob'])`` with
:func:`~omnirl_async.algos.rollout_correction.compute_bypass_correction`:
its keep mask (RS and masked-IS rejections) multiplies ``data['is_weights']``,
the same slot that carries the decoupled-mode weights, and its
``rollout_corr/*`` metrics join the loss's metrics. No gradient flows through
the mask; the IS weight values are reported only (the ratio is the IS term).

Trainer types: every loss class carries ``trainer_type``. The policy-gradient
losses above (``"policy_gradient"``, the default) train on stored SDE steps;
the direct-preference losses (``"direct_preference"``: DiffusionNFT,
Diffusion-DPO, AWM: :mod:`.diffusion_nft`, :mod:`.dpo`, :mod:`.awm`) train on the forward process and
read velocities instead:

``model_output``
    ``v [B, ...]`` current policy velocity at ``x_t = (1-t)*x0 + t*eps``
    (carries gradients); ``v_old`` (old / EMA adapter) and ``v_ref`` (adapter
    disabled), no gradients.
``data``
    ``x0``, ``eps`` ``[B, ...]``, ``t [B]`` (sigma in (0, 1)), ``advantages [B]``,
    optionally ``is_weights [B]``; AWM also ``v_prox`` (the policy before this
    update at the same ``x_t``).

:func:`loss_trainer_type` gives a registered loss's type, so start-up can
refuse a loss paired with the wrong trainer.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping
from enum import Enum
from typing import ClassVar, NamedTuple

import torch

from omnirl_async.algos.rollout_correction import compute_bypass_correction

__all__ = [
    "DiffusionLossResult",
    "DiffusionLossFn",
    "register_diffusion_loss",
    "get_diffusion_loss_fn",
    "registered_losses",
    "mean_dims",
    "loss_trainer_type",
    "TRAINER_TYPES",
]

_LOSS_PATH = "actor_rollout_ref.actor.diffusion_loss"
TRAINER_TYPES = ("policy_gradient", "direct_preference")
_ACTOR_PATH = "actor_rollout_ref.actor"


class DiffusionLossResult(NamedTuple):
    """A scalar loss to back-propagate and float metrics named as in VeRL (``actor/...``)."""

    loss: torch.Tensor
    metrics: dict[str, float]


def mean_dims(t: torch.Tensor) -> torch.Tensor:
    """Mean over every non-batch dim: ``[B, ...] -> [B]`` (``[B]`` stays ``[B]``)."""
    return t.mean(dim=tuple(range(1, t.ndim))) if t.ndim > 1 else t


class DiffusionLossFn(ABC):
    """Base class of every diffusion loss.

    Subclasses set ``required_model_outputs`` / ``required_data_keys`` and
    implement :meth:`compute`. They may add keys per instance (e.g. the KL
    term needs ``ref_mean`` only when ``use_kl_loss``) by extending
    ``self.model_output_keys`` / ``self.data_keys`` in ``__init__``.
    """

    name: ClassVar[str] = "base"
    #: Which trainer feeds this loss: "policy_gradient" (stored SDE steps, log-probs) or
    #: "direct_preference" (forward-process velocities, see the module docstring).
    trainer_type: ClassVar[str] = "policy_gradient"
    required_model_outputs: ClassVar[tuple[str, ...]] = ()
    required_data_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self, loss_config, actor_config=None) -> None:
        self.loss_config = loss_config
        self.actor_config = actor_config
        self.model_output_keys: tuple[str, ...] = tuple(self.required_model_outputs)
        self.data_keys: tuple[str, ...] = tuple(self.required_data_keys)
        scale = self._actor_opt("loss_scale_factor", None)
        if scale is not None and not float(scale) > 0:
            raise ValueError(f"`{_ACTOR_PATH}.loss_scale_factor` = {scale!r}: must be > 0, or null to disable.")
        self.loss_scale_factor = None if scale is None else float(scale)
        self.bypass_correction = self._bypass_correction_config()

    # --- config helpers -------------------------------------------------
    def _loss_opt(self, key: str, *, gt: float | None = None, ge: float | None = None) -> float:
        if not hasattr(self.loss_config, key):
            raise KeyError(f"loss {self.name!r}: `{_LOSS_PATH}.{key}` is missing from the loss config "
                           f"({type(self.loss_config).__name__}); add the field.")
        value = getattr(self.loss_config, key)
        if gt is not None and not float(value) > gt:
            raise ValueError(f"`{_LOSS_PATH}.{key}` = {value!r}: must be > {gt}.")
        if ge is not None and not float(value) >= ge:
            raise ValueError(f"`{_LOSS_PATH}.{key}` = {value!r}: must be >= {ge}.")
        return value

    def _actor_opt(self, key: str, default):
        if self.actor_config is None:
            return default
        return getattr(self.actor_config, key, default)

    def _bypass_correction_config(self):
        """``actor_config.rollout_correction`` when it sets ``bypass_mode`` and this loss has a ratio against
        ``old_log_prob`` (validated now), else None. Losses without one (e.g. :class:`KLLoss`) are not corrected."""
        rc = self._actor_opt("rollout_correction", None)
        get = rc.get if isinstance(rc, Mapping) else (lambda k, d=None: getattr(rc, k, d))
        if rc is None or not get("bypass_mode", False):
            return None
        if "log_prob" not in self.model_output_keys or "old_log_prob" not in self.data_keys:
            return None
        probe = torch.zeros(1, dtype=torch.float32)
        compute_bypass_correction(probe, probe, rc)  # bad options fail at construction, with their names
        if get("rollout_is", None) is not None:
            warnings.warn("`algorithm.rollout_correction.bypass_mode` = true: the IS weights (rollout_is) of the "
                          "current vs the behaviour policy are reported as rollout_corr/is_weight_* but not "
                          "multiplied into the loss, whose ratio pi_theta/pi_behaviour already is that IS term; "
                          "masked IS ('lo_hi') and rollout_rs still drop steps.", stacklevel=3)
        return rc

    # --- call protocol --------------------------------------------------
    def check_inputs(self, model_output: Mapping, data: Mapping) -> None:
        """Raise ``KeyError`` naming the loss, the missing key and the dict it belongs in."""
        for where, keys, d in (("model_output", self.model_output_keys, model_output),
                               ("data", self.data_keys, data)):
            missing = [k for k in keys if k not in d]
            if missing:
                raise KeyError(f"loss {self.name!r} needs `{where}[{missing[0]!r}]` (missing: {missing}); "
                               f"{where} has keys {sorted(d)}. Provide it from the "
                               f"{'learner forward pass' if where == 'model_output' else 'stored sample'}.")
        lp, old = model_output.get("log_prob"), data.get("old_log_prob")
        if lp is not None and old is not None and lp.shape != old.shape:
            raise ValueError(f"loss {self.name!r}: `model_output['log_prob']` shape {tuple(lp.shape)} != "
                             f"`data['old_log_prob']` shape {tuple(old.shape)}; both must be [B].")

    def __call__(self, model_output: Mapping, data: Mapping) -> DiffusionLossResult:
        self.check_inputs(model_output, data)
        corr_metrics: dict[str, float] = {}
        if self.bypass_correction is not None:
            data, corr_metrics = self._apply_bypass_correction(model_output, data)
        result = self.compute(model_output, data)
        if self.loss_scale_factor is not None:
            result = DiffusionLossResult(result.loss * self.loss_scale_factor, result.metrics)
        if corr_metrics:
            result = DiffusionLossResult(result.loss, {**result.metrics, **corr_metrics})
        return result

    def _apply_bypass_correction(self, model_output: Mapping, data: Mapping) -> tuple[dict, dict[str, float]]:
        """Bypass mode: ``data`` with ``is_weights`` times the keep mask of current (detached) vs behaviour."""
        log_prob, behaviour = model_output["log_prob"], data["old_log_prob"]  # both checked by check_inputs
        rc = compute_bypass_correction(log_prob.detach(), behaviour.detach(), self.bypass_correction)
        keep = rc.weights
        w = data.get("is_weights")
        if w is not None:
            if w.shape != keep.shape:
                raise ValueError(f"`data['is_weights']` shape {tuple(w.shape)} != `model_output['log_prob']` "
                                 f"shape {tuple(keep.shape)}; pass one weight per sample of this step.")
            keep = w.detach().to(keep.dtype) * keep
        return {**data, "is_weights": keep}, rc.metrics

    @abstractmethod
    def compute(self, model_output: Mapping, data: Mapping) -> DiffusionLossResult:
        """Compute the loss; inputs have been checked for the declared keys."""

    # --- shared pieces --------------------------------------------------
    def _clipped_advantages(self, data: Mapping) -> torch.Tensor:
        clip = float(self._loss_opt("adv_clip_max", gt=0.0))
        return data["advantages"].detach().clamp(-clip, clip)

    @staticmethod
    def _weighted_mean(per_elem: torch.Tensor, data: Mapping) -> torch.Tensor:
        """Mean over the batch of ``per_elem * is_weights`` (rejected = 0, still in the denominator)."""
        w = data.get("is_weights")
        if w is not None:
            if w.shape != per_elem.shape:
                raise ValueError(f"`data['is_weights']` shape {tuple(w.shape)} != per-sample loss shape "
                                 f"{tuple(per_elem.shape)}; pass one weight per sample of this step.")
            per_elem = per_elem * w.detach().to(per_elem.dtype)
        return per_elem.mean()

    @staticmethod
    def _ratio_metrics(ratio: torch.Tensor, log_ratio: torch.Tensor) -> dict[str, float]:
        r = ratio.detach()
        return {
            "actor/ppo_kl": float((-log_ratio.detach()).mean()),
            "actor/ratio_mean": float(r.mean()),
            "actor/ratio_max": float(r.max()),
            "actor/ratio_min": float(r.min()),
        }


_LOSSES: dict[str, type[DiffusionLossFn]] = {}


def _name(name_or_enum) -> str:
    return name_or_enum.value if isinstance(name_or_enum, Enum) else str(name_or_enum)


def register_diffusion_loss(name_or_enum):
    """Class decorator: register a :class:`DiffusionLossFn` under ``name``.

    A class may be registered under several names (aliases); the first one
    becomes its ``name`` (used in error messages).
    """
    name = _name(name_or_enum)

    def decorator(cls: type[DiffusionLossFn]) -> type[DiffusionLossFn]:
        if not (isinstance(cls, type) and issubclass(cls, DiffusionLossFn)):
            raise TypeError(f"@register_diffusion_loss({name!r}) decorates {cls!r}; it must be a "
                            "DiffusionLossFn subclass.")
        if name in _LOSSES and _LOSSES[name] is not cls:
            raise ValueError(f"diffusion loss {name!r} is already registered to {_LOSSES[name].__qualname__}; "
                             "pick another name.")
        if cls.trainer_type not in TRAINER_TYPES:
            raise ValueError(f"diffusion loss {name!r} ({cls.__qualname__}) has trainer_type "
                             f"{cls.trainer_type!r}; must be one of {list(TRAINER_TYPES)}.")
        _LOSSES[name] = cls
        if "name" not in cls.__dict__:
            cls.name = name
        return cls

    return decorator


def registered_losses() -> tuple[str, ...]:
    """Names of all registered diffusion losses, sorted."""
    return tuple(sorted(_LOSSES))


def get_diffusion_loss_fn(name_or_enum) -> type[DiffusionLossFn]:
    """Return the loss class registered under ``name``; unknown names list the registered ones."""
    name = _name(name_or_enum)
    if name not in _LOSSES:
        raise ValueError(f"`{_LOSS_PATH}.loss_mode` = {name!r} is not a registered diffusion loss; "
                         f"registered: {list(registered_losses())}. Register new ones with "
                         "@register_diffusion_loss.")
    return _LOSSES[name]


def loss_trainer_type(name_or_enum) -> str:
    """``trainer_type`` of the loss registered under ``name`` (``"policy_gradient"`` or ``"direct_preference"``).

    Unknown names raise the :func:`get_diffusion_loss_fn` ``ValueError`` listing the registered ones.
    """
    return get_diffusion_loss_fn(name_or_enum).trainer_type
