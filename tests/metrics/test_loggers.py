"""`trainer.logger`: TensorBoard and W&B runs written by `Tracking`, read back with each tool's own reader."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from omnirl_async.metrics.loggers import Tracking
from omnirl_async.models.evaluate import save_grid

CONFIG = {"actor_rollout_ref": {"model": {"path": "embedded:tiny-sd3", "lora_rank": 4}},
          "trainer": {"project_name": "proj", "experiment_name": "exp", "logger": ["console", "wandb"]}}


def _trainer_cfg(tmp_path: Path, loggers: list[str]) -> SimpleNamespace:
    return SimpleNamespace(logger=loggers, log_dir=str(tmp_path / "logs"), project_name="proj", experiment_name="exp")


def _samples(n: int = 6, size: int = 16) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(n, size, size, 3), dtype=np.uint8)


def _log_a_run(tmp_path: Path, loggers: list[str], printer=print) -> tuple[Tracking, Path]:
    """Two steps of scalars, a validation grid (a PNG, as the trainer saves it) and rollout samples."""
    samples = _samples()
    grid = save_grid(samples[:4], [f"prompt {i}" for i in range(4)], tmp_path / "grid.png", cols=2,
                     title="step 2 strict=0.500")
    tr = Tracking(_trainer_cfg(tmp_path, loggers), config=CONFIG, printer=printer)
    tr.log({"critic/rewards/mean": 0.25, "actor/pg_loss": -0.5, "training/global_step": 1.0,
            "nan_metric": float("nan")}, step=1)
    tr.log_images("val/images", [grid], 2, captions=["step 2 strict=0.500"],
                  text="- pass prompt 0\n- fail prompt 1")
    tr.log_images("rollout/samples", list(samples), 2,
                  captions=[f"reward {0.1 * i:.3f}: prompt {i}" for i in range(len(samples))])
    tr.log({"critic/rewards/mean": 0.75, "training/global_step": 2.0}, step=2)
    tr.close()
    return tr, grid


def test_the_console_shows_validation_and_failed_rewards_when_a_step_has_them(tmp_path):
    lines: list[str] = []
    tr = Tracking(_trainer_cfg(tmp_path, ["console"]), config=CONFIG, printer=lines.append)
    tr.log({"val/score": 0.25, "val/overall": 0.5, "val/failed_frac": 0.0, "val/clause/count": 0.75}, step=0)
    tr.log({"critic/rewards/mean": 0.5, "reward/failed_frac": 0.0}, step=1)
    tr.log({"critic/rewards/mean": 0.5, "reward/failed_frac": 0.125}, step=2)
    tr.close()
    assert lines == ["step 0: val/score=0.25  val/overall=0.5  val/failed_frac=0",
                     "step 1: critic/rewards/mean=0.5", "step 2: critic/rewards/mean=0.5  reward/failed_frac=0.125"]


def test_an_evaluation_whose_reward_failed_says_how_many_and_why():
    from omnirl_async.models.evaluate import EvalResult

    def result(failed, reasons):
        return EvalResult([], np.zeros((0, 1, 1, 3), np.uint8), np.zeros(0), failed=np.array(failed), reasons=reasons)

    assert result([False, False], [None, None]).failure_note() is None
    note = result([True, True, True], ["reward `colour` raised KeyError: 'ground_truth'"] * 3).failure_note()
    assert note == ("the reward failed every sample (scored 0 in val/*, `val/failed_frac` = 1.000); all of them: "
                    "reward `colour` raised KeyError: 'ground_truth'. A reward that needs the prompt rows' fields "
                    "(e.g. `ground_truth`) needs validation prompts that carry them: `data.val_files`")
    some = result([True, False, True, True], ["a", None, "b", "a"]).failure_note()
    assert some.startswith("the reward failed 3 of 4 samples (scored 0 in val/*, `val/failed_frac` = 0.750); 2 of "
                           "them: a.")


def test_tensorboard_gets_scalars_images_captions_and_the_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines: list[str] = []
    tr, grid = _log_a_run(tmp_path, ["console", "tensorboard"], printer=lines.append)
    assert lines == ["step 1: critic/rewards/mean=0.25  actor/pg_loss=-0.5", "step 2: critic/rewards/mean=0.75"]

    acc = EventAccumulator(str(tmp_path / "logs"), size_guidance={"images": 0, "tensors": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    assert [(e.step, e.value) for e in acc.Scalars("critic/rewards/mean")] == [(1, 0.25), (2, 0.75)]
    assert "nan_metric" not in tags["scalars"]  # non-finite values are not logged

    (val,) = acc.Images("val/images")
    gw, gh = Image.open(grid).size
    assert (val.step, val.width, val.height) == (2, gw, gh)  # the saved grid, at its own size
    (roll,) = acc.Images("rollout/samples")
    assert (roll.step, roll.width, roll.height) == (2, 6 * 16, 16)  # 6 samples of 16x16 tiled in one row
    decoded = np.asarray(Image.open(__import__("io").BytesIO(roll.encoded_image_string)).convert("RGB"))
    assert np.array_equal(decoded[:, :16], _samples()[0])  # the pixels themselves, losslessly

    def text(tag):
        (ev,) = acc.Tensors(f"{tag}/text_summary")  # torch's add_text names the tag so
        return ev.tensor_proto.string_val[0].decode()

    assert "reward 0.500: prompt 5" in text("rollout/samples/captions")
    assert "fail prompt 1" in text("val/images/captions")
    assert "actor_rollout_ref.model.lora_rank: 4" in text("config")


def test_wandb_offline_run_is_read_back_with_wandbs_own_reader(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    tr, grid = _log_a_run(tmp_path, ["wandb"])

    (run_dir,) = (tmp_path / "logs" / "wandb").glob("offline-run-*")  # W&B's folder under the run's log dir
    assert tr.wandb_dir == run_dir
    res = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    records = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]

    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["project"] == "proj" and run["display_name"] == "exp"
    config = run["config"]["update"]
    assert config["actor_rollout_ref"]["model"] == {"path": "embedded:tiny-sd3", "lora_rank": 4}

    rows = {int(r["history"]["step"]["num"]): r["history"]["item"] for r in records if r["type"] == "history"}
    assert rows[1]["critic/rewards/mean"] == 0.25 and rows[1]["actor/pg_loss"] == -0.5
    assert rows[2]["critic/rewards/mean"] == 0.75 and "nan_metric" not in rows[1]
    val = _media(rows[2], "val/images")  # one wandb.Image
    assert val["_type"] == "images/separated" and val["count"] == 1
    assert val["captions"] == ["step 2 strict=0.500"]
    gw, gh = Image.open(grid).size
    assert (val["width"], val["height"]) == (gw, gh)
    (png,) = (run_dir / "files").glob("media/images/val/images_*.png")
    assert Image.open(png).size == (gw, gh)
    roll = _media(rows[2], "rollout/samples")
    assert roll["count"] == 6 and roll["captions"][5] == "reward 0.500: prompt 5"


def _media(row: dict, key: str) -> dict:
    """A media entry of a history row: nested under ``key``, or flattened into ``key.<field>`` (wandb-core)."""
    if key in row:
        return row[key]
    fields = {k[len(key) + 1:]: v for k, v in row.items() if k.startswith(key + ".")}
    assert fields, f"{key} not in the history row {sorted(row)}"
    return fields


def test_missing_wandb_names_the_key_and_the_pip_command(tmp_path, monkeypatch):
    from omnirl_async.config import ConfigError, load_config

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with pytest.raises(ImportError) as err:
        Tracking(_trainer_cfg(tmp_path, ["console", "wandb"]))
    msg = str(err.value)
    assert "`trainer.logger`" in msg and "pip install omnirl-async[wandb]" in msg and "'wandb'" in msg
    assert not (tmp_path / "logs").exists()  # nothing written before the error

    with pytest.raises(ConfigError) as err:  # and the config refuses it at start-up, before Ray
        load_config(["trainer.logger=[console,wandb]"])
    assert "`trainer.logger`" in str(err.value) and "pip install omnirl-async[wandb]" in str(err.value)


def test_unknown_logger_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"`trainer.logger`.*mlflow"):
        Tracking(_trainer_cfg(tmp_path, ["mlflow"]))


def _wandb_offline(monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)


def _history_steps(run_dir: Path) -> tuple[str, list[int]]:
    """The run id and the logged steps of an offline W&B run folder, read with W&B's own reader."""
    res = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    records = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    return run["run_id"], sorted(int(r["history"]["step"]["num"]) for r in records if r["type"] == "history")


def test_a_resumed_run_continues_the_wandb_run_whose_id_it_is_given(tmp_path, monkeypatch):
    _wandb_offline(monkeypatch)
    first = Tracking(_trainer_cfg(tmp_path, ["wandb"]), config=CONFIG)
    for step in (1, 2):
        first.log({"critic/rewards/mean": 0.1 * step}, step=step)
    run_id = first.wandb_run.id  # the trainer keeps it beside the checkpoints (run_dir.write_wandb_run_id)
    first.close()

    lines: list[str] = []
    second = Tracking(_trainer_cfg(tmp_path, ["wandb"]), config=CONFIG, wandb_id=run_id, printer=lines.append)
    assert second.wandb_run.id == run_id and any(f"continuing run {run_id}" in line for line in lines)
    second.log({"critic/rewards/mean": 0.3}, step=3)
    second.close()
    dirs = sorted((tmp_path / "logs" / "wandb").glob("offline-run-*"))
    # both folders carry the run's id (W&B adds -1 to a second folder of the same second): `wandb sync` joins them
    assert len(dirs) == 2 and all(re.fullmatch(rf"offline-run-\d+_\d+-{run_id}(-\d+)?", d.name) for d in dirs), dirs
    assert _history_steps(second.wandb_dir) == (run_id, [3])

    fresh = Tracking(_trainer_cfg(tmp_path, ["wandb"]), config=CONFIG)
    assert fresh.wandb_run.id != run_id  # no id given: a new W&B run
    fresh.close()
