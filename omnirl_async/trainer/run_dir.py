"""The run directory: every run's resolved config beside its checkpoints and logs, and what reads it back.

``omnirl-async train`` writes ``resolved_config.yaml`` (the validated config,
interpolations resolved) into ``trainer.default_local_dir`` -- the folder of
the run's ``global_step_<N>`` checkpoints -- and into the log folder when a
file logger (tensorboard, wandb) is on. The file is itself a Hydra config
(its defaults list names the schema), so

* ``omnirl-async eval --run DIR`` composes it (plus any overrides) and scores
  the newest verified checkpoint in ``DIR`` with the model, resolution and
  LoRA it was trained with (:func:`load_run_config`, :func:`find_run`);
* ``omnirl-async train --config-dir DIR --config-name resolved_config``
  continues the run with nothing retyped;
* a ``train`` that would resume a checkpoint of ``DIR`` (``trainer.resume_mode``
  auto or resume_path) is compared with the saved file first
  (:func:`check_resume_config`): a changed key the checkpoint depends on (the
  base model, the LoRA's shape, :data:`RESUME_MUST_MATCH`) is refused, any
  other changed key is named in a warning, except those a continued run is
  expected to change (:data:`RESUME_FREE`: its length, logging, checkpoint
  and validation cadence, Ray set-up).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from omegaconf import OmegaConf

from omnirl_async.metrics.loggers import flatten_config, resolve_log_dir
from omnirl_async.preflight import InputError
from omnirl_async.trainer.checkpoint import CheckpointManager, verify_or_raise

__all__ = ["RESOLVED_CONFIG", "RESUME_MUST_MATCH", "RESUME_FREE", "config_dict", "resolved_config_text",
           "run_folders", "write_resolved_config", "read_saved_config", "load_run_config", "find_run",
           "resume_changes", "check_resume_config", "prepare_run_dir", "WANDB_RUN_ID", "wandb_run_id_file",
           "write_wandb_run_id", "wandb_resume_id"]

RESOLVED_CONFIG = "resolved_config.yaml"
#: the W&B run id of a run that logs to W&B, beside its checkpoints: a resumed run continues that W&B run
WANDB_RUN_ID = "wandb_run_id.txt"

#: Keys a checkpoint depends on: resuming it with another value is refused.
RESUME_MUST_MATCH = (
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.transformer_subfolder",
    "actor_rollout_ref.model.lora_rank",
    "actor_rollout_ref.model.lora_alpha",
    "actor_rollout_ref.model.lora_init_weights",
    "actor_rollout_ref.model.target_modules",
    "actor_rollout_ref.model.target_parameters",
    "actor_rollout_ref.model.exclude_modules",
)

#: Key prefixes a continued run may change without a word: its length, logging, cadence, Ray set-up.
RESUME_FREE = (
    "trainer.project_name", "trainer.experiment_name", "trainer.logger", "trainer.log_dir", "trainer.device",
    "trainer.total_epochs", "trainer.total_training_steps", "trainer.total_time_minutes", "trainer.save_freq",
    "trainer.test_freq", "trainer.val_before_train", "trainer.resume_mode", "trainer.resume_from_path",
    "trainer.max_actor_ckpt_to_keep", "trainer.rollout_data_", "trainer.validation_data_max_samples",
    "trainer.progress_bar", "trainer.wait_timeout_s", "ray_kwargs.",
)

_HEADER = """\
# The resolved config of the omnirl-async run in this folder, written by `omnirl-async train`
# (interpolations resolved, every key). Reuse it with nothing retyped:
#   omnirl-async eval --run {folder}      # newest verified checkpoint, this model and resolution
#   omnirl-async train --config-dir {folder} --config-name resolved_config [key=value ...]   # continue the run
defaults:
  - diffusion_trainer_schema
  - _self_

"""


# ---------------------------------------------------------------------------- writing
def config_dict(config) -> dict[str, Any]:
    """The validated config as plain nested dicts and lists (the run's hyperparameters)."""
    return OmegaConf.to_container(OmegaConf.structured(config), resolve=True)


def resolved_config_text(config, folder: str | os.PathLike = "DIR") -> str:
    return _HEADER.format(folder=os.fspath(folder)) + OmegaConf.to_yaml(OmegaConf.create(config_dict(config)))


def run_folders(config) -> list[Path]:
    """``trainer.default_local_dir``, and the log folder when tensorboard or wandb writes there."""
    tcfg = config.trainer
    folders = [Path(tcfg.default_local_dir)]
    loggers = [tcfg.logger] if isinstance(tcfg.logger, str) else list(tcfg.logger or [])
    if {"tensorboard", "wandb"} & set(loggers):
        log_dir = resolve_log_dir(tcfg)
        if log_dir.resolve() != folders[0].resolve():
            folders.append(log_dir)
    return folders


def write_resolved_config(config, folders: Sequence[str | os.PathLike] | None = None) -> list[Path]:
    """Write ``resolved_config.yaml`` into each folder (default :func:`run_folders`), atomically."""
    written = []
    for folder in (run_folders(config) if folders is None else [Path(f) for f in folders]):
        written.append(_write_atomic(folder / RESOLVED_CONFIG, resolved_config_text(config, folder)))
    return written


def _write_atomic(path: Path, text: str) -> Path:
    """``text`` into ``path`` through a temporary sibling and ``os.replace`` (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------- reading
def read_saved_config(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The saved config of the run in ``folder`` as nested dicts (no ``defaults``); None when absent."""
    path = Path(folder) / RESOLVED_CONFIG
    if not path.is_file():
        return None
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    data.pop("defaults", None)
    return data


def load_run_config(folder: str | os.PathLike, overrides: Sequence[str] = ()):
    """Compose ``folder/resolved_config.yaml`` with ``overrides`` and validate it, as ``train`` would."""
    from omnirl_async.config import load_config

    return load_config(list(overrides), config_name=Path(RESOLVED_CONFIG).stem, config_dir=folder)


def find_run(path: str | os.PathLike, *, report: Callable[[str], None] | None = None) -> tuple[Path, Path]:
    """``(run folder, checkpoint)`` for ``eval --run``: a run folder's newest verified checkpoint, or the
    ``global_step_<N>`` folder given (its run folder is the parent)."""
    p = Path(path)
    if (p / RESOLVED_CONFIG).is_file():
        ckpt = CheckpointManager(p).latest_verified(report=report)
        if ckpt is None:
            raise InputError(f"`--run` {os.fspath(path)!r} holds {RESOLVED_CONFIG} but no global_step_<N> "
                             "checkpoint yet. Fix: wait for the run's first checkpoint (`trainer.save_freq`), or "
                             f"score the base model with `omnirl-async eval --config-dir {p} --config-name "
                             "resolved_config`.")
        return p, ckpt
    if p.name.startswith("global_step_") and (p.parent / RESOLVED_CONFIG).is_file():
        return p.parent, verify_or_raise(p)
    where = "its parent has none either" if p.name.startswith("global_step_") else "it is not a run folder"
    raise InputError(f"`--run` {os.fspath(path)!r} has no {RESOLVED_CONFIG} ({where}; "
                     "`omnirl-async train` writes it into `trainer.default_local_dir`). Fix: point `--run` at a "
                     "run's `trainer.default_local_dir` or one of its global_step_<N> folders; for a checkpoint "
                     "written without it use `omnirl-async eval --lora CKPT key=value ...` with the training "
                     "overrides.")


# ---------------------------------------------------------------------------- resume
_ABSENT = "<absent>"


def resume_changes(saved: Mapping, config) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
    """``(refused, noted)``: ``(key, saved value, new value)`` for every changed key that matters."""
    old, new = flatten_config(saved), flatten_config(config_dict(config))
    refused, noted = [], []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if a == b:
            continue
        if key in RESUME_MUST_MATCH:
            refused.append((key, a, b))
        elif not key.startswith(RESUME_FREE):
            noted.append((key, a, b))
    return refused, noted


def _resume_source(config) -> tuple[Path, str] | None:
    """The run folder whose checkpoint this run will resume, and which one; None when it starts fresh."""
    tcfg = config.trainer
    if tcfg.resume_mode == "auto":
        folders = CheckpointManager(tcfg.default_local_dir).step_folders()
        if folders:
            return Path(tcfg.default_local_dir), f"its checkpoints ({folders[0][1].name} the newest)"
    elif tcfg.resume_mode == "resume_path" and tcfg.resume_from_path:
        ckpt = Path(tcfg.resume_from_path)
        return ckpt.parent, f"its checkpoint {ckpt.name}"
    return None


def wandb_run_id_file(config) -> Path:
    """Where this run keeps its W&B run id: :data:`WANDB_RUN_ID` in ``trainer.default_local_dir``."""
    return Path(config.trainer.default_local_dir) / WANDB_RUN_ID


def write_wandb_run_id(config, run_id: str) -> Path:
    """Keep the id of the W&B run this run logs to beside its checkpoints, for :func:`wandb_resume_id`."""
    return _write_atomic(wandb_run_id_file(config), run_id + "\n")


def wandb_resume_id(config) -> str | None:
    """The W&B run a resumed run continues: the id saved beside the checkpoints it resumes. None when the run
    starts fresh, or the run it resumes did not log to W&B (or predates the file): then W&B starts a new run."""
    source = _resume_source(config)
    if source is None:
        return None
    try:
        text = (source[0] / WANDB_RUN_ID).read_text().strip()
    except OSError:
        return None
    return text if text.replace("-", "").replace("_", "").isalnum() else None


def check_resume_config(config, *, printer: Callable[[str], None] = print) -> None:
    """Before a resume: refuse a changed key the checkpoint depends on; name the other changed keys."""
    source = _resume_source(config)
    if source is None:
        return
    folder, what = source
    saved = read_saved_config(folder)
    if saved is None:  # a run written before the file existed: nothing to compare with
        return
    refused, noted = resume_changes(saved, config)
    mode = config.trainer.resume_mode
    if refused:
        raise InputError(_refusal(refused, folder, what, mode))
    if noted:
        shown = "; ".join(f"`{k}`: {_show(a)} -> {_show(b)}" for k, a, b in noted)
        printer(f"warning: resuming the run in {folder} ({what}) with {len(noted)} key(s) changed from its "
                f"{RESOLVED_CONFIG} (saved -> now): {shown}")


def _refusal(refused: list[tuple[str, Any, Any]], folder: Path, what: str, mode: str) -> str:
    """One problem, however many keys changed: the changed keys, then the one fix (not a numbered problem)."""
    run = f"the run in {folder} that `trainer.resume_mode={mode}` resumes ({what})"
    if len(refused) == 1:
        (key, a, b), = refused
        changed = f"`{key}` = {_show(b)}, but {run} was trained with {_show(a)}"
    else:
        keys = "; ".join(f"`{k}` = {_show(b)} (trained with {_show(a)})" for k, a, b in refused)
        changed = f"{len(refused)} keys differ from {run}: {keys}"
    fix_keys = " ".join(f"`{k}={_override_value(a)}`" for k, a, _ in refused)
    return (f"{changed} ({folder / RESOLVED_CONFIG}); a checkpoint only fits the base model and LoRA shape it "
            f"was trained with. Fix: continue that run with its own values (drop the override, or set {fix_keys}), "
            "or start a new run with `trainer.resume_mode=disable` and another `trainer.default_local_dir`.")


def _show(value: Any) -> str:
    return value if isinstance(value, str) and value == _ABSENT else repr(value)


def _override_value(value: Any) -> str:
    """``value`` in Hydra's override grammar (null, true, 8, 'a b', [q,k])."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    if isinstance(value, str) and not value.replace("_", "").replace("-", "").replace(".", "").replace(
            ":", "").replace("/", "").isalnum():
        return repr(value)
    return str(value)


def prepare_run_dir(config, *, printer: Callable[[str], None] = print) -> list[Path]:
    """At the start of ``train``: check a resume against the saved config, then write the new one."""
    check_resume_config(config, printer=printer)
    return write_resolved_config(config)
