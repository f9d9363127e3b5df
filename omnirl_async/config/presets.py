"""Algorithm presets: choosing an algorithm sets its documented defaults unless you set them yourself.

``actor_rollout_ref.model.algorithm=X`` picks the loss and the advantage estimator (by interpolation) and, with
this module, the other keys X's documentation gives a value: GRPO-Guard's tiny clip range and per-group std,
DanceGRPO's SDE step, the direct-preference trainer type and old adapter of DiffusionNFT, and so on. The SDE
variant is a second trigger: ``actor_rollout_ref.rollout.algo.sde_type`` = cps / dance sets the noise level that
variant is documented with (and cps its clip range), whichever algorithm trains on it.

The rule (precedence, lowest to highest)::

    schema default  <  trainer YAML (diffusion_trainer.yaml)  <  preset  <  recipe YAML  <  command line

* **Set by you** means: the key, a section above it or a key below it is written in a config file of the
  composition other than the trainer YAML ``diffusion_trainer`` and the schema (a recipe given with
  ``--config-name`` and every file in its defaults list, e.g. a saved ``resolved_config.yaml``), or is named by
  a command-line override (``key=v``, ``+key=v``, ``++key=v``, ``~key``). It is decided from *where* a key is
  written, not from its value: ``clip_ratio=1e-4`` on the command line keeps 1e-4 with grpo_guard even though
  that is also the trainer YAML's value.
* The preset of ``actor_rollout_ref.model.algorithm`` (the value after the recipe and the command line) is
  applied first. Then the preset of ``actor_rollout_ref.rollout.algo.sde_type`` (the value after the algorithm's
  preset, which may have set it), for the policy-gradient trainer type only, on the keys neither you nor the
  algorithm's preset set: the algorithm is the more specific choice (grpo_guard on cps keeps clip 2e-6).
* Presets are applied to the composed config *before* validation, so every start-up check (unknown keys,
  refused values, the cross-key checks of ``DiffusionTrainerConfig.validate``) sees the final values. A
  refusal of a key a preset set says so, and names the preset's keys you overrode.
* ``omnirl-async config actor_rollout_ref.model.algorithm=X`` prints, above the YAML, which preset keys were
  applied and which of them you kept at your own value.

flow_grpo and mix_grpo have no preset: the trainer YAML's values (noise level 0.7, clip 1e-4, global std, the
``sde`` step) are Flow-GRPO's documented defaults, and MixGRPO's window depends on the number of steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

from omegaconf import DictConfig, OmegaConf

__all__ = ["ALGORITHM", "SDE_TYPE", "Preset", "ALGORITHM_PRESETS", "SDE_TYPE_PRESETS", "STAGES", "Setting",
           "PresetReport", "is_user_set", "apply_presets", "applied_presets", "attach", "describe", "explain",
           "render_table"]

ALGORITHM = "actor_rollout_ref.model.algorithm"
SDE_TYPE = "actor_rollout_ref.rollout.algo.sde_type"
TRAINER_TYPE = "algorithm.trainer_type"

_NOISE = "actor_rollout_ref.rollout.algo.noise_level"
_CLIP = "actor_rollout_ref.actor.diffusion_loss.clip_ratio"
_GLOBAL_STD = "algorithm.global_std"


@dataclasses.dataclass(frozen=True)
class Preset:
    """The values one choice implies, and where they are documented."""

    source: str
    values: Mapping[str, Any]
    #: applies only with this ``algorithm.trainer_type`` (None: always)
    trainer_type: str | None = None


#: ``actor_rollout_ref.model.algorithm`` -> its documented defaults ({dotted key: value}).
ALGORITHM_PRESETS: dict[str, Preset] = {
    # GRPO-Guard: ALGORITHMS.md "GRPO-Guard" -- "Defaults: clip 2e-6, global_std off".
    "grpo_guard": Preset('ALGORITHMS.md "GRPO-Guard" (Defaults: clip 2e-6, global_std off)', {
        _CLIP: 2e-6,
        _GLOBAL_STD: False,
    }),
    # DanceGRPO: ALGORITHMS.md "DanceGRPO step" -- its own step and a per-group (unbiased) std. The step's eta
    # (noise level 0.3) comes with the step: the sde_type=dance preset below, so that it follows the step you
    # train with (dance_grpo on sde_type=cps gets cps's noise level).
    "dance_grpo": Preset('ALGORITHMS.md "DanceGRPO step" (its own step, per-group std)', {
        SDE_TYPE: "dance",
        _GLOBAL_STD: False,
    }),
    # Flow-DPPO: ALGORITHMS.md "Flow-DPPO" -- drift threshold tau = 1e-5, drift normalised by the noise scale
    # (the trainer YAML already has both; listed so that the choice is visible).
    "flow_dppo": Preset('ALGORITHMS.md "Flow-DPPO" (tau = kl_mask_threshold 1e-5, add_kl_coefficient)', {
        "actor_rollout_ref.actor.diffusion_loss.kl_mask_threshold": 1e-5,
        "actor_rollout_ref.actor.diffusion_loss.add_kl_coefficient": True,
    }),
    # DiffusionNFT: ALGORITHMS.md "DiffusionNFT (direct preference, forward process)" -- "Rollout with the 'old'
    # adapter, deterministic sampler"; beta = 1 and the linear_to_0_5 old-policy schedule are the settings of
    # the diffusion_nft recipe (docs/PREFERENCE.md, "mix_beta (1.0 in the recipe)").
    "diffusion_nft": Preset('ALGORITHMS.md "DiffusionNFT"; docs/PREFERENCE.md (mix_beta 1.0, linear_to_0_5)', {
        TRAINER_TYPE: "direct_preference",
        "actor_rollout_ref.model.policy_state_adapters": ["default", "old"],
        "actor_rollout_ref.rollout.rollout_adapter": "old",
        _NOISE: 0.0,
        "algorithm.old_policy_decay_schedule": "linear_to_0_5",
        "actor_rollout_ref.actor.diffusion_loss.mix_beta": 1.0,
    }),
    # Diffusion-DPO: ALGORITHMS.md "Diffusion-DPO (flow matching)" -- winner/loser pairs (online: best and worst
    # of each group); deterministic rollouts as in the dpo recipe (docs/PREFERENCE.md).
    "dpo": Preset('ALGORITHMS.md "Diffusion-DPO (flow matching)" (pairs); docs/PREFERENCE.md (ODE rollouts)', {
        TRAINER_TYPE: "direct_preference",
        "algorithm.paired_preference": True,
        _NOISE: 0.0,
    }),
    # AWM: ALGORITHMS.md "AWM (advantage weighted matching)" -- a direct-preference (forward-process) loss;
    # deterministic rollouts as in the awm recipe (docs/PREFERENCE.md).
    "awm": Preset('ALGORITHMS.md "AWM (advantage weighted matching)"; docs/PREFERENCE.md (ODE rollouts)', {
        TRAINER_TYPE: "direct_preference",
        _NOISE: 0.0,
    }),
}

#: ``actor_rollout_ref.rollout.algo.sde_type`` -> the defaults of that SDE step (policy-gradient trainer only:
#: a direct-preference loss has no per-step ratio to clip, and its rollouts are deterministic by preset).
SDE_TYPE_PRESETS: dict[str, Preset] = {
    # CPS: ALGORITHMS.md "CPS step (sde_type = cps), default a = 0.8" -- log-probs without variance scaling,
    # "which is why their clip ranges are tiny (1e-5)".
    "cps": Preset('ALGORITHMS.md "CPS step" (default a = 0.8; unscaled log-probs, clip 1e-5)', {
        _NOISE: 0.8,
        _CLIP: 1e-5,
    }, trainer_type="policy_gradient"),
    # DanceGRPO's step: ALGORITHMS.md "DanceGRPO step" -- "Constant sig = eta (default 0.3)".
    "dance": Preset('ALGORITHMS.md "DanceGRPO step" (constant sig = eta, default 0.3)', {
        _NOISE: 0.3,
    }, trainer_type="policy_gradient"),
}

#: (trigger key, its presets), in the order they are applied.
STAGES: tuple[tuple[str, dict[str, Preset]], ...] = ((ALGORITHM, ALGORITHM_PRESETS), (SDE_TYPE, SDE_TYPE_PRESETS))


@dataclasses.dataclass(frozen=True)
class Setting:
    """One key of a preset: applied (``yours`` is None) or kept at the value you set (``yours``)."""

    key: str
    value: Any
    trigger: str      # e.g. "actor_rollout_ref.model.algorithm=dance_grpo"
    source: str
    yours: Any = None


@dataclasses.dataclass(frozen=True)
class PresetReport:
    applied: tuple[Setting, ...] = ()
    kept: tuple[Setting, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.applied or self.kept)

    def triggers(self) -> list[str]:
        return list(dict.fromkeys(s.trigger for s in (*self.applied, *self.kept)))


def is_user_set(key: str, user_keys: Iterable[str]) -> bool:
    """Whether ``key`` is set by one of ``user_keys``: the same key, a section above it, or a key below it."""
    for u in user_keys:
        if u == key or key.startswith(u + ".") or u.startswith(key + "."):
            return True
    return False


def _select(cfg: DictConfig, key: str) -> Any:
    try:
        return OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
    except Exception:  # noqa: BLE001 - a broken interpolation or section: validation reports it with its key
        return None


def _show(value: Any) -> str:
    """A value as one writes it in an override: null, true, 1e-05, old, [default, old]."""
    from omnirl_async.config.validate import show_value

    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_show(v) for v in value) + "]"
    return show_value(value)


def apply_presets(cfg: DictConfig, user_keys: Iterable[str]) -> PresetReport:
    """Apply the presets the composed ``cfg`` selects, in place, except on keys in ``user_keys`` (see the module
    docstring for the rule). Returns what was applied and what was kept at your value."""
    from omnirl_async.config.validate import ConfigError

    user_keys = list(user_keys)
    applied: list[Setting] = []
    kept: list[Setting] = []
    claimed: set[str] = set()
    for trigger_key, table in STAGES:
        choice = _select(cfg, trigger_key)
        preset = table.get(choice) if isinstance(choice, str) else None
        if preset is None:
            continue
        if preset.trainer_type is not None and _select(cfg, TRAINER_TYPE) != preset.trainer_type:
            continue
        trigger = f"{trigger_key}={choice}"
        for key, value in preset.values.items():
            if key in claimed:
                continue
            claimed.add(key)
            if is_user_set(key, user_keys):
                yours = _select(cfg, key)
                if OmegaConf.is_config(yours):
                    yours = OmegaConf.to_container(yours, resolve=False)
                kept.append(Setting(key, value, trigger, preset.source, yours=yours))
                continue
            try:
                OmegaConf.update(cfg, key, value, merge=False)
            except Exception as err:  # noqa: BLE001 - OmegaConf's errors come in several types
                reason = str(err).splitlines()[0] if str(err).strip() else type(err).__name__
                raise ConfigError(f"`{key}`: the preset of `{trigger}` cannot set it to {_show(value)} ({reason}); "
                                  f"set `{key}` yourself, or fix the section that holds it.") from None
            applied.append(Setting(key, value, trigger, preset.source))
    return PresetReport(tuple(applied), tuple(kept))


_ATTR = "_omnirl_presets"


def attach(config: Any, report: PresetReport) -> Any:
    """Remember on a loaded config object which presets made it (read back with :func:`applied_presets`)."""
    object.__setattr__(config, _ATTR, report)
    return config


def applied_presets(config: Any) -> PresetReport:
    """The presets :func:`omnirl_async.config.load_config` applied to ``config`` (empty for any other object)."""
    report = getattr(config, _ATTR, None)
    return report if isinstance(report, PresetReport) else PresetReport()


def describe(report: PresetReport) -> str:
    """Comment lines (YAML-safe) saying which preset keys were applied and which you set yourself."""
    if not report:
        return ""
    lines = ["# Presets (omnirl_async/config/presets.py); a key you set in a recipe or on the command line wins:"]
    for trigger in report.triggers():
        mine = [s for s in report.applied if s.trigger == trigger]
        yours = [s for s in report.kept if s.trigger == trigger]
        source = (mine or yours)[0].source
        lines.append(f"#   preset of {trigger}  ({source})")
        lines += [f"#     applied  {s.key}={_show(s.value)}" for s in mine]
        lines += [f"#     yours    {s.key}={_show(s.yours)}  (the preset's: {_show(s.value)})" for s in yours]
    return "\n".join(lines) + "\n"


def explain(message: str, report: PresetReport) -> str:
    """A start-up refusal whose key a preset set: say so, and name the keys of that preset you set otherwise."""
    for s in report.applied:
        if message.startswith(f"`{s.key}`"):
            note = f" (`{s.key}` = {_show(s.value)} comes from the preset of `{s.trigger}`"
            differ = [k for k in report.kept if k.trigger == s.trigger and k.yours != k.value]
            if differ:
                mine = ", ".join(f"`{k.key}={_show(k.yours)}` (the preset's: {_show(k.value)})" for k in differ)
                note += f"; you set {mine}: drop that, or also set `{s.key}` yourself"
            else:
                note += f"; set `{s.key}` yourself to override it"
            return message + note + ")"
    return message


def render_table() -> str:
    """The presets as a Markdown section (for docs/CONFIG_KEYS.md)."""
    out = ["\n## Algorithm presets\n",
           "Choosing `actor_rollout_ref.model.algorithm` (or `actor_rollout_ref.rollout.algo.sde_type`) sets these "
           "keys unless a recipe or the command line sets them (precedence: trainer YAML < preset < recipe < "
           "command line; the SDE-step presets apply with `algorithm.trainer_type` = policy_gradient, after the "
           "algorithm's, to the keys it left). `omnirl-async config actor_rollout_ref.model.algorithm=X` lists "
           "what was applied. Table and rule: `omnirl_async/config/presets.py`.\n",
           "| Choice | Sets | Source |", "|---|---|---|"]
    for trigger_key, table in STAGES:
        for choice, preset in table.items():
            sets = ", ".join(f"`{k}={_show(v)}`" for k, v in preset.values.items())
            out.append(f"| `{trigger_key}={choice}` | {sets} | {preset.source.replace('|', '/')} |")
    return "\n".join(out) + "\n"
