"""Shared by the learner tests: one small batch of two whole groups with distinct rewards."""

from __future__ import annotations

import numpy as np
import pytest

from omnirl_async.actors.prompt_dispatcher import PromptDispatcher
from omnirl_async.actors.rollout_worker import RolloutWorker
from omnirl_async.config import load_config

PROMPTS = ["two red circles", "a blue square to the left of a yellow triangle"]


@pytest.fixture(scope="module")
def batch(small_overrides):
    """``(fields, group_ids)`` of 2 prompts x 4 samples from the small config; rewards 0..1 so every group
    carries signal."""
    cfg = load_config(small_overrides)
    metas, fields, _ = RolloutWorker(cfg).generate(PromptDispatcher(PROMPTS, n=4, shuffle=False).lease(
        2, global_step=1))
    fields["rewards"] = np.linspace(0.0, 1.0, len(metas), dtype=np.float32)
    return fields, [m.tags.group_uid for m in metas]
