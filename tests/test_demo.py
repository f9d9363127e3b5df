"""The demo's summary reads only the reward curve of its own run."""

import os
import time

import pytest
from torch.utils.tensorboard import SummaryWriter

from omnirl_async.demo import _reward_curve


def _write_run(folder, values):
    before = set(os.listdir(folder))
    w = SummaryWriter(log_dir=str(folder), filename_suffix=f".run{len(before)}")
    for step, v in enumerate(values, start=1):
        w.add_scalar("critic/rewards/mean", v, step)
        w.add_scalar("timing_s/step", 1.0, step)
    w.close()
    (new,) = set(os.listdir(folder)) - before
    return os.path.join(folder, new)


def test_reward_curve_skips_event_files_of_earlier_runs(tmp_path):
    old = _write_run(tmp_path, [0.1, 0.2, 0.3])
    os.utime(old, (time.time() - 3600, time.time() - 3600))  # a demo run an hour ago, same folder
    started = time.time() - 1
    _write_run(tmp_path, [0.7, 0.9])

    assert _reward_curve(str(tmp_path), since=started) == [(1, 0.699999988079071), (2, 0.8999999761581421)]
    everything = _reward_curve(str(tmp_path))
    assert len(everything) == 5 and sorted(v for _, v in everything)[0] < 0.11


def test_reward_curve_of_a_missing_or_empty_folder_is_empty(tmp_path):
    assert _reward_curve(str(tmp_path / "absent")) == []
    assert _reward_curve(str(tmp_path)) == []


@pytest.mark.slow  # the demo's own smoke run (a few steps with Ray)
def test_demo_runs_a_few_separate_async_steps_and_prints_its_summary(tmp_path, capsys):
    """Smoke test of `make demo`'s entry point: the real run, cut to 2 steps, with its summary."""
    import ray

    from omnirl_async.demo import main

    assert main(["trainer.total_training_steps=2", "trainer.total_time_minutes=1", "trainer.progress_bar=false",
                 "actor_rollout_ref.model.path=embedded:tiny-sd3", "data.train_batch_size=2",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2",
                 "actor_rollout_ref.rollout.pipeline.num_inference_steps=3", "trainer.device=cpu",
                 "data.val_max_samples=4", "actor_rollout_ref.rollout.val_kwargs.n=2",
                 "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps=2",
                 "ray_kwargs.num_cpus=4", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
                 f"trainer.log_dir={tmp_path / 'tb'}"]) == 0
    assert not ray.is_initialized()  # the demo shuts down the Ray it started
    out = capsys.readouterr().out
    assert "omnirl-async demo: separate_async" in out and "=== demo summary ===" in out
    assert "steps trained:        2 (policy version 2)" in out
    assert f"checkpoints:          {tmp_path / 'ckpt'}" in out
    assert (tmp_path / "ckpt" / "global_step_2" / "manifest.json").is_file()
    assert "held-out set: 4 prompts x 2 images" in out and "diffusion_nft" in out  # the demo's recipe
    line = next(x for x in out.splitlines() if x.startswith("held-out strict acc.:"))
    assert "95 % CI" in line and "global_step_2" in line, line
    assert f"before/after images:  {tmp_path / 'ckpt' / 'demo_before_after.png'}" in out
    from PIL import Image

    assert Image.open(tmp_path / "ckpt" / "demo_before_after.png").size[0] > 0
