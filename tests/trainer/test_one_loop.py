"""The one training loop: both modes log the same metric keys and honour the same run settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnirl_async.config import load_config
from omnirl_async.trainer.task_runner import TaskRunner
from tests.trainer.tb_events import scalar_events, scalar_values

PROMPTS = ["one red circle", "two blue squares", "a green triangle", "three yellow circles"]


def _tags(log_dir: Path) -> dict[str, list[int]]:
    return {tag: [step for step, _ in ev] for tag, ev in scalar_events(log_dir).items()}


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
                    "rollout/min_worker_version", "training/off_policy/dropped_samples", "timing_s/reward",
                    "timing_s/put", "buffer/put_calls"):
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


@pytest.mark.slow  # four short runs (~1 min)
@pytest.mark.parametrize("mode", ["sync", "separate_async"])
def test_put_linger_s_is_waited_out_by_whoever_puts_in_both_modes(ray_cluster, small_overrides, tmp_path, mode):
    """``transfer_queue.put_linger_s`` in a trainer: the sync trainer's shards and a rollout worker's groups are
    flushed sharing (the linger runs out first), so each registration call waits it out – ``timing_s/put`` adds up
    to at least one linger per call (``buffer/put_calls``), and sync's two shards per step share one call."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    got = {}
    for linger in (0.0, 1.0):
        out = tmp_path / f"linger_{linger}"
        cfg = load_config(small_overrides + [
            f"trainer.v1.trainer_mode={mode}", f"transfer_queue.put_linger_s={linger}",
            f"actor_rollout_ref.rollout.num_workers={2 if mode == 'sync' else 1}", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.pipeline.num_inference_steps=2", f"data.train_files={prompts}",
            "data.shuffle=false", "trainer.total_epochs=1", "trainer.resume_mode=disable", "trainer.save_freq=-1",
            "trainer.test_freq=-1", "trainer.val_before_train=false",
            f"trainer.default_local_dir={out / 'ckpt'}", f"trainer.log_dir={out / 'tb'}"])
        assert TaskRunner(cfg, printer=lambda *a: None).run()["global_step"] == 2
        sc = scalar_values(out / "tb")
        got[linger] = (sum(sc["timing_s/put"]), sc["buffer/put_calls"][-1])
    (put_0, _), (put_1, calls_1) = got[0.0], got[1.0]
    assert calls_1 >= 1 and put_1 >= 0.9 * calls_1, got  # every call waited out its second
    assert put_0 < 0.5 * put_1, got  # no linger: admitted as soon as the call returns
    if mode == "sync":
        assert calls_1 == 2, got  # one call per step for both workers' shards
