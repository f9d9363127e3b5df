"""``max_off_policy_threshold: auto``: the controller on recorded signal traces, its config, and a short run."""

from __future__ import annotations

import math

import pytest
import torch

from omnirl_async.algos import compute_rollout_correction
from omnirl_async.config import ConfigError, load_config
from omnirl_async.trainer.auto_threshold import (LEARNER_WAITS, PREFIX, RAISE_MARGIN, StepSignals,
                                                 ThresholdController, WindowSignals)
from tests.trainer.tb_events import scalar_events

TARGET = 0.01
#: One update of each kind of trace (workers = 2, a step of 1 s).
WAITS = StepSignals(step_s=1.0, learner_wait_s=0.4, rollout_idle_s=1.0, rollout_slots_s=2.0, kl=0.001, ess=1.0)
BUSY_LEARNER = StepSignals(step_s=1.0, learner_wait_s=0.02, rollout_idle_s=1.0, rollout_slots_s=2.0, kl=0.001)
BUSY_ROLLOUT = StepSignals(step_s=1.0, learner_wait_s=0.4, rollout_idle_s=0.0, rollout_slots_s=2.0, kl=0.001)
DEAD_BAND = StepSignals(step_s=1.0, learner_wait_s=0.4, rollout_idle_s=1.0, rollout_slots_s=2.0, kl=0.7 * TARGET)
OVER = StepSignals(step_s=1.0, learner_wait_s=0.4, rollout_idle_s=1.0, rollout_slots_s=2.0, kl=2 * TARGET)
UNMEASURED = StepSignals(step_s=1.0, learner_wait_s=0.4, rollout_idle_s=1.0, rollout_slots_s=2.0)


def run(trace: list[StepSignals], **kw) -> tuple[ThresholdController, list[int]]:
    """Feed ``trace``; return the controller and the threshold after every update."""
    c = ThresholdController(**{"min": 0, "max": 3, "target_mismatch": TARGET, "window": 2, **kw})
    values = []
    for s in trace:
        c.observe(s)
        values.append(c.value)
    return c, values


def reversals(values: list[int]) -> int:
    moves = [b - a for a, b in zip(values, values[1:]) if b != a]
    return sum(1 for a, b in zip(moves, moves[1:]) if (a > 0) != (b > 0))


# ------------------------------------------------------------------------------------ raise, hold, lower, clamp
def test_raises_one_step_per_window_while_the_learner_waits_on_held_back_workers_then_holds_at_max():
    c, values = run([WAITS] * 12)
    assert values == [0, 1, 1, 2, 2, 3, 3, 3, 3, 3, 3, 3]  # a decision every 2 updates, clamped at max = 3
    assert [d.action for d in c.decisions] == ["raise"] * 3 + ["hold"] * 3
    assert c.decisions[-1].reason.endswith("but it is at auto.max")
    assert [d.update for d in c.decisions] == [2, 4, 6, 8, 10, 12]


@pytest.mark.parametrize("step, why", [
    (BUSY_LEARNER, "the learner hardly waits"),
    (BUSY_ROLLOUT, "the rollout is not held back: it is the slower side"),
    (DEAD_BAND, "mismatch within the dead band [0.5, 1] x target"),
    (UNMEASURED, "no mismatch measured in the window"),
])
def test_holds_when_raising_would_not_help_or_the_mismatch_is_near_or_unknown(step, why):
    c, values = run([step] * 10, max=4)
    assert set(values) == {0}
    assert {d.action for d in c.decisions} == {"hold"} and {d.reason for d in c.decisions} == {why}


def test_lowers_one_step_per_window_when_the_mismatch_goes_over_then_holds_at_min():
    c = ThresholdController(min=1, max=4, target_mismatch=TARGET, window=3)
    c.resume_at(4)
    values = []
    for _ in range(15):
        c.observe(OVER)
        values.append(c.value)
    assert values == [4, 4, 3, 3, 3, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1]
    assert [d.action for d in c.decisions] == ["lower"] * 3 + ["hold"] * 2
    assert c.decisions[0].reason == "mismatch over the target 0.01"
    assert c.decisions[-1].reason.endswith("but it is at auto.min")


def test_a_low_effective_sample_size_counts_as_mismatch_even_with_a_small_kl():
    # ESS 0.9 implies KL -ln(0.9)/2 = 0.053 > 0.01; the mean KL alone (0.001) would allow a raise
    low_ess = StepSignals(step_s=1.0, learner_wait_s=0.4, rollout_idle_s=1.0, rollout_slots_s=2.0, kl=0.001, ess=0.9)
    w = WindowSignals.of([low_ess])
    assert w.mismatch == pytest.approx(-math.log(0.9) / 2)
    c, values = run([low_ess] * 4)
    c.resume_at(2)
    c.observe(low_ess), c.observe(low_ess)
    assert c.value == 1 and c.decisions[-1].action == "lower"


def test_drop_strategy_samples_evicted_stale_count_as_held_back_rollout():
    dropped = StepSignals(step_s=1.0, learner_wait_s=0.4, rollout_idle_s=0.0, rollout_slots_s=2.0, generated=8,
                          dropped=4, kl=0.001)
    w = WindowSignals.of([dropped])
    assert (w.rollout_idle, w.dropped_frac, w.held_back) == (0.0, 0.5, 0.5)
    _, values = run([dropped] * 4)
    assert values[-1] == 2


@pytest.mark.parametrize("seed", range(3))
def test_the_threshold_stays_within_min_max_on_any_trace(seed):
    import random

    rng = random.Random(seed)
    kinds = [WAITS, BUSY_LEARNER, BUSY_ROLLOUT, DEAD_BAND, OVER, UNMEASURED]
    c, values = run([rng.choice(kinds) for _ in range(300)], min=1, max=3)
    assert min(values) >= 1 and max(values) <= 3
    assert len(set(values)) > 1  # it did move
    c.resume_at(9)
    assert c.value == 3
    c.resume_at(-2)
    assert c.value == 1


# ------------------------------------------------------------------------------------------------ hysteresis
@pytest.mark.parametrize("step", [WAITS, BUSY_LEARNER, BUSY_ROLLOUT, DEAD_BAND, OVER, UNMEASURED])
@pytest.mark.parametrize("start", [0, 2, 4])
def test_a_flat_trace_never_oscillates(step, start):
    c = ThresholdController(min=0, max=4, target_mismatch=TARGET, window=2)
    c.resume_at(start)
    values = [start]
    for _ in range(200):
        c.observe(step)
        values.append(c.value)
    assert reversals(values) == 0
    assert len({d.direction for d in c.decisions if d.direction}) <= 1  # only ever one direction


def test_a_noisy_trace_inside_the_dead_band_never_moves():
    noisy = [StepSignals(step_s=1.0, learner_wait_s=0.5, rollout_idle_s=1.5, rollout_slots_s=2.0,
                         kl=TARGET * (0.55 + 0.4 * ((i * 7919) % 100) / 100)) for i in range(400)]
    _, values = run(noisy, max=4)
    assert set(values) == {0}


def test_a_closed_loop_that_overshoots_backs_off_exponentially():
    """Mismatch 1.5 x target per unit of threshold: 0 is fine and the learner waits, 1 is over the target."""
    c = ThresholdController(min=0, max=4, target_mismatch=TARGET, window=1)
    values = [c.value]
    for _ in range(128):
        t = c.value
        c.observe(StepSignals(step_s=1.0, learner_wait_s=0.5 if t == 0 else 0.0, rollout_idle_s=1.0,
                              rollout_slots_s=2.0, kl=1.5 * TARGET * t))
        values.append(c.value)
    ups = [i for i, (a, b) in enumerate(zip(values, values[1:])) if b > a]
    gaps = [b - a for a, b in zip(ups, ups[1:])]
    assert max(values) == 1 and len(ups) <= 7  # log2(128): not every other window
    assert gaps == sorted(gaps) and gaps[-1] >= 2 * gaps[0]  # each retry waits longer


# ------------------------------------------------------------------------------------------------ the window
def test_signals_are_averaged_over_the_window_and_unmeasured_updates_are_skipped():
    steps = [StepSignals(step_s=2.0, learner_wait_s=1.0, rollout_idle_s=0.5, rollout_slots_s=4.0, kl=0.002, ess=0.98),
             StepSignals(step_s=2.0, learner_wait_s=0.0, rollout_idle_s=1.5, rollout_slots_s=4.0),
             StepSignals(step_s=4.0, learner_wait_s=1.0, rollout_idle_s=0.0, rollout_slots_s=8.0, kl=0.004, ess=0.96)]
    w = WindowSignals.of(steps)
    assert w.learner_idle == pytest.approx(2.0 / 8.0) and w.rollout_idle == pytest.approx(2.0 / 16.0)
    assert w.kl == pytest.approx(0.003) and w.ess == pytest.approx(0.97) and w.updates == 3
    assert w.mismatch == pytest.approx(max(0.003, -math.log(0.97) / 2))
    m = w.metrics()
    assert m[f"{PREFIX}/learner_idle"] == pytest.approx(0.25) and m[f"{PREFIX}/kl"] == pytest.approx(0.003)
    assert f"{PREFIX}/mismatch" in m and f"{PREFIX}/dropped_frac" in m


@pytest.mark.parametrize("window", [1, 3, 5])
def test_window_sets_how_often_it_decides(window):
    c, _ = run([WAITS] * 15, window=window, max=20)
    assert [d.update for d in c.decisions] == list(range(window, 16, window))
    assert c.value == 15 // window


def test_target_and_range_change_the_decision():
    # the same trace: under a target of 0.01 mismatch 0.004 allows raising; under 0.005 it is in the dead band
    trace = [StepSignals(step_s=1.0, learner_wait_s=0.5, rollout_idle_s=1.0, rollout_slots_s=2.0, kl=0.004)] * 8
    assert run(trace, target_mismatch=0.01)[0].value == 3
    assert run(trace, target_mismatch=0.005)[0].value == 0
    assert run(trace, min=2, max=2)[0].value == 2
    assert RAISE_MARGIN == 0.5 and LEARNER_WAITS == 0.1


def test_decisions_are_logged_and_summarised():
    c, _ = run([WAITS] * 4 + [OVER] * 2)
    last = c.decisions[-1]
    m = last.metrics()
    assert m["training/off_policy/threshold"] == 1.0 and m[f"{PREFIX}/decision"] == -1.0
    assert m[f"{PREFIX}/mismatch"] == pytest.approx(2 * TARGET)
    s = c.summary()
    assert s["threshold"] == 1 and s["path"] == [0, 1, 2, 1] and s["counts"] == {"raise": 2, "lower": 1, "hold": 0}
    assert len(s["decisions"]) == 3 and s["decisions"][-1]["signals"]["mismatch"] == pytest.approx(2 * TARGET)
    text = c.summary_text()
    assert text.startswith("max_off_policy_threshold auto: final 1 in [0, 3], path 0 -> 1 -> 2 -> 1; 3 decisions")
    assert "update 6: lower 2 -> 1: mismatch over the target 0.01" in text


@pytest.mark.parametrize("kw, match", [
    ({"min": -1}, r"`trainer.v1.sampler.auto.min` = -1: must be an integer >= 0"),
    ({"min": 3, "max": 2}, r"`trainer.v1.sampler.auto.max` = 2: must be an integer >= auto.min \(3\)"),
    ({"target_mismatch": 0.0}, r"`trainer.v1.sampler.auto.target_mismatch` = 0.0: must be a finite number > 0"),
    ({"target_mismatch": float("nan")}, r"`trainer.v1.sampler.auto.target_mismatch` = nan"),
    ({"window": 0}, r"`trainer.v1.sampler.auto.window` = 0: must be an integer >= 1"),
])
def test_bad_controller_settings_name_the_key(kw, match):
    with pytest.raises(ValueError, match=match):
        ThresholdController(**{"min": 0, "max": 3, "target_mismatch": TARGET, "window": 2, **kw})


def test_rollout_correction_reports_the_effective_sample_size():
    old = torch.zeros(2, 3)
    res = compute_rollout_correction(old, old.clone(), None, {"rollout_is": None})
    assert res.metrics["rollout_corr/ess"] == 1.0  # on-policy
    lr = torch.tensor([[0.0, math.log(2.0), 0.0], [0.0, 0.0, math.log(0.5)]])  # ratios 1, 2, 1, 1, 1, 0.5
    res = compute_rollout_correction(lr, torch.zeros(2, 3), None, {"rollout_is": "token", "rollout_is_threshold": 1.5})
    r = torch.tensor([1, 2, 1, 1, 1, 0.5])  # raw ratios: before the truncation at 1.5
    assert res.metrics["rollout_corr/ess"] == pytest.approx(float(r.sum() ** 2 / (6 * (r * r).sum())))


# ---------------------------------------------------------------------------------------------------- config
ASYNC = ["trainer.v1.trainer_mode=separate_async"]
AUTO = [*ASYNC, "trainer.v1.sampler.max_off_policy_threshold=auto"]


def test_auto_and_its_keys_load_under_separate_async():
    cfg = load_config([*AUTO, "trainer.v1.sampler.auto.min=1", "trainer.v1.sampler.auto.max=3",
                       "trainer.v1.sampler.auto.target_mismatch=0.002", "trainer.v1.sampler.auto.window=5"])
    s = cfg.trainer.v1.sampler
    assert s.max_off_policy_threshold == "auto"
    c = ThresholdController.from_config(s.auto)
    assert (c.min, c.max, c.target_mismatch, c.window, c.value) == (1, 3, 0.002, 5, 1)
    assert load_config(ASYNC + ["trainer.v1.sampler.max_off_policy_threshold=3"]).trainer.v1.sampler \
        .max_off_policy_threshold == 3


@pytest.mark.parametrize("overrides, match", [
    (["trainer.v1.sampler.max_off_policy_threshold=auto"],
     r"^`trainer.v1.sampler.max_off_policy_threshold` = 'auto' is refused under `trainer.v1.trainer_mode` = sync: "
     r"sync trains on-policy \(threshold 0\).*set `trainer.v1.trainer_mode` = separate_async"),
    (["trainer.v1.sampler.auto.window=8"],
     r"^`trainer.v1.sampler.auto.window` = 8 is refused under `trainer.v1.trainer_mode` = sync: sync trains "
     r"on-policy \(threshold 0\), so there is no threshold for `auto` to tune"),
    ([*ASYNC, "trainer.v1.sampler.auto.max=6"],
     r"^`trainer.v1.sampler.auto.max` = 6 is refused under `trainer.v1.trainer_mode` = separate_async while "
     r"`trainer.v1.sampler.max_off_policy_threshold` = 1 \(a "
     r"fixed number\): a fixed threshold is never tuned; leave it at its default \(4\), or set "
     r"`trainer.v1.sampler.max_off_policy_threshold` = auto"),
    ([*AUTO, "trainer.v1.sampler.auto.min=3", "trainer.v1.sampler.auto.max=2"],
     r"^`trainer.v1.sampler.auto.min` = 3 > `trainer.v1.sampler.auto.max` = 2: auto would have no threshold to "
     r"choose; lower auto.min or raise auto.max"),
    ([*AUTO, "trainer.v1.sampler.auto.window=0"], r"^`trainer.v1.sampler.auto.window` = 0 must be > 0"),
    ([*AUTO, "trainer.v1.sampler.auto.target_mismatch=0"],
     r"^`trainer.v1.sampler.auto.target_mismatch` = 0.0 must be > 0"),
    ([*AUTO, "trainer.v1.sampler.auto.min=-1"], r"^`trainer.v1.sampler.auto.min` = -1 must be >= 0"),
    ([*ASYNC, "trainer.v1.sampler.max_off_policy_threshold=fast"],
     r"^`trainer.v1.sampler.max_off_policy_threshold` = 'fast': give an integer >= 0 \(0 = on-policy\) or auto"),
    ([*ASYNC, "trainer.v1.sampler.max_off_policy_threshold=-1"],
     r"^`trainer.v1.sampler.max_off_policy_threshold` = -1: give an integer >= 0"),
    ([*ASYNC, "trainer.v1.sampler.max_off_policy_threshold=1.5"],
     r"^`trainer.v1.sampler.max_off_policy_threshold` = 1.5: give an integer >= 0"),
    ([*AUTO, "actor_rollout_ref.model.algorithm=dpo", "algorithm.trainer_type=direct_preference"],
     r"^`trainer.v1.sampler.max_off_policy_threshold` = 'auto' is refused under `trainer.v1.trainer_mode` = "
     r"separate_async with `algorithm.trainer_type` = direct_preference: direct-preference losses use no behaviour "
     r"log-probs.*; give a number \(e.g. 1\)"),
])
def test_bad_auto_settings_are_refused_at_start_up_with_key_value_and_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides)


# ------------------------------------------------------------------------------------------------ a short run
PROMPTS = ["one red circle", "two blue squares", "a green triangle", "three yellow circles",
           "a white square", "two purple triangles", "one blue circle", "four red squares"]


@pytest.mark.slow  # a training run on Ray (~20 s on 2 cores)
@pytest.mark.parametrize("mode", ["sync", "separate_async"])
def test_a_run_with_auto_logs_every_decision_and_keeps_every_lag_within_its_bound(request, small_overrides,
                                                                                  tmp_path, mode, capfd):
    from omnirl_async.trainer.separate_async import SeparateAsyncTrainer

    overrides = small_overrides + [
        f"trainer.v1.trainer_mode={mode}", "trainer.v1.sampler.max_off_policy_threshold=auto",
        "trainer.v1.sampler.auto.window=2", "trainer.v1.sampler.auto.max=2", "trainer.total_training_steps=6",
        "trainer.total_epochs=50", "actor_rollout_ref.rollout.num_workers=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.pipeline.num_inference_steps=3", "trainer.resume_mode=disable",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.log_dir={tmp_path / 'tb'}",
        "trainer.progress_bar=true"]
    if mode == "sync":  # sync trains on-policy: refused at start-up, with the reason
        with pytest.raises(ConfigError, match="sync trains on-policy"):
            load_config(overrides)
        return
    request.getfixturevalue("ray_cluster")
    printed: list[str] = []
    trainer = SeparateAsyncTrainer(load_config(overrides), PROMPTS,
                                   printer=printed.append)
    try:
        summary = trainer.fit()
    finally:
        trainer.stop()
    tags = scalar_events(tmp_path / "tb")
    threshold = tags["training/off_policy/threshold"]
    assert [s for s, _ in threshold] == list(range(1, 7))
    assert all(0 <= v <= 2 for _, v in threshold)
    decisions = tags[f"{PREFIX}/decision"]
    assert [s for s, _ in decisions] == [2, 4, 6]  # every window, with its signals
    for key in ("learner_idle", "rollout_idle", "dropped_frac", "kl", "ess", "mismatch"):
        assert [s for s, _ in tags[f"{PREFIX}/{key}"]] == [2, 4, 6], key
    auto = summary["auto_threshold"]
    assert len(auto["decisions"]) == 3 and summary["threshold"] == auto["threshold"] == threshold[-1][1]
    assert any(p.startswith("max_off_policy_threshold auto: final") for p in printed)
    # the run starts at auto.min = 0; the learner waited on held-back workers, so it raised at least once
    assert threshold[0][1] == 0 and auto["counts"]["raise"] >= 1
    # the progress bar's label follows the threshold (it was set once, at the start, and said "now 0" throughout)
    last_bar = capfd.readouterr().err.split("\r")[-1]
    assert f"(lag<=auto, now {summary['threshold']})" in last_bar, last_bar
    # every trained sample within the bound its prompt was admitted under, nothing dropped
    lags = [lv - bv for _, _, _, bv, lv in trainer.trained_log]
    assert max(lags) <= max(v for _, v in threshold) and summary["dropped_samples"] == 0


def test_a_resumed_auto_run_continues_from_the_saved_threshold_within_its_range(tmp_path):
    """The checkpoint's dispatcher state carries the admission threshold; ``resume_threshold`` (run start) puts it
    back into the controller and admission, clamped to the resumed run's [min, max]."""
    from types import SimpleNamespace

    from omnirl_async.actors.prompt_dispatcher import PromptDispatcher
    from omnirl_async.actors.staleness import AdmissionController
    from omnirl_async.trainer.checkpoint import save_state
    from omnirl_async.trainer.separate_async import SeparateAsyncTrainer

    saved = PromptDispatcher(["a", "b"], n=1, admission=AdmissionController(threshold=0, batch_groups=1))
    saved.set_threshold(3)
    save_state({"global_step": 4, "version": 4, "dispatcher": saved.get_state()}, tmp_path, "trainer")
    for top, expected in ((4, 3), (2, 2)):
        fresh = PromptDispatcher(["a", "b"], n=1, admission=AdmissionController(threshold=0, batch_groups=1))
        fresh.set_state(saved.get_state())
        assert fresh.threshold() == 0  # the dispatcher alone keeps the configured value
        trainer = SimpleNamespace(auto=ThresholdController(min=0, max=top, target_mismatch=TARGET, window=2),
                                  resumed_from=tmp_path, threshold=0, dispatcher=fresh)
        trainer.dcall = lambda method, *a: getattr(fresh, method)(*a)
        trainer.set_threshold = lambda t, tr=trainer: SeparateAsyncTrainer.set_threshold(tr, t)
        SeparateAsyncTrainer.resume_threshold(trainer)
        assert trainer.auto.value == trainer.threshold == fresh.threshold() == expected
        assert fresh.lease(1, global_step=1, worker_version=0)[0].max_lag == expected
