"""Validation metrics, the image grid and the `omnirl-async eval` command."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image

from omnirl_async.cli import main as cli_main
from omnirl_async.data.shapes import render
from omnirl_async.rewards import RewardManager
from omnirl_async.trainer.validation import save_grid, summarize


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
