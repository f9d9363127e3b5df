"""Chaos (c): rewards that raise, return NaN, return the wrong shape or time out on a third of calls.

A separate_async epoch with ``mixed_every_third`` (each worker's every third
reward call fails, the four ways in turn; ``reward.timeout_s`` = 1 s, the slow
call takes 3 s) finishes its epoch: the failed groups are counted per kind and
not trained, every other prompt is trained exactly once. A reward that always
fails stops the job within a minute with a message naming the reward, the
reason and the counts. Run as a script to print the figures.
"""

from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path

import pytest

from tests.chaos.harness import FLAKY, overrides, prompts, start_ray, trained_prompts

NUM_PROMPTS = 24


def run_flaky(run_dir: Path) -> dict:
    from omnirl_async.config import load_config
    from omnirl_async.trainer.task_runner import TaskRunner

    plist = prompts(NUM_PROMPTS)
    printed: list[str] = []
    cfg = load_config(overrides(run_dir, plist, "data.train_batch_size=4", "trainer.resume_mode=disable",
                                f"reward.custom_reward_function.path={FLAKY}",
                                "reward.custom_reward_function.name=mixed_every_third", "reward.timeout_s=1",
                                "trainer.wait_timeout_s=120"))
    t0 = time.monotonic()
    summary = TaskRunner(cfg, printer=printed.append).run()
    trained = trained_prompts(run_dir)
    return {"wall_s": time.monotonic() - t0, "steps": summary["global_step"], "scored": summary["reward_scored"],
            "failed": summary["reward_failed"], "failed_kinds": summary["reward_failed_kinds"],
            "trained_groups": sum(trained.values()), "duplicates": sum(c - 1 for c in trained.values()),
            "untrained_prompts": len(set(plist) - set(trained)),
            "first_examples": [line for line in printed if "first example" in line]}


def run_always_failing(run_dir: Path) -> dict:
    from omnirl_async.config import load_config
    from omnirl_async.trainer.failures import RewardFailureError
    from omnirl_async.trainer.task_runner import TaskRunner

    cfg = load_config(overrides(run_dir, prompts(48), "data.train_batch_size=4", "trainer.resume_mode=disable",
                                f"reward.custom_reward_function.path={FLAKY}",
                                "reward.custom_reward_function.name=always_fails", "trainer.total_epochs=10"))
    t0 = time.monotonic()
    try:
        TaskRunner(cfg, printer=lambda *a: None).run()
    except RewardFailureError as err:
        return {"stopped_after_s": time.monotonic() - t0, "message": str(err)}
    return {"stopped_after_s": None, "message": ""}


@pytest.fixture(scope="module")
def ray_cluster():
    ray = start_ray()
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_an_epoch_with_a_third_of_reward_calls_failing_finishes(ray_cluster, tmp_path):
    out = run_flaky(tmp_path)
    assert set(out["failed_kinds"]) == {"raised", "nonfinite", "bad_output", "timeout"}
    assert out["failed"] == sum(out["failed_kinds"].values()) and out["failed"] % 2 == 0
    assert out["duplicates"] == 0
    # every group either trained or failed: trained groups + failed groups = prompts of the epoch
    assert out["trained_groups"] + out["failed"] // 2 == NUM_PROMPTS
    assert out["untrained_prompts"] == out["failed"] // 2
    assert out["steps"] == NUM_PROMPTS // 4
    assert len(out["first_examples"]) == 4


@pytest.mark.slow
def test_a_reward_that_always_fails_stops_within_a_minute(ray_cluster, tmp_path):
    out = run_always_failing(tmp_path)
    assert out["stopped_after_s"] is not None and out["stopped_after_s"] < 60
    first, second = out["message"].split("\n")[:2]
    assert re.fullmatch(rf"custom reward `always_fails` from {re.escape(str(FLAKY))} failed on (\d+) of the last "
                        r"\1 scored samples \(100% > `reward.max_failed_frac` = 0.5\); stopping the job\.", first)
    assert second.startswith("  raised: ")
    assert "RuntimeError: the judge model is not loaded" in out["message"]


if __name__ == "__main__":
    ray = start_ray()
    try:
        print(run_flaky(Path(tempfile.mkdtemp(prefix="chaos_reward_"))))
        print(run_always_failing(Path(tempfile.mkdtemp(prefix="chaos_reward_"))))
    finally:
        ray.shutdown()
