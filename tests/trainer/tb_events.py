"""Read back what a training run logged to TensorBoard, with TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path


def scalar_events(log_dir: Path | str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag under ``log_dir`` -> its (step, value) events, in order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def scalar_values(log_dir: Path | str) -> dict[str, list[float]]:
    """Every scalar tag under ``log_dir`` -> its values, in order."""
    return {tag: [v for _, v in ev] for tag, ev in scalar_events(log_dir).items()}
