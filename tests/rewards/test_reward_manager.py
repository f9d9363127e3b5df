"""RewardManager: config resolution, weighted sum and the failure policy."""

import pickle
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest

from omnirl_async.data.shapes import render_batch
from omnirl_async.rewards import RewardManager, get_reward_fn, register_reward


@register_reward("test_mgr_index")
def _index_reward(images, prompts, offset=0.0, **_):
    return np.arange(len(prompts), dtype=np.float64) + offset


@register_reward("test_mgr_dict")
def _dict_reward(images, prompts, **_):
    n = len(prompts)
    return {"score": np.full(n, 0.5), "strict": np.ones(n)}


@register_reward("test_mgr_raises")
def _raising_reward(images, prompts, **_):
    raise RuntimeError("scorer offline")


@register_reward("test_mgr_nan")
def _nan_reward(images, prompts, **_):
    out = np.ones(len(prompts))
    out[1] = np.nan
    return out


@register_reward("test_mgr_bad_shape")
def _bad_shape_reward(images, prompts, **_):
    return np.ones((len(prompts), 2))


@register_reward("test_mgr_bad_extra")
def _bad_extra_reward(images, prompts, **_):
    return {"score": np.ones(len(prompts)), "note": "hello"}


@register_reward("test_mgr_mutates")
def _mutating_reward(images, prompts, **_):
    images[...] = 0
    return np.ones(len(prompts))


def cfg(**kw):
    base = dict(num_workers=1, custom_reward_function=SimpleNamespace(path=None, name=None),
                reward_functions=None, aggregation="weighted_sum", reward_kwargs={})
    base.update(kw)
    return SimpleNamespace(**base)


def batch(n=4):
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8), [f"p{i}" for i in range(n)]


def test_weighted_sum_equals_direct_computation():
    images, prompts = batch()
    mgr = RewardManager.from_config(cfg(
        reward_functions={
            "bright": {"path": None, "name": "brightness", "weight": 2.0, "kwargs": {}},
            "idx": {"name": "test_mgr_index", "weight": -0.5, "kwargs": {"offset": 1.0}},
            "test_mgr_dict": {"weight": 1.0},
        },
    ))
    res = mgr(images, prompts)
    bright = get_reward_fn("brightness")(images, prompts)
    expected = 2.0 * bright - 0.5 * (np.arange(4) + 1.0) + 0.5
    np.testing.assert_allclose(res.scores, expected, rtol=1e-6)
    assert res.scores.dtype == np.float32 and res.failed.dtype == bool
    assert not res.failed.any() and res.reasons == [None] * 4
    np.testing.assert_allclose(res.extra["reward/bright"], bright)
    np.testing.assert_allclose(res.extra["reward/idx"], np.arange(4) + 1.0)
    np.testing.assert_allclose(res.extra["test_mgr_dict/strict"], 1.0)
    assert all(v.dtype == np.float32 and v.shape == (4,) for v in res.extra.values())


def test_reward_kwargs_reach_functions_and_entry_kwargs_win():
    images, prompts = batch()
    mgr = RewardManager.from_config(cfg(
        reward_functions={"a": {"name": "test_mgr_index", "kwargs": {"offset": 10.0}}},
        reward_kwargs={"offset": 100.0},
    ))
    np.testing.assert_allclose(mgr(images, prompts).scores, np.arange(4) + 10.0)
    mgr = RewardManager.from_config(cfg(reward_fn_name="test_mgr_index", reward_kwargs={"offset": 100.0}))
    np.testing.assert_allclose(mgr(images, prompts).scores, np.arange(4) + 100.0)


def test_raising_function_fails_whole_batch_with_reason():
    images, prompts = batch()
    mgr = RewardManager.from_config(cfg(reward_functions={
        "ok": {"name": "brightness"}, "bad": {"name": "test_mgr_raises"}}))
    res = mgr(images, prompts)
    assert res.failed.all() and (res.scores == 0).all()
    assert all("RuntimeError: scorer offline" in r and "`bad`" in r for r in res.reasons)
    assert np.isnan(res.extra["reward/bad"]).all()


def test_nan_marks_one_sample_failed():
    images, prompts = batch()
    res = RewardManager.from_config(cfg(reward_fn_name="test_mgr_nan"))(images, prompts)
    assert res.failed.tolist() == [False, True, False, False]
    assert res.scores.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert res.reasons[0] is None and "nan" in res.reasons[1] and "test_mgr_nan" in res.reasons[1]


@pytest.mark.parametrize("name, fragment", [
    ("test_mgr_bad_shape", "shape (4, 2)"),
    ("test_mgr_bad_extra", "extra 'note' as a str"),
])
def test_bad_return_fails_batch_with_reason(name, fragment):
    images, prompts = batch()
    res = RewardManager.from_config(cfg(reward_fn_name=name))(images, prompts)
    assert res.failed.all() and (res.scores == 0).all()
    assert all(name in r and fragment in r for r in res.reasons), res.reasons


def test_wrong_types_returned():
    images, prompts = batch()
    for out, fragment in [("abc", "a str"), (None, "a NoneType"), ({"x": 1}, "without 'score'"),
                          (np.array(["a"] * 4), "dtype <U1"), (3.0, "shape ()")]:
        mgr = RewardManager([_component(lambda i, p, out=out: out)])
        res = mgr(images, prompts)
        assert res.failed.all() and fragment in res.reasons[0], (out, res.reasons[0])


def _component(fn):
    from omnirl_async.rewards import RewardComponent
    return RewardComponent("inline", 1.0, {}, fn=fn)


def test_images_are_read_only_to_rewards():
    images, prompts = batch()
    before = images.copy()
    res = RewardManager.from_config(cfg(reward_fn_name="test_mgr_mutates"))(images, prompts)
    assert res.failed.all() and "read-only" in res.reasons[0]
    np.testing.assert_array_equal(images, before)


def test_caller_errors_raise():
    mgr = RewardManager.from_config(cfg(reward_fn_name="brightness"))
    with pytest.raises(ValueError, match="uint8"):
        mgr(np.zeros((2, 4, 4, 3), np.float32), ["a", "b"])
    with pytest.raises(ValueError, match="`prompts` has 1"):
        mgr(np.zeros((2, 4, 4, 3), np.uint8), ["a"])


def test_custom_function_from_file_and_pickle(tmp_path):
    path = tmp_path / "user_reward.py"
    path.write_text(textwrap.dedent("""
        import numpy as np
        def reward(images, prompts, bonus=0.0):
            return images.reshape(len(images), -1).mean(1) * 0 + len(prompts) + bonus
    """))
    mgr = RewardManager.from_config(cfg(
        custom_reward_function={"path": str(path), "name": "reward"}, reward_kwargs={"bonus": 1.0}))
    images, prompts = batch(3)
    np.testing.assert_allclose(mgr(images, prompts).scores, [4.0] * 3)
    clone = pickle.loads(pickle.dumps(mgr))  # re-loads the file by path
    np.testing.assert_allclose(clone(images, prompts).scores, [4.0] * 3)
    assert clone.names == ["reward"]


def test_config_errors():
    with pytest.raises(ValueError, match="mutually exclusive"):
        RewardManager.from_config(cfg(custom_reward_function={"path": "x.py", "name": "f"},
                                      reward_functions={"b": {"name": "brightness"}}))
    with pytest.raises(ValueError, match="needs both"):
        RewardManager.from_config(cfg(custom_reward_function={"path": None, "name": "f"}))
    with pytest.raises(ValueError, match="aggregation"):
        RewardManager.from_config(cfg(aggregation="max"))
    with pytest.raises(ValueError, match="unknown keys"):
        RewardManager.from_config(cfg(reward_functions={"b": {"name": "brightness", "wieght": 2}}))
    with pytest.raises(KeyError, match="no_such"):
        RewardManager.from_config(cfg(reward_functions={"b": {"name": "no_such"}}))


def test_default_is_tiny_geneval_and_pickles():
    mgr = RewardManager.from_config(cfg())
    assert mgr.names == ["tiny_geneval"]
    mgr = pickle.loads(pickle.dumps(mgr))
    rng = np.random.default_rng(0)
    prompts = ["two red circles", "a blue square to the left of a yellow triangle"]
    images, _ = render_batch(prompts, rng)
    res = mgr(images, prompts)
    assert res.scores.tolist() == [1.0, 1.0]
    assert res.extra["tiny_geneval/strict"].tolist() == [1.0, 1.0]
    assert mgr(images, ["purple elephants", "a red circle"]).failed.all()
    # a dict-like config (e.g. OmegaConf / plain dict) works too
    assert RewardManager.from_config({"reward_functions": {"brightness": {}}}).names == ["brightness"]


def test_typed_dataclass_config():
    import dataclasses

    @dataclasses.dataclass
    class Entry:
        path: str | None = None
        name: str | None = None
        weight: float = 1.0
        kwargs: dict = dataclasses.field(default_factory=dict)

    @dataclasses.dataclass
    class Custom:
        path: str | None = None
        name: str | None = None

    @dataclasses.dataclass
    class RewardConfig:
        num_workers: int = 2
        custom_reward_function: Custom = dataclasses.field(default_factory=Custom)
        reward_functions: dict = dataclasses.field(default_factory=dict)
        aggregation: str = "weighted_sum"
        reward_kwargs: dict = dataclasses.field(default_factory=dict)

    mgr = RewardManager.from_config(RewardConfig(reward_functions={
        "b": Entry(name="brightness", weight=3.0), "i": Entry(name="test_mgr_index", kwargs={"offset": 1.0})}))
    images, prompts = batch()
    expected = 3.0 * get_reward_fn("brightness")(images, prompts) + np.arange(4) + 1.0
    np.testing.assert_allclose(mgr(images, prompts).scores, expected, rtol=1e-6)
    assert mgr.num_workers == 2
    assert RewardManager.from_config(RewardConfig()).names == ["tiny_geneval"]
