"""Non-finite optimizer steps: skipped bit-for-bit, counted, and fatal after `learner.max_consecutive_nonfinite`."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch

from omnirl_async.actors.prompt_dispatcher import PromptDispatcher
from omnirl_async.actors.rollout_worker import RolloutWorker
from omnirl_async.config import load_config
from omnirl_async.learners.learner import Learner, NonFiniteError

PROMPTS = ("two red circles", "a blue square to the left of a yellow triangle")


@pytest.fixture(scope="module")
def batch(small_overrides):
    """One rollout batch of 2 groups x 4 samples with distinct (finite) rewards; groups are contiguous."""
    cfg = load_config(small_overrides)
    torch.manual_seed(0)
    metas, fields, _ = RolloutWorker(cfg).generate(PromptDispatcher(list(PROMPTS), n=4, shuffle=False).lease(
        2, global_step=1))
    fields["rewards"] = np.linspace(0.0, 1.0, len(metas), dtype=np.float32)
    gids = [m.tags.group_uid for m in metas]
    assert gids[:4] == [gids[0]] * 4 and gids[4:] == [gids[4]] * 4 and gids[0] != gids[4]
    return fields, gids


def _with_rewards(fields, rewards):
    return {**fields, "rewards": np.asarray(rewards, dtype=np.float32)}


def _nan_rewards(fields, rows=slice(None)):
    rewards = np.array(fields["rewards"], copy=True)
    rewards[rows] = np.nan
    return _with_rewards(fields, rewards)


def _learner(small_overrides, *extra):
    return Learner(load_config(small_overrides + list(extra)))


def _snapshot(learner: Learner):
    return ({k: v.clone() for k, v in learner.get_weights().items()}, copy.deepcopy(learner.optimizer.state_dict()))


def _assert_same_tree(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _assert_same_tree(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_tree(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def test_nan_rewards_skip_the_step_and_change_nothing(small_overrides, batch):
    fields, gids = batch
    learner = _learner(small_overrides)
    learner.update(fields, gids)  # a finite step first, so that Adam has moments to protect
    before = _snapshot(learner)
    m = learner.update(_nan_rewards(fields, slice(0, 1)), gids)
    assert m["training/skipped_nonfinite"] == 1.0 and m["training/nonfinite_steps"] == 1.0
    assert m["actor/num_updates"] == 0.0
    assert not any(k.startswith("actor/") and k != "actor/num_updates" for k in m)  # no NaN means logged
    after = _snapshot(learner)
    _assert_same_tree(before, after)
    assert all(p.grad is None for p in learner.params)
    assert learner.consecutive_nonfinite == 1


def test_finite_update_reports_zero(small_overrides, batch):
    fields, gids = batch
    m = _learner(small_overrides).update(fields, gids)
    assert m["training/skipped_nonfinite"] == 0.0 and m["training/nonfinite_steps"] == 0.0
    assert np.isfinite(m["actor/grad_norm"])


def test_consecutive_nonfinite_steps_raise_a_diagnosis(small_overrides, batch):
    fields, gids = batch
    learner = _learner(small_overrides, "learner.max_consecutive_nonfinite=2")
    bad = _nan_rewards(fields)
    learner.update(bad, gids)
    with pytest.raises(NonFiniteError) as info:
        learner.update(bad, gids)
    msg = str(info.value)
    assert info.value.count == 2 and info.value.step == 2 and "loss" in info.value.quantity
    for part in ("2 optimizer step(s) in a row", "`learner.max_consecutive_nonfinite` = 2",
                 "the loss `actor/loss` (nan)", "learner update 2 (epoch 1/1, mini-batch 1/1)",
                 "2 non-finite step(s) skipped in total", "`actor_rollout_ref.actor.optim.lr` = 0.0003",
                 "rewards with huge", "`actor_rollout_ref.actor.grad_clip`", "adv_clip_max"):
        assert part in msg, (part, msg)


def test_a_finite_step_resets_the_run(small_overrides, batch):
    fields, gids = batch
    learner = _learner(small_overrides, "learner.max_consecutive_nonfinite=2")
    bad = _nan_rewards(fields)
    learner.update(bad, gids)
    m = learner.update(fields, gids)
    assert m["training/skipped_nonfinite"] == 0.0 and m["training/nonfinite_steps"] == 1.0
    assert learner.consecutive_nonfinite == 0
    m = learner.update(bad, gids)  # 1 in a row again: no error
    assert m["training/nonfinite_steps"] == 2.0 and learner.consecutive_nonfinite == 1


def test_infinite_rewards_are_skipped_too(small_overrides, batch):
    fields, gids = batch
    rewards = np.array(fields["rewards"], copy=True)
    rewards[2] = np.inf
    m = _learner(small_overrides).update(_with_rewards(fields, rewards), gids)
    assert m["training/skipped_nonfinite"] == 1.0


def test_decided_per_optimizer_step(small_overrides, batch):
    """One mini-batch per group, in order, 2 epochs: group 1's steps are skipped, group 0's applied."""
    fields, gids = batch
    learner = _learner(small_overrides, "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                       "actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.shuffle=false",
                       "algorithm.global_std=false", "learner.max_consecutive_nonfinite=2")
    before = {k: v.clone() for k, v in learner.get_weights().items()}
    m = learner.update(_nan_rewards(fields, slice(4, 8)), gids)  # skip, apply, skip, apply: never 2 in a row
    assert m["actor/num_updates"] == 2.0 and m["training/skipped_nonfinite"] == 0.5
    assert m["training/nonfinite_steps"] == 2.0 and learner.consecutive_nonfinite == 1
    assert np.isfinite(m["actor/grad_norm"]) and np.isfinite(m["actor/pg_loss"])
    after = learner.get_weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(torch.isfinite(v).all() for v in after.values())


def test_nonfinite_gradient_names_the_parameter(small_overrides):
    learner = _learner(small_overrides)
    assert learner.find_nonfinite() is None  # no gradients yet
    for p in learner.params:
        p.grad = torch.zeros_like(p)
    learner.params[3].grad[0] = float("inf")
    fault = learner.find_nonfinite()
    assert fault == f"the gradient of parameter `{learner.param_names[3]}` (inf)"
    assert "lora" in learner.param_names[3]
    learner.params[3].grad[0] = float("nan")
    assert fault.replace("(inf)", "(nan)") == learner.find_nonfinite()
    assert learner.find_nonfinite("the loss") == "the loss"


def test_counters_survive_a_checkpoint(small_overrides, batch, tmp_path):
    from omnirl_async.trainer.checkpoint import load_state, save_state

    fields, gids = batch
    extra = ("learner.max_consecutive_nonfinite=2",)
    learner = _learner(small_overrides, *extra)
    bad = _nan_rewards(fields)
    learner.update(fields, gids)
    learner.update(bad, gids)
    save_state(learner.get_state(), tmp_path, "learner")
    restored = _learner(small_overrides, *extra)
    restored.set_state(load_state(tmp_path, "learner"))
    assert (restored.nonfinite_steps, restored.consecutive_nonfinite) == (1, 1)
    with pytest.raises(NonFiniteError, match=re.escape("2 optimizer step(s) in a row")):
        restored.update(bad, gids)


def test_old_checkpoints_without_the_counter_load(small_overrides):
    learner = _learner(small_overrides)
    learner.nonfinite_steps = learner.consecutive_nonfinite = 5
    state = learner.get_state()
    del state["nonfinite"]
    learner.set_state(state)
    assert (learner.nonfinite_steps, learner.consecutive_nonfinite) == (0, 0)
