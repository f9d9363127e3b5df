"""Reward-failure accounting and the trained-groups audit file, without Ray."""

from __future__ import annotations

import json

import pytest

from omnirl_async.buffer.local import LocalReplayBuffer
from omnirl_async.config import load_config
from omnirl_async.protocol import SampleMeta, SampleStatus, SampleTags
from omnirl_async.rewards.base import failure_kind
from omnirl_async.trainer.failures import FailureMonitor, RewardFailureError
from omnirl_async.trainer.trained_log import TrainedLog, read_trained_log


def _reward_cfg(*overrides: str):
    return load_config(list(overrides)).reward


def _buf(failed: dict[str, int], inserted: int, examples=()) -> dict:
    out = {f"buffer/failed/{k}": float(v) for k, v in failed.items()}
    out["buffer/inserted"] = float(inserted)
    out["buffer/failure_examples"] = [list(e) for e in examples]
    return out


@pytest.mark.parametrize("reason, kind", [
    ("reward `f` raised ConnectionError: refused", "raised"),
    ("reward `f` returned nan for this sample", "nonfinite"),
    ("reward `f` returned -inf for this sample", "nonfinite"),
    ("reward `f` returned shape (3,); expected float[4] or a dict with a float[4] 'score'", "bad_output"),
    ("reward worker 0 took longer than `reward.timeout_s` = 2 s", "timeout"),
    ("reward call took longer than `reward.timeout_s` = 2 s (inline scoring)", "timeout"),
    ("no reward worker left (reward worker 0 died: ActorDiedError)", "no_worker"),
    (None, "other"),
])
def test_failure_kinds(reason, kind):
    assert failure_kind(reason) == kind


def test_the_buffer_counts_failed_samples_by_kind_and_keeps_the_first_reason():
    buf = LocalReplayBuffer()
    for g, reason in enumerate(["reward `f` raised KeyError: 'x'", "reward `f` returned nan for this sample",
                                "reward `f` raised KeyError: 'y'"]):
        metas = [SampleMeta(key=f"k{g}{i}", status=SampleStatus.FAILURE, reason=reason,
                            tags=SampleTags(uid=f"k{g}{i}", group_uid=f"g{g}", sample_index=i, group_size=2,
                                            policy_version=0, prompt=f"p{g}"))
                 for i in range(2)]
        buf.put(metas, {})
    m = buf.metrics()
    assert m["buffer/failed/raised"] == 4 and m["buffer/failed/nonfinite"] == 2
    assert m["buffer/failure_examples"] == [["raised", "reward `f` raised KeyError: 'x'", "p0"],
                                            ["nonfinite", "reward `f` returned nan for this sample", "p1"]]


def test_monitor_measures_the_window_and_stops_over_the_limit():
    printed: list[str] = []
    mon = FailureMonitor(_reward_cfg("reward.failed_frac_window=10", "reward.max_failed_frac=0.5"),
                         printer=printed.append)
    mon.reset(_buf({}, 0))
    m = mon.observe(_buf({"raised": 2}, 6, [("raised", "reward `f` raised E: x", "a cat")]))
    assert m["reward/failed_frac"] == pytest.approx(0.25) and m["reward/failed/raised"] == 2
    assert printed == ["reward failure (raised), first example: reward `f` raised E: x [prompt: 'a cat']; such "
                       "samples are not trained on and are counted in reward/failed/raised"]
    m = mon.observe(_buf({"raised": 4}, 8, [("raised", "reward `f` raised E: x", "a cat")]))
    assert m["reward/failed_frac_window"] == pytest.approx(4 / 12) and len(printed) == 1  # printed once
    with pytest.raises(RewardFailureError) as err:
        mon.observe(_buf({"raised": 10}, 9))  # the window now holds the last 12 samples: 8 failed
    assert str(err.value).startswith("reward `tiny_geneval` failed on 8 of the last 11 scored samples (73% > "
                                     "`reward.max_failed_frac` = 0.5); stopping the job.\n  raised: 10 samples")


def test_max_failed_frac_one_never_stops_and_the_window_must_fill_first():
    never = FailureMonitor(_reward_cfg("reward.max_failed_frac=1", "reward.failed_frac_window=4"), printer=None)
    never.reset(_buf({}, 0))
    assert never.observe(_buf({"raised": 100}, 0))["reward/failed_frac"] == 1.0
    filling = FailureMonitor(_reward_cfg("reward.failed_frac_window=64"), printer=lambda *a: None)
    filling.reset(_buf({}, 0))
    filling.observe(_buf({"raised": 63}, 0))  # all failed, but fewer than the window: no verdict yet
    with pytest.raises(RewardFailureError):
        filling.observe(_buf({"raised": 64}, 0))


def test_a_run_ending_before_the_window_filled_is_judged_on_all_it_scored():
    short = FailureMonitor(_reward_cfg("reward.failed_frac_window=64", "reward.max_failed_frac=0.5"),
                           printer=lambda *a: None)
    short.reset(_buf({}, 0))
    short.observe(_buf({"raised": 24}, 0, [("raised", "reward `f` raised E: x", "a cat")]))
    with pytest.raises(RewardFailureError) as err:
        short.check_run()
    assert str(err.value).startswith(
        "reward `tiny_geneval` failed on 24 of the 24 samples this run scored (fewer than "
        "`reward.failed_frac_window` = 64, so the limit is applied at the end) (100% > `reward.max_failed_frac` = "
        "0.5); the run fails.\n  raised: 24 samples so far, e.g. reward `f` raised E: x")
    half = FailureMonitor(_reward_cfg("reward.failed_frac_window=64", "reward.max_failed_frac=0.5"), printer=None)
    half.reset(_buf({}, 0))
    half.observe(_buf({"raised": 12}, 12))
    half.check_run()  # 50 %: not over the limit
    half.observe(_buf({"raised": 13}, 12))
    with pytest.raises(RewardFailureError):
        half.check_run()
    never = FailureMonitor(_reward_cfg("reward.max_failed_frac=1"), printer=None)
    never.reset(_buf({}, 0))
    never.observe(_buf({"raised": 8}, 0))
    never.check_run()  # 1 = never stop
    nothing = FailureMonitor(_reward_cfg(), printer=None)
    nothing.reset(_buf({"raised": 5}, 0))
    nothing.check_run()  # nothing scored in this run (the counts are a restored buffer's)


def test_monitor_ignores_counts_from_before_a_resume():
    mon = FailureMonitor(_reward_cfg("reward.failed_frac_window=4"), printer=lambda *a: None)
    mon.reset(_buf({"raised": 50}, 10))  # a restored buffer brings the earlier run's totals
    m = mon.observe(_buf({"raised": 50}, 14))
    assert m["reward/failed_frac"] == 0.0 and mon.summary()["reward_failed"] == 0


def test_trained_log_rolls_back_steps_after_a_resume_and_survives_a_cut_line(tmp_path):
    log = TrainedLog(tmp_path)

    class M:
        def __init__(self, g, p):
            self.tags = SampleTags(uid="u", group_uid=g, sample_index=0, group_size=1, policy_version=0, prompt=p,
                                   ticket=0)

    for step, prompt in [(1, "a"), (2, "b"), (3, "c")]:
        log.step(step, step - 1, [M(f"g{step}", prompt), M(f"g{step}", prompt)])
    log.resumed(2)
    log.step(3, 2, [M("g3", "c")])
    with open(log.path, "a") as fh:
        fh.write('{"step": 4, "vers')  # killed mid-write
    steps, rolled = read_trained_log(tmp_path)
    assert sorted(steps) == [1, 2, 3] and steps[3]["groups"] == [["g3", "c", 0, 0, 0, 1]]
    assert [r["groups"][0][5] for r in rolled[3]] == [2]
    assert json.loads(log.path.read_text().split("\n")[0])["groups"][0][:2] == ["g1", "a"]
