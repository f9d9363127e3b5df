"""separate_async on Ray: the staleness bound, exactly-once prompts, dead workers."""

from __future__ import annotations

from collections import Counter

import pytest

from omnirl_async.config import load_config
from omnirl_async.trainer.separate_async import SeparateAsyncTrainer

PROMPTS = ["one red circle", "two blue squares", "a green triangle", "three yellow circles",
           "a white square", "two purple triangles", "one blue circle", "four red squares"]


def _cfg(small_overrides, tmp_path, *extra):
    return load_config(small_overrides + [
        "trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.rollout.num_workers=2",
        "actor_rollout_ref.rollout.pipeline.num_inference_steps=3", "actor_rollout_ref.rollout.n=2",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.log_dir={tmp_path / 'tb'}",
        "trainer.resume_mode=disable", *extra])


def _fit(cfg, **kw):
    trainer = SeparateAsyncTrainer(cfg, PROMPTS, printer=lambda *a: None, **kw)
    try:
        summary = trainer.fit()
    finally:
        trainer.stop()
    return trainer, summary


@pytest.mark.slow  # a full training run; tests/trainer/test_one_loop.py covers both modes in `make test`
@pytest.mark.parametrize("threshold", [0, 1])
def test_wait_keeps_every_lag_within_the_threshold_and_drops_nothing(ray_cluster, small_overrides, tmp_path,
                                                                     threshold):
    cfg = _cfg(small_overrides, tmp_path, "trainer.total_training_steps=6",
               f"trainer.v1.sampler.max_off_policy_threshold={threshold}",
               "trainer.v1.sampler.max_off_policy_strategy=wait")
    trainer, summary = _fit(cfg, worker_slowdowns=[0.0, 0.7])  # one fast, one slow worker
    lags = [learner_v - behaviour_v for _, _, _, behaviour_v, learner_v in trainer.trained_log]
    assert len(lags) == 6 * 2 * 2
    assert max(lags) <= threshold and min(lags) >= 0
    assert summary["dropped_samples"] == 0
    if threshold == 1:
        assert max(lags) == 1  # it did run ahead
    else:
        assert set(lags) == {0}


@pytest.mark.slow  # a full training run; tests/trainer/test_one_loop.py covers both modes in `make test`
def test_drop_evicts_stale_groups_and_counts_them(ray_cluster, small_overrides, tmp_path):
    cfg = _cfg(small_overrides, tmp_path, "trainer.total_training_steps=5",
               "trainer.v1.sampler.max_off_policy_threshold=0", "trainer.v1.sampler.max_off_policy_strategy=drop",
               "trainer.total_epochs=50")
    trainer, summary = _fit(cfg, worker_slowdowns=[0.0, 0.5])
    lags = [lv - bv for _, _, _, bv, lv in trainer.trained_log]
    assert max(lags) == 0
    assert summary["dropped_samples"] > 0  # workers ran ahead of a threshold of 0


@pytest.mark.slow  # tests/chaos/test_kill_workers.py kills workers for 2 minutes; this is the short version
def test_every_prompt_is_trained_once_when_a_worker_is_killed(ray_cluster, small_overrides, tmp_path):
    import ray

    cfg = _cfg(small_overrides, tmp_path, "trainer.total_epochs=1",
               "trainer.v1.sampler.max_off_policy_threshold=1")

    class KillOnce(SeparateAsyncTrainer):
        killed = False

        def next_batch(self, timer, **kwargs):
            batch = super().next_batch(timer, **kwargs)
            if self.global_step == 1 and not self.killed:
                ray.kill(self.workers[0], no_restart=True)
                self.killed = True
            return batch

    trainer = KillOnce(cfg, PROMPTS, printer=lambda *a: None)
    try:
        summary = trainer.fit()
    finally:
        trainer.stop()
    assert trainer.killed and summary["replaced_workers"] >= 1
    groups = {(g, p, e) for g, p, e, _, _ in trainer.trained_log}
    per_prompt = Counter(p for _, p, _ in groups)
    assert per_prompt == Counter(PROMPTS)  # every prompt of the epoch exactly once
    assert summary["global_step"] == len(PROMPTS) // 2


@pytest.mark.slow  # a full training run; tests/learners/test_learner_group.py checks the call order in `make test`
def test_back_to_back_updates_publish_every_version_after_its_own_update(ray_cluster, small_overrides, tmp_path):
    """An update started as soon as the one before ends (its batch sampled ahead) still trains after the publish
    of the one before: every published version holds exactly its update; checkpoints see no update in flight;
    every prompt is trained once within the threshold. With it off, no update starts early."""
    import ray

    class Audited(SeparateAsyncTrainer):
        def publish_weights(self):
            out = super().publish_weights()
            info, _ = ray.get(self.store.get.remote(self.version))
            self.published.append((self.version, self.global_step, info.adapter_versions["default"]))
            return out

        def save_checkpoint(self):
            self.saves.append((self.global_step, self._started is None,
                               self.learners.adapter_versions()["default"]))
            return super().save_checkpoint()

    got = {}
    for enabled in (True, False):
        cfg = _cfg(small_overrides, tmp_path / str(enabled), "trainer.total_epochs=3", "trainer.save_freq=4",
                   "trainer.v1.sampler.max_off_policy_threshold=1", "actor_rollout_ref.actor.ppo_epochs=3")
        trainer = Audited(cfg, PROMPTS, printer=lambda *a: None)
        trainer.back_to_back_enabled, trainer.published, trainer.saves = enabled, [], []
        try:
            summary = trainer.fit()
        finally:
            trainer.stop()
        got[enabled] = summary
        assert summary["global_step"] == 3 * len(PROMPTS) // 2
        assert all(step == held for _, step, held in trainer.published), trainer.published
        assert [v for v, _, _ in trainer.published] == list(range(summary["global_step"] + 1))  # 0 at the start
        assert trainer.saves and all(idle and held == step for step, idle, held in trainer.saves), trainer.saves
        groups = {(g, p, e) for g, p, e, _, _ in trainer.trained_log}  # one entry per sample
        assert Counter(p for _, p, _ in groups) == Counter({p: 3 for p in PROMPTS})
        assert max(lv - bv for _, _, _, bv, lv in trainer.trained_log) <= 1
    assert got[True]["back_to_back_updates"] > 0
    assert got[False]["back_to_back_updates"] == 0


@pytest.mark.slow  # a full training run; the fetch itself is checked in tests/learners/test_learner_group.py
def test_a_worker_refused_a_lease_pulls_no_weights(ray_cluster, small_overrides, tmp_path):
    """Learner-bound: one group per update, two workers, threshold 0. After each publish only one worker can lease
    the next update's group; the other is refused and must not fetch the weights it would not use (at scale: most
    workers after every update). Every pull is followed by a group, and the bound still holds."""
    steps = 5
    cfg = _cfg(small_overrides, tmp_path, f"trainer.total_training_steps={steps}", "data.train_batch_size=1",
               "actor_rollout_ref.actor.ppo_mini_batch_size=1", "trainer.total_epochs=50",
               "trainer.v1.sampler.max_off_policy_threshold=0", "trainer.v1.sampler.max_off_policy_strategy=wait")
    trainer, summary = _fit(cfg)
    stats = trainer.final_worker_stats
    assert summary["global_step"] == steps and len(stats) == 2, (summary, stats)
    pulls, groups = sum(s["weight_pulls"] for s in stats), sum(s["groups"] for s in stats)
    # version 0 is pulled by nobody (workers start at 0); versions 1..steps-1 by the worker that leased the next
    # group; a worker refused a lease pulls nothing, so there are no more pulls than groups generated
    assert steps - 1 <= pulls <= groups, (pulls, groups, stats)
    assert max(lv - bv for _, _, _, bv, lv in trainer.trained_log) == 0
