"""Export a trained LoRA as a diffusers pipeline LoRA (``omnirl-async export``).

Why: checkpoints keep the adapter in PEFT's format (``adapter_model.safetensors``,
keys ``base_model.model.…``). A plain diffusers ``pipe.load_lora_weights(folder)``
on such a folder returns normally and loads *nothing* (it only logs that no key
matched the ``transformer`` prefix), so the "trained" pipeline silently is the
base model. The pipeline's own format is ``pytorch_lora_weights.safetensors``
with keys ``transformer.<module>.lora_A.weight`` / ``.lora_B.weight`` and the
``LoraConfig`` (rank, alpha, ...) in the file's ``lora_adapter_metadata``, as
written by the pipeline class's ``save_lora_weights``.

Since this version ``FlowMatchPolicy.save_lora`` writes both formats into every
checkpoint's ``lora/`` folder, and ``pipe.load_lora_weights("<ckpt>/global_step_N/lora")``
works directly. :func:`export_lora` converts any PEFT adapter folder (also one
from an older checkpoint) into a folder that holds only the diffusers file.

CKPT may be a checkpoint step folder (``global_step_N``), its ``lora/`` folder,
or any PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).
Anything else raises :class:`~omnirl_async.preflight.InputError` with one line
saying what the folder is and what to pass instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from omnirl_async.models import lora as _lora
from omnirl_async.preflight import InputError, check_lora_adapter

__all__ = ["ExportResult", "find_adapter_folder", "export_lora", "diffusers_snippet", "load_in_diffusers",
           "lora_module_names"]

#: Name used for CKPT in error messages.
ARG = "CKPT"
_PEFT_FILES = (_lora.PEFT_CONFIG, _lora.PEFT_WEIGHTS)
_WANT = ("pass a checkpoint step folder (global_step_N), its lora/ folder, or a PEFT adapter folder "
         "(adapter_config.json + adapter_model.safetensors)")


@dataclasses.dataclass
class ExportResult:
    """What :func:`export_lora` wrote."""

    source: Path  #: the PEFT adapter folder that was read
    weights: Path  #: the diffusers LoRA file written
    pipeline_class: str  #: e.g. "StableDiffusion3Pipeline"
    base: str | None  #: the base pipeline folder, when known
    rank: int
    alpha: float
    num_modules: int  #: LoRA-wrapped modules (each has a lora_A and a lora_B tensor)
    null_components: tuple[str, ...] = ()  #: base components saved as [null, null] (e.g. no T5)

    @property
    def folder(self) -> Path:
        return self.weights.parent

    def snippet(self, prompt: str = "a photo of a cat") -> str:
        return diffusers_snippet(self.folder, self.pipeline_class, base=self.base,
                                 null_components=self.null_components, prompt=prompt)


# --------------------------------------------------------------------------- finding the adapter
def _has_peft(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _PEFT_FILES)


def find_adapter_folder(ckpt: str | os.PathLike) -> Path:
    """The PEFT adapter folder that ``ckpt`` names; :class:`InputError` (one line) when there is none."""
    path = Path(ckpt).expanduser()
    if not path.exists():
        raise InputError(f"export: {ARG} {str(ckpt)!r} does not exist; {_WANT}.")
    if not path.is_dir():
        raise InputError(f"export: {ARG} {str(ckpt)!r} is a file, not a LoRA folder; {_WANT}.")
    if _has_peft(path):
        return path
    if _has_peft(path / "lora"):
        return path / "lora"
    raise InputError(f"export: {ARG} {str(ckpt)!r} is not a LoRA: {_what_is(path)}.")


def _what_is(path: Path) -> str:
    """What a folder without a PEFT adapter is, and what to pass instead, for the error message."""
    if (path / "lora").is_dir():
        return f"its lora/ folder {_what_is(path / 'lora').removeprefix('it ')}"
    if (path / "learner.msgpack").is_file() or (path / "manifest.json").is_file():
        return ("it is a checkpoint without a lora/ folder (a full fine-tuning run, lora_rank=0, has no LoRA "
                "to export)")
    steps = sorted(path.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1])
                   if p.name.rsplit("_", 1)[1].isdigit() else -1)
    if steps or (path / "latest_checkpointed_iteration.txt").is_file():
        hint = f", e.g. {steps[-1]}" if steps else ""
        return f"it is a checkpoint root folder; pass one of its global_step_N folders{hint}"
    if (path / "model_index.json").is_file():
        return f"it is a diffusers pipeline folder (a base model), not an adapter; {_WANT}"
    if (path / _lora.DIFFUSERS_WEIGHTS).is_file():
        return (f"it holds only a diffusers {_lora.DIFFUSERS_WEIGHTS}, which already loads with "
                "pipe.load_lora_weights(folder); to export again, pass the PEFT adapter folder it came from")
    present = [n for n in _PEFT_FILES if (path / n).is_file()]
    if present:
        missing = [n for n in _PEFT_FILES if n not in present][0]
        return f"it has {present[0]} but no {missing}; {_WANT}"
    return f"no {' or '.join(_PEFT_FILES)} there or in a lora/ folder inside; {_WANT}"


def _check_against_manifest(adapter: Path) -> None:
    """When ``adapter`` is a checkpoint's lora/ folder, check its files against the checkpoint manifest."""
    step = adapter.parent
    manifest_file = step / "manifest.json"
    if adapter.name != "lora" or not manifest_file.is_file():
        return
    try:
        entries = json.loads(manifest_file.read_text()).get("files", [])
    except (OSError, ValueError, AttributeError):
        return  # an unreadable manifest is the checkpoint loader's business; the adapter itself was checked
    for entry in entries:
        rel = str(entry.get("path", "")) if isinstance(entry, dict) else ""
        if not rel.startswith("lora/") or rel.removeprefix("lora/") not in _PEFT_FILES:
            continue
        file = step / rel
        digest = hashlib.sha256()
        with open(file, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
        if digest.hexdigest() != entry.get("sha256"):
            raise InputError(f"export: {file} differs from the SHA-256 recorded in {manifest_file} (damaged on "
                             "disk); export an older global_step_N folder instead.")


# --------------------------------------------------------------------------- pipeline class
def _base_info(base: str | os.PathLike) -> tuple[str, str, tuple[str, ...]]:
    """(folder, pipeline class name, components saved as [null, null]) of a base model."""
    from omnirl_async.models.policy import SUPPORTED_PIPELINES
    from omnirl_async.models.resolve import resolve_model_path

    try:
        folder = resolve_model_path(str(base))
    except (FileNotFoundError, ValueError) as err:
        raise InputError(f"export: --base: {err}") from None
    index_file = folder / "model_index.json"
    if not index_file.is_file():
        raise InputError(f"export: --base {str(base)!r} is not a diffusers pipeline folder (no model_index.json); "
                         "pass the model the LoRA was trained on (actor_rollout_ref.model.path).")
    index = json.loads(index_file.read_text())
    cls = index.get("_class_name")
    if cls not in SUPPORTED_PIPELINES:
        raise InputError(f"export: --base {str(base)!r} holds a {cls!r} pipeline; supported: "
                         f"{sorted(SUPPORTED_PIPELINES)}.")
    import diffusers

    optional = set(getattr(getattr(diffusers, cls), "_optional_components", []))
    nulls = tuple(k for k, v in index.items()
                  if not k.startswith("_") and v == [None, None] and k not in optional)
    return str(folder), cls, nulls


def _guess_pipeline_class(state: dict) -> str:
    """Flux transformers have ``single_transformer_blocks``; SD3's do not. (Both write the same file.)"""
    return "FluxPipeline" if any(k.startswith("single_transformer_blocks.") for k in state) else \
        "StableDiffusion3Pipeline"


# --------------------------------------------------------------------------- export
def export_lora(ckpt: str | os.PathLike, out: str | os.PathLike, *, base: str | os.PathLike | None = None
                ) -> ExportResult:
    """Write the adapter that ``ckpt`` names as ``<out>/pytorch_lora_weights.safetensors``.

    ``base`` (optional) is the base model the LoRA was trained on, a pipeline
    folder or an ``embedded:`` name: it fixes the pipeline class and goes into
    :meth:`ExportResult.snippet`. Without it the class is inferred from the
    adapter's module names. Raises :class:`InputError` for anything that is not
    a usable LoRA.
    """
    import diffusers

    adapter = find_adapter_folder(ckpt)
    check_lora_adapter(str(adapter), key=ARG)
    _check_against_manifest(adapter)
    config, state = _lora.read_adapter(adapter)
    base_folder, nulls = None, ()
    if base is not None:
        base_folder, cls_name, nulls = _base_info(base)
    else:
        cls_name = _guess_pipeline_class(state)
    pipeline_cls = getattr(diffusers, cls_name)
    problem = _lora.diffusers_export_problem(config, pipeline_cls)
    if problem is not None:
        raise InputError(f"export: {adapter} cannot be written as a diffusers LoRA: {problem}.")
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise InputError(f"export: --out {str(out)!r} is a file; pass a folder (it is created if missing).")
    weights = _lora.save_diffusers_lora(state, config, out, pipeline_cls)
    modules = lora_module_names(state)
    return ExportResult(source=adapter.resolve(), weights=weights.resolve(), pipeline_class=cls_name,
                        base=base_folder, rank=int(config.r), alpha=float(config.lora_alpha),
                        num_modules=len(modules), null_components=nulls)


def lora_module_names(state: dict) -> set[str]:
    """Module names that a LoRA state dict (peft or diffusers keys) wraps."""
    names = set()
    for key in state:
        if ".lora_A." in key:
            names.add(key.removeprefix(_lora.PEFT_FILE_PREFIX).removeprefix(_lora.DIFFUSERS_TRANSFORMER_PREFIX)
                      .split(".lora_A.")[0])
    return names


def diffusers_snippet(lora_dir: str | os.PathLike, pipeline_class: str = "StableDiffusion3Pipeline", *,
                      base: str | None = None, null_components: tuple[str, ...] = (),
                      prompt: str = "a photo of a cat") -> str:
    """Copy-paste Python that loads the base pipeline plus the exported LoRA with plain diffusers."""
    base_line = f"base = {str(base)!r}" if base else \
        'base = "path/to/base-model"  # the diffusers folder or Hub id the LoRA was trained on'
    extra = "".join(f", {name}=None" for name in null_components)
    if pipeline_class == "FluxPipeline":
        guidance, why = "guidance_scale=3.5", "# guidance_scale: the rollout's guidance_scale"
    else:
        guidance, why = "guidance_scale=1.0", "# guidance_scale: the rollout's true_cfg_scale (1.0 = no CFG)"
    lines = [
        f"from diffusers import {pipeline_class}",
        "",
        base_line,
        f"pipe = {pipeline_class}.from_pretrained(base{extra})  # on a GPU: dtype=torch.bfloat16, then .to(\"cuda\")",
    ]
    if not base and pipeline_class != "FluxPipeline":
        lines.append("# a model saved without T5 (the project's tiny and shapes models) also needs "
                     "text_encoder_3=None, tokenizer_3=None above")
    lines += [
        f"pipe.load_lora_weights({str(lora_dir)!r})",
        'assert pipe.get_active_adapters(), "no LoRA layers were loaded"',
        why,
        f"image = pipe({prompt!r}, num_inference_steps=28, {guidance}).images[0]",
        'image.save("sample.png")',
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- checking a load
def load_in_diffusers(base: str | os.PathLike, lora_dir: str | os.PathLike, *, pipeline_class: str | None = None):
    """Load ``base`` with plain diffusers, then ``load_lora_weights(lora_dir)``; return the pipeline.

    Raises ``RuntimeError`` when diffusers attached no LoRA layer (the silent
    failure this module exists for). Components saved as ``[null, null]`` are
    passed as ``None``, as diffusers requires.
    """
    import diffusers
    from peft.tuners.tuners_utils import BaseTunerLayer

    folder, cls_name, nulls = _base_info(base)
    cls = getattr(diffusers, pipeline_class or cls_name)
    from diffusers.utils import logging as dlogging

    pipe = cls.from_pretrained(folder, local_files_only=True, **{k: None for k in nulls})
    pipe.set_progress_bar_config(disable=True)
    level = dlogging.get_verbosity()
    dlogging.set_verbosity_error()  # silence "No LoRA keys ... text_encoder": this LoRA has none by design
    try:
        pipe.load_lora_weights(str(lora_dir))
    finally:
        dlogging.set_verbosity(level)
    wrapped = [n for n, m in pipe.transformer.named_modules() if isinstance(m, BaseTunerLayer)]
    if not wrapped or not pipe.get_active_adapters():
        raise RuntimeError(f"diffusers loaded no LoRA layer from {lora_dir}: is {_lora.DIFFUSERS_WEIGHTS} there?")
    return pipe
