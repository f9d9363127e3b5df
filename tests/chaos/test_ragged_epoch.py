"""Chaos (d): 20 prompts, batch 8, one epoch: all 20 trained (8 + 8 + 4) and the job ends.

Also run as a script (prints the batch sizes).
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from omnirl_async.trainer.trained_log import read_trained_log
from tests.chaos.harness import overrides, prompts, start_ray, trained_prompts


def run(run_dir: Path) -> dict:
    from omnirl_async.config import load_config
    from omnirl_async.trainer.task_runner import TaskRunner

    plist = prompts(20)
    cfg = load_config(overrides(run_dir, plist, "data.train_batch_size=8", "trainer.resume_mode=disable",
                                "actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.wait_timeout_s=60"))
    t0 = time.monotonic()
    summary = TaskRunner(cfg, printer=lambda *a: None).run()
    steps, _ = read_trained_log(run_dir / "ckpt")
    return {"wall_s": time.monotonic() - t0, "steps": summary["global_step"],
            "groups_per_step": [len(steps[s]["groups"]) for s in sorted(steps)],
            "trained_once": trained_prompts(run_dir) == Counter(plist)}


@pytest.mark.slow
def test_20_prompts_batch_8_trains_all_20_and_ends(tmp_path):
    ray = start_ray()
    try:
        out = run(tmp_path)
    finally:
        ray.shutdown()
    assert out["wall_s"] < 60
    assert out["steps"] == 3 and out["groups_per_step"] == [8, 8, 4] and out["trained_once"]


if __name__ == "__main__":
    ray = start_ray()
    try:
        print(run(Path(tempfile.mkdtemp(prefix="chaos_ragged_"))))
    finally:
        ray.shutdown()
