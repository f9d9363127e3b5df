"""Checkpoints without pickle: tensors in safetensors, everything else in msgpack.

A nested state (dicts, lists, numbers, strings, tensors, numpy arrays) is split
by :func:`flatten_state` into a flat ``{name: tensor}`` map and a skeleton in
which every tensor is replaced by ``{"__tensor__": name}``; the skeleton goes to
msgpack. Loading reverses it. Integer dict keys (optimizer state) survive
because msgpack keeps key types.

Layout of ``<default_local_dir>/global_step_<N>/``::

    lora/                    PEFT adapter (adapter_model.safetensors + adapter_config.json)
    learner.safetensors      learner tensors (weights, optimizer moments, RNG)
    learner.msgpack          learner skeleton
    trainer.safetensors / trainer.msgpack   driver state (step, version, prompt cursor, RNG)
    buffer/                  replay-buffer snapshot (when buffer.snapshot_with_checkpoint)
    COMPLETE                 written last; a folder without it is ignored on resume

and ``latest_checkpointed_iteration.txt`` beside them, as in verl.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from safetensors.torch import load_file, save_file

__all__ = ["flatten_state", "unflatten_state", "save_state", "load_state", "CheckpointManager"]

FORMAT_VERSION = 1
_TENSOR = "__tensor__"
_NDARRAY = "__ndarray__"
_TUPLE = "__tuple__"


def flatten_state(obj: Any, prefix: str = "s") -> tuple[dict[str, torch.Tensor], Any]:
    tensors: dict[str, torch.Tensor] = {}

    def walk(x, name):
        if isinstance(x, torch.Tensor):
            tensors[name] = x.detach().cpu().contiguous()
            return {_TENSOR: name}
        if isinstance(x, np.ndarray):
            tensors[name] = torch.from_numpy(np.ascontiguousarray(x))
            return {_NDARRAY: name}
        if isinstance(x, dict):
            return {k: walk(v, f"{name}.{k}") for k, v in x.items()}
        if isinstance(x, tuple):
            return {_TUPLE: [walk(v, f"{name}.{i}") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [walk(v, f"{name}.{i}") for i, v in enumerate(x)]
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, (np.integer, np.floating)):
            return x.item()
        raise TypeError(f"cannot checkpoint a value of type {type(x).__name__} at `{name}`")

    return tensors, walk(obj, prefix)


def unflatten_state(tensors: dict[str, torch.Tensor], skeleton: Any) -> Any:
    def walk(x):
        if isinstance(x, dict):
            if set(x) == {_TENSOR}:
                return tensors[x[_TENSOR]]
            if set(x) == {_NDARRAY}:
                return tensors[x[_NDARRAY]].numpy()
            if set(x) == {_TUPLE}:
                return tuple(walk(v) for v in x[_TUPLE])
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(skeleton)


def save_state(state: Any, folder: Path, name: str) -> None:
    tensors, skeleton = flatten_state(state)
    save_file(tensors, str(folder / f"{name}.safetensors"))
    (folder / f"{name}.msgpack").write_bytes(msgspec.msgpack.encode({"format": FORMAT_VERSION, "state": skeleton}))


def load_state(folder: Path, name: str) -> Any:
    raw = msgspec.msgpack.decode((folder / f"{name}.msgpack").read_bytes(), strict=False)
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_VERSION:
        raise ValueError(f"{folder / (name + '.msgpack')}: unsupported checkpoint format "
                         f"{raw.get('format') if isinstance(raw, dict) else raw!r}; expected {FORMAT_VERSION}.")
    tensors = load_file(str(folder / f"{name}.safetensors"))
    return unflatten_state(tensors, raw["state"])


class CheckpointManager:
    """Writes step folders atomically and finds the newest complete one."""

    def __init__(self, root: str | os.PathLike, *, max_to_keep: int | None = None):
        self.root = Path(root)
        self.max_to_keep = max_to_keep

    def step_dir(self, step: int) -> Path:
        return self.root / f"global_step_{step}"

    def begin(self, step: int) -> Path:
        """A fresh temporary folder to fill; :meth:`commit` moves it into place."""
        self.root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".tmp_global_step_{step}_", dir=self.root))

    def commit(self, tmp: Path, step: int) -> Path:
        (tmp / "COMPLETE").write_text(str(step))
        final = self.step_dir(step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        marker = self.root / "latest_checkpointed_iteration.txt"
        tmp_marker = marker.with_suffix(".tmp")
        tmp_marker.write_text(str(step))
        os.replace(tmp_marker, marker)
        self._prune()
        return final

    def _complete_steps(self) -> list[int]:
        steps = []
        if self.root.is_dir():
            for d in self.root.glob("global_step_*"):
                if (d / "COMPLETE").is_file():
                    try:
                        steps.append(int(d.name.rsplit("_", 1)[1]))
                    except ValueError:
                        continue
        return sorted(steps)

    def latest(self) -> Path | None:
        steps = self._complete_steps()
        return self.step_dir(steps[-1]) if steps else None

    def _prune(self) -> None:
        if self.max_to_keep:
            for step in self._complete_steps()[:-self.max_to_keep]:
                shutil.rmtree(self.step_dir(step), ignore_errors=True)
        for d in self.root.glob(".tmp_global_step_*"):
            shutil.rmtree(d, ignore_errors=True)
