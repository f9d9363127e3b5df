"""`omnirl-async report`: two run folders written with the project's own writers, read back into the table."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from omnirl_async import cli
from omnirl_async.config.root import DiffusionTrainerConfig
from omnirl_async.metrics.loggers import Tracking
from omnirl_async.metrics.report import (COLUMNS, RESOLVED_CONFIG, differing_keys, find_runs, format_table, load_run,
                                         summary_row)
from omnirl_async.metrics.report_plot import PALETTE
from omnirl_async.preflight import InputError
from omnirl_async.trainer import run_dir
from omnirl_async.trainer.run_dir import config_dict, write_resolved_config

STALE = "training/off_policy/trajectory_staleness"
STEP_S = 0.5  # timing_s/step of every step: the run's clock starts one step before the first step's event

# per run: samples per step, reward per step, learner idle per step, each sample's lag per step, validations
RUNS = {
    0: dict(samples=[4, 4, 4, 4], reward=[0.1, 0.4, 0.3, 0.2], idle=[0.5, 0.4, 0.3, 0.25],
            lags=[[0] * 4] * 4, val={0: 0.25, 2: 0.5, 4: 0.5}),
    2: dict(samples=[4, 6, 4, 4], reward=[0.2, 0.3, 0.6, 0.5], idle=[0.2, 0.15, 0.1, 0.05],
            lags=[[0, 0, 0, 0], [0, 1, 1, 2, 2, 1], [1, 2, 0, 0], [2, 2, 2, 1]], val={0: 0.25, 2: 0.75, 4: 0.5}),
}


def _config(root: Path, threshold: int, loggers=("console", "tensorboard")):
    cfg = DiffusionTrainerConfig()
    name = f"max_off_policy_threshold={threshold}"
    sampler = dataclasses.replace(cfg.trainer.v1.sampler, max_off_policy_threshold=threshold)
    trainer = dataclasses.replace(cfg.trainer, default_local_dir=str(root / "ck" / "sweep" / name),
                                  log_dir=str(root / "tb" / "sweep" / name), logger=list(loggers),
                                  v1=dataclasses.replace(cfg.trainer.v1, sampler=sampler))
    return dataclasses.replace(cfg, trainer=trainer)


def _write_run(root: Path, threshold: int, *, histogram: bool = True) -> tuple[float, float]:
    """A run folder as `train` leaves it; returns the wall-clock span (before the first, after the last event)."""
    spec, cfg = RUNS[threshold], _config(root, threshold)
    write_resolved_config(cfg)
    tr = Tracking(cfg.trainer, config=config_dict(cfg), printer=lambda *a: None)
    start = time.time()
    tr.log({"val/overall": spec["val"][0], "val/strict": 0.1}, 0)
    for step in range(1, 5):
        lags = np.array(spec["lags"][step - 1])
        if histogram:
            tr.log_histogram(STALE, lags, step)
        metrics = {"timing_s/step": STEP_S, "perf/total_num_samples": spec["samples"][step - 1],
                   "critic/rewards/mean": spec["reward"][step - 1], "perf/learner_idle_frac": spec["idle"][step - 1],
                   f"{STALE}/mean": float(lags.mean()), f"{STALE}/max": float(lags.max())}
        if step in spec["val"]:
            metrics.update({"val/overall": spec["val"][step], "val/strict": 0.1})
        tr.log(metrics, step)
    tr.close()
    return start, time.time()


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    spans = {t: _write_run(root, t) for t in RUNS}
    return root, spans


def test_table_numbers_are_the_values_written(sweep_dir):
    root, spans = sweep_dir
    runs = [load_run(p) for p in find_runs([root / "ck" / "sweep"])]  # a sweep folder stands for its runs
    assert [r.folder.name for r in runs] == ["max_off_policy_threshold=0", "max_off_policy_threshold=2"]
    assert [r.log_dir for r in runs] == [root / "tb" / "sweep" / r.folder.name for r in runs]  # from the config
    assert differing_keys(runs) == ["trainer.v1.sampler.max_off_policy_threshold"]

    rows = {t: summary_row(r) for t, r in zip(RUNS, runs)}
    assert rows[0] | {"wall_s": 0, "samples_per_s": 0, "val_best_at_s": 0} == pytest.approx({  # float32 events
        "steps": 4, "samples": 16, "wall_s": 0, "samples_per_s": 0, "learner_idle": 0.25, "reward_final": 0.2,
        "reward_best": 0.4, "val_first": 0.25, "val_final": 0.5, "val_best": 0.5, "val_best_at_s": 0,
        "staleness_mean": 0.0, "staleness_max": 0.0}, rel=1e-6)
    assert runs[1].staleness == {0: 7, 1: 5, 2: 6}  # every sample's lag, summed over the steps
    assert rows[2]["samples"] == 18 and rows[2]["staleness_mean"] == pytest.approx(17 / 18)
    assert rows[2]["staleness_max"] == 2 and rows[2]["val_best"] == 0.75
    assert rows[2]["learner_idle"] == pytest.approx(0.05)
    assert rows[2]["reward_final"] == pytest.approx(0.5) and rows[2]["reward_best"] == pytest.approx(0.6)
    for t, run in zip(RUNS, runs):
        row, (start, end) = rows[t], spans[t]
        # the clock starts one step duration before the first step's event; the run ends at its last step
        assert STEP_S <= row["wall_s"] <= STEP_S + (end - start)
        assert row["samples_per_s"] == pytest.approx(row["samples"] / row["wall_s"])
        assert STEP_S <= row["val_best_at_s"] <= row["wall_s"]  # the best held-out value came at step 2
        assert run.val_wall[0] == 0.0  # the validation before training sits at the start
        assert list(run.samples) == list(np.cumsum(RUNS[t]["samples"]))

    table = format_table(runs).splitlines()
    assert table[0].split()[:3] == ["run", "max_off_policy_threshold", "steps"] and "val/overall first" in table[0]
    cells = table[3].split()  # the row of threshold 2: config value, then the numbers of summary_row
    assert len(cells) == 2 + len(COLUMNS)
    assert cells[:4] == ["max_off_policy_threshold=2", "2", "4", "18"]
    assert cells[4:6] == [f"{rows[2]['wall_s']:.1f}", f"{rows[2]['samples_per_s']:.2f}"]
    assert cells[6:12] == ["5%", "0.500", "0.600", "0.250", "0.500", "0.750"]
    assert cells[12:] == [f"{rows[2]['val_best_at_s']:.1f}", "0.94", "2"]


def test_report_prints_and_saves_the_png(sweep_dir, capsys):
    root, _ = sweep_dir
    png = root / "out" / "cmp.png"
    assert cli.main(["report", str(root / "ck" / "sweep" / "*"), "--out", str(png)]) == 0  # a glob, unexpanded
    out = capsys.readouterr().out
    assert out.count("max_off_policy_threshold=") >= 4 and f"plot: {png}" in out
    with Image.open(png) as im:
        assert im.size[0] == 1240 and im.size[1] > 800
        colours = {c for _, c in im.convert("RGB").getcolors(1 << 20)}
    assert PALETTE[0] in colours and PALETTE[1] in colours  # one colour per run


def test_out_may_be_a_folder_and_an_unwritable_extension_is_refused_before_the_table(sweep_dir, tmp_path, capsys):
    root, _ = sweep_dir
    runs = str(root / "ck" / "sweep")
    folder = tmp_path / "plots"
    folder.mkdir()
    assert cli.main(["report", runs, "--out", str(folder)]) == 0  # an existing folder: report.png in it
    assert f"plot: {folder / 'report.png'}" in capsys.readouterr().out
    with Image.open(folder / "report.png") as im:
        assert im.format == "PNG" and im.size[0] == 1240
    assert cli.main(["report", runs, "--out", f"{tmp_path / 'new'}/"]) == 0  # a path ending in / is a folder too
    assert f"plot: {tmp_path / 'new' / 'report.png'}" in capsys.readouterr().out
    assert (tmp_path / "new" / "report.png").is_file()
    assert cli.main(["report", runs, "--out", str(tmp_path / "cmp.jpg")]) == 0  # another format Pillow writes
    with Image.open(tmp_path / "cmp.jpg") as im:
        assert im.format == "JPEG"
    capsys.readouterr()
    for out, why in ((tmp_path / "cmp.xyz", "Pillow cannot write an RGB image as '.xyz'"),
                     (tmp_path / "cmp.xbm", "Pillow cannot write an RGB image as '.xbm'"),  # 1-bit only
                     (tmp_path / "cmp", "has no file extension and is not an existing folder")):
        assert cli.main(["report", runs, "--out", str(out)]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""  # refused before the table is printed
        assert captured.err.startswith(f"omnirl-async: report: --out {str(out)!r}") and why in captured.err
        assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
        assert "name a .png file" in captured.err and "to write report.png into" in captured.err
        assert not out.exists()


def test_a_run_without_a_histogram_uses_the_per_step_staleness(tmp_path):
    _write_run(tmp_path, 2, histogram=False)
    run = load_run(tmp_path / "tb" / "sweep" / "max_off_policy_threshold=2")  # the log folder holds the config too
    assert run.staleness == {} and run.staleness_max == 2
    means = [np.mean(lags) for lags in RUNS[2]["lags"]]
    assert run.staleness_mean == pytest.approx(np.dot(means, RUNS[2]["samples"]) / 18)  # weighted by samples


def test_folders_that_are_not_runs_are_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError) as err:
        find_runs([tmp_path / "empty"])
    assert f"RUN_DIR {str(tmp_path / 'empty')!r} has no resolved_config.yaml" in str(err.value)
    with pytest.raises(InputError, match="does not exist"):
        find_runs([tmp_path / "nope"])
    # a run that logged to the console only: no events to read
    cfg = _config(tmp_path, 0, loggers=["console"])
    write_resolved_config(cfg)
    assert cli.main(["report", cfg.trainer.default_local_dir]) == 2
    msg = capsys.readouterr().err
    assert msg.startswith(f"omnirl-async: report: run {cfg.trainer.default_local_dir!r} has no TensorBoard events")
    assert "`trainer.logger=[console,tensorboard]`" in msg and msg.count("\n") == 1


def test_the_file_name_is_the_one_train_writes():
    assert RESOLVED_CONFIG == run_dir.RESOLVED_CONFIG
