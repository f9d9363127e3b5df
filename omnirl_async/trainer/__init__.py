"""Trainer modes (sync, separate_async), the task runner and checkpointing."""
