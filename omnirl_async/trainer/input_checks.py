"""The driver's preflight: check every file and folder a validated config points at, before Ray starts.

:func:`check_inputs` runs every check in :data:`CHECKS` and raises one
:class:`~omnirl_async.preflight.InputError` listing every problem;
``TaskRunner.run`` calls it before ``init_ray`` and the CLI prints it as one
message with exit code 2.

What is checked (each message names the config key, the file with its line
where there is one, what is wrong and the fix):

* ``data.train_files`` / ``data.val_files`` - read with the prompt loader
  itself (:func:`omnirl_async.data.prompts.read_prompts`), which raises
  :class:`InputError` for a missing file, a directory, an unsupported
  extension, bytes that are not UTF-8, invalid JSON, a row without the prompt
  field, or a file without prompts.
* ``actor_rollout_ref.model.path`` - an ``embedded:`` name the models package
  knows, or a diffusers pipeline folder (``model_index.json`` naming a
  supported pipeline, every listed component folder present).
* ``actor_rollout_ref.model.lora_adapter_path`` - a readable PEFT adapter of the
  declared rank (:func:`omnirl_async.preflight.check_lora_adapter`).
* ``actor_rollout_ref.actor.distill_teacher_path`` (with ``use_distill_loss``) -
  the same checks as the model path, then the teacher's latent layout and
  prompt-embedding widths, read from its JSON configs, must equal the policy's
  (:func:`omnirl_async.models.setup.signature_mismatches`); embedded tiny models
  are built for this (they are cached, and the learners load them anyway).
* ``reward.custom_reward_function`` and every ``reward.reward_functions.*`` -
  the file exists, compiles and binds the function name
  (:func:`omnirl_async.preflight.check_user_definition`); entries without a
  path must name a registered reward.
* ``trainer.v1.sampler.custom_sampler`` - the same for the sampler class.
* ``trainer.resume_from_path`` (with ``trainer.resume_mode=resume_path``) - a
  complete checkpoint folder.

Layer: trainer. The checks need the prompt readers (data), the model registry
(models), the reward registry (rewards) and the checkpoint marker (trainer), so
they sit at the layer that knows all of them; the single-file checks they
share with the loaders of lower layers live in :mod:`omnirl_async.preflight`.
All imports of lower layers happen inside the checks, so importing this module
stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from omnirl_async.preflight import (InputError, _expand, _is_path, _problems_of, _read_json_object, check_lora_adapter,
                                    check_user_definition)

__all__ = [
    "check_inputs",
    "find_input_problems",
    "check_prompt_files",
    "check_model_path",
    "check_resume_folder",
    "CHECKS",
]

MODEL_KEY = "actor_rollout_ref.model.path"
RESUME_KEY = "trainer.resume_from_path"


# --------------------------------------------------------------------------- prompts
def check_prompt_files(config) -> list[str]:
    """``data.train_files`` and ``data.val_files``, read with the prompt loader."""
    from omnirl_async.data.prompts import prompt_file_list, read_prompts

    data = config.data
    problems: list[str] = []
    for key in ("train_files", "val_files"):
        value = getattr(data, key)
        if value is None:
            continue
        try:
            files = prompt_file_list(value, key=f"data.{key}")
        except InputError as err:
            problems.extend(err.problems)
            continue
        for f in files:
            problems += _problems_of(read_prompts, f, prompt_key=data.prompt_key, key=f"data.{key}")
    return problems



# --------------------------------------------------------------------------- model
def check_model_path(path: Any, *, transformer_subfolder: str = "transformer", key: str = MODEL_KEY) -> None:
    """Raise :class:`InputError` unless ``path`` names an embedded model or a usable pipeline folder."""
    if not isinstance(path, str) or not path:
        raise InputError(f"`{key}` = {path!r}: expected a local diffusers pipeline folder or an embedded model "
                         "such as embedded:tiny-sd3.")
    if path.startswith("embedded:"):
        _check_embedded(path, key)
        return
    folder = Path(_expand(path))
    _check_pipeline_folder(folder, key)
    sub = folder / transformer_subfolder
    if not (sub / "config.json").is_file():
        raise InputError(f"`actor_rollout_ref.model.transformer_subfolder` = {transformer_subfolder!r}: {sub} has "
                         f"no config.json; use the name of the folder inside {folder} that holds the saved "
                         "diffusion transformer.")


def _check_embedded(path: str, key: str) -> None:
    from omnirl_async.models.resolve import EMBEDDED_MODELS, resolve_model_path

    name = path.split(":", 1)[1]
    if name not in EMBEDDED_MODELS:
        raise InputError(f"`{key}` = {path!r}: unknown embedded model {name!r}; choose one of "
                         f"{['embedded:' + m for m in EMBEDDED_MODELS]}, or give a local diffusers pipeline folder.")
    if name == "shapes":  # shipped inside the package; the tiny models are built on first use
        try:
            resolve_model_path(path)
        except (FileNotFoundError, ValueError) as err:
            raise InputError(str(err)) from None


def _check_pipeline_folder(folder: Path, key: str) -> None:
    from omnirl_async.models.policy import SUPPORTED_PIPELINES

    if not folder.exists():
        raise InputError(f"`{key}`: model folder {folder} does not exist; give a local diffusers pipeline folder "
                         "(with model_index.json) or an embedded model such as embedded:tiny-sd3.")
    if not folder.is_dir():
        raise InputError(f"`{key}`: {folder} is a file, not a model folder; give the diffusers pipeline folder "
                         "that holds model_index.json.")
    index_file = folder / "model_index.json"
    if not index_file.is_file():
        raise InputError(f"`{key}`: {folder} has no model_index.json, so it is not a diffusers pipeline folder; "
                         "give the folder written by `save_pretrained` (model_index.json, transformer/, vae/, ...).")
    index = _read_json_object(index_file, key, fix="copy the pipeline folder again")
    class_name = index.get("_class_name")
    if class_name not in SUPPORTED_PIPELINES:
        raise InputError(f"`{key}`: {index_file} names a {class_name!r} pipeline; supported pipeline classes are "
                         f"{sorted(SUPPORTED_PIPELINES)}.")
    missing = [name for name, entry in index.items()
               if not name.startswith("_") and isinstance(entry, list) and len(entry) == 2
               and entry != [None, None] and not (folder / name).is_dir()]
    if missing:
        raise InputError(f"`{key}`: {index_file} lists the component(s) {missing} but {folder} has no folder for "
                         "them; the copy or download is incomplete: copy the whole pipeline folder.")



def _check_model(config) -> list[str]:
    model = config.actor_rollout_ref.model
    return _problems_of(check_model_path, model.path, transformer_subfolder=model.transformer_subfolder)



def _check_teacher(config) -> list[str]:
    """The distillation teacher: a loadable pipeline folder whose latents match the policy's."""
    actor, model = config.actor_rollout_ref.actor, config.actor_rollout_ref.model
    if not actor.use_distill_loss:
        return []
    from omnirl_async.models.setup import TEACHER_KEY, folder_latent_signature, resolve_teacher_path

    path = actor.distill_teacher_path
    problems = _problems_of(check_model_path, path, key=TEACHER_KEY)
    if problems or _check_model(config):  # a broken policy path is reported by _check_model
        return problems
    try:
        teacher = folder_latent_signature(resolve_teacher_path(path))
    except (OSError, ValueError) as err:
        return [f"`{TEACHER_KEY}` = {path!r}: the teacher's configs cannot be read ({err}); copy the whole "
                "pipeline folder again, or set `actor_rollout_ref.actor.use_distill_loss=false`."]
    return _teacher_mismatch(path, model, teacher)


def _teacher_mismatch(path: Any, model, teacher: dict) -> list[str]:
    from omnirl_async.models.resolve import resolve_model_path
    from omnirl_async.models.setup import folder_latent_signature, signature_mismatches, teacher_mismatch_message

    try:
        policy = folder_latent_signature(resolve_model_path(model.path), model.transformer_subfolder)
    except (OSError, ValueError):
        return []  # the policy's own folder problem is _check_model's to report
    diffs = signature_mismatches(policy, teacher)
    return [teacher_mismatch_message(path, model.path, diffs)] if diffs else []



def _check_lora(config) -> list[str]:
    folder = config.actor_rollout_ref.model.lora_adapter_path
    if folder is None:
        return []
    return _problems_of(check_lora_adapter, folder)



def _check_rewards(config) -> list[str]:
    reward = config.reward
    crf = reward.custom_reward_function
    problems: list[str] = []
    if crf.path is not None:
        problems += _problems_of(check_user_definition, crf.path, crf.name, key="reward.custom_reward_function")
    for name, entry in (reward.reward_functions or {}).items():
        key = f"reward.reward_functions.{name}"
        fn_name = entry.get("name") or name
        if entry.get("path") is not None:
            problems += _problems_of(check_user_definition, entry["path"], fn_name, key=key)
        else:
            problems += _problems_of(_check_registered_reward, fn_name, key)
    return problems


def _check_registered_reward(name: Any, key: str) -> None:
    from omnirl_async.rewards import registered_rewards

    known = registered_rewards()
    if name not in known:
        raise InputError(f"`{key}.name` = {name!r} is not a registered reward; choose one of {known}, or set "
                         f"`{key}.path` to a .py file that defines it.")


def _check_sampler(config) -> list[str]:
    custom = config.trainer.v1.sampler.custom_sampler
    if custom.path is None:
        return []
    return _problems_of(check_user_definition, custom.path, custom.name, key="trainer.v1.sampler.custom_sampler",
                        kind="class")



# --------------------------------------------------------------------------- resume
def check_resume_folder(path: Any, *, key: str = RESUME_KEY) -> None:
    """Raise :class:`InputError` unless ``path`` is a complete checkpoint folder (``COMPLETE`` inside)."""
    fix = "point it at a complete global_step_<N> folder under `trainer.default_local_dir`, or set " \
          "`trainer.resume_mode=auto` (newest checkpoint there) or `disable`"
    if not _is_path(path):
        raise InputError(f"`{key}` = {path!r}: expected the path of a checkpoint folder; {fix}.")
    folder = Path(_expand(path))
    if not folder.exists():
        raise InputError(f"`{key}`: checkpoint folder {folder} does not exist; {fix}.")
    if not folder.is_dir():
        raise InputError(f"`{key}`: {folder} is a file, not a checkpoint folder; {fix}.")
    marker = _complete_marker()
    if (folder / marker).is_file():
        return
    steps = sorted((d for d in folder.glob("global_step_*") if (d / marker).is_file()),
                   key=lambda d: _step_number(d.name))
    if steps:
        raise InputError(f"`{key}`: {folder} holds checkpoints ({', '.join(d.name for d in steps)}) but is not "
                         f"one itself; point it at one of them, e.g. {steps[-1]}.")
    raise InputError(f"`{key}`: {folder} is not a complete checkpoint (no {marker} marker: the save was "
                     f"interrupted, or this is not a global_step_<N> folder); {fix}.")


def _complete_marker() -> str:
    """The file a committed checkpoint folder holds (the checkpoint module's name for it, when it has one)."""
    try:
        from omnirl_async.trainer.checkpoint import COMPLETE
    except Exception:  # noqa: BLE001 - an older or broken checkpoint module: fall back to the documented name
        return "COMPLETE"
    return COMPLETE if isinstance(COMPLETE, str) else "COMPLETE"


def _step_number(name: str) -> int:
    tail = name.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def _check_resume(config) -> list[str]:
    trainer = config.trainer
    if trainer.resume_mode != "resume_path":
        return []
    return _problems_of(check_resume_folder, trainer.resume_from_path)


# --------------------------------------------------------------------------- entry points
#: Every check: ``config -> list of problems``. Run in this order.
CHECKS: tuple[Callable[[Any], list[str]], ...] = (
    check_prompt_files, _check_model, _check_teacher, _check_lora, _check_rewards, _check_sampler, _check_resume)


def find_input_problems(config) -> list[str]:
    """Run every check in :data:`CHECKS` on a validated config; return all problems (empty: all good)."""
    problems: list[str] = []
    for check in CHECKS:
        problems.extend(check(config))
    return problems


def check_inputs(config) -> None:
    """Raise one :class:`InputError` carrying every problem :func:`find_input_problems` finds."""
    problems = find_input_problems(config)
    if problems:
        raise InputError(problems)
