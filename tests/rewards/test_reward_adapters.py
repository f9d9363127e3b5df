"""Row fields reach reward functions as keyword arguments; a verl-style compute_score runs unchanged."""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import numpy as np
import pytest

from omnirl_async.rewards import RewardManager
from omnirl_async.rewards.adapters import PerSampleReward, call_reward, is_per_sample, per_sample_arguments
from omnirl_async.rewards.base import failure_kind
from omnirl_async.rewards.manager import RewardComponent

# A verl reward file, as users have them, with `solution_str` read as the image.
VERL_FILE = '''
import numpy as np

def compute_score(data_source, solution_image, ground_truth, extra_info=None):
    """1 when the image's brightness level (0-4) is the ground truth; verl's dict form with extras."""
    if extra_info.get("explode"):
        raise RuntimeError("cannot score " + extra_info["prompt"])
    level = int(round(float(np.asarray(solution_image).mean()) / 255 * 4))
    if data_source == "strict" and level != int(ground_truth):
        return {"score": 0.0, "level": level, "pred": str(level)}
    return {"score": float(level == int(ground_truth)), "level": level, "pred": str(level)}
'''


def _images(levels) -> np.ndarray:
    return np.stack([np.full((4, 4, 3), round(v / 4 * 255), np.uint8) for v in levels])


@pytest.fixture()
def verl_file(tmp_path):
    path = tmp_path / "verl_reward.py"
    path.write_text(textwrap.dedent(VERL_FILE))
    return path


def test_verl_compute_score_runs_unchanged_from_a_file(verl_file):
    cfg = SimpleNamespace(custom_reward_function={"path": str(verl_file), "name": "compute_score"})
    mgr = RewardManager.from_config(cfg)
    assert isinstance(mgr.components[0].fn, PerSampleReward)
    rows = [{"data_source": "shapes", "ground_truth": 1},
            {"data_source": "shapes", "reward_model": {"style": "rule", "ground_truth": 2}},  # verl's parquet layout
            {"data_source": "shapes", "ground_truth": 4},
            {"ground_truth": 0, "extra_info": {"explode": True}}]
    res = mgr(_images([1, 2, 3, 0]), ["a", "b", "c", "d"], rows)
    assert res.scores.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert res.failed.tolist() == [False, False, False, True]
    assert res.reasons[3] == "reward `compute_score` raised RuntimeError: cannot score d (sample 3)"
    assert failure_kind(res.reasons[3]) == "raised"
    # numeric entries of the dict are logged as extras (NaN where the sample failed); strings are not
    np.testing.assert_array_equal(res.extra["compute_score/level"], [1, 2, 3, np.nan])
    assert "compute_score/pred" not in res.extra


def test_verl_function_survives_pickling_to_another_process(verl_file):
    import pickle  # the trainer sends managers to Ray actors this way; user files are never unpickled

    mgr = RewardManager.from_config(SimpleNamespace(
        custom_reward_function={"path": str(verl_file), "name": "compute_score"}))
    again = pickle.loads(pickle.dumps(mgr))
    assert isinstance(again.components[0].fn, PerSampleReward)
    assert again(_images([2]), ["x"], [{"ground_truth": 2}]).scores.tolist() == [1.0]


def test_per_sample_arguments_follow_verl():
    row = {"data_source": "geneval", "reward_model": {"ground_truth": {"count": 2}}, "extra_info": {"index": 7},
           "category": "counting", "index": 99}
    args = per_sample_arguments(row, "two red circles")
    assert args == {"data_source": "geneval", "ground_truth": {"count": 2},
                    "extra_info": {"index": 7, "prompt": "two red circles", "category": "counting"}}
    assert per_sample_arguments(None, "p") == {"data_source": None, "ground_truth": None,
                                               "extra_info": {"prompt": "p"}}


def test_per_sample_bad_outputs_fail_that_sample_only():
    outs = iter([0.5, float("nan"), "high", {"value": 1}, True])

    def compute_score(data_source, solution_image, ground_truth, extra_info, scale=1.0):
        return next(outs)

    fn = PerSampleReward(compute_score, "judge")
    out = fn(_images([0] * 5), list("abcde"), scale=2.0, url="unused")  # `url` is not its argument: dropped
    assert out.score[0] == 0.5 and out.score[4] == 1.0
    assert out.reasons[1] == "reward `judge` returned nan for this sample"
    assert out.reasons[2].startswith("reward `judge` returned a str for sample 2")
    assert out.reasons[3].startswith("reward `judge` returned a dict without 'score' (keys: ['value'])")

    def by_prompt(data_source, solution_image, ground_truth, extra_info):
        return {"a": 0.25, "b": float("inf")}[extra_info["prompt"]]

    res = RewardManager([RewardComponent("judge", fn=by_prompt)])(_images([0] * 2), ["a", "b"])
    assert res.scores.tolist() == [0.25, 0.0] and res.failed.tolist() == [False, True]
    assert res.reasons[1] == "reward `judge` returned inf for this sample"
    assert failure_kind(res.reasons[1]) == "nonfinite"


def test_is_per_sample():
    assert is_per_sample(lambda data_source, solution_image, ground_truth, extra_info: 0)
    assert is_per_sample(lambda solution_image, **kw: 0)
    assert not is_per_sample(lambda images, prompts, **kw: 0)
    assert not is_per_sample(PerSampleReward(lambda solution_image: 0, "x"))


def test_row_fields_reach_batched_functions_that_take_them():
    seen = {}

    def named(images, prompts, ground_truth):
        seen["named"] = ground_truth
        return np.array([float(g or 0) for g in ground_truth])

    def var_kw(images, prompts, **kwargs):
        seen["var_kw"] = kwargs
        return np.zeros(len(prompts))

    def plain(images, prompts):  # written before rows existed: gets none of them
        return np.ones(len(prompts))

    def whole(images, prompts, rows=None):
        seen["rows"] = rows
        return np.zeros(len(prompts))

    rows = [{"ground_truth": 3, "category": "single", "images": "x"}, {"category": "pair"}]
    images = _images([0, 0])
    assert call_reward(named, images, ["a", "b"], {}, rows).tolist() == [3.0, 0.0]
    assert seen["named"] == [3, None]
    call_reward(var_kw, images, ["a", "b"], {"quality": 5}, rows)
    assert seen["var_kw"] == {"quality": 5, "ground_truth": [3, None], "category": ["single", "pair"]}  # no `images`
    assert call_reward(plain, images, ["a", "b"], {}, rows).tolist() == [1.0, 1.0]
    call_reward(whole, images, ["a", "b"], {}, rows)
    assert seen["rows"] == rows
    call_reward(var_kw, images, ["a", "b"], {}, None)
    assert seen["var_kw"] == {}


def test_row_field_clashing_with_a_configured_argument_fails_the_batch_with_both_named():
    def score(images, prompts, threshold=0.5, **_):
        return np.zeros(len(prompts))

    mgr = RewardManager([RewardComponent("score", fn=score, kwargs={"threshold": 0.9})])
    res = mgr(_images([0]), ["a"], [{"threshold": 0.1}])
    assert res.failed.all()
    assert "field 'threshold' has the name of a configured keyword argument (threshold=0.9" in res.reasons[0]


def test_rows_must_match_the_batch():
    mgr = RewardManager([RewardComponent("b", registry_name="brightness")])
    with pytest.raises(ValueError, match="`rows` has 1 entries but `images` holds 2"):
        mgr(_images([0, 0]), ["a", "b"], [{}])
