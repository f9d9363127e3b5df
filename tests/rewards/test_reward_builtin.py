"""Built-in rewards: JPEG size and brightness."""

import numpy as np

from omnirl_async.rewards import get_reward_fn


def _flat_and_noise(size=64):
    rng = np.random.default_rng(0)
    flat = np.full((1, size, size, 3), 128, np.uint8)
    noise = rng.integers(0, 256, (1, size, size, 3), dtype=np.uint8)
    return np.concatenate([flat, noise])


def test_jpeg_rewards_are_monotone_in_detail():
    images = _flat_and_noise()
    inc = get_reward_fn("jpeg_incompressibility")(images, ["", ""])
    comp = get_reward_fn("jpeg_compressibility")(images, ["", ""])
    assert inc.shape == (2,) and inc.dtype == np.float32
    assert inc[1] > inc[0] > 0  # noise is bigger
    assert comp[0] > comp[1]  # flat compresses better
    np.testing.assert_array_equal(comp, -inc)
    # a 64×64 noise image at quality 95 is several kB
    assert 3.0 < inc[1] < 20.0


def test_brightness_exact():
    images = np.zeros((3, 4, 4, 3), np.uint8)
    images[1] = 255
    images[2, :2] = 255  # half the pixels
    images[2, 2:, :, 0] = 51  # plus one channel of the other half at 0.2
    out = get_reward_fn("brightness")(images, ["", "", ""])
    np.testing.assert_allclose(out, [0.0, 1.0, 0.5 + 0.5 * 0.2 / 3], rtol=1e-6)
