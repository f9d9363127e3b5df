"""The one training loop: both modes log the same metric keys and honour the same run settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnirl_async.config import load_config
from omnirl_async.trainer.task_runner import TaskRunner

PROMPTS = ["one red circle", "two blue squares", "a green triangle", "three yellow circles"]


def _tags(log_dir: Path) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _run(small_overrides, out: Path, mode: str) -> dict[str, list[int]]:
    prompts = out / "prompts.txt"
    out.mkdir(parents=True)
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cfg = load_config(small_overrides + [
        f"trainer.v1.trainer_mode={mode}", "actor_rollout_ref.rollout.num_workers=1", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.pipeline.num_inference_steps=3", f"data.train_files={prompts}",
        "data.shuffle=false", "trainer.total_epochs=1", "trainer.resume_mode=disable",
        "trainer.val_before_train=true", "trainer.test_freq=2", "data.val_max_samples=2",
        "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps=2", "trainer.rollout_data_save_freq=1",
        f"trainer.default_local_dir={out / 'ckpt'}", f"trainer.log_dir={out / 'tb'}"])
    summary = TaskRunner(cfg, printer=lambda *a: None).run()
    assert summary["global_step"] == 2
    return _tags(out / "tb")


def test_both_modes_log_the_same_keys_and_honour_val_before_train_and_dumps(ray_cluster, small_overrides,
                                                                            tmp_path):
    tags = {mode: _run(small_overrides, tmp_path / mode, mode) for mode in ("sync", "separate_async")}
    assert set(tags["sync"]) == set(tags["separate_async"]), (
        sorted(set(tags["sync"]) ^ set(tags["separate_async"])))
    for mode, t in tags.items():
        assert t["val/score"] == [0, 2], mode  # before training, then at test_freq (= the last step)
        assert t["critic/rewards/mean"] == [1, 2] and t["timing_s/gen"] == [1, 2], mode
        for key in ("training/policy_version", "training/epoch", "reward/failed_frac", "perf/rollout_idle_frac",
                    "rollout/min_worker_version", "training/off_policy/dropped_samples", "timing_s/reward"):
            assert t[key] == [1, 2], (mode, key)
        dumps = sorted(p.name for p in (tmp_path / mode / "ckpt" / "rollout_data").iterdir())
        assert dumps == ["step_1.png", "step_2.png"], mode


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "separate_async"])
def test_a_fresh_run_sets_an_earlier_runs_later_checkpoints_aside(ray_cluster, small_overrides, tmp_path, mode):
    """resume_mode=disable in a folder holding global_step_87 of another run: this run's checkpoints are found."""
    from omnirl_async.trainer.checkpoint import CheckpointManager, save_state

    old = CheckpointManager(tmp_path / "ckpt")
    folder = old.begin(87)
    save_state({"global_step": 87}, folder, "trainer")
    old.commit(folder, 87)
    lines = []
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cfg = load_config(small_overrides + [
        f"trainer.v1.trainer_mode={mode}", "actor_rollout_ref.rollout.num_workers=1", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.pipeline.num_inference_steps=3", f"data.train_files={prompts}",
        "trainer.total_training_steps=2", "trainer.resume_mode=disable", "trainer.save_freq=1",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.log_dir={tmp_path / 'tb'}"])
    assert TaskRunner(cfg, printer=lambda *a: lines.append(" ".join(map(str, a)))).run()["global_step"] == 2
    assert CheckpointManager(tmp_path / "ckpt").latest().name == "global_step_2"
    (moved,) = (tmp_path / "ckpt" / "superseded").iterdir()
    assert (moved / "global_step_87").is_dir()
    assert any("earlier run's checkpoints" in line and str(moved) in line for line in lines), lines
    trained = (tmp_path / "ckpt" / "trained_groups.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in trained] == [1, 2]  # only this run's steps
