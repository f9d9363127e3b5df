"""Failure paths of the one training loop, in both modes: failed rewards, ragged epochs, resume.

Each test is a real run on Ray (tiny model, 2-3 steps). The trained-groups
audit file says what every step trained on; it is how the tests check that
every prompt was trained exactly once.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from omnirl_async.config import load_config
from omnirl_async.trainer.failures import RewardFailureError
from omnirl_async.trainer.task_runner import TaskRunner
from omnirl_async.trainer.trained_log import read_trained_log

FLAKY = Path(__file__).parent.parent / "chaos" / "flaky_rewards.py"
PROMPTS = ["one red circle", "two blue squares", "a green triangle", "three yellow circles", "a white square",
           "two purple triangles", "one blue circle", "four red squares", "a red triangle", "two green circles"]
MODES = ["sync", "separate_async"]


def _write_prompts(folder: Path, prompts: list[str]) -> Path:
    path = folder / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    return path


def _cfg(small_overrides, tmp_path: Path, mode: str, prompts: list[str], *extra: str):
    return load_config(small_overrides + [
        f"trainer.v1.trainer_mode={mode}", "actor_rollout_ref.rollout.num_workers=2",
        "actor_rollout_ref.rollout.pipeline.num_inference_steps=3", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", f"data.train_files={_write_prompts(tmp_path, prompts)}",
        "data.shuffle=false", f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.log_dir={tmp_path / 'tb'}",
        "trainer.total_epochs=1", "trainer.resume_mode=disable", *extra])


def _trained_prompts(tmp_path: Path) -> Counter:
    steps, _ = read_trained_log(tmp_path / "ckpt")
    return Counter(g[1] for rec in steps.values() for g in rec["groups"])


@pytest.mark.slow  # a full training run; tests/trainer/test_one_loop.py covers both modes in `make test`
@pytest.mark.parametrize("mode", MODES)
def test_failed_rewards_and_a_ragged_epoch_never_stall_training(ray_cluster, small_overrides, tmp_path, mode):
    """9 prompts, batch 2, a reward failing every third call: the job ends, nothing trained twice or lost."""
    printed: list[str] = []
    cfg = _cfg(small_overrides, tmp_path, mode, PROMPTS[:9], f"reward.custom_reward_function.path={FLAKY}",
               "reward.custom_reward_function.name=raises_every_third", "trainer.wait_timeout_s=60")
    t0 = time.monotonic()
    summary = TaskRunner(cfg, printer=printed.append).run()
    assert time.monotonic() - t0 < 60
    # each of the 2 workers failed every third group it scored: some failed, all counted as `raised`
    assert 0 < summary["reward_failed"] < summary["reward_scored"]
    assert summary["reward_failed_kinds"] == {"raised": summary["reward_failed"]}
    assert summary["reward_failed"] % 2 == 0  # whole groups of n=2 fail
    assert sum(1 for line in printed if "first example" in line) == 1
    assert "ConnectionError: scorer service refused the connection" in next(x for x in printed if "first ex" in x)
    # every prompt was trained once, or failed; nothing trained twice
    trained = _trained_prompts(tmp_path)
    assert max(trained.values()) == 1
    assert sum(trained.values()) == 9 - summary["reward_failed"] // 2
    # 9 prompts / batch 2 = 5 steps: failed groups make batches smaller, not later; the last batch has 1 prompt
    assert summary["global_step"] == 5
    steps, _ = read_trained_log(tmp_path / "ckpt")
    assert all(sum(g[5] for g in steps[s]["groups"]) <= 4 for s in steps)
    assert (tmp_path / "ckpt" / "global_step_5").is_dir()  # the end of the run is checkpointed


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_last_batch_whose_groups_all_failed_is_an_empty_step_and_the_end_is_saved(ray_cluster, small_overrides,
                                                                                     tmp_path, mode):
    """9 prompts, batch 2: the 5th update holds only the 9th prompt, whose reward always fails. The run still
    takes that (empty) update and checkpoints its end, in both modes."""
    assert PROMPTS[8] == "a red triangle"
    cfg = _cfg(small_overrides, tmp_path, mode, PROMPTS[:9], f"reward.custom_reward_function.path={FLAKY}",
               "reward.custom_reward_function.name=raises_on_a_red_triangle", "trainer.wait_timeout_s=60")
    summary = TaskRunner(cfg, printer=lambda *a: None).run()
    assert summary["reward_failed"] == 2  # the one group of n=2
    assert summary["global_step"] == 5 and summary["empty_steps"] == 1
    trained = _trained_prompts(tmp_path)
    assert set(trained) == set(PROMPTS[:8]) and max(trained.values()) == 1
    assert (tmp_path / "ckpt" / "global_step_5").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_failed_groups_are_generated_again_with_drop_incomplete_groups(ray_cluster, small_overrides, tmp_path,
                                                                        mode):
    cfg = _cfg(small_overrides, tmp_path, mode, PROMPTS[:6], f"reward.custom_reward_function.path={FLAKY}",
               "reward.custom_reward_function.name=nan_every_third", "trainer.wait_timeout_s=60",
               "trainer.v1.sampler.drop_incomplete_groups=true")
    summary = TaskRunner(cfg, printer=lambda *a: None).run()
    assert summary["reward_failed_kinds"].get("nonfinite", 0) > 0
    assert _trained_prompts(tmp_path) == Counter(PROMPTS[:6])  # refilled: every prompt trained exactly once


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_reward_that_always_fails_stops_the_job_with_its_reason(ray_cluster, small_overrides, tmp_path, mode):
    cfg = _cfg(small_overrides, tmp_path, mode, PROMPTS, f"reward.custom_reward_function.path={FLAKY}",
               "reward.custom_reward_function.name=always_fails", "reward.failed_frac_window=8",
               "trainer.total_epochs=20")
    t0 = time.monotonic()
    with pytest.raises(RewardFailureError) as err:
        TaskRunner(cfg, printer=lambda *a: None).run()
    assert time.monotonic() - t0 < 60
    msg = str(err.value)
    assert msg.startswith(f"custom reward `always_fails` from {FLAKY} failed on ")
    assert "> `reward.max_failed_frac` = 0.5" in msg
    assert "raised: " in msg and "RuntimeError: the judge model is not loaded" in msg


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_short_run_whose_reward_always_failed_fails_at_its_end(ray_cluster, small_overrides, tmp_path, mode):
    """3 steps, 12 samples, fewer than the 64-sample window: the run still ends with the reward's failure (it used to
    print "finished" and exit 0 having trained on nothing)."""
    cfg = _cfg(small_overrides, tmp_path, mode, PROMPTS, f"reward.custom_reward_function.path={FLAKY}",
               "reward.custom_reward_function.name=always_fails", "trainer.total_training_steps=3")
    with pytest.raises(RewardFailureError) as err:
        TaskRunner(cfg, printer=lambda *a: None).run()
    msg = str(err.value)
    assert msg.startswith(f"custom reward `always_fails` from {FLAKY} failed on ")
    assert "samples this run scored (fewer than `reward.failed_frac_window` = 64, so the limit is applied at the " \
           "end) (100% > `reward.max_failed_frac` = 0.5); the run fails." in msg
    assert "RuntimeError: the judge model is not loaded" in msg


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_the_train_command_ends_a_failed_or_interrupted_run_with_its_reason_and_checkpoint(small_overrides, tmp_path,
                                                                                          mode):
    """`omnirl-async train` as a user runs it: a reward that always fails exits 1 with the reason and no traceback;
    Ctrl-C after the first checkpoint exits 130 saying where the run can go on from."""
    import signal
    import subprocess
    import sys

    def command(folder: Path, *extra: str) -> list[str]:
        folder.mkdir()
        return [sys.executable, "-m", "omnirl_async.cli", "train", *small_overrides, f"trainer.v1.trainer_mode={mode}",
                "actor_rollout_ref.rollout.num_workers=1", "actor_rollout_ref.rollout.pipeline.num_inference_steps=3",
                "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                f"data.train_files={_write_prompts(folder, PROMPTS)}", f"trainer.default_local_dir={folder / 'ckpt'}",
                f"trainer.log_dir={folder / 'tb'}", "trainer.progress_bar=false", *extra]

    failed = subprocess.run(command(tmp_path / "fails", f"reward.custom_reward_function.path={FLAKY}",
                                    "reward.custom_reward_function.name=always_fails",
                                    "trainer.total_training_steps=3"), capture_output=True, text=True, timeout=300)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert f"omnirl-async: the run stopped: custom reward `always_fails` from {FLAKY} failed on " in failed.stderr
    assert "Traceback" not in failed.stderr and "the newest checkpoint is " in failed.stderr

    folder = tmp_path / "interrupted"
    proc = subprocess.Popen(command(folder, "trainer.save_freq=1", "trainer.total_training_steps=200"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (folder / "ckpt" / "global_step_1").is_dir():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 130, err[-3000:]
    assert f"omnirl-async: interrupted; the newest checkpoint is {folder / 'ckpt'}/global_step_" in err
    assert "`trainer.resume_mode=auto` (the default) continues from it" in err


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_resume_publishes_once_and_the_next_step_is_bit_exact(ray_cluster, small_overrides, tmp_path, mode):
    """An uninterrupted 3-step run vs. a run resumed from its step-2 checkpoint: step 3 is the same."""
    common = ["trainer.v1.sampler.max_off_policy_threshold=0", "trainer.save_freq=2", "trainer.total_epochs=2",
              "actor_rollout_ref.rollout.num_workers=1"]
    a = tmp_path / "a"
    a.mkdir()
    cfg_a = _cfg(small_overrides, a, mode, PROMPTS[:6], *common, "trainer.total_training_steps=3")
    runner = TaskRunner(cfg_a, printer=lambda *x: None)
    summary_a = runner.run()
    assert summary_a["global_step"] == 3
    steps_a, _ = read_trained_log(a / "ckpt")

    b = tmp_path / "b"
    b.mkdir()
    shutil.copytree(a / "ckpt" / "global_step_2", b / "ckpt" / "global_step_2")
    printed: list[str] = []
    cfg_b = _cfg(small_overrides, b, mode, PROMPTS[:6], *common, "trainer.total_training_steps=3",
                 "trainer.resume_mode=auto")
    summary_b = TaskRunner(cfg_b, printer=printed.append).run()
    assert any("at step 2 (policy version 2)" in line for line in printed)
    assert summary_b["global_step"] == 3 and summary_b["version"] == 3
    steps_b, _ = read_trained_log(b / "ckpt")
    assert sorted(steps_b) == [3]
    assert steps_b[3]["groups"] == steps_a[3]["groups"] or \
        [g[1:] for g in steps_b[3]["groups"]] == [g[1:] for g in steps_a[3]["groups"]]
    from safetensors.torch import load_file

    lora_a = load_file(str(a / "ckpt" / "global_step_3" / "lora" / "adapter_model.safetensors"))
    lora_b = load_file(str(b / "ckpt" / "global_step_3" / "lora" / "adapter_model.safetensors"))
    assert all(bool((lora_a[k] == lora_b[k]).all()) for k in lora_a)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_hanging_reward_hits_the_wait_timeout_with_a_diagnosis(ray_cluster, small_overrides, tmp_path, mode):
    cfg = _cfg(small_overrides, tmp_path, mode, PROMPTS[:4], f"reward.custom_reward_function.path={FLAKY}",
               "reward.custom_reward_function.name=hangs", "trainer.wait_timeout_s=20")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        TaskRunner(cfg, printer=lambda *a: None).run()
    assert time.monotonic() - t0 < 58  # the reward sleeps 60 s
    msg = str(err.value)
    assert msg.startswith("step 1: ")
    assert "`trainer.wait_timeout_s` = 20 s" in msg and "`reward.timeout_s`" in msg
    if mode == "separate_async":
        assert "for the prompt groups of tickets below 2. dispatcher: tickets issued " in msg
        assert "leases outstanding " in msg and "failed samples by kind none" in msg


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_reward_hanging_in_validation_hits_the_wait_timeout_naming_validation(ray_cluster, small_overrides,
                                                                                tmp_path, mode):
    """Validation before training, a reward that sleeps 60 s per call and no `reward.timeout_s`: the driver's wait
    for the validation worker is bounded too (it waited for every call to end)."""
    cfg = _cfg(small_overrides, tmp_path, mode, PROMPTS[:4], f"reward.custom_reward_function.path={FLAKY}",
               "reward.custom_reward_function.name=hangs", "trainer.wait_timeout_s=20", "trainer.val_before_train=true",
               "data.val_max_samples=2")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        TaskRunner(cfg, printer=lambda *a: None).run()
    assert time.monotonic() - t0 < 58
    assert str(err.value).startswith("step 0: validation of 2 prompts on rollout worker 0 got no answer within "
                                     "`trainer.wait_timeout_s` = 20 s. Likely causes: a reward call hangs "
                                     "(`reward.timeout_s` is unset: set it to bound each call)")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_inline_reward_timeout_fails_the_slow_groups(ray_cluster, small_overrides, tmp_path, mode):
    """`reward.timeout_s` bounds inline scoring too: a call past it fails its group with kind `timeout`."""
    cfg = _cfg(small_overrides, tmp_path, mode, PROMPTS, f"reward.custom_reward_function.path={FLAKY}",
               "reward.custom_reward_function.name=slow_every_third", "reward.timeout_s=1",
               "trainer.wait_timeout_s=60")
    summary = TaskRunner(cfg, printer=lambda *a: None).run()
    assert summary["reward_failed_kinds"] == {"timeout": summary["reward_failed"]} and summary["reward_failed"] > 0


@pytest.mark.slow
def test_drop_strategy_with_failed_rewards_and_a_ragged_epoch_ends(ray_cluster, small_overrides, tmp_path):
    """Under `drop` the learner takes B groups' worth of fresh samples, or what is left at the end of the run."""
    cfg = _cfg(small_overrides, tmp_path, "separate_async", PROMPTS[:9], f"reward.custom_reward_function.path={FLAKY}",
               "reward.custom_reward_function.name=raises_every_third", "trainer.wait_timeout_s=60",
               "trainer.v1.sampler.max_off_policy_strategy=drop", "trainer.v1.sampler.max_off_policy_threshold=4")
    summary = TaskRunner(cfg, printer=lambda *a: None).run()
    trained = _trained_prompts(tmp_path)
    assert max(trained.values()) == 1 and summary["dropped_samples"] == 0
    assert sum(trained.values()) == 9 - summary["reward_failed"] // 2 and summary["reward_failed"] > 0


def _fit_until_the_learner_dies(trainer):
    """Run ``trainer`` (whose learner is killed on the way) to its LearnerDiedError: (the error, seconds taken)."""
    from omnirl_async.learners.learner_group import LearnerDiedError

    t0 = time.monotonic()
    try:
        with pytest.raises(LearnerDiedError) as err:
            trainer.fit()
    finally:
        trainer.stop()
    return err, time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_dead_learner_gives_one_message_with_its_rank_and_the_checkpoint(ray_cluster, small_overrides, tmp_path,
                                                                          mode):
    import ray

    from omnirl_async.trainer.separate_async import SeparateAsyncTrainer
    from omnirl_async.trainer.sync import SyncTrainer

    base = SyncTrainer if mode == "sync" else SeparateAsyncTrainer

    class KillLearner(base):
        def start_update(self, prepared):
            if self.global_step == 2:
                ray.kill(self.learners.actors[0], no_restart=True)
            return super().start_update(prepared)

    cfg = _cfg(small_overrides, tmp_path, mode, PROMPTS[:8], "trainer.save_freq=2")
    trainer = KillLearner(cfg, PROMPTS[:8], printer=lambda *a: None)
    err, seconds = _fit_until_the_learner_dies(trainer)
    assert seconds < 60
    msg = str(err.value)
    assert err.value.rank == 0 and err.value.call == "update" and err.value.__cause__ is None
    assert msg.startswith("learner rank 0 died during `update`; training cannot continue without it. Cause: ")
    assert msg.endswith(f"the last complete checkpoint is {tmp_path / 'ckpt' / 'global_step_2'}; rerun with "
                        "`trainer.resume_mode=auto` to continue from it")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_hung_learner_is_a_timeout_naming_the_update_in_both_modes(ray_cluster, small_overrides, tmp_path, mode):
    """A learner that neither answers nor dies (SIGSTOPped: a rank stuck in a collective looks the same to the
    loop). Threshold 0: no batch for the next step can be ready while the update is out, so separate_async's
    look-ahead for it is what must give up – it used to poll the frozen update for ever."""
    from omnirl_async.trainer.separate_async import SeparateAsyncTrainer
    from omnirl_async.trainer.sync import SyncTrainer

    class FreezeLearner(SyncTrainer if mode == "sync" else SeparateAsyncTrainer):
        pid = None

        def start_update(self, prepared):
            if self.pid is None:
                self.pid = self.learners.assert_healthy()[0]["pid"]
            if self.global_step == 1:
                os.kill(self.pid, signal.SIGSTOP)
            return super().start_update(prepared)

    cfg = _cfg(small_overrides, tmp_path, mode, PROMPTS[:8], "trainer.wait_timeout_s=20",
               "trainer.v1.sampler.max_off_policy_threshold=0")
    trainer = FreezeLearner(cfg, PROMPTS[:8], printer=lambda *a: None)
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError) as err:
            trainer.fit()
    finally:
        if trainer.pid is not None:
            os.kill(trainer.pid, signal.SIGCONT)
        trainer.stop()  # kills the hung learner rather than asking it to leave its process group
    assert time.monotonic() - t0 < 100  # separate_async: 20 s looking ahead, then 20 s for the update's reply
    assert str(err.value).startswith("learner call `update` got no answer from rank(s) [0] within "
                                     "`trainer.wait_timeout_s` = 20 s.")
    assert trainer.learners.hung and not trainer.learners.actors


@pytest.mark.slow  # separate_async only: sync never starts an update before its step
def test_a_learner_dying_while_an_update_runs_back_to_back_gives_the_same_one_message(ray_cluster, small_overrides,
                                                                                     tmp_path):
    """Killed right after the next update was started early (with the publish of the last one before it): the
    loop's collect of that publish is the one clear error, with the checkpoint to resume from."""
    import ray

    from omnirl_async.trainer.separate_async import SeparateAsyncTrainer

    class KillLearner(SeparateAsyncTrainer):
        killed_at = None

        def start_next_early(self):
            super().start_next_early()
            if self._started is not None and self.global_step >= 2 and self.killed_at is None:
                self.killed_at = self.global_step
                ray.kill(self.learners.actors[0], no_restart=True)

    cfg = _cfg(small_overrides, tmp_path, "separate_async", PROMPTS, "trainer.save_freq=2", "trainer.total_epochs=4",
               "trainer.v1.sampler.max_off_policy_threshold=1", "actor_rollout_ref.actor.ppo_epochs=3")
    trainer = KillLearner(cfg, PROMPTS, printer=lambda *a: None)
    err, seconds = _fit_until_the_learner_dies(trainer)
    assert trainer.killed_at is not None and seconds < 120
    assert err.value.rank == 0 and err.value.call == "publish" and err.value.__cause__ is None
    assert str(err.value).startswith("learner rank 0 died during `publish`; training cannot continue without it.")
    last = 2 * (trainer.killed_at // 2)  # saves every 2 steps, never with an update in flight
    assert str(err.value).endswith(f"the last complete checkpoint is {tmp_path / 'ckpt' / f'global_step_{last}'}; "
                                   "rerun with `trainer.resume_mode=auto` to continue from it")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_resume_without_a_buffer_snapshot_generates_the_untrained_groups_again(ray_cluster, small_overrides,
                                                                               tmp_path, mode):
    """`buffer.snapshot_with_checkpoint=false`: groups admitted but not trained at the checkpoint are re-leased."""
    common = ["buffer.snapshot_with_checkpoint=false", "trainer.save_freq=2", "trainer.resume_mode=auto",
              "actor_rollout_ref.rollout.num_workers=2"]
    first = _cfg(small_overrides, tmp_path, mode, PROMPTS[:8], *common, "trainer.total_training_steps=2")
    TaskRunner(first, printer=lambda *a: None).run()
    assert not (tmp_path / "ckpt" / "global_step_2" / "buffer").exists()
    printed: list[str] = []
    second = _cfg(small_overrides, tmp_path, mode, PROMPTS[:8], *common)
    summary = TaskRunner(second, printer=printed.append).run()
    assert summary["global_step"] == 4
    assert _trained_prompts(tmp_path) == Counter(PROMPTS[:8])  # across both runs, each prompt once


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_checkpoint_taken_while_the_next_batch_is_held_resumes_with_every_prompt_once(ray_cluster,
                                                                                        small_overrides, tmp_path,
                                                                                        mode):
    """separate_async samples the next batch while an update runs (here certain at step 2: a warm-up of three
    batches under threshold 2); the checkpoint taken then lists the held tickets, and the resumed run generates
    those groups again, so across both runs every prompt is trained exactly once."""
    from omnirl_async.trainer.checkpoint import load_state

    common = ["trainer.save_freq=2", "actor_rollout_ref.rollout.num_workers=2"]
    if mode == "separate_async":  # sync queues nothing ahead (and refuses a warm-up or a larger threshold)
        common += ["trainer.v1.sampler.max_off_policy_threshold=2", "trainer.v1.separate_async.num_warmup_batches=3"]
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    summary_a = TaskRunner(_cfg(small_overrides, a, mode, PROMPTS[:8], *common, "trainer.total_training_steps=3"),
                           printer=lambda *x: None).run()
    assert summary_a["global_step"] == 3
    held = load_state(a / "ckpt" / "global_step_2", "trainer")["dispatcher"].get("held", [])
    assert held == ([4, 5] if mode == "separate_async" else [])  # the tickets of the third batch
    shutil.copytree(a / "ckpt" / "global_step_2", b / "ckpt" / "global_step_2")
    printed: list[str] = []
    summary_b = TaskRunner(_cfg(small_overrides, b, mode, PROMPTS[:8], *common, "trainer.resume_mode=auto"),
                           printer=printed.append).run()
    assert summary_b["global_step"] == 4
    if held:
        assert any("2 admitted groups not yet trained are generated again" in line for line in printed), printed
    steps_a, _ = read_trained_log(a / "ckpt")
    steps_b, _ = read_trained_log(b / "ckpt")
    assert sorted(steps_b) == [3, 4]
    trained = Counter(g[1] for step, rec in steps_a.items() if step <= 2 for g in rec["groups"])
    trained.update(g[1] for rec in steps_b.values() for g in rec["groups"])
    assert trained == Counter(PROMPTS[:8])
    # the held batch is what the uninterrupted run trained at step 3
    assert {g[1] for g in steps_b[3]["groups"]} == {g[1] for g in steps_a[3]["groups"]}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_with_a_long_tailed_reward_each_update_trains_exactly_its_tickets_in_order(ray_cluster, small_overrides,
                                                                                   tmp_path, mode, monkeypatch):
    """Groups of triangle prompts are scored 4 s late. separate_async takes the next update's other groups as they
    land (their payloads are fetched while it waits for the late one) and still trains exactly the tickets of each
    update, in ticket order - the same batches as sync."""
    from omnirl_async.trainer.separate_async import SeparateAsyncTrainer

    monkeypatch.setattr(SeparateAsyncTrainer, "land_every_s", 0.1)  # off by default (README, bench_scale N:land)
    cfg = _cfg(small_overrides, tmp_path, mode, PROMPTS[:8], f"reward.custom_reward_function.path={FLAKY}",
               "reward.custom_reward_function.name=slow_on_triangles", "trainer.wait_timeout_s=60")
    summary = TaskRunner(cfg, printer=lambda *a: None).run()
    steps, _ = read_trained_log(tmp_path / "ckpt")
    assert {s: [g[1] for g in rec["groups"]] for s, rec in steps.items()} == {
        u + 1: PROMPTS[2 * u:2 * u + 2] for u in range(4)}
    if mode == "separate_async":  # at least one of "three yellow circles", "a white square" landed before its triangle
        assert summary["landed_groups"] >= 1


@pytest.mark.slow  # sync holds no groups between updates: nothing of the kind to checkpoint there
def test_a_checkpoint_taken_while_landed_groups_of_the_next_update_are_held_resumes_with_every_prompt_once(
        ray_cluster, small_overrides, tmp_path, monkeypatch):
    """The checkpoint after update 1 waits until update 2's fast group (ticket 3) has landed and been taken while
    its triangle (ticket 2) is still being scored: the checkpoint lists ticket 3 as held, and the resumed run
    generates it again, so across both runs every prompt is trained exactly once and update 2 is the same."""
    from omnirl_async.trainer.checkpoint import load_state
    from omnirl_async.trainer.separate_async import SeparateAsyncTrainer

    save = SeparateAsyncTrainer.save_checkpoint

    def save_once_landed(self):
        deadline = time.monotonic() + 30
        while self.global_step == 1 and not self._landed and time.monotonic() < deadline:
            self.take_landed(self.global_step)  # the next update's groups that are done
            time.sleep(0.05)
        return save(self)

    monkeypatch.setattr(SeparateAsyncTrainer, "save_checkpoint", save_once_landed)
    monkeypatch.setattr(SeparateAsyncTrainer, "land_every_s", 0.1)  # off by default (README, bench_scale N:land)
    common = [f"reward.custom_reward_function.path={FLAKY}", "reward.custom_reward_function.name=slow_on_triangles",
              "trainer.wait_timeout_s=60", "trainer.save_freq=1"]
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    summary_a = TaskRunner(_cfg(small_overrides, a, "separate_async", PROMPTS[:6], *common,
                                "trainer.total_training_steps=3"), printer=lambda *x: None).run()
    assert summary_a["global_step"] == 3 and summary_a["landed_groups"] >= 1
    assert load_state(a / "ckpt" / "global_step_1", "trainer")["dispatcher"].get("held") == [3]
    monkeypatch.undo()
    shutil.copytree(a / "ckpt" / "global_step_1", b / "ckpt" / "global_step_1")
    summary_b = TaskRunner(_cfg(small_overrides, b, "separate_async", PROMPTS[:6], *common,
                                "trainer.resume_mode=auto"), printer=lambda *x: None).run()
    assert summary_b["global_step"] == 3
    steps_a, _ = read_trained_log(a / "ckpt")
    steps_b, _ = read_trained_log(b / "ckpt")
    assert sorted(steps_b) == [2, 3]
    trained = Counter(g[1] for g in steps_a[1]["groups"])
    trained.update(g[1] for rec in steps_b.values() for g in rec["groups"])
    assert trained == Counter(PROMPTS[:6])
    assert [g[1] for g in steps_b[2]["groups"]] == [g[1] for g in steps_a[2]["groups"]] == PROMPTS[2:4]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_validation_scores_the_learner_version_also_right_after_a_resume(ray_cluster, small_overrides, tmp_path,
                                                                        mode):
    """val/score of the restored weights (val_before_train after resume) == val/score at that step in the run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def val_scores(log_dir):
        acc = EventAccumulator(str(log_dir))
        acc.Reload()
        return {e.step: e.value for e in acc.Scalars("val/score")}

    common = ["trainer.test_freq=2", "data.val_max_samples=2",
              "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps=2", "trainer.save_freq=2"]
    (tmp_path / "a").mkdir()
    a = _cfg(small_overrides, tmp_path / "a", mode, PROMPTS[:8], *common, "trainer.total_training_steps=2")
    TaskRunner(a, printer=lambda *x: None).run()
    (tmp_path / "b").mkdir()
    b = _cfg(small_overrides, tmp_path / "b", mode, PROMPTS[:8], *common, "trainer.total_training_steps=2",
             "trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path / 'a' / 'ckpt' / 'global_step_2'}",
             "trainer.val_before_train=true")
    TaskRunner(b, printer=lambda *x: None).run()
    assert val_scores(tmp_path / "b" / "tb")[2] == val_scores(tmp_path / "a" / "tb")[2]
    # the validation images themselves: the same weights drew them (the base model's differ)
    from PIL import Image
    import numpy as np

    grid_a = np.asarray(Image.open(tmp_path / "a" / "ckpt" / "validation" / "step_2.png"))
    grid_b = np.asarray(Image.open(tmp_path / "b" / "ckpt" / "validation" / "step_2.png"))
    assert np.array_equal(grid_a, grid_b)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_resumed_run_logs_into_the_same_wandb_run(ray_cluster, small_overrides, tmp_path, mode, monkeypatch):
    """W&B (offline) as the logger: the run saves its W&B id beside the checkpoints; the resumed run continues it."""
    pytest.importorskip("wandb")
    from tests.metrics.test_loggers import _history_steps, _wandb_offline

    _wandb_offline(monkeypatch)
    common = ["trainer.save_freq=2", "trainer.logger=[wandb]", "buffer.snapshot_with_checkpoint=false"]
    TaskRunner(_cfg(small_overrides, tmp_path, mode, PROMPTS[:8], *common, "trainer.total_training_steps=2"),
               printer=lambda *a: None).run()
    run_id = (tmp_path / "ckpt" / "wandb_run_id.txt").read_text().strip()
    (first,) = (tmp_path / "tb" / "wandb").glob("offline-run-*")
    assert _history_steps(first) == (run_id, [1, 2])
    printed: list[str] = []
    summary = TaskRunner(_cfg(small_overrides, tmp_path, mode, PROMPTS[:8], *common, "trainer.total_training_steps=3",
                              "trainer.resume_mode=auto"), printer=printed.append).run()
    assert summary["global_step"] == 3
    assert any(f"W&B: continuing run {run_id}" in line for line in printed), printed
    (second,) = [d for d in (tmp_path / "tb" / "wandb").glob("offline-run-*") if d != first]
    assert _history_steps(second) == (run_id, [3])  # `wandb sync` of both folders gives one run, steps 1-3
