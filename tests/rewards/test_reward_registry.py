"""Registry look-ups and loading user reward functions from files."""

import textwrap

import numpy as np
import pytest

from omnirl_async.rewards import get_reward_fn, load_custom_reward_fn, register_reward, registered_rewards


def test_builtins_are_registered():
    names = registered_rewards()
    for name in ("tiny_geneval", "jpeg_compressibility", "jpeg_incompressibility", "brightness"):
        assert name in names


def test_unknown_name_lists_registered():
    with pytest.raises(KeyError) as e:
        get_reward_fn("no_such_reward")
    msg = str(e.value)
    assert "no_such_reward" in msg and "brightness" in msg and "tiny_geneval" in msg


def test_register_and_conflict():
    @register_reward("test_const_reward")
    def const(images, prompts, **kw):
        return np.ones(len(prompts))

    assert get_reward_fn("test_const_reward") is const

    with pytest.raises(ValueError, match="already registered"):

        @register_reward("test_const_reward")
        def other(images, prompts, **kw):
            return np.zeros(len(prompts))

    with pytest.raises(ValueError, match="non-empty"):
        register_reward("")


def _write(tmp_path, body, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_load_custom_function(tmp_path):
    path = _write(
        tmp_path,
        """
        import numpy as np
        OFFSET = 3.0
        def score(images, prompts, scale=1.0):
            return scale * (np.arange(len(prompts)) + OFFSET)
        """,
    )
    fn = load_custom_reward_fn(str(path), "score")
    np.testing.assert_allclose(fn(None, ["a", "b"], scale=2.0), [6.0, 8.0])
    # Two files with the same basename do not collide.
    sub = tmp_path / "sub"
    sub.mkdir()
    path2 = _write(sub, "def score(images, prompts):\n    return [7.0] * len(prompts)\n")
    assert load_custom_reward_fn(path2, "score")(None, ["a"]) == [7.0]
    np.testing.assert_allclose(load_custom_reward_fn(path, "score")(None, ["a"]), [3.0])


def test_custom_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist") as e:
        load_custom_reward_fn(tmp_path / "nope.py", "score")
    assert "reward.custom_reward_function.path" in str(e.value)


def test_custom_missing_name_lists_callables(tmp_path):
    path = _write(tmp_path, "def alpha(images, prompts):\n    return [0.0]\n")
    with pytest.raises(ValueError, match="'beta' is not defined") as e:
        load_custom_reward_fn(path, "beta")
    assert "alpha" in str(e.value)


def test_custom_not_callable(tmp_path):
    path = _write(tmp_path, "score = 3\n")
    with pytest.raises(ValueError, match="not a function"):
        load_custom_reward_fn(path, "score")


def test_custom_file_that_raises(tmp_path):
    path = _write(tmp_path, "raise RuntimeError('boom at import')\n")
    with pytest.raises(ValueError, match="RuntimeError: boom at import"):
        load_custom_reward_fn(path, "score")


def test_custom_not_py(tmp_path):
    path = tmp_path / "reward.txt"
    path.write_text("x")
    with pytest.raises(ValueError, match="not a .py file"):
        load_custom_reward_fn(path, "score")
