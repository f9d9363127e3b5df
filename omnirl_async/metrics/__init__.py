"""Metric computation (VeRL-Omni names) and loggers."""

from omnirl_async.metrics.compute import (Timer, compute_data_metrics, compute_staleness_metrics,
                                          compute_throughput_metrics, compute_timing_metrics, reduce_metrics)
from omnirl_async.metrics.loggers import Tracking, resolve_log_dir

__all__ = ["Timer", "Tracking", "compute_data_metrics", "compute_staleness_metrics", "compute_throughput_metrics",
           "compute_timing_metrics", "reduce_metrics", "resolve_log_dir"]
