"""The old-policy (EMA) adapter of the direct-preference trainers.

DiffusionNFT samples with an *old* LoRA adapter and refreshes it every
``algorithm.old_policy_update_interval`` optimizer steps::

    theta_old <- d*theta_old + (1-d)*theta

``d`` is ``algorithm.old_policy_decay`` when set, else the schedule
``algorithm.old_policy_decay_schedule`` at the current optimizer step:

``copy``                     d = 0 (the old adapter becomes the current one)
``linear_to_0_5``            d = min(0.001*step, 0.5)
``delayed_linear_to_0_999``  d = 0 for step < 75, then min(0.0075*(step - 75), 0.999)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["DECAY_SCHEDULES", "decay_at", "ema_update_"]

_SCHEDULE_PATH = "algorithm.old_policy_decay_schedule"
_FIXED_PATH = "algorithm.old_policy_decay"


def _copy(step: int) -> float:
    return 0.0


def _linear_to_0_5(step: int) -> float:
    return min(0.001 * step, 0.5)


def _delayed_linear_to_0_999(step: int) -> float:
    return 0.0 if step < 75 else min(0.0075 * (step - 75), 0.999)


DECAY_SCHEDULES: dict[str, Callable[[int], float]] = {
    "copy": _copy,
    "linear_to_0_5": _linear_to_0_5,
    "delayed_linear_to_0_999": _delayed_linear_to_0_999,
}


def decay_at(step: int, schedule: str, fixed: float | None = None) -> float:
    """EMA decay ``d`` for the old-policy refresh at optimizer step ``step`` (>= 0).

    ``fixed`` (``algorithm.old_policy_decay``, in [0, 1]) overrides the schedule; the schedule name is
    validated either way. Unknown schedules raise ``ValueError`` listing the choices.
    """
    if schedule not in DECAY_SCHEDULES:
        raise ValueError(f"`{_SCHEDULE_PATH}` = {schedule!r} is not a known schedule; "
                         f"choices: {list(DECAY_SCHEDULES)}.")
    if int(step) != step or step < 0:
        raise ValueError(f"old-policy decay step = {step!r}: must be an integer >= 0 (the optimizer step).")
    if fixed is not None:
        d = float(fixed)
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"`{_FIXED_PATH}` = {fixed!r}: must be in [0, 1], or null to use `{_SCHEDULE_PATH}`.")
        return d
    return float(DECAY_SCHEDULES[schedule](int(step)))


@torch.no_grad()
def ema_update_(old: dict[str, torch.Tensor], current: dict[str, torch.Tensor], decay: float) -> None:
    """In place ``old[k] <- decay*old[k] + (1-decay)*current[k]`` for every key, without gradients.

    Both dicts must have the same keys and per-key shapes; ``decay`` must be in [0, 1]. ``decay = 0``
    copies ``current`` exactly; ``decay = 1`` leaves ``old`` unchanged.
    """
    d = float(decay)
    if not 0.0 <= d <= 1.0:
        raise ValueError(f"old-policy EMA decay = {decay!r}: must be in [0, 1].")
    missing_cur = sorted(set(old) - set(current))
    missing_old = sorted(set(current) - set(old))
    if missing_cur or missing_old:
        raise KeyError(f"old-policy EMA update needs the same parameter names in both adapters: missing from "
                       f"current: {missing_cur}; missing from old: {missing_old}.")
    for k, o in old.items():
        c = current[k]
        if o.shape != c.shape:
            raise ValueError(f"old-policy EMA update: parameter {k!r} has shape {tuple(o.shape)} in the old adapter "
                             f"and {tuple(c.shape)} in the current one.")
    for k, o in old.items():
        c = current[k].detach().to(device=o.device, dtype=o.dtype)
        if d == 0.0:
            o.copy_(c)
        elif d != 1.0:
            o.mul_(d).add_(c, alpha=1.0 - d)
