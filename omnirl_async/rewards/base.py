"""Reward-function contract and the name → function registry.

A **reward function** scores a batch of generated images against their
prompts::

    def my_reward(images: np.ndarray, prompts: list[str], **kwargs) -> np.ndarray | dict:
        ...

* ``images`` – ``uint8 [B, H, W, 3]``, RGB, batch first.
* ``prompts`` – ``list[str]`` of length ``B``.
* ``**kwargs`` – the ``kwargs`` of the function's config entry merged over
  ``reward.reward_kwargs``, and the **other fields of each prompt's row**
  (``ground_truth``, metadata; see :mod:`omnirl_async.rewards.adapters`): a
  field reaches the function as a keyword argument holding a list of ``B``
  values when the function names it as a parameter or takes ``**kwargs``; a
  function with a ``rows`` parameter gets the list of ``B`` row dicts instead.
* returns either ``float [B]`` scores, or a ``dict`` whose ``"score"`` entry is
  the ``[B]`` scores and whose other entries are extra per-sample ``[B]``
  arrays (for example ``"strict"``) that are logged but not optimised, or a
  :class:`ScoredSamples` (scores, extras and a reason for each failed sample).

A verl-style per-sample ``compute_score(data_source, solution_image,
ground_truth, extra_info)`` is a reward function too: the reward layer calls
it once per image (:class:`omnirl_async.rewards.adapters.PerSampleReward`).

A function signals "cannot score sample i" by returning NaN for it (or a
:class:`ScoredSamples` whose reason for ``i`` says why); raising
means "cannot score this batch". Either way the
:class:`~omnirl_async.rewards.manager.RewardManager` records the samples as
failed with a reason instead of training on a made-up number.

Functions are found by name through :func:`get_reward_fn`; built-ins register
themselves with the :func:`register_reward` decorator when
:mod:`omnirl_async.rewards` is imported. A registry (rather than import paths
in the config) keeps config values short and lets config validation list the
valid names.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Union

import numpy as np

__all__ = [
    "RewardFn",
    "RewardOutput",
    "RewardResult",
    "ScoredSamples",
    "register_reward",
    "get_reward_fn",
    "registered_rewards",
    "failure_kind",
    "FAILURE_KINDS",
]

RewardOutput = Union[np.ndarray, dict]


class RewardFn(Protocol):
    """What a reward function looks like (see the module docstring)."""

    def __call__(self, images: np.ndarray, prompts: list[str], **kwargs: Any) -> RewardOutput: ...


@dataclasses.dataclass
class RewardResult:
    """Scores of one batch, as returned by ``RewardManager.__call__``.

    Attributes:
        scores: ``float32 [B]`` total reward (weighted sum); 0.0 where failed.
        extra: name → ``float32 [B]``: each component's own score under
            ``reward/<name>`` and each component's extra outputs under
            ``<name>/<key>`` (NaN where that component failed).
        failed: ``bool [B]``; a failed sample must not be trained on as if
            its score were real.
        reasons: per sample, why it failed, or ``None``.
    """

    scores: np.ndarray
    extra: dict[str, np.ndarray]
    failed: np.ndarray
    reasons: list[str | None]

    def __len__(self) -> int:
        return int(self.scores.shape[0])

    @property
    def num_failed(self) -> int:
        return int(self.failed.sum())


@dataclasses.dataclass
class ScoredSamples:
    """What a reward function may return when some samples failed for reasons of their own.

    ``score`` is ``float [B]`` with NaN where a sample failed, ``reasons[i]``
    says why sample ``i`` failed (None where it was scored), ``extra`` maps
    name -> ``float [B]`` logged values (NaN where unknown). The per-sample
    adapter, the OpenAI-compatible judge and the HTTP client return it, so a
    judge that timed out on one image fails that image with "timed out", not
    the whole batch with a bare NaN.
    """

    score: np.ndarray
    reasons: list[str | None]
    extra: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


FAILURE_KINDS = ("raised", "nonfinite", "bad_output", "timeout", "no_worker", "other")


def failure_kind(reason: str | None) -> str:
    """The kind of a failed sample's ``reason``, for per-kind counters (``reward/failed/<kind>``).

    The reasons come from :class:`~omnirl_async.rewards.manager.RewardManager`
    (a function that raised, returned NaN/inf, or returned the wrong type or
    shape) and from the scorers around it (a call that outlived
    ``reward.timeout_s``, a judge request that timed out, no reward worker left).
    """
    text = reason or ""
    if "reward.timeout_s" in text or " timed out" in text:  # a pool / inline call, or a judge request
        return "timeout"
    if "no reward worker left" in text or "every reward worker tried died on it" in text:
        return "no_worker"
    if " raised " in text:
        return "raised"
    if text.endswith("for this sample") and any(w in text for w in ("nan", "inf")):
        return "nonfinite"
    if " returned " in text:
        return "bad_output"
    return "other"


_REGISTRY: dict[str, Callable[..., RewardOutput]] = {}


def register_reward(name: str) -> Callable[[Callable], Callable]:
    """Decorator that registers a reward function under ``name``.

    Registering a second, different function under a taken name raises, so two
    modules cannot silently shadow each other.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name must be a non-empty str, got {name!r}")

    def deco(fn: Callable) -> Callable:
        if not callable(fn):
            raise ValueError(f"`register_reward({name!r})` must decorate a callable, got {fn!r}")
        old = _REGISTRY.get(name)
        if old is not None and old is not fn and getattr(old, "__qualname__", None) != getattr(fn, "__qualname__", 0):
            raise ValueError(
                f"reward name {name!r} is already registered to {old.__module__}.{old.__qualname__}; "
                f"pick another name"
            )
        _REGISTRY[name] = fn
        return fn

    return deco


def registered_rewards() -> list[str]:
    """Sorted names of all registered reward functions."""
    import omnirl_async.rewards  # noqa: F401  (registers the built-ins)

    return sorted(_REGISTRY)


def get_reward_fn(name: str) -> Callable[..., RewardOutput]:
    """Look up a registered reward function; an unknown name lists the known ones."""
    import omnirl_async.rewards  # noqa: F401  (registers the built-ins)

    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise KeyError(
            f"unknown reward function {name!r}; registered: {', '.join(sorted(_REGISTRY))}. "
            f"Register one with `@register_reward(name)` or load it from a file with "
            f"`reward.custom_reward_function.path`/`name`"
        ) from None
