"""`omnirl-async train -m`: Hydra's multirun semantics, one run directory per combination, failures reported."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from omnirl_async import cli
from omnirl_async.config.validate import ConfigError
from omnirl_async.trainer.sweep import SWEEP_FOLDER, expand_sweep, plan_sweep

T = "trainer.v1.sampler.max_off_policy_threshold"


# ---------------------------------------------------------------------------- expansion (pure)
def test_cartesian_product_first_key_slowest_other_overrides_kept():
    runs = expand_sweep([f"{T}=0,1,2", "data.seed=7", "+a.lr=1e-4,0.25"])
    assert [r.name for r in runs] == [  # values as Hydra writes them (1e-4 -> 0.0001)
        "max_off_policy_threshold=0,lr=0.0001", "max_off_policy_threshold=0,lr=0.25",
        "max_off_policy_threshold=1,lr=0.0001", "max_off_policy_threshold=1,lr=0.25",
        "max_off_policy_threshold=2,lr=0.0001", "max_off_policy_threshold=2,lr=0.25"]
    assert runs[3].overrides == (f"{T}=1", "data.seed=7", "+a.lr=0.25")  # the `+` prefix and the order kept
    assert runs[3].swept == ((T, "1"), ("a.lr", "0.25"))
    # range() and choice() are sweeps too; a single comma list is enough
    assert [r.overrides for r in expand_sweep([f"{T}=range(0,3)"])] == [(f"{T}=0",), (f"{T}=1",), (f"{T}=2",)]
    assert [r.name for r in expand_sweep([f"{T}=choice(4,8)"])] == ["max_off_policy_threshold=4",
                                                                       "max_off_policy_threshold=8"]


def test_quoting_a_comma_is_one_value_and_lists_sweep_whole():
    runs = expand_sweep(["data.train_files='a,b.txt',c.txt", "trainer.logger=[console],[console,tensorboard]"])
    assert len(runs) == 4
    assert runs[0].overrides == ("data.train_files='a,b.txt'", "trainer.logger=[console]")
    assert runs[0].name == "train_files=a_b.txt,logger=_console_"  # quotes dropped, unsafe characters -> _
    assert runs[3].overrides == ("data.train_files=c.txt", "trainer.logger=[console,tensorboard]")
    parser = OverridesParser.create()
    assert parser.parse_override(runs[0].overrides[0]).value() == "a,b.txt"


def test_two_swept_keys_with_one_leaf_name_are_named_in_full():
    runs = expand_sweep(["a.lr=1,2", "b.lr=3,4", "c.lr=5"])
    assert runs[0].name == "a.lr=1,b.lr=3"


@pytest.mark.parametrize("overrides, words", [
    ([f"{T}=1", "data.seed=3"], ["`-m` (multirun) needs an override with a comma list", "drop `-m`"]),
    ([], ["`-m` (multirun) needs an override with a comma list"]),
    ([f"{T}=interval(0,4)"], [f"`{T}`", "cannot be enumerated", "interval() and glob() are not supported"]),
    ([f"{T}=glob(*)"], [f"`{T}`", "cannot be enumerated"]),
    ([f"{T}=range(0,0)"], [f"`{T}`", "has no values"]),
    ([f"{T}=0,1", f"{T}=2,3"], [f"`{T}` is swept more than once", f"`{T}=0,1,2`"]),
    ([f"{T}=1,1"], ["would share the run directory `sweep/max_off_policy_threshold=1`"]),
    (["data.train_files='a b',a_b"], ["data.train_files='a b'", "data.train_files=a_b", "train_files=a_b"]),
    ([f"{T}=[1"], [f"`{T}`: cannot parse the override"]),
])
def test_what_cannot_be_swept_is_refused_naming_the_key(overrides, words):
    with pytest.raises(ConfigError) as err:
        expand_sweep(overrides)
    for w in words:
        assert w in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------- planning (configs composed)
def test_each_run_gets_its_own_checkpoint_and_log_folder(tmp_path):
    planned = plan_sweep(["trainer.v1.trainer_mode=separate_async", f"{T}=0,2",
                          f"trainer.default_local_dir={tmp_path / 'ck'}", f"trainer.log_dir={tmp_path / 'tb'}"])
    assert [p.run.name for p in planned] == ["max_off_policy_threshold=0", "max_off_policy_threshold=2"]
    for p, value in zip(planned, (0, 2)):
        assert p.config.trainer.v1.sampler.max_off_policy_threshold == value
        assert Path(p.config.trainer.default_local_dir) == tmp_path / "ck" / SWEEP_FOLDER / p.run.name == p.run_dir
        assert Path(p.config.trainer.log_dir) == tmp_path / "tb" / SWEEP_FOLDER / p.run.name == p.log_dir


def test_a_value_one_run_refuses_stops_the_sweep_before_it_starts():
    with pytest.raises(ConfigError) as err:  # sync trains on-policy: threshold 2 is refused there
        plan_sweep([f"{T}=0,2"])
    assert str(err.value).startswith(f"sweep run 2/2 (max_off_policy_threshold=2): `{T}` = 2 is refused under")


def test_resume_path_shared_by_the_runs_is_refused(tmp_path):
    ckpt = tmp_path / "old" / "global_step_3"
    with pytest.raises(ConfigError) as err:
        plan_sweep(["trainer.v1.trainer_mode=separate_async", f"{T}=0,1", "trainer.resume_mode=resume_path",
                    f"trainer.resume_from_path={ckpt}"])
    msg = str(err.value)
    assert f"`trainer.resume_from_path` = {str(ckpt)!r} for 2 sweep runs" in msg
    assert "`trainer.resume_mode=auto`" in msg and f"lora_adapter_path={ckpt}/lora" in msg
    # one checkpoint per run is fine
    other = tmp_path / "old" / "global_step_6"
    planned = plan_sweep(["trainer.v1.trainer_mode=separate_async", f"{T}=0", "trainer.resume_mode=resume_path",
                          f"trainer.resume_from_path={ckpt},{other}"])
    assert [p.config.trainer.resume_from_path for p in planned] == [str(ckpt), str(other)]


# ---------------------------------------------------------------------------- running
def test_train_m_goes_on_past_failed_runs_and_prints_one_line_each(tmp_path, capsys):
    """Two real runs that fail at their input check (before Ray starts): both tried, both reported."""
    missing = tmp_path / "nope.txt"
    rc = cli.main(["train", "-m", "trainer.v1.trainer_mode=separate_async", f"{T}=0,2",
                   f"data.train_files={missing}", f"trainer.default_local_dir={tmp_path / 'ck'}",
                   f"trainer.log_dir={tmp_path / 'tb'}", "trainer.progress_bar=false"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "=== sweep run 1/2: max_off_policy_threshold=0" in out and "=== sweep run 2/2" in out
    lines = out.splitlines()
    i = lines.index("sweep finished: 0 ok, 2 failed")
    for line, name in zip(lines[i + 1:i + 3], ("max_off_policy_threshold=0", "max_off_policy_threshold=2")):
        assert line.startswith(f"  failed  {name}  InputError: `data.train_files`: prompt file {missing}"), line
    assert "compare them" not in out


def test_train_m_user_error_is_one_line(tmp_path, capsys):
    rc = cli.main(["train", "-m", f"{T}=1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("omnirl-async: `-m` (multirun) needs") and err.count("\n") == 1


@pytest.mark.slow  # two short separate_async runs on Ray, then the report
def test_sweep_of_two_runs_then_report(ray_cluster, small_overrides, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one red circle\ntwo blue squares\na green triangle\nthree yellow circles\n")
    rc = cli.main(["train", "-m", *small_overrides, "trainer.v1.trainer_mode=separate_async", f"{T}=0,1",
                   "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.pipeline.num_inference_steps=3",
                   "actor_rollout_ref.rollout.num_workers=1", f"data.train_files={prompts}",
                   "trainer.total_training_steps=3", "trainer.total_epochs=10", "trainer.test_freq=3",
                   "data.val_max_samples=2", "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps=2",
                   f"trainer.default_local_dir={tmp_path / 'ck'}", f"trainer.log_dir={tmp_path / 'tb'}"])
    out = capsys.readouterr().out
    sweep_dir = tmp_path / "ck" / SWEEP_FOLDER
    assert rc == 0, out
    assert "sweep finished: 2 ok, 0 failed" in out and f"compare them: omnirl-async report {sweep_dir}" in out
    for name in ("max_off_policy_threshold=0", "max_off_policy_threshold=1"):
        assert (sweep_dir / name / "global_step_3").is_dir()
        assert any((tmp_path / "tb" / SWEEP_FOLDER / name).glob("events.out.tfevents.*"))

    from omnirl_async.metrics.report import report

    runs, png = report([sweep_dir], printer=lambda *a: None)
    assert [r.config[T] for r in runs] == [0, 1] and png == sweep_dir / "report.png" and png.is_file()
    for run in runs:
        assert list(run.steps) == [1, 2, 3] and run.total_samples == 3 * 2 * 2  # steps x prompts x n
        assert sum(run.staleness.values()) == 12 and max(run.staleness) <= run.config[T]
        assert run.val_key == "val/overall" and len(run.val) == 1
        assert 0.0 <= run.learner_idle <= 1.0 and run.run_s > 0
    assert set(runs[0].staleness) == {0}
