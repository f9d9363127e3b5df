"""Rewards: the registry, built-in reward functions and the reward manager.

* :mod:`~omnirl_async.rewards.base` – the reward-function contract,
  :class:`RewardResult`, :func:`register_reward` / :func:`get_reward_fn`.
* :mod:`~omnirl_async.rewards.custom` – load a user function from a ``.py`` file.
* :mod:`~omnirl_async.rewards.manager` – :class:`RewardManager`: config →
  weighted sum with per-sample failure flags.
* :mod:`~omnirl_async.rewards.builtin` – ``jpeg_compressibility``,
  ``jpeg_incompressibility``, ``brightness``.
* :mod:`~omnirl_async.rewards.tiny_geneval` – ``tiny_geneval``, the verifiable
  reward of the embedded shapes world (the default).
* :mod:`~omnirl_async.rewards.adapters` – how functions are called: the prompt
  rows' fields as keyword arguments, verl-style per-sample ``compute_score``.
* :mod:`~omnirl_async.rewards.http_scorer` / :mod:`~omnirl_async.rewards.server`
  – ``http_scorer``, the client of a reward service, and the service itself
  (``omnirl-async serve-reward``: batching, health, bearer token).
* :mod:`~omnirl_async.rewards.judge` – ``openai_judge``: a judge model behind an
  OpenAI-compatible chat-completions API.
* :mod:`~omnirl_async.rewards.worker_pool` – reward worker actors
  (``reward.num_workers``, ``reward.num_gpus_per_worker``).

Importing this package registers the built-ins.
"""

from omnirl_async.rewards.base import (
    RewardFn,
    RewardResult,
    get_reward_fn,
    register_reward,
    registered_rewards,
)
from omnirl_async.rewards import builtin as _builtin  # noqa: F401  (registers)
from omnirl_async.rewards import tiny_geneval as _tiny_geneval  # noqa: F401  (registers)
from omnirl_async.rewards import http_scorer as _http_scorer  # noqa: F401  (registers)
from omnirl_async.rewards import judge as _judge  # noqa: F401  (registers)
from omnirl_async.rewards.custom import load_custom_reward_fn
from omnirl_async.rewards.manager import DEFAULT_REWARD_FN, RewardComponent, RewardManager
from omnirl_async.rewards.tiny_geneval import clause_accuracy

__all__ = [
    "RewardFn",
    "RewardResult",
    "get_reward_fn",
    "register_reward",
    "registered_rewards",
    "load_custom_reward_fn",
    "DEFAULT_REWARD_FN",
    "RewardComponent",
    "RewardManager",
    "clause_accuracy",
]
