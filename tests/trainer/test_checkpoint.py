"""Checkpoint files: safetensors + msgpack, atomic, bit-exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnirl_async.trainer.checkpoint import CheckpointError, CheckpointManager, load_state, save_state


def test_nested_state_round_trips_bit_exactly(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"optimizer": opt.state_dict(), "rng": torch.get_rng_state(), "arr": np.arange(5, dtype=np.int16),
             "step": 7, "name": "x", "none": None, "tup": (1, 2.5)}
    save_state(state, tmp_path, "s")
    back = load_state(tmp_path, "s")
    assert back["step"] == 7 and back["name"] == "x" and back["none"] is None and back["tup"] == (1, 2.5)
    assert torch.equal(back["rng"], state["rng"])
    np.testing.assert_array_equal(back["arr"], state["arr"])
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt2.load_state_dict(back["optimizer"])
    for k, v in opt.state_dict()["state"][0].items():
        assert torch.equal(opt2.state_dict()["state"][0][k], v)
    assert opt2.param_groups[0]["betas"] == (0.8, 0.95)


def test_no_pickle_on_disk(tmp_path):
    save_state({"w": torch.ones(2)}, tmp_path, "s")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.msgpack", "s.safetensors"]
    assert b"\x80\x04" not in (tmp_path / "s.msgpack").read_bytes()[:2]


def test_bad_format_version_is_refused(tmp_path):
    import msgspec

    save_state({"w": torch.ones(2)}, tmp_path, "s")
    (tmp_path / "s.msgpack").write_bytes(msgspec.msgpack.encode({"format": 99, "state": {}}))
    with pytest.raises(CheckpointError, match="s.msgpack: unsupported checkpoint format 99"):
        load_state(tmp_path, "s")
    assert issubclass(CheckpointError, ValueError)


def test_manager_commits_atomically_and_prunes(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=2)
    for step in (1, 2, 3):
        tmp = mgr.begin(step)
        save_state({"step": step}, tmp, "trainer")
        mgr.commit(tmp, step)
    assert mgr.latest().name == "global_step_3"
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_2", "global_step_3"]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3"
    # an interrupted write (no COMPLETE marker) is never picked up
    (tmp_path / "global_step_9").mkdir()
    assert mgr.latest().name == "global_step_3"


def _commit(mgr, step):
    tmp = mgr.begin(step)
    save_state({"step": step, "w": torch.full((64,), float(step))}, tmp, "trainer")
    return mgr.commit(tmp, step)


def test_prune_never_removes_the_checkpoint_being_written(tmp_path):
    # resumed from an older step while a newer folder exists: the new step stays, the older one goes
    mgr = CheckpointManager(tmp_path, max_to_keep=2)
    for step in (9, 5, 6):
        _commit(mgr, step)
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_6", "global_step_9"]
    mgr.max_to_keep = 1
    _commit(mgr, 7)
    assert [p.name for p in tmp_path.glob("global_step_*")] == ["global_step_7"]


def test_prune_keeps_damaged_folders_and_does_not_count_them(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=2)
    _commit(mgr, 1)
    damaged = _commit(mgr, 2)
    path = damaged / "trainer.safetensors"
    path.write_bytes(path.read_bytes()[:-16])
    _commit(mgr, 3)
    # 3 and the newest verified older one (1) are kept; the damaged 2 is left for inspection
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_1", "global_step_2",
                                                                       "global_step_3"]
    _commit(mgr, 4)
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_2", "global_step_3",
                                                                       "global_step_4"]


def test_recommitting_a_step_replaces_it(tmp_path):
    mgr = CheckpointManager(tmp_path)
    _commit(mgr, 3)
    tmp = mgr.begin(3)
    save_state({"step": 30}, tmp, "trainer")
    final = mgr.commit(tmp, 3)
    assert load_state(final, "trainer")["step"] == 30
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert mgr.latest_verified() == final


def test_set_aside_moves_an_earlier_runs_checkpoints_and_log_and_deletes_nothing(tmp_path):
    mgr = CheckpointManager(tmp_path)
    for step in (40, 87):
        _commit(mgr, step)
    (tmp_path / "trained_groups.jsonl").write_text('{"step": 87}\n')
    (tmp_path / "resolved_config.yaml").write_text("kept: in place\n")
    dest = mgr.set_aside(extra=("trained_groups.jsonl", "not_there.txt"))
    assert dest.parent == tmp_path / "superseded"
    assert sorted(p.name for p in dest.iterdir()) == [
        "global_step_40", "global_step_87", "latest_checkpointed_iteration.txt", "trained_groups.jsonl"]
    assert mgr.latest() is None and mgr.step_folders() == []  # nothing of the earlier run is found any more
    assert (tmp_path / "resolved_config.yaml").is_file()
    assert CheckpointManager(dest).latest().name == "global_step_87"  # still a whole, verifiable checkpoint
    assert mgr.set_aside() is None  # nothing left to move
    _commit(mgr, 3)  # the fresh run's own
    assert mgr.latest().name == "global_step_3"
    _commit(mgr, 4)
    again = mgr.set_aside()
    assert again != dest and sorted(p.name for p in again.iterdir()) == [
        "global_step_3", "global_step_4", "latest_checkpointed_iteration.txt"]
