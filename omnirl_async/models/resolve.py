"""Resolve ``actor_rollout_ref.model.path`` to a local diffusers folder.

``embedded:<name>`` names a model the project ships or builds:

* ``embedded:tiny-sd3`` / ``embedded:tiny-flux`` – random-weight tiny pipelines
  built from a config with a fixed seed on first use and cached.
* ``embedded:shapes`` – the pretrained shapes text-to-image model committed
  inside the package (when present).

Anything else must be an existing folder with a ``model_index.json``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["resolve_model_path", "EMBEDDED_MODELS"]

EMBEDDED_MODELS = ("tiny-sd3", "tiny-flux", "shapes")
_ASSETS = Path(__file__).resolve().parent.parent / "assets"


def resolve_model_path(path: str) -> Path:
    if path.startswith("embedded:"):
        name = path.split(":", 1)[1]
        if name in ("tiny-sd3", "tiny-flux"):
            from omnirl_async.models.tiny import ensure_tiny_model

            return Path(ensure_tiny_model(name.split("-", 1)[1]))
        if name == "shapes":
            folder = _ASSETS / "shapes-t2i"
            if not (folder / "model_index.json").is_file():
                raise FileNotFoundError(f"`actor_rollout_ref.model.path` = {path!r}: the embedded shapes model is "
                                        f"missing from {folder}; reinstall the package.")
            return folder
        raise ValueError(f"`actor_rollout_ref.model.path` = {path!r}: unknown embedded model {name!r}; choose one "
                         f"of {['embedded:' + m for m in EMBEDDED_MODELS]}.")
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"`actor_rollout_ref.model.path` = {path!r} is not a folder. Give a local "
                                "diffusers pipeline folder (with model_index.json) or embedded:tiny-sd3.")
    return folder.resolve()
