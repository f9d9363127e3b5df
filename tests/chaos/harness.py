"""Shared set-up of the chaos runs: a small separate_async job on the embedded tiny model.

Every chaos scenario is a real ``separate_async`` run on Ray. They are pytest
tests marked ``slow`` and also scripts (``python -m tests.chaos.test_kill_workers``
and so on) that print their figures, which the README's Reliability section
quotes.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

from omnirl_async.trainer.trained_log import read_trained_log

FLAKY = Path(__file__).with_name("flaky_rewards.py")
SMALL = [
    "actor_rollout_ref.model.path=embedded:tiny-sd3", "trainer.device=cpu", "trainer.logger=[tensorboard]",
    "trainer.progress_bar=false", "trainer.v1.trainer_mode=separate_async",
    "actor_rollout_ref.rollout.num_workers=2", "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.rollout.pipeline.num_inference_steps=3", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "data.shuffle=false", "trainer.total_epochs=1",
]


def prompts(n: int) -> list[str]:
    """The first ``n`` distinct prompts of the embedded shapes-world training set."""
    from omnirl_async.data.prompts import train_prompts

    out = list(dict.fromkeys(train_prompts()))
    if n > len(out):
        raise ValueError(f"at most {len(out)} distinct prompts")
    return out[:n]


def overrides(run_dir: Path, prompt_list: list[str], *extra: str) -> list[str]:
    """Config overrides of a chaos run writing everything under ``run_dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "prompts.txt"
    path.write_text("\n".join(prompt_list) + "\n")
    return SMALL + [f"data.train_files={path}", f"trainer.default_local_dir={run_dir / 'ckpt'}",
                    f"trainer.log_dir={run_dir / 'tb'}", *extra]


def trained_prompts(run_dir: Path) -> Counter:
    """How often each prompt was trained, by the run's audit file (rolled-back steps excluded)."""
    steps, _ = read_trained_log(run_dir / "ckpt")
    return Counter(g[1] for rec in steps.values() for g in rec["groups"])


def start_ray():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    return ray


def python() -> str:
    return sys.executable


def env_with_repo() -> dict:
    """Environment for a job subprocess that imports this checkout and the tests package."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
