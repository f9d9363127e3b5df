"""Where metrics go: the console and TensorBoard (``trainer.logger``)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Mapping

__all__ = ["Tracking", "resolve_log_dir"]


def resolve_log_dir(trainer_cfg) -> Path:
    if trainer_cfg.log_dir:
        return Path(trainer_cfg.log_dir)
    base = os.environ.get("TENSORBOARD_DIR")
    if base:
        return Path(base)
    return Path("tensorboard_log") / trainer_cfg.project_name / trainer_cfg.experiment_name


class Tracking:
    """Fan metrics out to the configured backends."""

    _CONSOLE_KEYS = ("critic/rewards/mean", "critic/score/tiny_geneval/strict/mean", "actor/pg_loss", "actor/ppo_kl",
                     "actor/pg_clipfrac", "actor/grad_norm", "perf/throughput", "timing_s/step",
                     "training/off_policy/trajectory_staleness/mean")

    def __init__(self, trainer_cfg, *, printer=print):
        loggers = trainer_cfg.logger
        self.backends = [loggers] if isinstance(loggers, str) else list(loggers or [])
        self.printer = printer
        self.writer = None
        self.log_dir = resolve_log_dir(trainer_cfg)
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter

            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, data: Mapping[str, float], step: int) -> None:
        if self.writer is not None:
            for k, v in data.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.writer.add_scalar(k, v, global_step=step)
            self.writer.flush()
        if "console" in self.backends:
            shown = [f"{k}={data[k]:.4g}" for k in self._CONSOLE_KEYS if k in data]
            self.printer(f"step {step}: " + "  ".join(shown))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
