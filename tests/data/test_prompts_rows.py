"""A prompt row's other fields travel with its lease and reach the reward: dispatcher, rollout worker, both modes."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest

from omnirl_async.actors.prompt_dispatcher import PromptDispatcher
from omnirl_async.config import load_config
from omnirl_async.data.prompts import PromptSet, read_prompt_set

# verl's signature, unchanged: the reward is the row's ground truth, plus a bonus read from extra_info
VERL_REWARD = '''
def compute_score(data_source, solution_image, ground_truth, extra_info=None):
    assert solution_image.ndim == 3 and solution_image.shape[-1] == 3, solution_image.shape
    return float(ground_truth) + float(extra_info.get("bonus", 0.0))
'''
TRAIN = {"prompt": ["a red circle", "two blue squares", "a green triangle", "three yellow circles"],
         "ground_truth": ["0.1", "0.2", "0.3", "0.4"], "extra_info": [{"bonus": 0.0}] * 3 + [{"bonus": 0.05}]}
VAL = {"prompt": ["a red square", "two green circles"], "reward_model": [{"ground_truth": 0.7}, {"ground_truth": 0.9}]}


def _parquet(path: Path, columns: dict) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), str(path))
    return path


def _expected(prompt: str) -> float:
    i = TRAIN["prompt"].index(prompt)
    return float(TRAIN["ground_truth"][i]) + TRAIN["extra_info"][i]["bonus"]


def test_leases_carry_their_rows_fields_through_requeue_and_checkpoints():
    ps = PromptSet(["same", "same", "other"], [{"ground_truth": 1}, {"ground_truth": 2}, {}])
    d = PromptDispatcher(ps, n=2, shuffle=False)
    leases = d.lease(3, global_step=1)
    assert [x.fields for x in leases] == [{"ground_truth": 1}, {"ground_truth": 2}, None]
    d.complete([x.lease_id for x in leases])
    d.requeue(leases[1].group_uid, "same", 2)  # the buffer evicted it: generated again with its own row
    again = d.lease(1, global_step=2)[0]
    assert again.group_uid == leases[1].group_uid and again.fields == {"ground_truth": 2}
    state = msgspec.msgpack.decode(msgspec.msgpack.encode(d.get_state()))  # checkpoints are msgpack
    restored = PromptDispatcher(ps, n=2, shuffle=False)
    restored.set_state(state)
    assert [x.fields for x in restored.lease(5, global_step=3, cross_epoch=False)] == [{"ground_truth": 2}]


def test_rollout_worker_hands_row_fields_to_a_verl_reward(tmp_path, small_overrides):
    from omnirl_async.actors.rollout_worker import RolloutWorker

    (tmp_path / "verl_reward.py").write_text(VERL_REWARD)
    prompts = read_prompt_set(_parquet(tmp_path / "train.parquet", TRAIN))
    cfg = load_config(small_overrides + ["actor_rollout_ref.rollout.n=2",
                                         "actor_rollout_ref.rollout.pipeline.num_inference_steps=2",
                                         f"reward.custom_reward_function.path={tmp_path / 'verl_reward.py'}",
                                         "reward.custom_reward_function.name=compute_score"])
    worker = RolloutWorker(cfg)
    d = PromptDispatcher(prompts, n=2, shuffle=False)
    metas, fields, _ = worker.generate(d.lease(4, global_step=1))
    assert [m.reward for m in metas] == pytest.approx([_expected(m.tags.prompt) for m in metas])
    np.testing.assert_allclose(fields["rewards"], [_expected(m.tags.prompt) for m in metas], rtol=1e-6)


@pytest.mark.slow  # two short training runs on Ray
@pytest.mark.parametrize("mode, reward_workers", [("sync", 0), ("separate_async", 1)])
def test_rows_reach_the_reward_in_training_and_validation(ray_cluster, small_overrides, tmp_path, mode,
                                                          reward_workers):
    """Both modes; inline scoring in one, the reward worker pool in the other (the two paths a group takes)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from omnirl_async.trainer.task_runner import TaskRunner

    (tmp_path / "verl_reward.py").write_text(VERL_REWARD)
    cfg = load_config(small_overrides + [
        f"trainer.v1.trainer_mode={mode}", "actor_rollout_ref.rollout.num_workers=1", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.pipeline.num_inference_steps=2", "data.shuffle=false", "trainer.total_epochs=1",
        f"data.train_files={_parquet(tmp_path / 'train.parquet', TRAIN)}",
        f"data.val_files={_parquet(tmp_path / 'val.parquet', VAL)}", "trainer.val_before_train=true",
        "trainer.test_freq=2", "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps=2",
        f"reward.num_workers={reward_workers}", "reward.num_cpus_per_worker=0.5",
        f"reward.custom_reward_function.path={tmp_path / 'verl_reward.py'}",
        "reward.custom_reward_function.name=compute_score", "trainer.resume_mode=disable",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.log_dir={tmp_path / 'tb'}"])
    assert TaskRunner(cfg, printer=lambda *a: None).run()["global_step"] == 2

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    trained = [json.loads(line) for line in (tmp_path / "ckpt" / "trained_groups.jsonl").read_text().splitlines()]
    trained = {r["step"]: [g[1] for g in r["groups"]] for r in trained if "groups" in r}
    assert sorted(p for ps in trained.values() for p in ps) == sorted(TRAIN["prompt"])
    for step, prompts in trained.items():  # every sample's reward is its own row's ground truth (+ bonus)
        assert scalars["critic/rewards/mean"][step] == pytest.approx(np.mean([_expected(p) for p in prompts]),
                                                                     abs=1e-6), step
        assert scalars["reward/failed_frac"][step] == 0.0
    assert scalars["val/score"][0] == pytest.approx(0.8, abs=1e-6)  # verl's reward_model.ground_truth layout
    assert scalars["val/score"][2] == pytest.approx(0.8, abs=1e-6)
