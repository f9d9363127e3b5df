"""The learning-rate schedule: warm-up and cosine count learner updates; without a horizon the run's progress
(steps or training time, from the trainer) drives the cosine."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omnirl_async.actors.prompt_dispatcher import PromptDispatcher
from omnirl_async.actors.rollout_worker import RolloutWorker
from omnirl_async.config import load_config
from omnirl_async.learners.learner import Learner, lr_factor
from omnirl_async.trainer.base import BaseTrainer


def _optim(kind="cosine", warmup=0, horizon=None):
    return SimpleNamespace(lr_scheduler_type=kind, lr_warmup_steps=warmup, total_training_steps=horizon)


def _cos(p):
    return 0.5 * (1 + math.cos(math.pi * p))


def test_constant_and_warm_up():
    assert [lr_factor(_optim("constant"), s, 0.7) for s in (0, 5, 1000)] == [1.0, 1.0, 1.0]
    assert [lr_factor(_optim("constant", warmup=4), s, None) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_with_an_explicit_horizon_counts_updates_after_warm_up_and_ignores_the_run():
    o = _optim(warmup=10, horizon=110)
    assert lr_factor(o, 9, 0.9) == 1.0  # last warm-up update
    for step, progress in [(10, 0.0), (35, 0.25), (60, 0.5), (85, 0.75), (110, 1.0), (500, 1.0)]:
        assert lr_factor(o, step, 0.99) == pytest.approx(_cos(progress)), step


def test_cosine_without_a_horizon_follows_the_runs_progress():
    o = _optim()
    for p in (0.0, 0.1, 0.5, 0.9, 1.0):
        assert lr_factor(o, 3, p) == pytest.approx(_cos(p))
    assert lr_factor(o, 3, None) == 1.0 and lr_factor(o, 3, 1.7) == pytest.approx(0.0)
    assert lr_factor(o, 3, 0.5) == pytest.approx(0.5) and lr_factor(o, 3, 0.25) == pytest.approx(0.853553, abs=1e-6)


def _progress(total_steps, step, minutes=None, trained_s=0.0, warmup=0):
    """BaseTrainer.schedule_progress on a stand-in holding only what it reads."""
    cfg = SimpleNamespace(trainer=SimpleNamespace(total_time_minutes=minutes),
                          actor_rollout_ref=SimpleNamespace(actor=SimpleNamespace(
                              optim=SimpleNamespace(lr_warmup_steps=warmup))))
    me = SimpleNamespace(config=cfg, global_step=step, total_steps=lambda: total_steps, trained_s=lambda: trained_s)
    me.time_progress = lambda: BaseTrainer.time_progress(me)
    return BaseTrainer.schedule_progress(me)


def test_run_progress_is_steps_or_training_time_whichever_is_further():
    assert _progress(200, 50) == pytest.approx(0.25)
    assert _progress(200, 60, warmup=20) == pytest.approx(40 / 180)
    assert _progress(200, 10, warmup=20) == 0.0
    # a 20-minute budget with a step cap far away (the benchmarks' 100000): time decides
    assert _progress(100_000, 300, minutes=20, trained_s=600) == pytest.approx(0.5)
    # the step cap comes first
    assert _progress(400, 300, minutes=20, trained_s=60) == pytest.approx(0.75)
    assert _progress(400, 300, minutes=20, trained_s=5000) == 1.0


@pytest.fixture(scope="module")
def batch(small_overrides):
    cfg = load_config(small_overrides)
    torch.manual_seed(0)
    metas, fields, _ = RolloutWorker(cfg).generate(PromptDispatcher(["two red circles", "a blue square"], n=4,
                                                                    shuffle=False).lease(2, global_step=1))
    fields["rewards"] = np.linspace(0.0, 1.0, len(metas), dtype=np.float32)
    return fields, [m.tags.group_uid for m in metas]


@pytest.mark.parametrize("extra", [[], ["actor_rollout_ref.actor.ppo_epochs=2",
                                        "actor_rollout_ref.actor.ppo_mini_batch_size=1"]])
def test_a_learner_update_trains_at_one_rate_and_the_schedule_counts_updates(small_overrides, batch, extra):
    """With 1 or 4 optimizer steps per update (2 epochs x 2 mini-batches), update k trains at lr * factor(k):
    the cosine spans the 4 updates after the warm-up however many optimizer steps they made."""
    lr = 1e-3
    learner = Learner(load_config(small_overrides + extra + [
        f"actor_rollout_ref.actor.optim.lr={lr}", "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=1", "actor_rollout_ref.actor.optim.total_training_steps=5"]))
    seen = []
    for _ in range(6):
        m = learner.update(*batch)
        seen.append((m["actor/lr"], m["actor/num_updates"]))
    assert seen[0][1] == (4.0 if extra else 1.0)
    expected = [lr] + [lr * _cos(k / 4) for k in range(4)] + [0.0]
    assert [s[0] for s in seen] == pytest.approx(expected, abs=1e-12)


def test_run_progress_reaches_the_learner(small_overrides, batch):
    learner = Learner(load_config(small_overrides + ["actor_rollout_ref.actor.optim.lr=1e-3",
                                                     "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine"]))
    lrs = [learner.update(*batch, run_progress=p)["actor/lr"] for p in (0.0, 0.5, 0.75)]
    assert lrs == pytest.approx([1e-3, 5e-4, 1e-3 * _cos(0.75)])
    # a checkpointed learner restores the same rate: it is a function of the update count and the progress
    other = Learner(load_config(small_overrides + ["actor_rollout_ref.actor.optim.lr=1e-3",
                                                   "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine"]))
    other.set_state(learner.get_state())
    assert other.update(*batch, run_progress=0.9)["actor/lr"] == pytest.approx(learner.update(
        *batch, run_progress=0.9)["actor/lr"])
