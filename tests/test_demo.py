"""The demo's summary reads only the reward curve of its own run."""

import os
import time

from torch.utils.tensorboard import SummaryWriter

from omnirl_async.demo import _reward_curve


def _write_run(folder, values):
    before = set(os.listdir(folder))
    w = SummaryWriter(log_dir=str(folder), filename_suffix=f".run{len(before)}")
    for step, v in enumerate(values, start=1):
        w.add_scalar("critic/rewards/mean", v, step)
        w.add_scalar("timing_s/step", 1.0, step)
    w.close()
    (new,) = set(os.listdir(folder)) - before
    return os.path.join(folder, new)


def test_reward_curve_skips_event_files_of_earlier_runs(tmp_path):
    old = _write_run(tmp_path, [0.1, 0.2, 0.3])
    os.utime(old, (time.time() - 3600, time.time() - 3600))  # a demo run an hour ago, same folder
    started = time.time() - 1
    _write_run(tmp_path, [0.7, 0.9])

    assert _reward_curve(str(tmp_path), since=started) == [(1, 0.699999988079071), (2, 0.8999999761581421)]
    everything = _reward_curve(str(tmp_path))
    assert len(everything) == 5 and sorted(v for _, v in everything)[0] < 0.11


def test_reward_curve_of_a_missing_or_empty_folder_is_empty(tmp_path):
    assert _reward_curve(str(tmp_path / "absent")) == []
    assert _reward_curve(str(tmp_path)) == []
