"""Offline pairs at the learner-batch level (no Ray): joined batches, advantages, pairs, split metrics, refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from omnirl_async.buffer import LocalReplayBuffer
from omnirl_async.buffer.base import SampledBatch
from omnirl_async.buffer.offline_table import OFFLINE_FIELD
from omnirl_async.buffer.spec import BufferSpec
from omnirl_async.config import load_config
from omnirl_async.config.validate import ConfigError
from omnirl_async.learners.preference_learner import PreferenceLearner
from omnirl_async.preflight import InputError
from omnirl_async.protocol import SampleMeta, SampleStatus, SampleTags
from omnirl_async.trainer.ingest import check_offline_store
from omnirl_async.trainer.offline_mix import OfflineData, group_schedule, learner_inputs, online_groups_per_update
from tests.data.offline_fixtures import PROMPTS, model_store, synthetic_store

RECIPES = {"dpo": ["actor_rollout_ref.model.algorithm=dpo"],
           "diffusion_nft": ["actor_rollout_ref.model.algorithm=diffusion_nft"],
           "awm": ["actor_rollout_ref.model.algorithm=awm"]}


def _config(small_overrides, algo, *extra):
    return load_config(small_overrides + RECIPES[algo] + ["algorithm.timestep_fraction=0.25", *extra])


@pytest.fixture(scope="module")
def tiny(small_overrides, tmp_path_factory):
    """The tiny model, a 6-pair offline store for it, and its offline share + an online batch as the buffer gives them."""
    from omnirl_async.trainer.ingest import _load_policy

    cfg = _config(small_overrides, "dpo")
    policy = _load_policy(cfg)
    run = tmp_path_factory.mktemp("run")
    model_store(run, cfg, policy, 6)
    buf = LocalReplayBuffer(BufferSpec(offline_mix_ratio=0.5), seed=0)
    buf.load_offline(str(run))
    offline = buf.sample(8, learner_version=0, source="offline")
    # an online batch: 2 groups of n=4, rewards with a best and a worst per group
    n = cfg.actor_rollout_ref.rollout.n
    rng = np.random.default_rng(0)
    emb = policy.encode_prompt(PROMPTS[:2], max_sequence_length=cfg.actor_rollout_ref.rollout.pipeline
                               .max_sequence_length).repeat_interleave(n).to_numpy()
    metas = [SampleMeta(key=f"g{g}/{i}", status=SampleStatus.SUCCESS, reward=float(i),
                        tags=SampleTags(uid=f"g{g}/{i}", group_uid=f"g{g}", sample_index=i, group_size=n,
                                        policy_version=0, prompt=PROMPTS[g])) for g in range(2) for i in range(n)]
    fields = {"images": np.zeros((2 * n, 32, 32, 3), np.uint8), "x0": rng.standard_normal(
        (2 * n, *offline.fields["x0"].shape[1:])).astype(np.float32),
        "rewards": np.asarray([0.1, 0.9, 0.4, 0.2, 0.7, 0.3, 0.3, 0.5], np.float32)[:2 * n],
        "extra.tiny_geneval.strict": np.zeros(2 * n, np.float32), **{f"emb.{k}": v for k, v in emb.items()}}
    online = SampledBatch(metas=metas, fields=fields)
    return run, online, offline


def test_learner_inputs_join_the_common_fields_and_mark_offline_rows(tiny):
    _, online, offline = tiny
    fields, gids = learner_inputs(online, offline)
    assert "images" not in fields and "extra.tiny_geneval.strict" not in fields  # online-only fields: not trained
    assert fields[OFFLINE_FIELD].tolist() == [False] * len(online) + [True] * len(offline)
    assert fields["x0"].shape[0] == len(online) + len(offline) and gids[-1].startswith("offline/")
    assert fields["rewards"][len(online):].tolist() == [1.0, 0.0] * (len(offline) // 2)
    same, _ = learner_inputs(online, SampledBatch(metas=[], fields={}))
    assert same is online.fields  # no offline share: the online batch as it was
    pg = SampledBatch(metas=online.metas, fields={"log_probs": np.zeros((len(online), 2), np.float32),
                                                  "rewards": online.fields["rewards"]})
    with pytest.raises(ValueError, match=r"lack the field\(s\) \['x0'\].*direct_preference"):
        learner_inputs(pg, offline)


@pytest.mark.parametrize("algo", ["diffusion_nft", "awm"])
def test_offline_rows_get_r_one_and_zero_and_leave_online_advantages_alone(small_overrides, tiny, algo):
    _, online, offline = tiny
    learner = PreferenceLearner(_config(small_overrides, algo))
    c = learner.actor_cfg.diffusion_loss.adv_clip_max
    fields, gids = learner_inputs(online, offline)
    b = learner.prepare_batch(fields, gids)
    off = b[OFFLINE_FIELD]
    assert b["advantages"][off].tolist() == [c, -c] * (len(offline) // 2)  # NFT r = 1 / 0, AWM weight +1 / -1
    alone = learner.prepare_batch(online.fields, [m.tags.group_uid for m in online.metas])
    assert torch.equal(b["advantages"][~off], alone["advantages"])  # offline rows do not move the online std
    metrics = learner.update(fields, gids)
    for src in ("online", "offline"):
        assert np.isfinite(metrics[f"actor/pg_loss/{src}"])
        assert 0.0 <= metrics[f"actor/implicit_acc/{src}"] <= 1.0
    assert metrics["critic/advantages/max"] == pytest.approx(float(alone["advantages"].max()))


@pytest.mark.parametrize("algo", ["diffusion_nft", "awm"])
def test_offline_advantage_sets_the_strength_of_offline_pairs(small_overrides, tiny, algo):
    _, online, offline = tiny
    fields, gids = learner_inputs(online, offline)
    losses = {}
    for a in (None, 1.0):
        extra = [] if a is None else [f"algorithm.offline_advantage={a}"]
        learner = PreferenceLearner(_config(small_overrides, algo, "buffer.offline_mix_ratio=0.5", *extra))
        c = learner.actor_cfg.diffusion_loss.adv_clip_max if a is None else a
        b = learner.prepare_batch(fields, gids)
        off = b[OFFLINE_FIELD]
        assert b["advantages"][off].tolist() == [c, -c] * (len(offline) // 2)
        alone = learner.prepare_batch(online.fields, [m.tags.group_uid for m in online.metas])
        assert torch.equal(b["advantages"][~off], alone["advantages"])  # online rows untouched either way
        losses[a] = learner.update(fields, gids)["actor/pg_loss/offline"]
    assert losses[None] != pytest.approx(losses[1.0])  # the same rows, the same seeds: only the strength differs


@pytest.mark.parametrize("mode, chosen, rejected", [("positive_only", 1.0, 0.0), ("negative_only", 0.0, -1.0),
                                                   ("one_only", None, 0.0), ("binary", None, -1.0)])
def test_adv_mode_maps_offline_advantages_as_it_maps_online_ones(small_overrides, tiny, mode, chosen, rejected):
    """adv_mode applies to offline rows too: positive_only leaves a rejected sample nothing to push away from;
    one_only / binary give +-1 whatever the strength (so offline_advantage is refused with them)."""
    _, online, offline = tiny
    fields, gids = learner_inputs(online, offline)
    strength = [] if chosen is None else ["algorithm.offline_advantage=1.0"]
    learner = PreferenceLearner(_config(small_overrides, "diffusion_nft", "buffer.offline_mix_ratio=0.5",
                                        f"algorithm.adv_mode={mode}", *strength))
    b = learner.prepare_batch(fields, gids)
    off = b[OFFLINE_FIELD]
    assert b["advantages"][off].tolist() == [1.0 if chosen is None else chosen, rejected] * (len(offline) // 2)
    online_adv = b["advantages"][~off]
    assert torch.equal(online_adv, learner.prepare_batch(online.fields, gids[:len(online)])["advantages"])


def test_dpo_trains_offline_pairs_as_given_and_splits_its_metrics(small_overrides, tiny):
    _, online, offline = tiny
    learner = PreferenceLearner(_config(small_overrides, "dpo"))
    fields, gids = learner_inputs(online, offline)
    b = learner.prepare_batch(fields, gids)
    off = b[OFFLINE_FIELD]
    assert off.tolist() == [False] * 4 + [True] * len(offline)  # 2 online pairs, then the offline pairs
    assert b["rewards"][off][0::2].tolist() == [1.0] * (len(offline) // 2)  # chosen first in every pair
    assert torch.equal(b["t"][0::2], b["t"][1::2])
    metrics = learner.update(fields, gids)
    assert metrics["actor/dpo/num_pairs"] == 2 and metrics["actor/dpo/num_pairs/offline"] == len(offline) // 2
    for src in ("online", "offline"):
        assert 0.0 <= metrics[f"actor/dpo/implicit_acc/{src}"] <= 1.0 and np.isfinite(metrics[f"actor/pg_loss/{src}"])
    # an offline-only batch: its /offline metrics are the loss's own
    only, ids = learner_inputs(SampledBatch(metas=[], fields={}), offline)
    m = PreferenceLearner(_config(small_overrides, "dpo")).update(only, ids)
    assert m["actor/dpo/implicit_acc/offline"] == pytest.approx(m["actor/dpo/implicit_acc"])
    assert m["actor/pg_loss/offline"] == pytest.approx(m["actor/pg_loss"], rel=1e-5)
    assert "actor/pg_loss/online" not in m and "critic/advantages/mean" not in m


# ---------------------------------------------------------------- refusals at start-up
@pytest.mark.parametrize("overrides, needles", [
    (["buffer.offline_mix_ratio=0.25"], ["`buffer.offline_mix_ratio` = 0.25 is refused",
                                         "policy-gradient loss cannot train on them", "diffusion_nft"]),
    (["algorithm.sample_source=offline"], ["`algorithm.sample_source` = 'offline' is refused",
                                           "algorithm.trainer_type` = policy_gradient"]),
    (["actor_rollout_ref.model.algorithm=dpo", "buffer.offline_mix_ratio=1.0"],
     ["no room for online samples", "algorithm.sample_source=offline"]),
    (["actor_rollout_ref.model.algorithm=dpo", "algorithm.sample_source=offline", "buffer.offline_mix_ratio=0.5"],
     ["every learner row already comes from the offline table"]),
    (["actor_rollout_ref.model.algorithm=diffusion_nft", "algorithm.offline_advantage=1.0"],
     ["`algorithm.offline_advantage`", "no offline pair is trained", "buffer.offline_mix_ratio"]),
    (["actor_rollout_ref.model.algorithm=dpo", "algorithm.offline_advantage=1.0", "buffer.offline_mix_ratio=0.5"],
     ["`algorithm.offline_advantage`", "compares the two samples of a pair", "diffusion_nft, awm"]),
    (["actor_rollout_ref.model.algorithm=awm", "algorithm.offline_advantage=6", "buffer.offline_mix_ratio=0.5"],
     ["`algorithm.offline_advantage` = 6 exceeds", "adv_clip_max` = 5"]),
    (["actor_rollout_ref.model.algorithm=diffusion_nft", "algorithm.offline_advantage=1.0", "buffer.offline_mix_ratio=0.5",
      "algorithm.adv_mode=binary"], ["`algorithm.offline_advantage` = 1.0 is refused with `algorithm.adv_mode` = binary",
                                     "continuous, positive_only or negative_only"]),
    (["actor_rollout_ref.model.algorithm=dpo", "buffer.offline_mix_ratio_final=0"],
     ["`buffer.offline_mix_ratio_final` = 0 is refused while `buffer.offline_mix_ratio` = 0", "no offline share"]),
    (["actor_rollout_ref.model.algorithm=dpo", "algorithm.sample_source=offline", "buffer.offline_mix_ratio_final=0.1"],
     ["`buffer.offline_mix_ratio_final` = 0.1 is refused with `algorithm.sample_source` = offline"]),
    (["actor_rollout_ref.model.algorithm=dpo", "buffer.offline_mix_ratio=0.5", "buffer.offline_mix_ratio_final=1"],
     ["`buffer.offline_mix_ratio_final`", "1"]),
])
def test_config_refuses_what_offline_data_cannot_do(overrides, needles):
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    for needle in needles:
        assert needle in str(err.value)
    load_config(["actor_rollout_ref.model.algorithm=dpo", "buffer.offline_mix_ratio=0.5"])  # this one is fine


@pytest.mark.parametrize("batch,ratio,groups", [(4, 0.0, 4), (4, 0.25, 3), (4, 0.5, 2), (4, 0.1, 4), (4, 0.9, 1),
                                                (8, 0.25, 6), (8, 0.3, 6), (2, 0.5, 1), (1, 0.5, 1)])
def test_offline_pairs_take_the_place_of_online_groups(batch, ratio, groups):
    cfg = load_config(["actor_rollout_ref.model.algorithm=dpo", f"data.train_batch_size={batch}",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=1", f"buffer.offline_mix_ratio={ratio}"])
    assert online_groups_per_update(cfg) == groups
    # with the offline share that sample_offline draws for them (r of all rows), a learner batch keeps about
    # train_batch_size x n rows, exactly when r x train_batch_size is whole
    n = cfg.actor_rollout_ref.rollout.n
    if ratio < 1 and (ratio * batch).is_integer():
        assert groups * n / (1 - ratio) == pytest.approx(batch * n)
    offline_only = load_config(["actor_rollout_ref.model.algorithm=dpo", f"data.train_batch_size={batch}",
                                "actor_rollout_ref.actor.ppo_mini_batch_size=1", "algorithm.sample_source=offline"])
    assert online_groups_per_update(offline_only) == batch


@pytest.mark.parametrize("final, expected", [(None, [0.5, 0.5, 0.5, 0.5]), (0.0, [0.5, 0.375, 0.25, 0.0]),
                                             (0.1, [0.5, 0.4, 0.3, 0.1])])
def test_a_tapered_share_follows_the_runs_progress_and_hands_its_rows_back(final, expected):
    extra = [] if final is None else [f"buffer.offline_mix_ratio_final={final}"]
    cfg = load_config(["actor_rollout_ref.model.algorithm=dpo", "data.train_batch_size=4",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=1", "buffer.offline_mix_ratio=0.5", *extra])
    data = OfflineData(cfg, buffer=None, printer=lambda *a: None)
    assert [data.ratio_at(p) for p in (0.0, 0.25, 0.5, 1.0)] == pytest.approx(expected)
    assert data.ratio_at(1.7) == pytest.approx(expected[-1])  # clipped to the run
    assert online_groups_per_update(cfg) == 2  # the first update's: those of offline_mix_ratio
    schedule = group_schedule(cfg, total_steps=4)
    assert schedule.fixed == (final is None)
    # update u trains round((1 - r) x 4) online groups, r at the progress u/4: the freed rows go back online
    want = [max(1, math.floor((1 - r) * 4 + 0.5)) for r in (data.ratio_at(u / 4) for u in range(4))]
    assert [schedule.at(u) for u in range(4)] == want
    if final == 0.0:
        assert want == [2, 3, 3, 4]


def test_the_taper_end_moves_where_the_share_reaches_its_final_value_and_needs_a_taper():
    base = ["actor_rollout_ref.model.algorithm=dpo", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1", "buffer.offline_mix_ratio=0.5"]
    whole = group_schedule(load_config(base + ["buffer.offline_mix_ratio_final=0"]), total_steps=8)
    half = group_schedule(load_config(base + ["buffer.offline_mix_ratio_final=0", "buffer.offline_mix_taper_end=0.5"]),
                          total_steps=8)
    assert [whole.at(u) for u in range(8)] == [2, 2, 3, 3, 3, 3, 4, 4]
    assert [half.at(u) for u in range(8)] == [2, 3, 3, 4, 4, 4, 4, 4]
    assert half.share_at(0.5) == whole.share_at(1.0) == 0.0
    with pytest.raises(ConfigError, match=r"`buffer.offline_mix_taper_end` = 0.5 is refused while "
                                          r"`buffer.offline_mix_ratio_final` is null"):
        load_config(base + ["buffer.offline_mix_taper_end=0.5"])
    with pytest.raises(ConfigError, match="offline_mix_taper_end"):
        load_config(base + ["buffer.offline_mix_ratio_final=0", "buffer.offline_mix_taper_end=0"])


def test_a_run_on_offline_data_needs_a_filled_store_of_its_model(small_overrides, tiny, tmp_path):
    run, _, _ = tiny
    cfg = _config(small_overrides, "dpo", "buffer.offline_mix_ratio=0.5", f"trainer.default_local_dir={tmp_path}")
    with pytest.raises(InputError) as err:
        check_offline_store(cfg)
    assert f"`omnirl-async ingest DATASET --run-dir {tmp_path}`" in str(err.value)
    assert "does not exist" in str(err.value) and "data.offline_files" in str(err.value)
    ok = _config(small_overrides, "dpo", "algorithm.sample_source=offline", f"trainer.default_local_dir={run}")
    assert len(check_offline_store(ok)) == 6
    assert check_offline_store(_config(small_overrides, "dpo", f"trainer.default_local_dir={tmp_path}")) is None
    small = _config(small_overrides, "dpo", "algorithm.sample_source=offline", "buffer.max_size=8",
                    f"trainer.default_local_dir={run}")
    with pytest.raises(InputError, match=r"6 pairs = 12 samples.*`buffer.max_size=12`"):
        check_offline_store(small)
    other = tmp_path / "other"
    synthetic_store(other, 2)
    with pytest.raises(InputError, match=r"another model set-up \(model: store 'synthetic'"):
        check_offline_store(_config(small_overrides, "dpo", "buffer.offline_mix_ratio=0.5",
                                    f"trainer.default_local_dir={other}"))
