"""The audit trail of what every learner step trained on: ``trained_groups.jsonl``.

One JSON line per step, appended and flushed when the step is done (both
modes)::

    {"step": 3, "version": 2, "groups": [[group_uid, prompt, epoch, ticket, behaviour_version, samples], ...]}

and one line ``{"resume": N}`` each time a run resumes from the checkpoint of
step ``N``: steps after ``N`` that were logged before it were rolled back and
are trained again. :func:`read_trained_log` applies those rules and returns
the steps that count, plus the rolled-back ones, so a user (or a test) can
check that every prompt of an epoch was trained exactly once across crashes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

__all__ = ["TrainedLog", "read_trained_log"]

FILE_NAME = "trained_groups.jsonl"


class TrainedLog:
    def __init__(self, folder: str | os.PathLike):
        self.path = Path(folder) / FILE_NAME

    def _append(self, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()

    def step(self, step: int, version: int, metas: Sequence[Any]) -> None:
        """Record the samples (``SampleMeta``) of one step, one entry per group."""
        groups: dict[str, list] = {}
        for m in metas:
            t = m.tags
            entry = groups.setdefault(t.group_uid, [t.group_uid, t.prompt, t.epoch, t.ticket, t.policy_version, 0])
            entry[5] += 1
        self._append({"step": int(step), "version": int(version), "groups": list(groups.values())})

    def resumed(self, step: int) -> None:
        self._append({"resume": int(step)})


def read_trained_log(path: str | os.PathLike) -> tuple[dict[int, dict], dict[int, list[dict]]]:
    """``(steps, rolled_back)``: the record of every step that counts, and earlier records of re-done steps.

    A truncated last line (the process was killed while writing it) is ignored.
    """
    path = Path(path)
    if path.is_dir():
        path = path / FILE_NAME
    steps: dict[int, dict] = {}
    rolled_back: dict[int, list[dict]] = {}
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if lineno >= len(lines) - 1:
                break  # the write of the last line was cut by a crash
            raise ValueError(f"{path}:{lineno}: not valid JSON") from None
        if "resume" in rec:
            for s in [s for s in steps if s > rec["resume"]]:
                rolled_back.setdefault(s, []).append(steps.pop(s))
            continue
        steps[int(rec["step"])] = rec
    return steps, rolled_back
