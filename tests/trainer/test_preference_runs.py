"""DiffusionNFT, Diffusion-DPO and AWM train end to end in both modes, driven through the CLI with their recipes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from omnirl_async.cli import main

PROMPTS = ["one red circle", "two blue squares", "a green triangle", "three yellow circles",
           "a red square", "two green circles"]


def _scalars(log_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "separate_async"])
@pytest.mark.parametrize("recipe", ["diffusion_nft", "dpo", "awm"])
def test_recipe_trains_in_both_modes(ray_cluster, small_overrides, tmp_path, recipe, mode, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    overrides = [o for o in small_overrides if "ppo_mini_batch_size" not in o and "train_batch_size" not in o]
    rc = main(["train", "--config-name", recipe, *overrides,
               f"trainer.v1.trainer_mode={mode}", "actor_rollout_ref.rollout.num_workers=1",
               "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.rollout.pipeline.num_inference_steps=3",
               "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
               f"data.train_files={prompts}", "trainer.total_epochs=1", "trainer.resume_mode=disable",
               "trainer.test_freq=-1", "trainer.save_freq=3", "trainer.v1.sampler.max_off_policy_threshold=1",
               f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.log_dir={tmp_path / 'tb'}"])
    assert rc == 0, capsys.readouterr().err
    s = _scalars(tmp_path / "tb")
    assert len(s["actor/loss"]) == 3 and all(math.isfinite(v) for v in s["actor/loss"])
    assert max(s["training/off_policy/trajectory_staleness/max"]) <= (1 if mode == "separate_async" else 0)
    lora = load_file(str(tmp_path / "ckpt" / "global_step_3" / "lora" / "adapter_model.safetensors"))
    moved = max(float(v.abs().max()) for k, v in lora.items() if "lora_B" in k)
    assert moved > 0, "the trained adapter did not move (lora_B is still its zero init)"
    if recipe == "diffusion_nft":
        assert s["actor/old_policy/version"][-1] >= 1
    if recipe == "dpo":
        assert "actor/dpo/implicit_acc" in s
