"""LoRA adapters on a diffusers transformer, through peft, in PEFT's file format.

Concepts
--------
A LoRA adapter adds ``B @ A`` (rank ``r``, scaled by ``alpha / r``) to the
output of a frozen ``nn.Linear``. peft replaces each targeted Linear by a
``LoraLayer`` that holds the original layer as ``base_layer`` plus the
``lora_A``/``lora_B`` matrices of one or more *named* adapters. We always use
one adapter, named :data:`ADAPTER_NAME`.

Why ``inject_adapter_in_model`` and not ``get_peft_model``: the latter wraps the
transformer in a ``PeftModel`` whose ``forward`` signature is the one of a
transformers model, and whose parameter names gain a ``base_model.model.``
prefix. Injecting in place keeps the diffusers module (its ``forward`` and
config untouched) and the parameter names stable, which is what a weight
broadcast between processes needs.

Three exactness properties the RL code relies on:

* peft's default (and ``"gaussian"``) init sets ``B = 0``: right after
  :func:`add_lora` the model computes exactly the base function, so version 0
  of the policy is the pretrained model.
* :func:`disabled_adapter` switches every LoRA layer to its ``base_layer``
  alone: the reference policy for KL terms is the base model, bit for bit.
* :func:`lora_state_dict` / :func:`load_lora_state_dict` copy tensors in place,
  keyed in peft's format (adapter name removed, e.g.
  ``transformer_blocks.0.attn.to_q.lora_A.weight``): a round trip is exact and
  optimizer references to the parameters stay valid.

Files: :func:`save_lora` writes a PEFT adapter folder
(``adapter_model.safetensors`` + ``adapter_config.json``) whose keys carry the
``base_model.model.`` prefix, exactly as ``PeftModel.save_pretrained`` would, so
``PeftModel.from_pretrained(transformer, folder)`` loads it; diffusers loads it
with ``transformer.load_lora_adapter(folder, weight_name="adapter_model.safetensors",
prefix="base_model.model")``.

Given the pipeline class (``pipeline_cls=``, as ``FlowMatchPolicy.save_lora``
does), :func:`save_lora` also writes the pipeline's own LoRA file into the same
folder with :func:`save_diffusers_lora`: ``pytorch_lora_weights.safetensors``,
keys ``transformer.<module>.lora_A.weight`` / ``.lora_B.weight``, written by the
pipeline class's ``save_lora_weights`` with the ``LoraConfig`` (rank, alpha,
rslora, patterns) in the file's ``lora_adapter_metadata``, so that a plain
``pipe.load_lora_weights(folder)`` attaches the adapter with the right scaling.
Plain ``load_lora_weights(folder)`` picks that file even with the PEFT file
beside it (diffusers prefers a file named ``pytorch_lora_weights.safetensors``);
on the PEFT file alone it would load nothing, and say so only in a log line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

ADAPTER_NAME = "default"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
#: The key prefix peft's ``PeftModel`` uses in saved adapter files.
PEFT_FILE_PREFIX = "base_model.model."
#: The file diffusers' ``save_lora_weights`` writes and ``load_lora_weights(folder)`` looks for first.
DIFFUSERS_WEIGHTS = "pytorch_lora_weights.safetensors"
#: The component prefix of the transformer's keys in a diffusers pipeline LoRA file.
DIFFUSERS_TRANSFORMER_PREFIX = "transformer."
#: ``init_lora_weights`` values with which peft rewrites the base weights at
#: injection (the adapter is trained against a modified base): such an adapter
#: does not reproduce the policy on the original base model, so no diffusers
#: file is written for it.
BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def resolve_dtype(value, *, arg: str) -> torch.dtype | None:
    """Map ``"fp32" | "bf16" | "fp16"`` (or a ``torch.dtype``, or ``None``) to a dtype."""
    if value is None or isinstance(value, torch.dtype):
        return value
    key = str(value).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(
            f"`{arg}` must be one of {sorted(set(_DTYPES))}, a torch.dtype or None; got {value!r}."
        )
    return _DTYPES[key]


# --------------------------------------------------------------------------- targets
def _matches(name: str, patterns: str | Sequence[str]) -> bool:
    """peft's matching rule: a string is a regex that must match the full name;
    a list entry matches the name itself or a dotted suffix of it."""
    if isinstance(patterns, str):
        return re.fullmatch(patterns, name) is not None
    return any(name == p or name.endswith("." + p) for p in patterns)


def resolve_target_modules(
    model: nn.Module,
    target_modules: str | Sequence[str] = "all-linear",
    exclude_modules: str | Sequence[str] | None = None,
) -> list[str]:
    """Full dotted names of the modules LoRA will wrap.

    ``"all-linear"`` means every ``nn.Linear`` in ``model``. (peft's own
    ``all-linear`` shortcut is written for transformers language models: it
    skips the output head by name and can miss or misjudge diffusers layers,
    so we resolve the names ourselves.) Any other string is a regex matched
    against full names; a list matches names or name suffixes, as in peft.
    ``exclude_modules`` uses the same rules and wins over ``target_modules``.
    Only ``nn.Linear`` modules are returned for ``"all-linear"``; explicit
    patterns may also select other layer types peft supports (Conv2d...).
    """
    names = []
    for name, module in model.named_modules():
        if not name:
            continue
        if target_modules == "all-linear":
            hit = isinstance(module, nn.Linear)
        else:
            hit = _matches(name, target_modules)
        if hit and not (exclude_modules and _matches(name, exclude_modules)):
            names.append(name)
    if not names:
        raise ValueError(
            f"`target_modules`={target_modules!r} with `exclude_modules`={exclude_modules!r} selects no "
            f"module of {type(model).__name__}. Use 'all-linear' or module names such as 'to_q'."
        )
    return names


# --------------------------------------------------------------------------- inject / load
def add_lora(
    model: nn.Module,
    *,
    rank: int,
    alpha: float,
    init_weights: bool | str = "gaussian",
    target_modules: str | Sequence[str] = "all-linear",
    exclude_modules: str | Sequence[str] | None = None,
    adapter_path: str | os.PathLike | None = None,
    lora_dtype=None,
) -> list[str]:
    """Inject a trainable LoRA adapter into ``model`` (in place); return its targets.

    With ``adapter_path`` the adapter's own ``adapter_config.json`` decides rank,
    alpha and targets, and its weights are loaded (to continue training it).
    Base parameters are left frozen; LoRA parameters get ``requires_grad=True``.
    """
    from peft import LoraConfig, inject_adapter_in_model

    if getattr(model, "peft_config", None):
        raise ValueError(
            f"{type(model).__name__} already has LoRA adapter(s) {sorted(model.peft_config)}; "
            "`add_lora` can be called once per policy. Load new weights with `load_lora_state_dict`."
        )
    dtype = resolve_dtype(lora_dtype, arg="lora_dtype")
    if adapter_path is not None:
        config, state = read_adapter(adapter_path)
    else:
        if int(rank) <= 0:
            raise ValueError(f"`rank` must be a positive integer for LoRA, got {rank!r}.")
        targets = resolve_target_modules(model, target_modules, exclude_modules)
        config = LoraConfig(
            r=int(rank),
            lora_alpha=float(alpha),
            init_lora_weights=_check_init(init_weights),
            target_modules=targets,
        )
        state = None
    inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    for name, param in model.named_parameters():
        is_lora = f".{ADAPTER_NAME}" in name and "lora_" in name
        param.requires_grad_(is_lora)
        if is_lora and dtype is not None:
            param.data = param.data.to(dtype)
    if state is not None:
        load_lora_state_dict(model, state)
    return sorted(config.target_modules) if not isinstance(config.target_modules, str) else [config.target_modules]


def _check_init(value):
    allowed = (True, False, "gaussian", "pissa", "olora", "orthogonal")
    ok = value in allowed or (isinstance(value, str) and value.startswith("pissa_niter_"))
    if not ok:
        raise ValueError(
            f"`init_weights` must be one of {allowed} or 'pissa_niter_<n>', got {value!r}. "
            "'gaussian' (default) and True both start with B=0, i.e. the base model."
        )
    return value


def read_adapter(adapter_path: str | os.PathLike):
    """Read a PEFT adapter folder: ``(LoraConfig, state_dict)`` with file-prefix removed."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    folder = Path(adapter_path)
    weights, config_file = folder / PEFT_WEIGHTS, folder / PEFT_CONFIG
    for f in (weights, config_file):
        if not f.is_file():
            raise FileNotFoundError(
                f"`adapter_path`={str(folder)!r} is not a PEFT adapter folder: missing {f.name}. "
                "Point it at a folder written by `save_lora` or `PeftModel.save_pretrained`."
            )
    config = LoraConfig.from_pretrained(str(folder))
    state = {k.removeprefix(PEFT_FILE_PREFIX): v for k, v in load_file(str(weights)).items()}
    return config, state


# --------------------------------------------------------------------------- state dicts
def _lora_params(model: nn.Module, adapter: str = ADAPTER_NAME) -> dict[str, nn.Parameter]:
    """peft-format key -> live parameter of adapter ``adapter``, matched by storage so names can't drift."""
    from peft import get_peft_model_state_dict

    if not getattr(model, "peft_config", None):
        raise ValueError(f"{type(model).__name__} has no LoRA adapter: call `add_lora(...)` first.")
    if adapter not in model.peft_config:
        raise ValueError(f"{type(model).__name__} has no LoRA adapter named {adapter!r} "
                         f"(adapters: {sorted(model.peft_config)}).")
    by_ptr = {p.data_ptr(): p for p in model.parameters()}
    out = {}
    for key, tensor in get_peft_model_state_dict(model, adapter_name=adapter).items():
        out[key] = by_ptr[tensor.data_ptr()]
    return out


def lora_state_dict(model: nn.Module, adapter: str = ADAPTER_NAME) -> dict[str, torch.Tensor]:
    """A detached CPU copy of the adapter weights (never aliases live parameters)."""
    return {k: p.detach().to("cpu", copy=True) for k, p in _lora_params(model, adapter).items()}


def load_lora_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], adapter: str = ADAPTER_NAME) -> None:
    """Copy adapter weights in place. Strict: key sets and shapes must match."""
    params = _lora_params(model, adapter)
    state_dict = {k.removeprefix(PEFT_FILE_PREFIX): v for k, v in state_dict.items()}
    _strict_copy(params, state_dict, what="LoRA state dict", fix="save it with `lora_state_dict()`/`save_lora`")


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of every parameter and buffer of ``model``."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy a full state dict in place (strict)."""
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    _strict_copy(targets, state_dict, what="full state dict", fix="save it with `full_state_dict()`")


def _strict_copy(targets: dict, source: dict, *, what: str, fix: str) -> None:
    missing = sorted(set(targets) - set(source))
    unexpected = sorted(set(source) - set(targets))
    if missing or unexpected:
        raise KeyError(
            f"{what} does not match the model: {len(missing)} missing key(s) {missing[:5]}, "
            f"{len(unexpected)} unexpected key(s) {unexpected[:5]}. The adapter must come from a policy "
            f"with the same base model, rank and target modules ({fix})."
        )
    with torch.no_grad():
        for key, dst in targets.items():
            src = source[key]
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(
                    f"{what}: key `{key}` has shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}. "
                    "Was it saved with a different `lora_rank`?"
                )
            dst.copy_(torch.as_tensor(src))


# --------------------------------------------------------------------------- files / switches
def save_lora(model: nn.Module, directory: str | os.PathLike, *, pipeline_cls: type | None = None) -> Path:
    """Write the adapter as a PEFT folder (see the module docstring); return the folder.

    With ``pipeline_cls`` (the diffusers pipeline class the transformer belongs
    to, e.g. ``StableDiffusion3Pipeline``) the folder also gets that pipeline's
    own LoRA file, :data:`DIFFUSERS_WEIGHTS` (see :func:`save_diffusers_lora`).
    An adapter whose init rewrote the base weights (:data:`BASE_REWRITING_INITS`)
    gets no diffusers file (a warning says why) and a stale one is removed.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = model.peft_config[ADAPTER_NAME]
    state = {PEFT_FILE_PREFIX + k: v.contiguous() for k, v in lora_state_dict(model).items()}
    meta = config.to_dict()
    meta = {k: (sorted(v) if isinstance(v, set) else v) for k, v in meta.items()}
    # "format" tells safetensors readers the framework. "lora_adapter_metadata"
    # is where diffusers' load_lora_adapter looks for the LoraConfig (without
    # it diffusers guesses alpha = rank). Diffusers scopes these config keys by
    # the same prefix as the weight keys and strips both with `prefix=`, so they
    # carry the "base_model.model." prefix too.
    meta = {PEFT_FILE_PREFIX + k: v for k, v in meta.items()}
    save_file(state, str(directory / PEFT_WEIGHTS), metadata={
        "format": "pt", "lora_adapter_metadata": json.dumps(meta, sort_keys=True)})
    config.save_pretrained(str(directory))
    if pipeline_cls is not None:
        reason = diffusers_export_problem(config, pipeline_cls)
        if reason is None:
            save_diffusers_lora(state, config, directory, pipeline_cls)
        else:
            (directory / DIFFUSERS_WEIGHTS).unlink(missing_ok=True)
            logging.getLogger(__name__).warning("%s: no %s written: %s", directory, DIFFUSERS_WEIGHTS, reason)
    return directory


def base_rewriting_init(config) -> str | None:
    """The ``init_lora_weights`` of ``config`` if it is one that rewrites the base weights, else None."""
    init = getattr(config, "init_lora_weights", None)
    if isinstance(init, str) and init.lower().startswith(BASE_REWRITING_INITS):
        return init
    return None


def diffusers_export_problem(config, pipeline_cls: type | None = None) -> str | None:
    """Why this adapter cannot be written as a diffusers pipeline LoRA, or None when it can."""
    init = base_rewriting_init(config)
    if init is not None:
        return (f"the adapter was initialised with init_lora_weights={init!r}, which rewrites the base weights, "
                "so applied to the original base model it does not reproduce the trained policy")
    if pipeline_cls is not None and not hasattr(pipeline_cls, "save_lora_weights"):
        return f"{pipeline_cls.__name__} has no LoRA support (`save_lora_weights`) in this diffusers version"
    return None


def diffusers_adapter_metadata(config) -> dict:
    """The ``LoraConfig`` as diffusers stores it in ``lora_adapter_metadata`` (its ``to_dict()``).

    diffusers builds the loading ``LoraConfig(**metadata)`` from it, so rank,
    alpha, ``use_rslora``, ``rank_pattern`` / ``alpha_pattern`` and the target
    modules carry over exactly (without metadata diffusers guesses alpha =
    rank). ``init_lora_weights`` is set to True: the loaded tensors replace the
    init anyway, and a special init must not run again at load time.
    """
    meta = config.to_dict()
    meta = {k: (sorted(v) if isinstance(v, set) else v) for k, v in meta.items()}
    meta["init_lora_weights"] = True
    return meta


def save_diffusers_lora(
    state_dict: dict[str, torch.Tensor],
    config,
    directory: str | os.PathLike,
    pipeline_cls: type,
) -> Path:
    """Write ``state_dict`` (peft keys, as from ``lora_state_dict`` or ``read_adapter``)
    as ``pipeline_cls``'s own LoRA file; return the file's path.

    Uses ``pipeline_cls.save_lora_weights(directory, transformer_lora_layers=...,
    transformer_lora_adapter_metadata=...)``, i.e. diffusers' own writer:
    ``<directory>/pytorch_lora_weights.safetensors`` with keys
    ``transformer.<peft key>`` and the config in the ``lora_adapter_metadata``
    header entry. ``pipe.load_lora_weights(directory)`` then loads it.
    Raises ``ValueError`` when :func:`diffusers_export_problem` finds one.
    """
    reason = diffusers_export_problem(config, pipeline_cls)
    if reason is not None:
        raise ValueError(f"cannot write a diffusers LoRA file: {reason}.")
    if not state_dict:
        raise ValueError("cannot write a diffusers LoRA file: the adapter state dict is empty.")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    layers = {k.removeprefix(PEFT_FILE_PREFIX): v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    pipeline_cls.save_lora_weights(str(directory), transformer_lora_layers=layers,
                                   transformer_lora_adapter_metadata=diffusers_adapter_metadata(config),
                                   weight_name=DIFFUSERS_WEIGHTS)
    return directory / DIFFUSERS_WEIGHTS


@contextlib.contextmanager
def disabled_adapter(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its base (LoRA layers bypassed) inside the block."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no LoRA adapter to disable: call `add_lora(...)` first.")
    # peft's enable_adapters() also flips requires_grad of the LoRA weights;
    # remember and restore those flags so a frozen adapter stays frozen.
    previously = [not m.disable_adapters for m in layers]
    grads = [(p, p.requires_grad) for m in layers for p in m.parameters()]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m, enabled in zip(layers, previously):
            m.enable_adapters(enabled)
        for p, flag in grads:
            p.requires_grad_(flag)
