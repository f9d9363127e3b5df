"""`data.*` and `reward.*`: where prompts come from and how samples are scored."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnirl_async.config.fields import NoEffect, opt

__all__ = ["DataConfig", "CustomRewardFunctionConfig", "RewardConfig"]


#: Upstream VeRL's default reward manager; this project's built-in manager does what it does.
UPSTREAM_REWARD_MANAGER = "naive"


def _upstream_reward_manager(value: Any) -> bool:
    """The upstream default, as a name or as upstream's ``{source: register, name: naive, ...}`` mapping."""
    if value == UPSTREAM_REWARD_MANAGER:
        return True
    return (isinstance(value, dict) and value.get("name") == UPSTREAM_REWARD_MANAGER
            and value.get("source", "register") == "register" and not (value.get("module") or {}).get("path"))


def _offline_data_unread(data: Any, root: Any) -> str | None:
    """Ingested offline pairs are read only by offline mixing or the offline sample source."""
    if root.buffer.offline_mix_ratio > 0 or root.algorithm.sample_source == "offline":
        return None
    return "while `buffer.offline_mix_ratio` = 0 and `algorithm.sample_source` = online"


def _inline_scoring(reward: Any, root: Any) -> str | None:
    """Reward workers (and their GPUs) exist only with ``reward.num_workers`` > 0."""
    return "while `reward.num_workers` = 0" if reward.num_workers == 0 else None


def _rewards():
    from omnirl_async.rewards import registered_rewards

    return registered_rewards()


@dataclass
class DataConfig:
    train_files: Any = opt(None, "Prompt file(s): .jsonl / .parquet rows with a `prompt` field, a `datasets` "
                           "folder (save_to_disk), or .txt with one prompt per line; a row's other fields "
                           "(ground_truth, metadata) reach the reward as keyword arguments. null = the embedded "
                           "shapes prompts.")
    val_files: Any = opt(None, "Validation prompt file(s), as `train_files`; null = the embedded held-out shapes "
                         "prompts.")
    prompt_key: str = opt("prompt", "Field (column) holding the prompt text in .jsonl / .parquet / `datasets` rows.")
    train_batch_size: int = opt(8, "Prompts per training step (each yields rollout.n samples).", gt=0)
    val_batch_size: Any = opt(None, "Validation prompts per generation forward (each gives "
                              "rollout.val_kwargs.n images); null = 32 images per forward.", gt=0)
    val_max_samples: Any = opt(64, "Cap on validation prompts; null = all.", gt=0)
    shuffle: bool = opt(True, "Shuffle prompts each epoch.")
    seed: int = opt(1, "Seed of the prompt order.")
    offline_files: Any = opt(None, "Preference datasets (.jsonl, .parquet or `datasets` folders; "
                             "docs/PREFERENCE_DATA.md) checked and ingested into "
                             "`<trainer.default_local_dir>/offline/` at the start of `train`, as `omnirl-async ingest` "
                             "does; null = none.",
                             no_effect=NoEffect("ingested data is only read with `buffer.offline_mix_ratio` > 0 or "
                                                "`algorithm.sample_source` = offline",
                                                when=_offline_data_unread,
                                                when_doc="while `buffer.offline_mix_ratio` = 0 and "
                                                         "`algorithm.sample_source` = online",
                                                fix="set `buffer.offline_mix_ratio` > 0 or "
                                                    "`algorithm.sample_source=offline`, or leave it at null "
                                                    "(`omnirl-async ingest DATASET --run-dir DIR` fills a run's "
                                                    "offline store without training)"))


@dataclass
class CustomRewardFunctionConfig:
    path: Any = opt(None, "Python file defining the reward function.", string=True)
    name: Any = opt(None, "Function name in that file.", string=True)


@dataclass
class RewardConfig:
    num_workers: int = opt(0, "Reward worker actors shared by all rollout workers; 0 = score inline in each "
                              "rollout worker.", ge=0)
    num_cpus_per_worker: float = opt(1.0, "Ray CPUs reserved per reward worker (with num_workers > 0).", gt=0)
    num_gpus_per_worker: float = opt(0.0, "Ray GPUs reserved per reward worker (a judge model on its own GPU; "
                                     "fractions share one). Refused at start when the Ray cluster lacks them.", ge=0,
                                     no_effect=NoEffect("inline scoring runs inside the rollout workers, which "
                                                        "reserve their own GPUs "
                                                        "(`actor_rollout_ref.rollout.num_gpus_per_worker`)",
                                                        when=_inline_scoring, when_doc="while `num_workers` = 0",
                                                        fix="set `reward.num_workers` > 0 to score on reward "
                                                            "workers with their own GPUs, or leave it at 0"))
    timeout_s: Any = opt(None, "Seconds a reward worker may take for one group before the group is marked "
                               "failed; null = no limit.", gt=0)
    reward_fn_name: str = opt("tiny_geneval", "Built-in reward used when neither custom_reward_function "
                              "nor reward_functions is set.", choices=_rewards)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    reward_functions: Any = opt(None, "{name: {path, name, weight, kwargs}}; path null = built-in registry name.")
    aggregation: str = opt("weighted_sum", "How reward_functions combine.", choices=("weighted_sum",))
    reward_kwargs: dict = opt(factory=dict, help="Extra keyword arguments passed to the reward function.")
    reward_manager: Any = opt(None, "Upstream VeRL's reward-manager choice; the built-in manager is always used, so "
                              "only null or upstream's default 'naive' are accepted.",
                              no_effect=NoEffect("the built-in reward manager (omnirl_async.rewards.RewardManager) is "
                                                 "always used; choose what it scores with `reward.reward_fn_name`, "
                                                 "`reward.reward_functions` or `reward.custom_reward_function`",
                                                 accept=_upstream_reward_manager,
                                                 accept_doc="null, 'naive' (upstream's default)",
                                                 fix="leave it at null (or upstream's default 'naive')"))
    max_failed_frac: float = opt(0.5, "Stop the job when more than this fraction of the last "
                                 "`failed_frac_window` scored samples failed (reward raised, NaN/inf, wrong "
                                 "shape, timeout); 1 = never stop.", ge=0, le=1)
    failed_frac_window: int = opt(64, "Scored samples over which `max_failed_frac` is measured.", gt=0)

    def validate(self, path: str) -> None:
        crf = self.custom_reward_function
        if (crf.path is None) != (crf.name is None):
            raise ValueError(f"`{path}.custom_reward_function` needs both path and name "
                             f"(got path={crf.path!r}, name={crf.name!r}).")
        if crf.path is not None and self.reward_functions:
            raise ValueError(f"`{path}.custom_reward_function` and `{path}.reward_functions` are mutually "
                             "exclusive; set one of them.")
        if self.reward_functions is not None:
            if not isinstance(self.reward_functions, dict) or not self.reward_functions:
                raise ValueError(f"`{path}.reward_functions` = {self.reward_functions!r}: expected a non-empty "
                                 "mapping {name: {path, name, weight}}.")
            allowed = {"path", "name", "weight", "kwargs"}
            for key, spec in self.reward_functions.items():
                if not isinstance(spec, dict):
                    raise ValueError(f"`{path}.reward_functions.{key}` = {spec!r}: expected a mapping.")
                extra = set(spec) - allowed
                if extra:
                    raise ValueError(f"`{path}.reward_functions.{key}` has unknown keys {sorted(extra)}; "
                                     f"allowed: {sorted(allowed)}.")
                weight = spec.get("weight", 1.0)
                if not isinstance(weight, (int, float)):
                    raise ValueError(f"`{path}.reward_functions.{key}.weight` = {weight!r}: expected a number.")
