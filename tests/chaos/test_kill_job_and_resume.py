"""Chaos (b): kill -9 of the whole job in the middle of a run, then ``trainer.resume_mode=auto``.

The job runs as a real ``omnirl-async train`` process (separate_async) in its
own session; once it has checkpointed and trained past the checkpoint, the
whole process group (driver, Ray and every actor) gets SIGKILL. The same
command again resumes from the newest complete checkpoint and finishes the
epoch. Checked with the run's ``trained_groups.jsonl``: across both runs every
prompt of the epoch was trained exactly once, and every step that was rolled
back was trained again on exactly the same prompts as in the first run.
Run as a script to print the figures.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from omnirl_async.trainer.trained_log import read_trained_log
from tests.chaos.harness import FLAKY, env_with_repo, overrides, prompts, python

NUM_PROMPTS = 24


def _command(run_dir: Path, ray_tmp: str, plist: list[str]) -> list[str]:
    args = overrides(run_dir, plist, "data.train_batch_size=2", "trainer.save_freq=3",
                     "trainer.v1.sampler.max_off_policy_threshold=1", "trainer.resume_mode=auto",
                     f"reward.custom_reward_function.path={FLAKY}", "reward.custom_reward_function.name=sleepy",
                     "+reward.reward_kwargs.sleep_s=0.3", "trainer.wait_timeout_s=120",
                     f"+ray_kwargs.ray_init._temp_dir={ray_tmp}", "ray_kwargs.num_cpus=4")
    return [python(), "-m", "omnirl_async.cli", "train", *args]


def _kill_session(proc: subprocess.Popen, ray_tmp: str) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    # Ray's own daemons may sit in another session: everything started under this run's temp dir goes too
    subprocess.run(["pkill", "-9", "-f", ray_tmp], check=False)
    time.sleep(1.0)


def run(run_dir: Path, *, kill_after_step: int = 5, timeout_s: float = 400) -> dict:
    plist = prompts(NUM_PROMPTS)
    ray_tmp = tempfile.mkdtemp(prefix="rc", dir="/tmp")
    log_path = run_dir / "ckpt" / "trained_groups.jsonl"
    first = subprocess.Popen(_command(run_dir, ray_tmp, plist), env=env_with_repo(), start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout_s
    killed_at = None
    try:
        while time.monotonic() < deadline and first.poll() is None:
            if log_path.is_file():
                steps, _ = read_trained_log(log_path)
                if steps and max(steps) >= kill_after_step:
                    killed_at = max(steps)
                    break
            time.sleep(0.05)
    finally:
        if first.poll() is None:
            _kill_session(first, ray_tmp)
    if killed_at is None:
        raise RuntimeError(f"the first run ended (rc {first.returncode}) before step {kill_after_step}: "
                           f"{first.stderr.read().decode()[-3000:]}")
    second = subprocess.run(_command(run_dir, ray_tmp, plist), env=env_with_repo(), capture_output=True, text=True,
                            timeout=timeout_s, start_new_session=True)
    subprocess.run(["pkill", "-9", "-f", ray_tmp], check=False)
    steps, rolled_back = read_trained_log(log_path)
    trained = Counter(g[1] for rec in steps.values() for g in rec["groups"])
    same = all(sorted(g[1] for g in old["groups"]) == sorted(g[1] for g in steps[s]["groups"])
               for s, olds in rolled_back.items() for old in olds)
    resumed = [line for line in second.stdout.splitlines() + second.stderr.splitlines() if "resumed from" in line]
    return {"rc": second.returncode, "killed_at_step": killed_at, "resumed": resumed, "steps": sorted(steps),
            "rolled_back_steps": sorted(rolled_back), "rolled_back_same_prompts": same,
            "trained_once": trained == Counter(plist), "duplicates": sum(c - 1 for c in trained.values()),
            "lost": len(set(plist) - set(trained)), "stderr_tail": second.stderr[-2000:]}


@pytest.mark.slow
def test_kill_9_of_the_whole_job_then_resume_trains_every_prompt_once(tmp_path):
    out = run(tmp_path)
    assert out["rc"] == 0, out["stderr_tail"]
    assert out["resumed"] and "at step 3 (policy version 3)" in out["resumed"][0]
    assert out["steps"] == list(range(1, NUM_PROMPTS // 2 + 1))
    assert out["rolled_back_steps"] and min(out["rolled_back_steps"]) == 4
    assert out["rolled_back_same_prompts"]
    assert out["trained_once"] and out["duplicates"] == 0 and out["lost"] == 0


if __name__ == "__main__":
    result = run(Path(tempfile.mkdtemp(prefix="chaos_resume_")))
    result.pop("stderr_tail")
    print(result)
