"""benchmarks/bench_scale.py (+ scale_model.py, scale_report.py): the time model and the ideal bound, the report's
figures (fast, no Ray), and a smoke run end to end (slow)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_scale.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_scale", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_scale"] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_scale", None)


@pytest.fixture(scope="module")
def report(bench):
    import scale_report  # bench_scale put benchmarks/ on sys.path

    return scale_report


def test_ideal_bound_is_min_of_rollout_capacity_and_learner_demand(bench):
    t = bench.TimeModel()  # 16 images per group, 32 groups per step, 24 s per group, 60 s per step
    demand = 32 * 16 / 60.0
    for workers in (1, 8, 12, 13, 32, 128):
        capacity = workers * 16 / 24.0
        assert t.capacity(workers) == pytest.approx(capacity)
        assert t.demand() == pytest.approx(demand)
        assert t.ideal(workers) == pytest.approx(min(capacity, demand))
        assert t.learner_bound(workers) == (capacity > demand)
        assert t.step_s(workers) == pytest.approx(32 * 16 / min(capacity, demand))
    assert t.step_s(8) == pytest.approx(96.0)  # rollout-bound: 32 groups / 8 workers x 24 s
    assert t.step_s(128) == pytest.approx(60.0)  # learner-bound: the update


def test_a_slow_scorer_caps_a_workers_pace(bench):
    # scoring runs on 4 threads beside generation: it limits a worker only past 4x the generation time
    t = bench.TimeModel(reward_median_s=200.0, reward_sigma=0.0)
    assert t.reward_mean_s() == pytest.approx(200.0)
    assert t.worker_group_s() == pytest.approx(50.0)
    assert t.capacity(10) == pytest.approx(10 * 16 / 50.0)
    lognormal = bench.TimeModel(reward_median_s=2.0, reward_sigma=1.0)
    assert lognormal.reward_mean_s() == pytest.approx(2.0 * math.exp(0.5))
    assert lognormal.worker_group_s() == pytest.approx(24.0)


def test_draws_follow_the_model(bench):
    t = bench.TimeModel()
    rng = np.random.default_rng(0)
    gen = np.array([t.draw_gen(rng) for _ in range(20000)])
    upd = np.array([t.draw_update(rng) for _ in range(20000)])
    rew = np.array([t.draw_reward(rng) for _ in range(20000)])
    assert gen.mean() == pytest.approx(t.gen_s, rel=0.01)  # jitter keeps the mean
    assert upd.mean() == pytest.approx(t.update_s, rel=0.01)
    assert np.median(rew) == pytest.approx(t.reward_median_s, rel=0.05)
    assert rew.mean() == pytest.approx(t.reward_mean_s(), rel=0.05)
    assert np.quantile(rew, 0.99) > 8 * t.reward_median_s  # the long tail


def test_payload_sizes_match_direct_computation(bench):
    p = bench.SimSpec().payload  # scale_model.PayloadModel
    lat = 16 * 128 * 128 * 4  # one float32 SD3 latent at 1024 px
    direct = (1024 * 1024 * 3 + 3 * 3 * lat + 3 * (4 + 4 + 4 + 8) + 333 * 4096 * 4 + 2048 * 4)
    assert p.sample_bytes() == direct
    assert p.lora_params() == 24 * 8 * 32 * (1536 + 1536)
    spec = bench.SimSpec(time_scale=20.0, payload_scale=1 / 20)
    group = spec.group_payload(16, fill=3)
    assert all(v.shape[0] == 16 for v in group.values())
    sent = sum(v.nbytes for v in group.values())
    assert sent == pytest.approx(16 * direct / 20, rel=0.01)
    weights = spec.weights(2)
    assert len(weights) == p.lora_tensors()
    assert sum(v.nbytes for v in weights.values()) == pytest.approx(p.lora_bytes() / 20, rel=0.01)


def test_host_layout_and_arguments(bench, report):
    assert bench.host_layout(128, 4) == [32, 32, 32, 32]
    assert bench.host_layout(6, 4) == [2, 2, 1, 1]
    assert bench.host_layout(3, 8) == [1, 1, 1]
    args = bench.parse_args(["--quick"])
    assert bench.check_args(args) == [(6, None, "")]
    assert bench.parse_settings("8, 128@0.25, 32:serial, 32@0.5:serial, 128:land") == [
        (8, None, ""), (128, 0.25, ""), (32, None, "serial"), (32, 0.5, "serial"), (128, None, "land")]
    assert report.name({"workers": 32, "lease_wait_s": 2.0, "sample_ahead": False}) == "32@wait:serial"
    assert report.name({"workers": 32, "lease_wait_s": 2.0, "sample_ahead": True, "land": True}) == "32@wait:land"
    assert report.name({"workers": 32, "lease_wait_s": 2.0, "sample_ahead": True, "land": False}) == "32@wait"
    assert report.name({"workers": 32, "lease_wait_s": 2.0, "sample_ahead": True, "back_to_back": False}) == "32@wait:gap"
    assert bench.parse_settings("32:gap") == [(32, None, "gap")]
    assert bench.build_spec(args).payload_scale == pytest.approx(1 / args.time_scale)
    with pytest.raises(SystemExit):
        bench.check_args(bench.parse_args(["--workers", "8,x"]))
    with pytest.raises(SystemExit):
        bench.parse_settings("8@0")
    with pytest.raises(SystemExit, match="':serial', ':land' and ':gap'"):
        bench.parse_settings("8:fast")


def test_exactly_once_and_goals(report):
    log = [("g1", "p1", 0, 0, 0)] * 4 + [("g2", "p2", 0, 0, 1)] * 4
    assert report.exactly_once(log, 4) == (True, "ok")
    twice = log + [("g3", "p1", 0, 1, 2)] * 4  # p1 trained again in the same epoch
    assert not report.exactly_once(twice, 4)[0]
    row = dict(workers=32, ratio=0.95, learner_bound=True, learner_idle=0.02, bound_held=True, max_lag=1,
               learner_cp_frac=0.004, worker_cp_frac=0.001)
    assert [ok for _, ok, _ in report.goals([row])] == [True, True, True, True]
    slow = dict(row, ratio=0.8, learner_idle=0.2)
    assert [ok for _, ok, _ in report.goals([slow])] == [False, False, True, True]
    small = dict(row, workers=8, learner_bound=False)
    assert [ok for _, ok, _ in report.goals([small])][:2] == [None, None]


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path):
    out = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ratio" in proc.stdout and "goals (refused leases wait in the dispatcher" in proc.stdout
    [r] = json.loads(out.read_text())["results"]
    assert r["throughput"] > 0 and r["window_steps"] >= 2
    assert r["bound_held"] and r["max_lag"] <= r["threshold"]
    assert r["exactly_once"], r["exactly_once_text"]
    assert r["trained_samples"] > 0 and sum(r["lags"].values()) == r["trained_samples"]
    # the simulated workers spoke the real protocol: leases, puts with producer ids, completions, weight pulls
    for call in ("dispatcher.lease (granted)", "dispatcher.complete", "buffer.put", "weight_store.get",
                 "buffer.sample_tickets"):
        assert r["calls"].get(call, [0])[0] > 0, call
