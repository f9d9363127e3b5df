"""`trainer.total_time_minutes` counts training time across resumes and is the horizon of a cosine learning rate
without `optim.total_training_steps`, in both modes (real runs on Ray)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from omnirl_async.config import load_config
from omnirl_async.trainer.checkpoint import CheckpointManager, load_state
from omnirl_async.trainer.task_runner import TaskRunner

PROMPTS = ["one red circle", "two blue squares", "a green triangle", "three yellow circles"]
LR = 1e-3


def _lrs(log_dir: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    if "actor/lr" not in acc.Tags()["scalars"]:
        return []
    return [(e.step, e.value) for e in acc.Scalars("actor/lr")]


def _run(small_overrides, tmp_path: Path, mode: str, minutes: float, part: str, printed: list[str]) -> dict:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cfg = load_config(small_overrides + [
        f"trainer.v1.trainer_mode={mode}", "actor_rollout_ref.rollout.num_workers=1", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.pipeline.num_inference_steps=3", f"data.train_files={prompts}",
        f"trainer.total_time_minutes={minutes}", "trainer.total_training_steps=100000", "trainer.save_freq=-1",
        # the budget must be what ends the run: 4 prompts x 100 epochs (the default) last only ~200 fast updates
        "trainer.total_epochs=100000",
        "trainer.resume_mode=auto",
        f"actor_rollout_ref.actor.optim.lr={LR}", "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.log_dir={tmp_path / 'tb' / part}"])
    return TaskRunner(cfg, printer=printed.append).run()


def _trained_s(tmp_path: Path) -> float:
    return float(load_state(CheckpointManager(tmp_path / "ckpt").latest(), "trainer")["trained_s"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "separate_async"])
def test_the_time_budget_is_the_cosine_horizon_and_counts_across_resumes(ray_cluster, small_overrides, tmp_path,
                                                                       mode):
    printed: list[str] = []
    first = _run(small_overrides, tmp_path, mode, 0.2, "a", printed)  # 12 s of training
    lrs = [v for _, v in _lrs(tmp_path / "tb" / "a")]
    assert first["global_step"] >= 4 and len(lrs) == first["global_step"]
    # the cosine over the 12 s: near the full rate at first (the first batch took some of the time), falling every
    # update, near its end at the last
    assert lrs[0] > 0.8 * LR and all(b <= a for a, b in zip(lrs, lrs[1:])) and lrs[-1] < lrs[0], lrs
    assert lrs[-1] < 0.25 * LR, lrs
    spent = _trained_s(tmp_path)
    assert 12.0 <= spent < 12.0 + 30.0, spent  # the budget, plus the update that was running at its end

    # resumed with the same budget: it is used up, nothing is trained, the message says why
    again = _run(small_overrides, tmp_path, mode, 0.2, "b", printed)
    assert again["global_step"] == first["global_step"]
    assert any("`trainer.total_time_minutes` = 0.2 is used up" in line for line in printed), printed
    assert not (tmp_path / "tb" / "b").exists() or _lrs(tmp_path / "tb" / "b") == []

    # a larger budget trains the rest, and the cosine resumes where the run's time puts it, not at the top
    budget_s = spent + 12.0
    more = _run(small_overrides, tmp_path, mode, budget_s / 60, "c", printed)
    assert more["global_step"] > first["global_step"]
    resumed = [v for _, v in _lrs(tmp_path / "tb" / "c")]
    expected_first = LR * 0.5 * (1 + math.cos(math.pi * spent / budget_s))
    # about half the budget was spent: about half the rate (a fresh budget would start at the top)
    assert resumed[0] <= expected_first * 1.001 and resumed[0] < 0.6 * LR, (resumed, expected_first)
    assert _trained_s(tmp_path) >= budget_s, (more["global_step"], budget_s)
