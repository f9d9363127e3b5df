"""Offline preference pairs in real runs on Ray, both modes: mixed into online batches, and trained alone.

Each run is a few seconds on the tiny model but Ray and the actors dominate: the runs are ``slow``
(``tests/buffer/test_offline_mix.py`` and ``tests/trainer/test_offline_learner.py`` hold the fast checks).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from omnirl_async.buffer.offline_store import OfflineStore
from omnirl_async.config import load_config
from omnirl_async.trainer.task_runner import TaskRunner
from tests.data.offline_fixtures import PROMPTS, latent_dataset, model_store
from tests.trainer.tb_events import scalar_values

MODES = ["sync", "separate_async"]


def _overrides(small_overrides, tmp_path: Path, mode: str, *extra: str) -> list[str]:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    base = [o for o in small_overrides if "ppo_mini_batch_size" not in o and "train_batch_size" not in o]
    return [*base, "actor_rollout_ref.model.algorithm=dpo", f"trainer.v1.trainer_mode={mode}",
            "actor_rollout_ref.rollout.num_workers=1", "actor_rollout_ref.rollout.n=3",
            "actor_rollout_ref.rollout.pipeline.num_inference_steps=3", "data.train_batch_size=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", f"data.train_files={prompts}",
            "trainer.test_freq=-1", "trainer.v1.sampler.max_off_policy_threshold=1",
            f"trainer.default_local_dir={tmp_path / 'run'}", f"trainer.log_dir={tmp_path / 'tb'}", *extra]


@pytest.fixture(scope="module")
def tiny_policy(small_overrides):
    from omnirl_async.trainer.ingest import _load_policy

    return _load_policy(load_config(small_overrides))


def _store(tmp_path, cfg, policy, n=12):
    return model_store(tmp_path / "run", cfg, policy, n)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_mixed_run_draws_the_ratio_and_splits_metrics(ray_cluster, small_overrides, tiny_policy, tmp_path, mode):
    cfg = load_config(_overrides(small_overrides, tmp_path, mode, "buffer.offline_mix_ratio=0.5",
                                 "trainer.total_training_steps=4", "trainer.save_freq=4"))
    _store(tmp_path, cfg, tiny_policy)
    printed: list[str] = []
    summary = TaskRunner(cfg, printer=printed.append).run()
    assert summary["global_step"] == 4
    assert any("offline table: 12 preference pairs" in line and "1 online group(s) of 3 samples and ~3 offline rows "
               "per update" in line for line in printed), printed
    s = scalar_values(tmp_path / "tb")
    # the offline half takes the place of one of the 2 groups: each update trains 1 online group of 3 samples and
    # whole offline pairs as the carried rounding gives them (3 wanted: 2 pairs, then 1, ...): the drawn share is
    # the ratio and a batch keeps ~2 x 3 rows
    assert s["training/offline_samples"] == [4.0, 2.0, 4.0, 2.0]
    assert s["buffer/offline_frac"][-1] == pytest.approx(0.5)
    assert s["buffer/offline_size"][-1] == 24
    for key in ("actor/dpo/implicit_acc/online", "actor/dpo/implicit_acc/offline", "actor/pg_loss/offline"):
        assert key in s and all(math.isfinite(v) for v in s[key]), key
    assert s["actor/dpo/num_pairs/offline"] == [2.0, 1.0, 2.0, 1.0]
    # staleness comes from the online rows alone (offline rows would read lag 0)
    assert max(s["training/off_policy/trajectory_staleness/max"]) <= (1 if mode == "separate_async" else 0)
    assert s["buffer/sampled"][-1] == 4 * 3  # online samples only: one group of 3 per update


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("taper_end", [1.0, 0.5])
def test_a_tapered_share_falls_with_the_run_and_hands_its_rows_back_to_online_groups(ray_cluster, small_overrides,
                                                                                    tiny_policy, tmp_path, mode,
                                                                                    taper_end):
    cfg = load_config(_overrides(small_overrides, tmp_path, mode, "buffer.offline_mix_ratio=0.5",
                                 "buffer.offline_mix_ratio_final=0", f"buffer.offline_mix_taper_end={taper_end}",
                                 "trainer.total_training_steps=6", "trainer.save_freq=-1"))
    _store(tmp_path, cfg, tiny_policy)
    printed: list[str] = []
    assert TaskRunner(cfg, printer=printed.append).run()["global_step"] == 6
    by = "the run's end" if taper_end == 1.0 else "50% of the run (`buffer.offline_mix_taper_end`)"
    assert any(f"moving to `buffer.offline_mix_ratio_final` = 0 by {by} (2 online group(s) of 3 samples "
               "and ~0 offline rows per update)" in line for line in printed), printed
    s = scalar_values(tmp_path / "tb")
    ratios, drawn = s["training/offline_mix_ratio"], s["training/offline_samples"]
    # the share of an update follows the run's progress at that update (separate_async makes its batch an update
    # ahead, at the share of the update it is for): 0.5 at first, falling linearly to 0 at `taper_end` of the run
    # (1/12 per update over the whole run; 1/6 per update over its first half, then 0)
    assert ratios == pytest.approx([0.5 * max(0.0, 1 - k / 6 / taper_end) for k in range(6)])
    # the online groups of update u: round((1 - r(u)) x 2) -> 1, 1, 1, 2, 2, 2 (taper over the run) or
    # 1, 1, 2, 2, 2, 2 (over its first half): the freed rows go back to online groups, in both modes
    # (separate_async lays its tickets out by these sizes)
    online = s["perf/total_num_samples"]  # the step's online samples trained
    assert online == ([3, 3, 3, 6, 6, 6] if taper_end == 1.0 else [3, 3, 6, 6, 6, 6]), online
    assert s["buffer/sampled"][-1] == sum(online)
    # the offline rows drawn follow the running target of ratio/(1-ratio) x the online rows within one pair
    target = np.cumsum([r / (1 - r) * o for r, o in zip(ratios, online)])
    assert all(abs(d - t) <= 2 for d, t in zip(np.cumsum(drawn), target)), (drawn, ratios)
    assert sum(drawn) < 6 * 3  # less than the untapered share (as many offline rows as online ones)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_tapered_run_resumes_with_the_update_sizes_it_laid_out(ray_cluster, small_overrides, tiny_policy, tmp_path,
                                                                 mode):
    from omnirl_async.trainer.checkpoint import load_state

    taper = ["buffer.offline_mix_ratio=0.5", "buffer.offline_mix_ratio_final=0"]
    cfg = load_config(_overrides(small_overrides, tmp_path, mode, *taper, "trainer.total_training_steps=3",
                                 "trainer.save_freq=3"))
    _store(tmp_path, cfg, tiny_policy)
    assert TaskRunner(cfg, printer=lambda line: None).run()["global_step"] == 3
    assert scalar_values(tmp_path / "tb")["perf/total_num_samples"] == [3, 3, 6]  # r = 0.5, 1/3, 1/6: 1, 1, 2 groups
    state = load_state(tmp_path / "run" / "global_step_3", "trainer")
    if mode == "separate_async":  # the sizes admission laid out (ahead of training) travel with the checkpoint
        assert state["dispatcher"]["admission"]["layout"]["sizes"][:3] == [1, 1, 2]
    resumed = load_config(_overrides(small_overrides, tmp_path, mode, *taper, "trainer.total_training_steps=6",
                                     "trainer.save_freq=6", "trainer.resume_mode=auto",
                                     f"trainer.log_dir={tmp_path / 'tb2'}"))
    assert TaskRunner(resumed, printer=lambda line: None).run()["global_step"] == 6
    # updates 4-6 of a 6-update taper: r = 0.25, 1/6, 1/12 -> 2 online groups of 3 each
    assert scalar_values(tmp_path / "tb2")["perf/total_num_samples"] == [6, 6, 6]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_offline_source_trains_with_no_rollout_workers(ray_cluster, small_overrides, tiny_policy, tmp_path, mode):
    cfg = load_config(_overrides(small_overrides, tmp_path, mode, "algorithm.sample_source=offline",
                                 "trainer.total_epochs=2", "trainer.save_freq=-1", "trainer.test_freq=3"))
    _store(tmp_path, cfg, tiny_policy, n=9)
    from omnirl_async.data.prompts import load_train_prompts
    from omnirl_async.trainer.ingest import prepare_offline_store
    from omnirl_async.trainer.separate_async import SeparateAsyncTrainer
    from omnirl_async.trainer.sync import SyncTrainer

    assert len(prepare_offline_store(cfg)) == 9
    cls = SyncTrainer if mode == "sync" else SeparateAsyncTrainer
    trainer = cls(cfg, load_train_prompts(cfg.data), printer=lambda line: None)
    try:
        assert trainer.workers == [] and trainer.reward_actors == []  # no rollout worker is started
        summary = trainer.fit()
        # 9 pairs = 18 rows, 6 rows (2 prompts x n=3) per update, 2 passes: 6 updates
        assert summary["global_step"] == 6
        assert trainer.workers == [] and trainer._validator is not None  # one actor, for validation only
        assert not trainer.dcall("tickets_issued")  # no prompt was ever leased
    finally:
        trainer.stop()
    s = scalar_values(tmp_path / "tb")
    assert s["training/offline_samples"] == [6.0] * 6
    # the rows it trained, per second of each step (it read 0: only online samples were counted)
    assert all(t == pytest.approx(6.0 / dt, rel=1e-3) for t, dt in zip(s["perf/throughput"], s["timing_s/step"]))
    assert s["perf/total_num_samples"] == [0.0] * 6
    assert "critic/rewards/mean" not in s and "training/off_policy/trajectory_staleness/max" not in s
    assert s["buffer/offline_frac"][-1] == 1.0 and s["buffer/sampled"][-1] == 0
    assert all(math.isfinite(v) for v in s["actor/dpo/implicit_acc/offline"])
    assert len(s["val/score"]) == 2  # steps 3 and 6: validation as in an online run


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_ingest_checkpoint_resume_keeps_the_offline_table_bit_exact(ray_cluster, small_overrides, tmp_path, mode):
    from omnirl_async.buffer import LocalReplayBuffer

    # ingest at the start of `train` (data.offline_files), as `omnirl-async ingest` would
    data = latent_dataset(tmp_path / "data", load_config(small_overrides), 8)
    cfg = load_config(_overrides(small_overrides, tmp_path, mode, "buffer.offline_mix_ratio=0.25",
                                 "trainer.total_training_steps=2", "trainer.save_freq=2", f"data.offline_files={data}"))
    TaskRunner(cfg, printer=lambda line: None).run()
    store = OfflineStore(tmp_path / "run")
    snap = tmp_path / "run" / "global_step_2" / "buffer"
    from safetensors import safe_open
    tables = {safe_open(str(p), "numpy").metadata()["table"] for p in snap.glob("chunk-*.safetensors")}
    assert "offline" not in tables  # offline rows are referenced in the store, not copied
    # what a resume restores: the offline table read back from the store, bit for bit
    restored = LocalReplayBuffer()
    restored.restore(str(snap))
    keys = sorted(restored.list_keys(source="offline"))
    assert len(keys) == 16
    got = restored.get(keys)
    want = store.pairs(list(range(8)))
    by_key = {k: i for i, k in enumerate(got.keys)}
    for i, row in enumerate(store.rows()):
        for j, side in enumerate(("chosen", "rejected")):
            r = by_key[f"offline/{row.id}/{side}"]
            assert got.fields["x0"][r].tobytes() == want["x0"][2 * i + j].tobytes()
    # and the run resumes from it (the store unchanged: no pair added twice)
    cfg2 = load_config(_overrides(small_overrides, tmp_path, mode, "buffer.offline_mix_ratio=0.25",
                                  "trainer.total_training_steps=3", "trainer.save_freq=3",
                                  "trainer.resume_mode=auto", f"data.offline_files={data}"))
    printed: list[str] = []
    assert TaskRunner(cfg2, printer=printed.append).run()["global_step"] == 3
    assert any("offline table: 8 preference pairs" in line and "(0 added now)" in line for line in printed), printed
    assert len(OfflineStore(tmp_path / "run")) == 8
