"""Where metrics go: the console, TensorBoard and Weights & Biases (``trainer.logger``).

:class:`Tracking` fans every step's scalars out to the configured backends
under their VeRL-Omni names, puts the run's resolved config in as its
hyperparameters (W&B's run config; a text summary named ``config`` in
TensorBoard) and logs images with captions (:meth:`Tracking.log_images`:
TensorBoard images plus the captions as text, W&B ``wandb.Image`` objects).

W&B is an optional extra (``pip install omnirl-async[wandb]``), imported only
when ``trainer.logger`` names it; it honours ``WANDB_MODE`` (``offline`` works
with no network and writes the run under ``<log dir>/wandb/``).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["LOGGERS", "Tracking", "flatten_config", "resolve_log_dir", "wandb_installed", "wandb_missing_message", "import_wandb"]

#: The backends ``trainer.logger`` may name.
LOGGERS = ("console", "tensorboard", "wandb")


def resolve_log_dir(trainer_cfg) -> Path:
    if trainer_cfg.log_dir:
        return Path(trainer_cfg.log_dir)
    base = os.environ.get("TENSORBOARD_DIR")
    if base:
        return Path(base)
    return Path("tensorboard_log") / trainer_cfg.project_name / trainer_cfg.experiment_name


def wandb_installed() -> bool:
    """Whether ``import wandb`` can work, without importing it (a ``None`` in ``sys.modules`` blocks it)."""
    if "wandb" in sys.modules:
        return sys.modules["wandb"] is not None
    import importlib.util

    try:
        return importlib.util.find_spec("wandb") is not None
    except (ImportError, ValueError):
        return False


def wandb_missing_message(loggers: Any) -> str:
    return (f"`trainer.logger` = {list(loggers)!r} names wandb, but the wandb package is not installed. Fix: "
            "`pip install omnirl-async[wandb]` (or `pip install wandb`), or drop wandb from `trainer.logger`, "
            "e.g. `trainer.logger=[console,tensorboard]`.")


def import_wandb(loggers: Any):
    """``import wandb``, or an ImportError that names ``trainer.logger`` and the pip command."""
    try:
        import wandb
    except ImportError as err:
        raise ImportError(wandb_missing_message(loggers)) from err
    return wandb


def flatten_config(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: dotted key paths of a nested config dict (empty sections kept)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping) and v:
            out.update(flatten_config(v, key))
        else:
            out[key] = v
    return out


def _config_text(config: Mapping) -> str:
    """The config as Markdown for TensorBoard's text tab: one ``key: value`` line per leaf, as a code block."""
    return "\n".join(f"    {k}: {v!r}" for k, v in flatten_config(config).items())


def _as_image(x) -> np.ndarray:
    """An ``HxWx3`` uint8 array from an array (HW, HWC, grey/RGBA) or an image file (e.g. a saved grid)."""
    if isinstance(x, (str, os.PathLike)):
        from PIL import Image

        with Image.open(x) as im:
            return np.asarray(im.convert("RGB"))
    a = np.asarray(x)
    if a.dtype != np.uint8:
        a = np.clip(np.round(a.astype(np.float32) * (255.0 if a.max(initial=0) <= 1.0 else 1.0)), 0, 255)
        a = a.astype(np.uint8)
    if a.ndim == 2:
        a = a[..., None]
    if a.shape[-1] == 1:
        a = np.repeat(a, 3, axis=-1)
    return a[..., :3]


class Tracking:
    """Fan metrics, the run's config and images out to the configured backends.

    ``config``: the run's resolved config as a nested mapping (the hyperparameters of the run).
    ``wandb_id``: the W&B run to continue (a resumed training run; ``resume="allow"``), None for a new one
    (``wandb_run.id`` is the id to keep for a later resume).
    """

    _CONSOLE_KEYS = ("critic/rewards/mean", "critic/score/tiny_geneval/strict/mean", "actor/pg_loss", "actor/ppo_kl",
                     "actor/pg_clipfrac", "actor/grad_norm", "perf/throughput", "timing_s/step",
                     "training/off_policy/trajectory_staleness/mean")
    _CONSOLE_VAL_KEYS = ("val/score", "val/strict", "val/overall", "val/failed_frac")

    def __init__(self, trainer_cfg, *, printer=print, config: Mapping | None = None, wandb_id: str | None = None):
        loggers = trainer_cfg.logger
        self.backends = [loggers] if isinstance(loggers, str) else list(loggers or [])
        bad = [b for b in self.backends if b not in LOGGERS]
        if bad:
            raise ValueError(f"`trainer.logger` = {self.backends!r}: unknown logger(s) {bad}; allowed: "
                             f"{list(LOGGERS)}.")
        self.printer = printer
        self.writer = None
        self.wandb_run = None
        self._wandb = None
        self.log_dir = resolve_log_dir(trainer_cfg)
        if "wandb" in self.backends:
            self._wandb = import_wandb(self.backends)  # before anything is written: a missing package fails first
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter

            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(log_dir=str(self.log_dir))
            if config:
                self.writer.add_text("config", _config_text(config), global_step=0)
                self.writer.flush()
        #: the W&B run's folder (``<log dir>/wandb/<offline-run-...>``) when W&B logs
        self.wandb_dir: Path | None = None
        if self._wandb is not None:
            self.wandb_run = self._start_wandb(trainer_cfg, config, wandb_id)
            self.wandb_dir = Path(self.wandb_run.dir).parent  # run.dir is that folder's files/
            if wandb_id:
                self.printer(f"W&B: continuing run {wandb_id} (a resumed run logs into the same W&B run; steps the "
                             "earlier run already logged past its checkpoint keep their first values)")

    def _start_wandb(self, trainer_cfg, config: Mapping | None, wandb_id: str | None):
        self.log_dir.mkdir(parents=True, exist_ok=True)
        resume = {"id": wandb_id, "resume": "allow"} if wandb_id else {}
        try:
            return self._wandb.init(project=trainer_cfg.project_name, name=trainer_cfg.experiment_name,
                                    dir=str(self.log_dir), config=dict(config or {}), reinit="create_new", **resume)
        except Exception as err:  # noqa: BLE001 - login, network and permission errors come in many types
            self.close()
            raise RuntimeError(f"`trainer.logger` = {self.backends!r}: wandb.init failed ({err}). Fix: log in "
                               "with `wandb login` (or set WANDB_API_KEY), or run without a network with "
                               "`WANDB_MODE=offline` (upload later with `wandb sync <log dir>/wandb/offline-run-*`), "
                               "or drop wandb from `trainer.logger`.") from err


    def log(self, data: Mapping[str, float], step: int) -> None:
        scalars = {k: float(v) for k, v in data.items() if isinstance(v, (int, float, np.number)) and math.isfinite(v)}
        if self.writer is not None:
            for k, v in scalars.items():
                self.writer.add_scalar(k, v, global_step=step)
            self.writer.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)
        if "console" in self.backends:
            shown = [f"{k}={data[k]:.4g}" for k in self._CONSOLE_KEYS if k in data]
            shown += [f"{k}={data[k]:.4g}" for k in self._CONSOLE_VAL_KEYS if k in data]  # a validation step
            if data.get("reward/failed_frac"):  # samples whose reward failed: say so while it happens
                shown.append(f"reward/failed_frac={data['reward/failed_frac']:.4g}")
            self.printer(f"step {step}: " + "  ".join(shown))

    def log_histogram(self, key: str, values, step: int) -> None:
        """Integer ``values`` (e.g. each trained sample's staleness) as a histogram with one bucket per integer.

        TensorBoard: ``add_histogram`` with bucket edges at ``k +- 0.5``, so a reader gets exact counts back
        (:func:`omnirl_async.metrics.report.read_integer_histogram`); W&B: a ``wandb.Histogram``. Nothing for an
        empty array, nothing on the console."""
        if self.writer is None and self.wandb_run is None:
            return
        v = np.asarray(values, dtype=np.int64).reshape(-1)
        if v.size == 0:
            return
        edges = np.arange(int(v.min()), int(v.max()) + 2, dtype=np.float64) - 0.5
        if self.writer is not None:
            self.writer.add_histogram(key, v.astype(np.float64), global_step=step, bins=edges)
            self.writer.flush()
        if self.wandb_run is not None:
            counts, _ = np.histogram(v, bins=edges)
            self.wandb_run.log({key: self._wandb.Histogram(np_histogram=(counts, edges))}, step=step)

    def log_images(self, key: str, images: Sequence, step: int, *, captions: Sequence[str] | None = None,
                   text: str | None = None) -> None:
        """Images (uint8 ``HxWx3`` arrays or image files, one caption each) under ``key`` at ``step``.

        TensorBoard: one image is ``add_image(key)``, several of one size are tiled by ``add_images(key)``
        (8 per row); the captions (or ``text``) go to ``add_text(key + "/captions")``. W&B: a list of
        ``wandb.Image`` with their captions under ``key``. The console shows nothing.
        """
        if self.writer is None and self.wandb_run is None:
            return
        imgs = [_as_image(x) for x in images]
        if not imgs:
            return
        caps = [str(c) for c in captions] if captions is not None else [""] * len(imgs)
        if len(caps) != len(imgs):
            raise ValueError(f"log_images({key!r}): {len(imgs)} images but {len(caps)} captions.")
        if self.writer is not None:
            if len(imgs) == 1:
                self.writer.add_image(key, imgs[0], global_step=step, dataformats="HWC")
            elif len({im.shape for im in imgs}) == 1:
                self.writer.add_images(key, np.stack(imgs), global_step=step, dataformats="NHWC")
            else:
                for i, im in enumerate(imgs):
                    self.writer.add_image(f"{key}/{i}", im, global_step=step, dataformats="HWC")
            body = text if text is not None else "\n".join(f"- {i}: {c}" for i, c in enumerate(caps))
            if body.strip():
                self.writer.add_text(f"{key}/captions", body, global_step=step)
            self.writer.flush()
        if self.wandb_run is not None:
            wandb = self._wandb
            self.wandb_run.log({key: [wandb.Image(im, caption=c or None) for im, c in zip(imgs, caps)]}, step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb_run is not None:
            run, self.wandb_run = self.wandb_run, None
            run.finish()
