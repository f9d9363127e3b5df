"""A short sync FlowGRPO run on Ray: weights change, metrics are logged, resume is exact."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from omnirl_async.config import load_config
from omnirl_async.trainer.task_runner import TaskRunner


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _run(overrides, out: Path, printed: list[str]):
    cfg = load_config(overrides + [f"trainer.default_local_dir={out / 'ckpt'}", f"trainer.log_dir={out / 'tb'}"])
    return TaskRunner(cfg, printer=printed.append).run()


@pytest.fixture(scope="module")
def base_overrides(small_overrides):
    return small_overrides + ["actor_rollout_ref.rollout.num_workers=1", "trainer.save_freq=2",
                              "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.rollout.seed=7"]


@pytest.mark.slow  # a full training run; tests/trainer/test_one_loop.py covers both modes in `make test`
def test_sync_run_trains_logs_checkpoints_and_resumes_exactly(ray_cluster, base_overrides, tmp_path):
    printed: list[str] = []
    a = tmp_path / "a"
    summary = _run(base_overrides + ["trainer.total_training_steps=4", "trainer.test_freq=4",
                                     "data.val_max_samples=6", "trainer.rollout_data_save_freq=2",
                                     "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps=4"],
                   a, printed)
    assert summary["global_step"] == 4 and summary["version"] == 4

    # 1. the LoRA weights moved away from their init (peft gaussian init: B = 0)
    lora = load_file(str(a / "ckpt" / "global_step_4" / "lora" / "adapter_model.safetensors"))
    b_keys = [k for k in lora if "lora_B" in k]
    assert b_keys and any(float(lora[k].abs().max()) > 0 for k in b_keys)
    assert (a / "ckpt" / "global_step_2" / "COMPLETE").is_file()
    assert (a / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "4"

    # 2. metrics with VeRL-Omni names reached TensorBoard for every step
    scalars = _scalars(a / "tb")
    for tag in ("critic/rewards/mean", "critic/advantages/max", "actor/pg_loss", "actor/ppo_kl",
                "actor/pg_clipfrac", "actor/ratio_mean", "timing_s/gen", "timing_s/update_actor",
                "timing_s/step", "timing_per_image_ms/gen", "perf/throughput",
                "training/off_policy/trajectory_staleness/max"):
        assert [s for s, _ in scalars[tag]] == [1, 2, 3, 4], tag
    assert all(v == 0 for _, v in scalars["training/off_policy/trajectory_staleness/max"])  # sync = on-policy
    assert [s for s, _ in scalars["val/score"]] == [4] and "val/clause/count" in scalars
    assert (a / "ckpt" / "validation" / "step_4.png").is_file()
    assert sorted(p.name for p in (a / "ckpt" / "rollout_data").iterdir()) == ["step_2.png", "step_4.png"]

    # 3. resuming from step 2 reproduces steps 3-4 of the uninterrupted run
    b = tmp_path / "b"
    summary_b = _run(base_overrides + ["trainer.total_training_steps=4", "trainer.resume_mode=resume_path",
                                       f"trainer.resume_from_path={a / 'ckpt' / 'global_step_2'}"], b, printed)
    assert summary_b["global_step"] == 4
    assert any("at step 2" in line for line in printed)
    lora_b = load_file(str(b / "ckpt" / "global_step_4" / "lora" / "adapter_model.safetensors"))
    for k in lora:
        assert (lora[k] - lora_b[k]).abs().max() <= 1e-6, k
    assert sorted(s for s, _ in _scalars(b / "tb")["critic/rewards/mean"]) == [3, 4]

    # 4. resume_mode=auto picks the newest complete checkpoint and continues from its step
    printed.clear()
    summary_c = _run(base_overrides + ["trainer.total_training_steps=5"], a, printed)
    assert any("at step 4" in line for line in printed)
    assert summary_c["global_step"] == 5


@pytest.mark.slow
def test_reward_worker_pool_gives_the_same_run_as_inline_scoring(ray_cluster, base_overrides, tmp_path):
    runs = {}
    for name, extra in (("inline", []), ("pool", ["reward.num_workers=1", "reward.num_cpus_per_worker=0.5"])):
        summary = _run(base_overrides + ["trainer.total_training_steps=2", "trainer.save_freq=-1", *extra],
                       tmp_path / name, [])
        assert summary["global_step"] == 2
        runs[name] = _scalars(tmp_path / name / "tb")
    for tag in ("critic/rewards/mean", "critic/rewards/max", "actor/pg_loss"):
        assert runs["pool"][tag] == runs["inline"][tag], tag
