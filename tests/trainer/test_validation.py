"""Validation metrics, the image grid and the `omnirl-async eval` command."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image

from omnirl_async.cli import main as cli_main
from omnirl_async.data.shapes import render
from omnirl_async.models.evaluate import save_grid, summarize
from omnirl_async.rewards import RewardManager


def test_summarize_matches_direct_counts():
    rng = np.random.default_rng(0)
    prompts = ["two red circles", "a blue square to the left of a red circle", "one green triangle"]
    images = np.stack([render(p, rng)[0] for p in prompts])
    images[2] = 0  # an empty image fails every clause of its prompt
    mgr = RewardManager.from_config({"reward_fn_name": "tiny_geneval"})
    res = mgr(images, prompts)
    m = summarize(prompts, res.scores, res.extra)
    assert m["val/strict"] == 2 / 3
    assert m["val/category/single/strict"] == 0.0 and m["val/category/counting/strict"] == 1.0
    assert m["val/category/position/strict"] == 1.0 and m["val/overall"] == 2 / 3  # (0 + 1 + 1) / 3 tasks
    m4 = summarize(prompts + ["two red circles"], np.ones(4), {"strict": np.array([1.0, 1.0, 0.0, 0.0])})
    assert m4["val/strict"] == 0.5 and m4["val/overall"] == (0.5 + 1.0 + 0.0) / 3  # counting has 2 prompts
    met, total = res.extra["tiny_geneval/clause/count"], res.extra["tiny_geneval/clause/count_total"]
    assert m["val/clause/count"] == float(met.sum() / total.sum())


def test_grid_has_one_tile_per_image(tmp_path):
    imgs = np.zeros((5, 32, 32, 3), dtype=np.uint8)
    path = save_grid(imgs, ["a"] * 5, tmp_path / "g.png", cols=4, scale=4, marks=np.array([1, 0, 1, 0, 1], bool))
    w, h = Image.open(path).size
    assert w == 4 * (128 + 6) and h > 2 * 128


def test_eval_command_writes_grid_and_metrics(tmp_path, capsys):
    rc = cli_main(["eval", "--num-prompts", "4", "--out", str(tmp_path), "--threads", "1",
                   "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps=3", "trainer.device=cpu"])
    assert rc == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert 0.0 <= metrics["val/score"] <= 1.0 and "val/strict" in metrics
    assert (tmp_path / "grid.png").is_file()
    assert cli_main(["eval", "--lora", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "neither a PEFT adapter folder" in capsys.readouterr().err


def test_eval_seeds_do_not_depend_on_batching():
    import dataclasses

    from omnirl_async.config import load_config
    from omnirl_async.models import FlowMatchPolicy
    from omnirl_async.models.pretrain import ASSET_DIR
    from omnirl_async.models.evaluate import evaluate_policy

    val = load_config(["actor_rollout_ref.rollout.val_kwargs.n=2"]).actor_rollout_ref.rollout.val_kwargs
    val = dataclasses.replace(val, pipeline=dataclasses.replace(val.pipeline, num_inference_steps=2))
    policy = FlowMatchPolicy.from_pretrained(ASSET_DIR)
    reward = RewardManager.from_config({"reward_fn_name": "tiny_geneval"})
    prompts = ["a red circle", "two blue squares", "a green triangle"]
    a = evaluate_policy(policy, reward, prompts, val, seed=5, batch_size=6)
    b = evaluate_policy(policy, reward, prompts, val, seed=5, batch_size=4)
    assert a.prompts == b.prompts == [p for p in prompts for _ in range(2)]
    _same_noise(a.images, b.images)
    assert np.abs(a.images[0].astype(int) - a.images[1]).max() > 50  # two images of one prompt differ
    c = evaluate_policy(policy, reward, prompts[1:], val, seed=5 + 1009, batch_size=6)
    _same_noise(c.images, a.images[2:])  # image j of prompt i: seed + 1009 i + j


def _same_noise(x: np.ndarray, y: np.ndarray) -> None:
    """Images from the same noise: equal up to float rounding (CPU kernels round differently per batch size)."""
    diff = np.abs(x.astype(np.int16) - y.astype(np.int16))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01


def test_validation_settings_follow_val_batch_size_and_the_val_negative_prompt():
    from omnirl_async.config import load_config
    from omnirl_async.models.evaluate import validation_settings

    assert validation_settings(load_config([])) == {"batch_size": 32, "negative_prompt": ""}
    cfg = load_config(["data.val_batch_size=3", "actor_rollout_ref.rollout.val_kwargs.n=2",
                       "actor_rollout_ref.rollout.pipeline.negative_prompt=blurry"])
    assert validation_settings(cfg) == {"batch_size": 6, "negative_prompt": "blurry"}
    cfg = load_config(["actor_rollout_ref.rollout.pipeline.negative_prompt=blurry",
                       "actor_rollout_ref.rollout.val_kwargs.pipeline.negative_prompt=text"])
    assert validation_settings(cfg)["negative_prompt"] == "text"
