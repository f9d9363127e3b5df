"""``omnirl-async buffer inspect DIR``: tables, versions, staleness and offline pairs of a run or checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

from omnirl_async.buffer import LocalReplayBuffer
from omnirl_async.buffer.spec import BufferSpec, StalenessSpec
from omnirl_async.cli import main
from omnirl_async.protocol import SampleMeta, SampleStatus, SampleTags
from omnirl_async.trainer.checkpoint import CheckpointManager
from tests.data.offline_fixtures import synthetic_store


def _group(gid: str, version: int, n: int = 3, failed: int | None = None):
    metas = [SampleMeta(key=f"{gid}/{i}", status=SampleStatus.FAILURE if i == failed else SampleStatus.SUCCESS,
                        reason="boom" if i == failed else None, reward=None if i == failed else float(i),
                        tags=SampleTags(uid=f"{gid}/{i}", group_uid=gid, sample_index=i, group_size=n,
                                        policy_version=version)) for i in range(n)]
    return metas, {"x0": np.zeros((n, 2, 4, 4), np.float32), "rewards": np.zeros(n, np.float32)}


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    synthetic_store(run, 7)
    buf = LocalReplayBuffer(BufferSpec(staleness=StalenessSpec(threshold=3), offline_mix_ratio=0.25), seed=0)
    buf.load_offline(str(run))
    for gid, v in (("a", 0), ("b", 1), ("c", 1)):
        buf.put(*_group(gid, v))
    buf.put(*_group("d", 2, failed=1))
    batch = buf.sample(3, learner_version=2, source="online")  # group a, lag 2
    buf.sample_offline(len(batch), learner_version=2)          # one pair
    mgr = CheckpointManager(run)
    tmp = mgr.begin(5)
    buf.snapshot(str(tmp / "buffer"))
    mgr.commit(tmp, 5)
    return run


def test_inspect_a_run_dir_reports_tables_versions_staleness_and_offline_rows(run_dir, capsys):
    assert main(["buffer", "inspect", str(run_dir), "--rows", "3"]) == 0
    out = capsys.readouterr().out
    assert f"buffer snapshot {run_dir / 'global_step_5' / 'buffer'}" in out and "learner version 2" in out
    lines = out.splitlines()
    online = next(line.split() for line in lines if line.strip().startswith("online "))
    assert online[:4] == ["online", "3", "8", "1"]        # groups b, c, d: 3 + 3 + 2 samples, 1 failed member
    offline = next(line for line in lines if line.strip().startswith("offline "))
    assert offline.split()[:4] == ["offline", "7", "14", "0"] and "(in the offline store)" in offline
    assert "online rows by policy version: v1: 6, v2: 2" in out
    assert "online staleness at learner version 2: lag 0: 2, lag 1: 6" in out
    assert "drawn so far: 3 online samples (lag 2: 3), 2 offline samples; offline share 0.400" in out
    assert "7 pairs" in out and "by source: judge: 3, render: 4" in out
    assert "p0000" in out and "p0002" in out and "p0003" not in out and "... 4 more" in out
    # the checkpoint folder itself gives the same report
    assert main(["buffer", "inspect", str(run_dir / "global_step_5")]) == 0
    assert "online rows by policy version: v1: 6, v2: 2" in capsys.readouterr().out


def test_inspect_an_offline_store_alone_and_nothing(tmp_path, capsys):
    synthetic_store(tmp_path / "fresh", 2)
    assert main(["buffer", "inspect", str(tmp_path / "fresh")]) == 0
    out = capsys.readouterr().out
    assert "no buffer snapshot" in out and "2 pairs" in out
    (tmp_path / "empty").mkdir()
    assert main(["buffer", "inspect", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "nothing to inspect" in err and "global_step_N" in err
    assert main(["buffer", "inspect", str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err
