"""The run directory: resolved_config.yaml beside checkpoints and logs, `eval --run`, and resume checks."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from PIL import Image

from omnirl_async import cli
from omnirl_async.config import load_config
from omnirl_async.config.loader import to_yaml
from omnirl_async.preflight import InputError
from omnirl_async.trainer.checkpoint import CheckpointError, CheckpointManager
from omnirl_async.trainer.run_dir import (RESOLVED_CONFIG, find_run, load_run_config, prepare_run_dir,
                                          read_saved_config, write_resolved_config)


def _cfg(tmp_path, small_overrides, *extra):
    return load_config([*small_overrides, f"trainer.default_local_dir={tmp_path / 'run'}",
                        f"trainer.log_dir={tmp_path / 'tb'}", *extra])


def test_a_run_writes_its_resolved_config_beside_checkpoints_and_logs(tmp_path, small_overrides):
    cfg = _cfg(tmp_path, small_overrides, "actor_rollout_ref.model.lora_rank=4")
    written = prepare_run_dir(cfg)
    assert written == [tmp_path / "run" / RESOLVED_CONFIG, tmp_path / "tb" / RESOLVED_CONFIG]
    def body(path):
        return [line for line in path.read_text().splitlines() if not line.startswith("#")]

    assert body(written[0]) == body(written[1])
    # a Hydra config of its own: composing it gives back the very config of the run, overrides on top
    assert to_yaml(load_run_config(tmp_path / "run")) == to_yaml(cfg)
    again = load_run_config(tmp_path / "run", ["trainer.test_freq=7"])
    assert again.trainer.test_freq == 7 and again.actor_rollout_ref.model.lora_rank == 4
    saved = read_saved_config(tmp_path / "run")
    assert "defaults" not in saved and saved["actor_rollout_ref"]["model"]["path"] == "embedded:tiny-sd3"
    # console only: no log folder is created just for the file
    only = load_config([*small_overrides, "trainer.logger=[console]", f"trainer.default_local_dir={tmp_path / 'c'}",
                        f"trainer.log_dir={tmp_path / 'no_logs'}"])
    assert prepare_run_dir(only) == [tmp_path / "c" / RESOLVED_CONFIG]
    assert not (tmp_path / "no_logs").exists()


def test_task_runner_writes_it_before_ray_starts(tmp_path, small_overrides, monkeypatch):
    import ray

    from omnirl_async.trainer import task_runner

    class Stop(Exception):
        pass

    def stop(_data_cfg):
        raise Stop

    monkeypatch.setattr(task_runner, "load_train_prompts", stop)
    cfg = _cfg(tmp_path, small_overrides)
    with pytest.raises(Stop):
        task_runner.TaskRunner(cfg).run()
    assert (tmp_path / "run" / RESOLVED_CONFIG).is_file() and (tmp_path / "tb" / RESOLVED_CONFIG).is_file()
    assert not ray.is_initialized()


def _fake_checkpoint(run_dir, step=3):
    (run_dir / f"global_step_{step}").mkdir(parents=True)


def test_resume_refuses_a_changed_model_key_and_names_other_changes(tmp_path, small_overrides):
    write_resolved_config(_cfg(tmp_path, small_overrides))
    _fake_checkpoint(tmp_path / "run")
    saved_text = (tmp_path / "run" / RESOLVED_CONFIG).read_text()

    with pytest.raises(InputError) as err:
        prepare_run_dir(_cfg(tmp_path, small_overrides, "actor_rollout_ref.model.lora_rank=16",
                             "actor_rollout_ref.model.path=embedded:tiny-flux"))
    msg = str(err.value)
    assert "`actor_rollout_ref.model.lora_rank` = 16" in msg and "trained with 8" in msg, msg
    assert "`actor_rollout_ref.model.path` = 'embedded:tiny-flux'" in msg and "global_step_3" in msg, msg
    assert "`actor_rollout_ref.model.lora_rank=8`" in msg and "actor_rollout_ref.model.path=embedded:tiny-sd3" in msg
    assert "trainer.resume_mode=disable" in msg
    # one problem (the resume does not fit the checkpoint) naming both keys, and its fix is not a numbered problem
    assert err.value.problems == [msg] and "\n" not in msg and "problems with the files" not in msg, msg
    assert msg.startswith(f"2 keys differ from the run in {tmp_path / 'run'} that `trainer.resume_mode=auto` "
                          "resumes (its checkpoints (global_step_3 the newest)): "), msg
    assert msg.count("Fix:") == 1 and msg.index("Fix:") > msg.index("tiny-flux"), msg
    assert (tmp_path / "run" / RESOLVED_CONFIG).read_text() == saved_text  # the saved config is kept

    lines: list[str] = []
    prepare_run_dir(_cfg(tmp_path, small_overrides, "actor_rollout_ref.actor.optim.lr=1e-4",
                         "trainer.total_training_steps=50", "trainer.save_freq=5"), printer=lines.append)
    (line,) = lines
    assert line.startswith("warning: resuming the run in") and "1 key(s) changed" in line, line
    assert "`actor_rollout_ref.actor.optim.lr`: 0.0003 -> 0.0001" in line, line
    assert "total_training_steps" not in line and "save_freq" not in line  # a continued run may change those

    # a fresh start in the same folder is not a resume: nothing to compare
    prepare_run_dir(_cfg(tmp_path, small_overrides, "actor_rollout_ref.model.lora_rank=16",
                         "trainer.resume_mode=disable"), printer=lines.append)
    assert len(lines) == 1 and read_saved_config(tmp_path / "run")["actor_rollout_ref"]["model"]["lora_rank"] == 16


def test_train_command_refuses_the_changed_resume_in_one_line(tmp_path, small_overrides, capsys):
    write_resolved_config(_cfg(tmp_path, small_overrides))
    _fake_checkpoint(tmp_path / "run")
    rc = cli.main(["train", *small_overrides, f"trainer.default_local_dir={tmp_path / 'run'}",
                   f"trainer.log_dir={tmp_path / 'tb'}", "actor_rollout_ref.model.lora_rank=2"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("omnirl-async: ") and "Traceback" not in err
    assert "`actor_rollout_ref.model.lora_rank` = 2" in err and "`actor_rollout_ref.model.lora_rank=8`" in err
    # one changed key is one problem: no count, no numbered list with the fix as item 2
    assert len(err.strip().splitlines()) == 1 and "problems" not in err and "  1. " not in err, err
    assert err.startswith(f"omnirl-async: `actor_rollout_ref.model.lora_rank` = 2, but the run in {tmp_path / 'run'} "
                          "that `trainer.resume_mode=auto` resumes (its checkpoints (global_step_3 the newest)) was "
                          "trained with 8"), err
    assert err.rstrip().endswith("Fix: continue that run with its own values (drop the override, or set "
                                 "`actor_rollout_ref.model.lora_rank=8`), or start a new run with "
                                 "`trainer.resume_mode=disable` and another `trainer.default_local_dir`."), err


def _train_a_checkpoint(tmp_path, small_overrides):
    """A run folder as `train` leaves it: resolved_config.yaml and a verified checkpoint with a LoRA that
    changes the model, plus a newer damaged checkpoint that must be skipped."""
    from omnirl_async.models.setup import build_policy

    cfg = _cfg(tmp_path, small_overrides, "actor_rollout_ref.model.lora_rank=4",
               "actor_rollout_ref.rollout.val_kwargs.pipeline.height=48",
               "actor_rollout_ref.rollout.val_kwargs.pipeline.width=48",
               "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps=2",
               "actor_rollout_ref.rollout.val_kwargs.n=1", "data.val_max_samples=2")
    run = tmp_path / "run"
    write_resolved_config(cfg, [run])
    policy = build_policy(cfg.actor_rollout_ref.model, torch.device("cpu"))
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    mgr = CheckpointManager(run)
    tmp = mgr.begin(5)
    policy.save_lora(tmp / "lora")
    mgr.commit(tmp, 5)
    (run / "global_step_9").mkdir()  # interrupted before its commit
    return run


def test_eval_run_scores_the_newest_verified_checkpoint_with_the_saved_config(tmp_path, small_overrides, capsys,
                                                                               monkeypatch):
    run = _train_a_checkpoint(tmp_path, small_overrides)
    config_file = run / RESOLVED_CONFIG
    config_file.write_text(config_file.read_text().replace("  - tensorboard\n", "  - tensorboard\n  - wandb\n"))
    assert "  - wandb\n" in config_file.read_text()
    monkeypatch.setitem(sys.modules, "wandb", None)  # the run logged to W&B; eval needs no wandb
    assert cli.main(["eval", "--run", str(run), "--threads", "1", "data.seed=3"]) == 0
    out, err = capsys.readouterr()
    assert f"run {run}: embedded:tiny-sd3, LoRA {run / 'global_step_5'}" in out
    assert "global_step_9" in err and "skipping it" in err  # the damaged newer one is named
    result = run / "eval" / "global_step_5"
    metrics = json.loads((result / "metrics.json").read_text())
    assert 0.0 <= metrics["val/score"] <= 1.0
    # the saved resolution (48 px, drawn 4x in the grid) and val_max_samples=2 (two tiles in a row)
    assert Image.open(result / "grid.png").size[0] == 2 * (4 * 48 + 6)

    # a checkpoint folder of the run names its own checkpoint (a damaged one is refused)
    assert find_run(run / "global_step_5") == (run, run / "global_step_5")
    with pytest.raises(CheckpointError, match="global_step_9"):
        find_run(run / "global_step_9")


def test_eval_run_without_a_saved_config_says_what_to_do(tmp_path, capsys):
    (tmp_path / "global_step_1").mkdir()
    assert cli.main(["eval", "--run", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"`--run` {str(tmp_path)!r} has no {RESOLVED_CONFIG}" in err and "eval --lora CKPT" in err
    (tmp_path / RESOLVED_CONFIG).write_text("trainer: {}\n")
    assert cli.main(["eval", "--run", str(tmp_path), "--config-dir", str(tmp_path)]) == 2
    assert "drop `--config-dir`" in capsys.readouterr().err


def test_eval_compare_base_prints_the_gain_with_its_interval(tmp_path, small_overrides, capsys):
    run = _train_a_checkpoint(tmp_path, small_overrides)
    assert cli.main(["eval", "--run", str(run), "--threads", "1", "--compare-base", "data.val_max_samples=6"]) == 0
    out = capsys.readouterr().out
    metrics = json.loads((run / "eval" / "global_step_5" / "metrics.json").read_text())
    assert metrics["gain/overall_points"] == pytest.approx(100 * (metrics["val/overall"] - metrics["base/overall"]))
    assert metrics["gain/ci_low"] <= metrics["gain/overall_points"] <= metrics["gain/ci_high"]
    assert "held-out strict accuracy, overall (6 prompts x 1 images, seed 0): base" in out
    assert f"gain {metrics['gain/overall_points']:+.1f} points (95 % CI" in out


def test_eval_compare_base_needs_a_lora_and_a_strict_reward(tmp_path, small_overrides, capsys):
    assert cli.main(["eval", "--compare-base", *small_overrides]) == 2
    assert "give `--lora` or `--run`" in capsys.readouterr().err
    run = _train_a_checkpoint(tmp_path, small_overrides)
    assert cli.main(["eval", "--run", str(run), "--threads", "1", "--compare-base",
                     "reward.reward_fn_name=brightness"]) == 2
    assert "gives no strict field" in capsys.readouterr().err


def test_wandb_resume_id_is_the_one_saved_beside_the_resumed_checkpoints(tmp_path, small_overrides):
    from omnirl_async.trainer.run_dir import WANDB_RUN_ID, wandb_resume_id, wandb_run_id_file, write_wandb_run_id

    run = tmp_path / "run"
    cfg = _cfg(tmp_path, small_overrides, "trainer.resume_mode=auto")
    assert wandb_run_id_file(cfg) == run / WANDB_RUN_ID
    assert wandb_resume_id(cfg) is None  # no checkpoint: a fresh run, a new W&B run
    (run / "global_step_2").mkdir(parents=True)
    assert wandb_resume_id(cfg) is None  # the earlier run did not log to W&B
    assert write_wandb_run_id(cfg, "ab12cd34") == run / WANDB_RUN_ID
    assert (run / WANDB_RUN_ID).read_text() == "ab12cd34\n" and not list(run.glob(".*.tmp"))
    assert wandb_resume_id(cfg) == "ab12cd34"
    assert wandb_resume_id(_cfg(tmp_path, small_overrides, "trainer.resume_mode=disable")) is None
    other = tmp_path / "other"
    (other / "global_step_7").mkdir(parents=True)
    (other / WANDB_RUN_ID).write_text("ef56\n")
    cfg_path = _cfg(tmp_path, small_overrides, "trainer.resume_mode=resume_path",
                    f"trainer.resume_from_path={other / 'global_step_7'}")
    assert wandb_resume_id(cfg_path) == "ef56"  # the run whose checkpoint is resumed, not this run's folder
    (other / WANDB_RUN_ID).write_text("not an id/../x\n")
    assert wandb_resume_id(cfg_path) is None
