"""The benchmarks' recipes are valid configurations (a typo there would only show after 20 minutes)."""

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

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
    rc = cfg.algorithm.rollout_correction  # decoupled: stale samples in separate_async are not clipped away
    assert cfg.learner.num_workers == 2 and not rc.bypass_mode and rc.rollout_is == "token"
    reward = RewardManager.from_config(cfg.reward)
    # A red square with an extra red circle: GenEval's clauses all pass, the training score does not pay for it.
    image = np.zeros((1, 32, 32, 3), np.uint8)
    image[0, 4:14, 2:12][shape_template("square", 10)] = PALETTE["red"]
    image[0, 4:14, 18:28][shape_template("circle", 10)] = PALETTE["red"]
    scored = reward(image, ["a red square"])
    assert scored.extra["tiny_geneval/strict"].tolist() == [1.0]
    np.testing.assert_allclose(scored.scores, [1 / 3], rtol=1e-6)


def test_staleness_settings_load_and_differ_only_in_mode_and_threshold():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    bench = _load("bench_staleness")
    args = bench.argparse.Namespace(recipe="nft", strategies=["wait", "drop"], thresholds=[0, 2], auto=True,
                                    corrections=["decoupled"], sync=True)
    got = {label: load_config(overrides) for label, overrides in bench.settings(args)}
    assert list(got) == ["sync", "async t=0 wait", "async t=2 wait", "async t=0 drop", "async t=2 drop"]  # no auto
    assert got["sync"].trainer.v1.trainer_mode == "sync"
    for label, cfg in got.items():
        assert cfg.actor_rollout_ref.model.algorithm == "diffusion_nft"  # one recipe for every setting
        if label != "sync":
            s = cfg.trainer.v1.sampler
            assert cfg.trainer.v1.trainer_mode == "separate_async"
            assert (str(s.max_off_policy_threshold), s.max_off_policy_strategy) == {
                "async t=0 wait": ("0", "wait"), "async t=2 wait": ("2", "wait"), "async t=0 drop": ("0", "drop"),
                "async t=2 drop": ("2", "drop"), "async auto": ("auto", "wait")}[label]
    args.recipe, args.strategies, args.thresholds = "geneval", ["wait"], [1]
    auto = dict(bench.settings(args))["async auto"]
    assert str(load_config(auto).trainer.v1.sampler.max_off_policy_threshold) == "auto"
    args.corrections = ["decoupled", "bypass"]  # every separate_async setting once more, in bypass mode
    got = {label: load_config(o).algorithm.rollout_correction for label, o in bench.settings(args)}
    assert list(got) == ["sync", "async t=1 wait", "async auto", "async t=1 wait bypass", "async auto bypass"]
    assert [rc.bypass_mode for rc in got.values()] == [False, False, False, True, True]
    assert [rc.rollout_is for rc in got.values()] == ["token", "token", "token", None, None]
    args.sync = False  # --no-sync: the same separate_async settings, sync left out
    assert [label for label, _ in bench.settings(args)] == list(got)[1:]
    assert bench.training_order(args) == bench.settings(args)
    args.reverse = True  # --reverse: they train last to first
    assert [label for label, _ in bench.training_order(args)] == list(got)[1:][::-1]
    results = {"sync": {"steps": 10, "metrics": dict.fromkeys(bench.METRICS), "before": 0.2, "after": 0.35,
                        "gain": 15.0, "ci": [10.0, 20.0], "curve": [(0.0, 0.2), (1.5, 0.25), (3.0, 0.31)]},
               "async t=1 wait": {"steps": 20, "metrics": {**dict.fromkeys(bench.METRICS), "perf/throughput": 9.5},
                                  "before": 0.2, "after": 0.4, "gain": 20.0, "ci": [15.0, 25.0],
                                  "curve": [(0.0, 0.2), (1.0, 0.22), (2.0, 0.30)], "cpu_busy": 0.874}}
    rows = bench.table(results)  # 3 checkpoints in a row: neither 2-point curve holds +10
    assert rows[2].endswith("| 3.0 | 1.00x | not reached | - |") and "| 9.5 | 87 |" in rows[3]
    assert rows[3].endswith("| 2.0 | 1.50x | not reached | - |")
    no_sync = bench.table({"async t=1 wait": results["async t=1 wait"]})  # --no-sync: no speed-up to give
    assert no_sync[2].endswith("| 2.0 | - | not reached | - |")
    rows = bench.table(results, target=5)  # the same curves, another target: sync gets there first
    assert "min to +5 |" in rows[0] and rows[2].endswith("| 1.5 | 1.00x | not reached | - |")
    assert rows[3].endswith("| 2.0 | 0.75x | not reached | - |")
    rows = bench.table(results, target=5, hold=2)  # means of 2 in a row: sync +8 at 3.0, async +6 at 2.0
    assert "+5, 2-ckpt mean |" in rows[0] and rows[2].endswith("| 3.0 | 1.00x |")
    assert rows[3].endswith("| 2.0 | 1.50x |")
    assert bench.minutes_to(results["sync"]["curve"], 12) is None
    assert bench.table(results, target=12)[3].endswith("| not reached | - | not reached | - |")
    assert rows[2].startswith("| sync | 10 | - | - |")  # no throughput logged, no CPU measured
    # two runs side by side (e.g. two seeds): first / held minutes, speed-up over that run's sync on the held time
    other = {"sync": dict(results["sync"], curve=[(0.0, 0.2), (1.0, 0.27), (2.0, 0.26), (3.0, 0.28)]),
             "async t=1 wait": dict(results["async t=1 wait"], curve=[(0.0, 0.2), (0.5, 0.3), (1.0, 0.28)])}
    rows = bench.across({"seed 0": results, "seed 1": other}, target=5, hold=2)
    assert rows[0] == "| setting | seed 0 | seed 1 |"
    assert rows[3] == "| sync | 1.5 / 3.0 (1.00x) | 1.0 / 2.0 (1.00x) |"
    assert rows[4] == "| async t=1 wait | 2.0 / 2.0 (1.50x) | 0.5 / 1.0 (2.00x) |"
    assert bench.across({"a": results, "b": {"sync": other["sync"]}}, target=5, hold=2)[4].endswith("| - |")


def test_staleness_plot_draws_the_target_line_and_redraws_an_earlier_run(tmp_path):
    import json
    import sys

    from PIL import Image

    sys.path.insert(0, str(ROOT / "benchmarks"))
    bench = _load("bench_staleness")
    row = {"steps": 10, "metrics": dict.fromkeys(bench.METRICS), "before": 0.2, "gain": 10.0, "ci": [5.0, 15.0]}
    results = {"sync": dict(row, after=0.31, curve=[[0.0, 0.2], [1.5, 0.25], [3.0, 0.31]]),
               "async t=2 wait": dict(row, after=0.3, curve=[[0.0, 0.2], [1.0, 0.22], [2.0, 0.30]])}
    (tmp_path / "results.json").write_text(json.dumps(results))

    def gray_rows(png):
        a = np.asarray(Image.open(png).convert("RGB")).astype(int)
        return np.nonzero(((a == 128).all(axis=2)).sum(axis=1) > 100)[0]  # rows mostly drawn in dashes

    bench.plot(results, tmp_path / "plain.png")  # no target: no dashed line
    assert gray_rows(tmp_path / "plain.png").size == 0
    assert bench.main(["--table-from", str(tmp_path / "results.json"), "--target", "5",
                       "--plot", str(tmp_path / "t5.png")]) == 0
    # base 20 % + 5 points = 0.25 on an axis up to 1.1 x 0.31: row 400 - 52 - 296 x 0.25 / 0.341
    (row,) = gray_rows(tmp_path / "t5.png")
    assert abs(row - (348 - 296 * 0.25 / (0.31 * 1.1))) <= 1
    assert bench.main(["--table-from", str(tmp_path / "results.json"), "--target", "20",
                       "--plot", str(tmp_path / "t20.png")]) == 0  # a target over every curve widens the axis
    (row,) = gray_rows(tmp_path / "t20.png")
    assert abs(row - (348 - 296 / 1.1)) <= 1
    with pytest.raises(SystemExit):  # nothing to redraw without one earlier run
        bench.main(["--plot", str(tmp_path / "x.png")])


def test_staleness_pooled_averages_runs_and_compares_each_setting_with_the_best_fixed_threshold(tmp_path, capsys):
    import json
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    bench = _load("bench_staleness")

    def line(base, slope):  # a checkpoint a minute, `slope` points a minute over the run's own base
        return {"steps": 10, "metrics": dict.fromkeys(bench.METRICS), "before": base, "after": base, "gain": 0.0,
                "ci": [0.0, 0.0], "curve": [[float(m), base + slope * m / 100] for m in range(11)],
                "curve_steps": [100 * m for m in range(11)]}

    runs = {f"s{i}": {"async t=1 wait": line(base, 2.0), "async t=2 wait": line(base, 4.0),
                      "async auto": line(base, a), "async t=4 wait": line(base, 0.5)}
            for i, (base, a) in enumerate([(0.20, 2.0), (0.25, 4.0), (0.30, 4.0)])}
    runs["s0"]["sync"] = line(0.2, 8.0)  # in one run only: left out
    rows = bench.pooled(runs)
    assert "best fixed threshold: async t=2 wait" in rows[0] and "up to 10.0 min" in rows[0]
    got = {r.split(" | ")[0][2:]: r.split(" | ")[1:] for r in rows[3:]}
    assert list(got) == ["async t=1 wait", "async t=2 wait", "async auto", "async t=4 wait"]
    # +10 at 5.0 / 2.5 / 3.0 min (the mean of slopes 2, 4, 4) / never; mean gains over 0-10 min = 5 x slope
    assert got["async t=1 wait"][:3] == ["5.00 (5.00, 5.00)", "+10.00 (+10.00, +10.00)", "0.50x (0.50, 0.50)"]
    assert got["async t=2 wait"] == ["2.50 (2.50, 2.50)", "+20.00 (+20.00, +20.00)", "-", "- |"]
    assert got["async auto"][0] == "3.00 (2.50, 5.00)" and got["async auto"][2] == "0.83x (0.50, 1.00)"
    assert got["async auto"][3] == "-3.33 (-10.00, +0.00) |"
    assert got["async t=4 wait"][0] == "never (never, never)" and got["async t=4 wait"][2] == "0.00x (0.00, 0.00)"
    paths = []
    for name, results in runs.items():
        paths.append(str(tmp_path / f"{name}.json"))
        (tmp_path / f"{name}.json").write_text(json.dumps(results))
    # per update (100 a minute here): the same ranking, the times x 100
    per_update = {r.split(" | ")[0][2:]: r.split(" | ")[1:] for r in bench.pooled(runs, x="updates")[3:]}
    assert per_update["async auto"][0] == "300 (250, 500)" and per_update["async auto"][2] == "0.83x (0.50, 1.00)"
    assert bench.main(["--table-from", *paths]) == 0  # several runs: their tables, side by side, then pooled
    printed = capsys.readouterr().out
    assert "pooled over 3 runs" in printed and "per update: curves on a 10-update grid up to 1000 updates" in printed
    del runs["s1"]["async auto"]["curve_steps"]  # older results: the updates are read off the run's checkpoints
    runs["s1"]["async auto"]["run_dir"] = str(tmp_path / "s1_auto")
    with pytest.raises(ValueError, match="0 checkpoints for the 10 points"):
        bench.pooled(runs, x="updates")
    for m in range(1, 11):
        (tmp_path / "s1_auto" / "ckpt" / f"global_step_{100 * m}").mkdir(parents=True)
    assert bench.pooled(runs, x="updates")[3:] == [f"| {k} | {' | '.join(v)}" for k, v in per_update.items()]
    slow_fixed = {"async t=2 wait": line(0.2, 0.5), "async auto": line(0.2, 4.0)}  # the only fixed one: never
    (auto_row,) = [r for r in bench.pooled({"a": slow_fixed, "b": slow_fixed}) if r.startswith("| async auto")]
    assert auto_row.split(" | ")[3] == "inf (inf, inf)"
    one = bench.pooled({"s0": runs["s0"]})  # one run: the figures without intervals
    assert "| sync | 1.25 | +40.00 | 2.00x | +20.00 |" in one


def test_staleness_remote_reward_serves_the_recipe_reward_late_and_stops(tmp_path):
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    bench = _load("bench_staleness")
    recipe = bench.RECIPES["geneval"]
    with bench.remote_reward(recipe, 0.0, tmp_path / "none.log") as extra:
        assert extra == []  # no latency: the reward stays in the rollout workers
    image = np.zeros((1, 32, 32, 3), np.uint8)
    image[0, 4:14, 2:12][shape_template("square", 10)] = PALETTE["red"]
    image[0, 4:14, 18:28][shape_template("circle", 10)] = PALETTE["red"]
    with bench.remote_reward(recipe, 0.3, tmp_path / "server.log") as extra:
        cfg = load_config(recipe + extra)
        assert cfg.reward.reward_fn_name == "http_scorer"
        reward = RewardManager.from_config(cfg.reward)
        t0 = time.perf_counter()
        scored = reward(image, ["a red square"])
        took = time.perf_counter() - t0
    assert took >= 0.3 and "serving reward 'tiny_geneval'" in (tmp_path / "server.log").read_text()  # answered late
    # the recipe's own reward kwargs reached the server: the extra circle costs the training score (penalize_extras)
    assert not scored.failed.any() and scored.extra["http_scorer/strict"].tolist() == [1.0], sorted(scored.extra)
    np.testing.assert_allclose(scored.scores, [1 / 3], rtol=1e-6)
    cfg = load_config(recipe + extra + ["+reward.reward_kwargs.retries=0", "+reward.reward_kwargs.timeout=2"])
    assert RewardManager.from_config(cfg.reward)(image, ["a red square"]).failed.all()  # the server stopped


def test_staleness_remote_reward_that_does_not_start_in_time_says_why_and_is_stopped(tmp_path):
    import os
    import re
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    bench = _load("bench_staleness")
    with pytest.raises(SystemExit, match=r"did not start within 0 s \(exit code None; `.*http_scorer") as err:
        with bench.remote_reward(bench.RECIPES["geneval"], 0.1, tmp_path / "server.log", start_timeout_s=0.0):
            pass
    pid = int(re.search(r"process (\d+)", str(err.value)).group(1))
    with pytest.raises(ProcessLookupError):  # terminated and reaped on the way out
        os.kill(pid, 0)


def test_minutes_to_a_target_on_one_checkpoint_or_held_over_several():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    bench = _load("bench_algorithms")
    # base 0.20; a one-checkpoint spike to +12 at 1.0, then a climb that holds +10 from 4.0 on
    curve = [(0.0, 0.20), (1.0, 0.32), (2.0, 0.22), (3.0, 0.25), (4.0, 0.31), (5.0, 0.33), (6.0, 0.30)]
    assert bench.minutes_to(curve, 10) == 1.0  # the spike counts on one checkpoint
    assert bench.minutes_to(curve, 10, hold=2) == 5.0  # (0.31 + 0.33) / 2 = 0.32; (0.32 + 0.22) / 2 does not
    assert bench.minutes_to(curve, 10, hold=3) == 6.0  # (0.31 + 0.33 + 0.30) / 3 = 0.313
    assert bench.minutes_to(curve, 12, hold=3) is None
    assert bench.minutes_to(curve, 10, hold=len(curve)) is None  # more checkpoints asked for than the run has
    assert bench.minutes_to(curve[:1], 10) is None  # only the base
    with pytest.raises(ValueError, match="hold = 0"):
        bench.minutes_to(curve, 10, hold=0)


def test_cpu_meter_measures_the_busy_share_between_two_times():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    bench = _load("bench_algorithms")
    meter = bench.CpuMeter()
    meter.samples = [(0.0, 0, 0), (1.0, 50, 100), (2.0, 150, 200), (3.0, 150, 300)]  # (time, busy, total)
    assert meter.busy(0.0, 2.0) == 0.75 and meter.busy(1.0, 2.0) == 1.0 and meter.busy(2.0, 3.0) == 0.0
    assert meter.busy(0.5, 1.5) is None  # one sample inside: no interval
    busy, total = bench.CpuMeter.read()  # this machine's counters
    assert 0 < busy < total
    with bench.CpuMeter(every_s=0.01) as meter:
        end = time.time() + 0.3
        while time.time() < end:  # keep one core busy
            pass
    assert len(meter.samples) >= 5
    share = meter.busy(meter.samples[0][0], meter.samples[-1][0])
    assert share is not None and share > 0.3 / (os.cpu_count() or 1)  # at least our one spinning core, roughly


def test_offline_mix_variants_load_with_the_offline_strength_only_where_pairs_are_read():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    bench = _load("bench_offline_mix")
    base = bench.base_overrides("diffusion_nft") + bench.ALGOS["diffusion_nft"]
    for strength in (None, 1.0):
        got = {name: load_config(base + extra) for name, extra in bench.variants([0.25, 0.5], strength).items()}
        assert list(got) == ["online", "offline", "mix_0.25", "mix_0.5"]  # every variant is a valid config
        assert got["online"].algorithm.offline_advantage is None  # refused there: no offline pair is trained
        for name in ("offline", "mix_0.25", "mix_0.5"):
            assert got[name].algorithm.offline_advantage == strength, name
    assert got["mix_0.5"].buffer.offline_mix_ratio == 0.5 and got["offline"].algorithm.sample_source == "offline"
    tapered = {name: load_config(base + extra) for name, extra in bench.variants([0.5], 1.0, taper_to=0.0).items()}
    assert list(tapered) == ["online", "offline", "mix_0.5_to_0"]
    assert tapered["mix_0.5_to_0"].buffer.offline_mix_ratio_final == 0.0
    assert tapered["online"].buffer.offline_mix_ratio_final is None  # refused there: no offline share to taper
    early = {name: load_config(base + extra)
             for name, extra in bench.variants([0.5], 1.0, taper_to=0.0, taper_end=0.25).items()}
    assert list(early) == ["online", "offline", "mix_0.5_to_0_by_0.25"]
    assert early["mix_0.5_to_0_by_0.25"].buffer.offline_mix_taper_end == 0.25
    assert early["online"].buffer.offline_mix_taper_end == 1.0
    with pytest.raises(ValueError, match="--taper-end needs --taper-to"):
        bench.variants([0.5], 1.0, taper_end=0.25)


def test_offline_mix_pairs_lora_is_checked_and_reaches_the_dataset_script_only(tmp_path):
    import sys
    from types import SimpleNamespace

    import torch

    from omnirl_async.models.setup import build_policy

    sys.path.insert(0, str(ROOT / "benchmarks"))
    bench = _load("bench_offline_mix")
    args = SimpleNamespace(pairs_from="renders", pairs_lora=None, model_samples=8)
    assert bench.pair_source(args, ["x=1"]) == []
    with pytest.raises(SystemExit, match="--pairs-lora .* needs --pairs-from model"):
        bench.pair_source(SimpleNamespace(**args.__dict__ | {"pairs_lora": str(tmp_path)}), [])
    step = tmp_path / "global_step_3"
    model = SimpleNamespace(pairs_from="model", pairs_lora=str(step), model_samples=8)
    with pytest.raises(SystemExit, match="`--pairs-lora`: adapter folder .* does not exist"):
        bench.pair_source(model, [])
    policy = build_policy(load_config(["actor_rollout_ref.model.lora_rank=4"]).actor_rollout_ref.model,
                          torch.device("cpu"))
    policy.save_lora(step / "lora")  # a checkpoint step folder: the LoRA is in lora/ inside
    with pytest.raises(SystemExit, match=r"`--pairs-lora`: .* has no adapter_config.json, so it is not a PEFT "
                                         r"adapter folder \(.*lora holds one: point at that\)"):
        bench.pair_source(model, [])
    model.pairs_lora = str(step / "lora")
    got = bench.pair_source(model, ["x=1"])
    assert got == ["--model-samples", "8", "x=1",
                   f"actor_rollout_ref.model.lora_adapter_path={(step / 'lora').resolve()}"]
    assert bench.pair_source(SimpleNamespace(**model.__dict__ | {"pairs_lora": None}), ["x=1"]) == [
        "--model-samples", "8", "x=1"]
    with pytest.raises(SystemExit, match="--store reuses a built one: pass one of them"):
        bench.main(["--store", str(tmp_path), "--pairs-from", "model", "--pairs-lora", str(tmp_path)])


@pytest.mark.slow
def test_offline_mix_quick_run_with_model_sample_pairs(tmp_path):
    """The whole bench_offline_mix pipeline on a tiny world, its store built from ranked samples of the base model."""
    import json
    import subprocess
    import sys

    out = tmp_path / "om"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_offline_mix.py"), "--quick", "--pairs-from",
                           "model", "--model-samples", "3", "--out", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "pref_data" / "data.jsonl").read_text().splitlines()]
    assert rows and {r["source"] for r in rows} == {"model-samples"}
    assert all(r["chosen_score"] > r["rejected_score"] and r["metadata"]["samples"] == 3 for r in rows)
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"online", "offline", "mix_0.5"}
    assert results["online"]["offline_frac"] == 0.0 and results["offline"]["offline_frac"] == 1.0
    assert "pairs from model" in proc.stdout


def test_staleness_run_metrics_take_the_last_value_of_whole_run_figures(tmp_path):
    """perf/learner_idle_frac is the whole run's share so far (its last value is the run's); per-step figures are
    averaged."""
    import sys

    from torch.utils.tensorboard import SummaryWriter

    sys.path.insert(0, str(ROOT / "benchmarks"))
    bench = _load("bench_staleness")
    writer = SummaryWriter(str(tmp_path / "tb"))
    for step, (idle, rate) in enumerate([(0.5, 10.0), (0.3, 20.0), (0.25, 30.0)], start=1):
        writer.add_scalar("perf/learner_idle_frac", idle, step)
        writer.add_scalar("perf/throughput", rate, step)
    writer.close()
    got = bench.run_metrics(tmp_path)
    assert got["perf/learner_idle_frac"] == pytest.approx(0.25) and got["perf/throughput"] == pytest.approx(20.0)
    assert got["rollout_corr/kl"] is None and got["rollout_corr/ess"] is None  # never logged


def test_replay_auto_threshold_counts_the_windows_a_target_would_lower_on(tmp_path, capsys):
    import sys

    from torch.utils.tensorboard import SummaryWriter

    sys.path.insert(0, str(ROOT / "benchmarks"))
    replay = _load("replay_auto_threshold")
    # a healthy stretch (kl 1e-6) of 8 updates, then 4 updates at kl 5e-4 with the ESS still 1
    with SummaryWriter(str(tmp_path / "tb")) as w:
        for step in range(1, 13):
            w.add_scalar("rollout_corr/kl", 1e-6 if step <= 8 else 5e-4, step)
            w.add_scalar("rollout_corr/ess", 1.0, step)
    assert replay.main([str(tmp_path / "tb"), "--targets", "1e-3,3e-4,1e-7", "--window", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "3 windows of 4 updates" in out[0] and "max 0.0005" in out[0]
    assert out[1:] == ["  target 0.001: 0 windows over",
                       "  target 0.0003: 1 windows over, the first ending at update 12",
                       "  target 1e-07: 3 windows over, the first ending at update 4"]
    wins = replay.windows(replay.read_trace(tmp_path / "tb"), 3)  # 12 updates: 4 windows of 3
    assert [u for u, _ in wins] == [3, 6, 9, 12] and replay.over(wins, 3e-4, 3) == [12]
    assert replay.over(wins, 1e-4, 3) == [9, 12]  # (1e-6 + 1e-6 + 5e-4) / 3 = 1.7e-4 in the third
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no `rollout_corr/kl` logged"):
        replay.main([str(tmp_path / "empty")])
    with pytest.raises(SystemExit):
        replay.main([str(tmp_path / "tb"), "--targets", "0"])


def test_buffer_bench_takes_each_ratio_within_a_repetition_and_reports_its_median_and_range():
    bench = _load("bench_buffer")
    # the machine slows down 2x between repetitions: the rates move, the paired ratio does not
    reps = [{"raw": 1000.0, "tq": 200.0, "buffer": 900.0, "durable": 500.0},
            {"raw": 500.0, "tq": 100.0, "buffer": 450.0, "durable": 250.0},
            {"raw": 800.0, "tq": 100.0, "buffer": 400.0, "durable": 400.0}]
    r = bench.summarise(reps)
    assert r["raw"] == 800.0 and r["buffer"] == 450.0 and r["tq"] == 100.0
    med, lo, hi = r["buffer/raw"]
    assert (med, lo, hi) == pytest.approx((0.9, 0.5, 0.9))  # ratios 0.9, 0.9, 0.5
    assert r["buffer/tq"] == pytest.approx((4.5, 4.0, 4.5))
    assert r["durable/raw"] == pytest.approx((0.5, 0.5, 0.5))
    # the unpaired ratio of medians would say 450 / 800 = 0.56: drift, not the buffer
    assert bench.fmt_ratio(r["buffer/raw"]) == " 0.90 [0.50-0.90]"


def test_buffer_bench_marks_a_cell_with_a_failed_repetition_or_a_missing_transport_unmeasured(capsys):
    bench = _load("bench_buffer")
    reps = [{"raw": 1000.0, "buffer": 900.0, "durable": 500.0},  # no TransferQueue installed
            {"raw": 1000.0, "buffer": float("nan"), "durable": 600.0}]  # buffer failed exactly-once here
    r = bench.summarise(reps)
    assert np.isnan(r["tq"]) and np.isnan(r["buffer"]) and r["raw"] == 1000.0
    assert all(np.isnan(x) for x in r["buffer/raw"] + r["buffer/tq"])
    assert r["durable/raw"] == pytest.approx((0.55, 0.5, 0.6))
    assert bench.fmt_ratio(r["buffer/tq"]).strip() == "-"
    bench.goals([("1MB", 1024**2, 8, 4, r)], have_tq=False)
    out = capsys.readouterr().out
    assert "buffer/raw >= 0.9 at >= 1 MB, groups of 8: not met (a transport failed exactly-once)" in out
    assert "buffer/tq  >= 3   at >= 1 MB, groups of 8: n/a (TransferQueue not installed)" in out


def test_buffer_bench_refuses_zero_repetitions():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_buffer.py"), "--repeats", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--repeats 0: at least 1 repetition per cell" in out.stderr


def test_buffer_cpu_rows_name_the_driver_actors_and_daemons_and_count_what_each_spent(tmp_path):
    cpu = _load("buffer_cpu")
    me = psutil.Process()
    # real processes titled the way Ray titles its workers and daemons (argv[0])
    titles = {"ray::_Controller": "_Controller", "ray::Producer.buffer()": "Producer", "ray::IDLE": cpu.OTHER,
              "/x/ray/core/src/ray/raylet/raylet": cpu.SYSTEM, "gcs_server": cpu.SYSTEM, "python": cpu.OTHER}
    procs = [subprocess.Popen(["bash", "-c", f'exec -a "{title}" sleep 30']) for title in titles]
    try:
        time.sleep(0.3)
        assert cpu.role(me, me.pid) == "consumer (driver)"
        assert [cpu.role(psutil.Process(p.pid), me.pid) for p in procs] == list(titles.values())
        snap = cpu.cpu_snapshot()
        assert snap[me.pid][0] == "consumer (driver)" and all(p.pid in snap for p in procs)  # children counted
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
    before = {1: ("a", 1.0), 2: ("b", 5.0)}
    after = {1: ("a", 1.5), 2: ("b", 5.25), 3: ("a", 0.125)}  # pid 3 started meanwhile: all of it counts
    assert cpu.cpu_between(before, after) == {"a": 0.625, "b": 0.25}


@pytest.mark.slow
def test_buffer_bench_call_costs_and_cpu_parts_run_alone_and_print_every_row():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_buffer.py"), "--quick", "--parts",
                          "costs,cpu", "--num-cpus", "2"], capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "where a group of 8 goes" in out.stdout and "raw smp/s" not in out.stdout  # part 1 left out
    # part 4: a column per transport and size, the consumer's and the controller's rows, a sum and the floor
    lines = out.stdout[out.stdout.index("where the CPU goes"):].splitlines()
    header = [c.strip() for c in lines[1].split("|")[1:]]
    # with 2 CPUs for Ray, TransferQueue (3 one-CPU actors) is left out, and said so, rather than waited for
    if importlib.util.find_spec("transfer_queue"):
        assert "tq skipped: TransferQueue's controller and 2 storage units ask Ray for 3 CPUs" in out.stdout
    transports = ["raw", "buffer"]
    assert header == [f"{t} {size}" for size in ("4KB", "1MB") for t in transports]
    row = {ln.split("|")[0].strip(): [float(x) for x in ln.split("|")[1:]] for ln in lines[2:] if "|" in ln}
    assert all(x > 0 for x in row["sum"] + row["wall ms per group"] + row["samples/s"])
    at = {t: transports.index(t) for t in transports}  # the 4 KB columns
    assert row["_Controller"][at["buffer"]] > 0 and row["_Controller"][at["raw"]] == 0  # the buffer's alone
    assert re.search(r"an empty actor call, 8 in flight: [\d.]+ ms wall, CPU [\d.]+ ms in the caller", out.stdout)
    bench = _load("bench_buffer")
    for _who, what, key, _note in bench.COST_ROWS:
        line = next(ln for ln in out.stdout.splitlines() if what in ln)
        small, large = (float(x) for x in line.split("|")[1:3])
        # a 4 KB group rides inline in the sample reply: its "ray.get" fetches nothing and prints 0.00 ms
        assert (0 <= small if key == "get" else 0 < small) and small < 1000 and 0 < large < 1000, line
