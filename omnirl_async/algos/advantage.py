"""Group-relative advantages for diffusion policy gradients (GRPO family).

A diffusion rollout gets one scalar reward for the finished image. GRPO needs
no critic: every prompt is sampled ``n`` times (a *group*), and a sample's
advantage is how much better it did than its siblings::

    A_i = (r_i - mean_group(r)) / (std + epsilon)

* ``std`` is the *population* std (``ddof = 0``) of the whole batch when
  ``global_std`` (Flow-GRPO default: one scale for every prompt, so easy
  prompts with tiny reward spread are not blown up), else of the group.
* ``norm_adv_by_std_in_grpo = False``: mean-centring only (Dr.GRPO).
* A group of one has no sibling to compare against: its mean is its own
  reward, so its advantage is 0 whatever the scale. Its scale is still
  defined (batch std, or 1 when that is 0) so the formula never divides 0/0.
* A group whose rewards are all equal carries no signal; its advantages are
  set to exactly 0 (not 1e-17 round-off) and it is counted in
  ``critic/rewards/zero_std_ratio`` (fraction of groups).
* The result is clipped to ``+-adv_clip_max`` and then mapped by ``adv_mode``:
  ``continuous`` (as is), ``positive_only`` (max(A, 0)), ``negative_only``
  (min(A, 0)), ``one_only`` (1 where A > 0 else 0), ``binary`` (sign(A)).

The per-sample advantage is the same for every trained SDE step of the
sample; the learner expands it.

Estimators live in a registry (``register_diffusion_adv_est``), so an
algorithm can bring its own. Every estimator takes ``(rewards [B], index,
**options)`` and returns ``(advantages [B], metrics)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum

import torch

__all__ = [
    "ADV_MODES",
    "DiffusionAdvantageEstimator",
    "register_diffusion_adv_est",
    "get_diffusion_adv_estimator_fn",
    "registered_adv_estimators",
    "compute_flow_grpo_outcome_advantage",
    "compute_dance_grpo_outcome_advantage",
    "apply_adv_mode",
]

ADV_MODES = ("continuous", "positive_only", "negative_only", "one_only", "binary")


class DiffusionAdvantageEstimator(str, Enum):
    """Names of the built-in advantage estimators (``algorithm.adv_estimator``)."""

    FLOW_GRPO = "flow_grpo"
    MIX_GRPO = "mix_grpo"
    DANCE_GRPO = "dance_grpo"
    GRPO_GUARD = "grpo_guard"
    FLOW_DPPO = "flow_dppo"
    DIFFUSION_NFT = "diffusion_nft"
    DPO = "dpo"
    AWM = "awm"


_ADV_ESTIMATORS: dict[str, Callable] = {}


def _name(name_or_enum) -> str:
    return name_or_enum.value if isinstance(name_or_enum, Enum) else str(name_or_enum)


def register_diffusion_adv_est(name_or_enum) -> Callable[[Callable], Callable]:
    """Decorator: register an advantage estimator under ``name`` (str or enum member)."""
    name = _name(name_or_enum)

    def decorator(fn: Callable) -> Callable:
        if name in _ADV_ESTIMATORS and _ADV_ESTIMATORS[name] is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered to "
                             f"{_ADV_ESTIMATORS[name].__qualname__}; pick another name.")
        _ADV_ESTIMATORS[name] = fn
        return fn

    return decorator


def registered_adv_estimators() -> tuple[str, ...]:
    """Names of all registered advantage estimators, sorted."""
    return tuple(sorted(_ADV_ESTIMATORS))


def get_diffusion_adv_estimator_fn(name_or_enum) -> Callable:
    """Look up an estimator by name; unknown names raise listing the registered ones."""
    name = _name(name_or_enum)
    if name not in _ADV_ESTIMATORS:
        raise ValueError(f"`algorithm.adv_estimator` = {name!r} is not a registered advantage estimator; "
                         f"registered: {list(registered_adv_estimators())}. Register new ones with "
                         "@register_diffusion_adv_est.")
    return _ADV_ESTIMATORS[name]


def apply_adv_mode(advantages: torch.Tensor, adv_mode: str) -> torch.Tensor:
    """Map advantages by ``adv_mode`` (see the module docstring)."""
    if adv_mode == "continuous":
        return advantages
    if adv_mode == "positive_only":
        return advantages.clamp(min=0.0)
    if adv_mode == "negative_only":
        return advantages.clamp(max=0.0)
    if adv_mode == "one_only":
        return (advantages > 0).to(advantages.dtype)
    if adv_mode == "binary":
        return torch.sign(advantages)
    raise ValueError(f"`algorithm.adv_mode` = {adv_mode!r} is not known; use one of {list(ADV_MODES)}.")


def _group_ids(index: Sequence, batch: int) -> tuple[torch.Tensor, int]:
    """Map arbitrary hashable group ids to ``0..G-1`` (first-appearance order)."""
    if hasattr(index, "tolist"):
        index = index.tolist()
    index = list(index)
    if len(index) != batch:
        raise ValueError(f"`index` has {len(index)} group ids but `rewards` has {batch} entries; "
                         "pass one group id (e.g. the prompt uid) per sample.")
    ids: dict = {}
    out = [ids.setdefault(g, len(ids)) for g in index]
    return torch.tensor(out, dtype=torch.long), len(ids)


def _std(x: torch.Tensor, unbiased: bool) -> torch.Tensor:
    if unbiased and x.numel() < 2:
        return torch.zeros((), dtype=x.dtype)
    return x.std(correction=1 if unbiased else 0)


def _group_advantage(rewards, index, *, epsilon, norm_adv_by_std_in_grpo, global_std, adv_clip_max,
                     adv_mode, unbiased):
    if not isinstance(rewards, torch.Tensor):
        rewards = torch.as_tensor(rewards)
    rewards = rewards.detach()
    if rewards.ndim == 2 and rewards.shape[1] == 1:
        rewards = rewards[:, 0]
    if rewards.ndim != 1:
        raise ValueError(f"`rewards` must be a Tensor[B] of per-sample scores, got shape {tuple(rewards.shape)}.")
    if adv_mode not in ADV_MODES:
        raise ValueError(f"`algorithm.adv_mode` = {adv_mode!r} is not known; use one of {list(ADV_MODES)}.")
    if adv_clip_max is not None and not adv_clip_max > 0:
        raise ValueError(f"`actor_rollout_ref.actor.diffusion_loss.adv_clip_max` = {adv_clip_max!r}: must be > 0 "
                         "(or None for no clipping).")
    if not epsilon >= 0:
        raise ValueError(f"`epsilon` = {epsilon!r}: must be >= 0.")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    b = rewards.shape[0]
    if b == 0:
        return torch.zeros(0, dtype=out_dtype), {"critic/rewards/zero_std_ratio": 0.0}
    r = rewards.to(torch.float64).cpu()
    g, n_groups = _group_ids(index, b)

    # 1. Per-group statistics.
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, torch.ones_like(r))
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, r) / count
    centred = r - mean[g]
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, centred**2)
    gmax = torch.full((n_groups,), -torch.inf, dtype=torch.float64).scatter_reduce_(0, g, r, "amax")
    gmin = torch.full((n_groups,), torch.inf, dtype=torch.float64).scatter_reduce_(0, g, r, "amin")
    zero_std = gmax == gmin  # includes single-member groups

    # 2. Scale: batch std, or per-group std (single-member groups: batch std, or 1 if that is 0).
    batch_std = _std(r, unbiased)
    singleton_scale = batch_std if batch_std > 0 else torch.ones((), dtype=torch.float64)
    if global_std:
        scale = batch_std.expand(n_groups)
    else:
        ddof = 1.0 if unbiased else 0.0
        group_std = torch.sqrt(sq / (count - ddof).clamp(min=1.0))
        scale = torch.where(count > 1, group_std, singleton_scale)

    # 3. Advantage, exact zeros for signal-free groups, clip, mode.
    adv = centred / (scale[g] + epsilon) if norm_adv_by_std_in_grpo else centred
    adv = torch.where(zero_std[g], torch.zeros_like(adv), adv)
    if adv_clip_max is not None:
        adv = adv.clamp(-adv_clip_max, adv_clip_max)
    adv = apply_adv_mode(adv, adv_mode)

    metrics = {
        "critic/rewards/zero_std_ratio": float(zero_std.to(torch.float64).mean()),
        "critic/rewards/mean": float(r.mean()),
        "critic/rewards/std": float(r.std(correction=0)),
        "critic/advantages/mean": float(adv.mean()),
        "critic/advantages/max": float(adv.max()),
        "critic/advantages/min": float(adv.min()),
    }
    return adv.to(out_dtype).to(rewards.device), metrics


@register_diffusion_adv_est(DiffusionAdvantageEstimator.FLOW_GRPO)
@register_diffusion_adv_est(DiffusionAdvantageEstimator.MIX_GRPO)
@register_diffusion_adv_est(DiffusionAdvantageEstimator.GRPO_GUARD)
@register_diffusion_adv_est(DiffusionAdvantageEstimator.FLOW_DPPO)
@register_diffusion_adv_est(DiffusionAdvantageEstimator.DIFFUSION_NFT)
@register_diffusion_adv_est(DiffusionAdvantageEstimator.DPO)
@register_diffusion_adv_est(DiffusionAdvantageEstimator.AWM)
def compute_flow_grpo_outcome_advantage(
    rewards: torch.Tensor,
    index: Sequence,
    *,
    epsilon: float = 1e-4,
    norm_adv_by_std_in_grpo: bool = True,
    global_std: bool = True,
    adv_clip_max: float | None = 5.0,
    adv_mode: str = "continuous",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Flow-GRPO group advantage with population std (see the module docstring).

    Also registered as ``mix_grpo``, ``grpo_guard`` (GRPO-Guard runs with
    ``algorithm.global_std=false``; that is a config choice, not a new formula)
    and ``flow_dppo`` (Flow-DPPO changes the loss, not the advantage),
    and as ``diffusion_nft``, ``dpo`` and ``awm``: the direct-preference losses
    read the same group advantage (NFT maps it to an optimality probability,
    DPO picks each group's best and worst by it, AWM weights by it).

    Args:
        rewards: ``Tensor[B]`` (or ``[B, 1]``) per-sample rewards.
        index: ``B`` hashable group ids (prompt uids); members need not be contiguous.
        epsilon: added to the std before dividing.
        norm_adv_by_std_in_grpo: divide by the std; False = mean-centring only.
        global_std: std over the whole batch (True) or within each group.
        adv_clip_max: clip to ``+-adv_clip_max``; None = no clipping.
        adv_mode: one of :data:`ADV_MODES`.

    Returns:
        ``(advantages [B], metrics)``; ``advantages`` has the rewards' float dtype and device.
    """
    return _group_advantage(rewards, index, epsilon=epsilon, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
                            global_std=global_std, adv_clip_max=adv_clip_max, adv_mode=adv_mode, unbiased=False)


@register_diffusion_adv_est(DiffusionAdvantageEstimator.DANCE_GRPO)
def compute_dance_grpo_outcome_advantage(
    rewards: torch.Tensor,
    index: Sequence,
    *,
    epsilon: float = 1e-4,
    norm_adv_by_std_in_grpo: bool = True,
    global_std: bool = False,
    adv_clip_max: float | None = 5.0,
    adv_mode: str = "continuous",
) -> tuple[torch.Tensor, dict[str, float]]:
    """DanceGRPO group advantage: like Flow-GRPO but with the *unbiased* std (``ddof = 1``),
    per group by default. ``global_std=True`` uses the unbiased batch std."""
    return _group_advantage(rewards, index, epsilon=epsilon, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
                            global_std=global_std, adv_clip_max=adv_clip_max, adv_mode=adv_mode, unbiased=True)
