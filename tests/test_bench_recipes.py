"""The benchmarks' recipes are valid configurations (a typo there would only show after 20 minutes)."""

import importlib.util
from pathlib import Path

import numpy as np

from omnirl_async.config import load_config
from omnirl_async.data.shapes import PALETTE, shape_template
from omnirl_async.rewards import RewardManager

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_geneval_rl_recipe_loads_and_its_reward_runs():
    bench = _load("bench_geneval_rl")
    cfg = load_config(bench.RL_DEFAULTS)
    assert cfg.trainer.v1.trainer_mode == "sync"
    assert cfg.learner.num_workers == 2 and cfg.algorithm.rollout_correction.bypass_mode
    reward = RewardManager.from_config(cfg.reward)
    # A red square with an extra red circle: GenEval's clauses all pass, the training score does not pay for it.
    image = np.zeros((1, 32, 32, 3), np.uint8)
    image[0, 4:14, 2:12][shape_template("square", 10)] = PALETTE["red"]
    image[0, 4:14, 18:28][shape_template("circle", 10)] = PALETTE["red"]
    scored = reward(image, ["a red square"])
    assert scored.extra["tiny_geneval/strict"].tolist() == [1.0]
    np.testing.assert_allclose(scored.scores, [1 / 3], rtol=1e-6)
