"""`algorithm.*`: how advantages are formed and how off-policy data is corrected."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnirl_async.config.buffer import OFFLINE_NEEDS_PREFERENCE
from omnirl_async.config.fields import NoEffect, opt

__all__ = ["RolloutCorrectionConfig", "DiffusionAlgoConfig", "PREFERENCE_LOSSES", "DIRECT_PREFERENCE_TRAINER"]

#: The losses of the direct-preference trainer, and which of them read the old adapter / pairs.
PREFERENCE_LOSSES = ("diffusion_nft", "dpo", "awm")
DIRECT_PREFERENCE_TRAINER = "`algorithm.trainer_type` = direct_preference (DiffusionNFT / DPO / AWM)"


def _old_policy_absent(algo: Any, root: Any) -> str | None:
    states = root.actor_rollout_ref.model.policy_state_adapters or ["default"]
    if "old" in states and algo.trainer_type == "direct_preference":
        return None
    return ("while `actor_rollout_ref.model.policy_state_adapters` has no 'old' adapter"
            if algo.trainer_type == "direct_preference" else "with `algorithm.trainer_type` = policy_gradient")


#: The old-policy keys act only when an old adapter exists (DiffusionNFT's rollout policy, AWM's EMA policy).
_OLD_POLICY_ONLY = NoEffect("only the 'old' LoRA adapter (DiffusionNFT / AWM, direct_preference trainer) is "
                            "refreshed on this schedule", when=_old_policy_absent,
                            when_doc="unless `algorithm.trainer_type` = direct_preference and "
                                     "`actor_rollout_ref.model.policy_state_adapters` holds 'old'",
                            fix="leave it at its default ({default}), or add the old adapter: "
                                "`actor_rollout_ref.model.policy_state_adapters=[default,old]`")


def _no_offline_rows(algo: Any, root: Any) -> str | None:
    if root.buffer.offline_mix_ratio > 0 or algo.sample_source == "offline":
        return None
    return "while `buffer.offline_mix_ratio` = 0 and `algorithm.sample_source` = online"


def _sign_adv_mode(algo: Any, root: Any) -> str | None:
    return f"with `algorithm.adv_mode` = {algo.adv_mode}" if algo.adv_mode in ("one_only", "binary") else None


def _pairwise(algo: Any, root: Any) -> str | None:
    return "with `algorithm.paired_preference` = true (dpo)" if algo.paired_preference else None


def _adv_estimators():
    from omnirl_async.algos.advantage import registered_adv_estimators

    return registered_adv_estimators()


@dataclass
class RolloutCorrectionConfig:
    """Importance sampling / rejection sampling between behaviour and proximal policies.

    The schema mirrors upstream verl's ``RolloutCorrectionConfig``. Behaviour
    log-probs come from the rollout worker; proximal ("old") log-probs are
    recomputed by the learner before the update unless ``bypass_mode``.
    """

    rollout_is: Any = opt(None, "IS aggregation level: null (off), token (per SDE step) or sequence (product over steps).",
                          choices=(None, "token", "sequence"))
    rollout_is_threshold: Any = opt(2.0, "A float truncates IS weights at that value (TIS); "
                                    "a string 'lo_hi' such as '0.5_2.0' zeroes weights outside [lo, hi] (masked IS).")
    rollout_is_batch_normalize: bool = opt(False, "Divide IS weights by their batch mean after truncation.")
    rollout_rs: Any = opt(None, "Rejection-sampling criteria, comma list: token_k1, token_k2, token_k3, seq_sum_k1, "
                          "seq_sum_k2, seq_sum_k3, seq_mean_k1, seq_mean_k2, seq_mean_k3, seq_max_k2, seq_max_k3.")
    rollout_rs_threshold: Any = opt(None, "Threshold(s) for rollout_rs: one value for all criteria, or a comma list "
                                    "aligned with them; k1 with a single value u keeps [1/u, u], 'lo_hi' gives both bounds.")
    bypass_mode: bool = opt(False, "Skip the proximal log-probs: old := behaviour, the PPO ratio carries the IS term. "
                            "In separate_async a tiny clip_ratio then clips stale samples' steps away (start-up "
                            "warns); decoupled mode costs no extra pass with one epoch and one mini-batch.")

    def validate(self, path: str) -> None:
        """The thresholds and criteria parse here, at start-up, not when the first loss is built."""
        from omnirl_async.algos import rollout_correction as rc

        for key, check in (("rollout_is_threshold", lambda: rc.parse_is_threshold(self.rollout_is_threshold)),
                           ("rollout_rs", lambda: rc._parse_criteria(self.rollout_rs) if self.rollout_rs else None),
                           ("rollout_rs_threshold", lambda: rc.parse_rs_thresholds(
                               rc._parse_criteria(self.rollout_rs), self.rollout_rs_threshold)
                            if self.rollout_rs else None)):
            try:
                check()
            except (ValueError, TypeError) as err:
                text = str(err)  # the parsers' messages already name the key when they can
                raise ValueError(text if text.startswith("`") else
                                 f"`{path}.{key}` = {getattr(self, key)!r}: {text}") from None


@dataclass
class DiffusionAlgoConfig:
    trainer_type: str = opt("policy_gradient", "policy_gradient (FlowGRPO family) or direct_preference.",
                            choices=("policy_gradient", "direct_preference"))
    sample_source: str = opt("online", "online (rollout + reward) or offline: train on the run's offline store "
                             "alone (`omnirl-async ingest`, docs/PREFERENCE_DATA.md), no rollout workers; each update "
                             "takes data.train_batch_size * rollout.n offline rows.",
                             choices=("online", "offline"), no_effect=OFFLINE_NEEDS_PREFERENCE)
    adv_estimator: str = opt("${oc.select:actor_rollout_ref.model.algorithm,flow_grpo}",
                             "Advantage estimator registry key; defaults to actor_rollout_ref.model.algorithm.",
                             choices=_adv_estimators)
    norm_adv_by_std_in_grpo: bool = opt(True, "Divide group-centred rewards by the std (GRPO); false = mean-centring only.")
    global_std: bool = opt(True, "Use the std over the whole batch instead of within each group (the grpo_guard and "
                           "dance_grpo presets set false).")
    old_policy_decay_schedule: str = opt("copy", "DiffusionNFT old-policy EMA schedule.",
                                         choices=("copy", "linear_to_0_5", "delayed_linear_to_0_999"),
                                         no_effect=_OLD_POLICY_ONLY)
    old_policy_decay: Any = opt(None, "Fixed old-policy EMA decay in [0, 1]; overrides the schedule.", ge=0.0, le=1.0,
                                no_effect=_OLD_POLICY_ONLY)
    old_policy_update_interval: int = opt(1, "DiffusionNFT optimizer steps between old-policy refreshes.", gt=0,
                                          no_effect=_OLD_POLICY_ONLY)
    timestep_fraction: float = opt(1.0, "Fraction of the trained SDE steps used per sample, in (0, 1].", gt=0.0, le=1.0)
    adv_mode: str = opt("continuous", "Advantage mapping.",
                        choices=("continuous", "positive_only", "negative_only", "one_only", "binary"))
    paired_preference: bool = opt(False, "Batches of (winner, loser) pairs, never split across mini-batches or "
                                  "learners; the pair-based loss (dpo) needs it. Online pairs are the best and worst "
                                  "sample of each group (ties skipped).")
    offline_advantage: Any = opt(
        None, "Advantage an offline pair's chosen (+a) and rejected (-a) sample train with in the pointwise losses "
        "(DiffusionNFT: r = a / (2 adv_clip_max) + 0.5; AWM's weight); null = actor.diffusion_loss.adv_clip_max, "
        "so r = 1 / 0. About 1 puts a pair on the scale of the best and worst sample of a normalised online group.",
        gt=0, no_effect=(NoEffect("no offline pair is trained", when=_no_offline_rows,
                                  when_doc="while `buffer.offline_mix_ratio` = 0 and `algorithm.sample_source` = online",
                                  fix="leave it at {default}, or mix offline pairs in (`buffer.offline_mix_ratio` > 0, "
                                      "or `algorithm.sample_source=offline`)"),
                         NoEffect("the pairwise loss (dpo) compares the two samples of a pair and gives them no "
                                  "advantage", when=_pairwise,
                                  when_doc="with `algorithm.paired_preference` = true (dpo)",
                                  fix="leave it at {default}, or use a pointwise loss (diffusion_nft, awm)"),
                         NoEffect("`algorithm.adv_mode` maps every advantage, the offline ones too, to 1 / 0 / -1 "
                                  "whatever its size", when=_sign_adv_mode,
                                  when_doc="with `algorithm.adv_mode` = one_only or binary",
                                  fix="leave it at {default}, or use adv_mode continuous, positive_only or "
                                      "negative_only")))
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
