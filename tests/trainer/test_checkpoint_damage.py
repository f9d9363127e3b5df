"""Damaged, incomplete and interrupted checkpoints are detected, named, and skipped (real files, no mocks)."""

from __future__ import annotations

import hashlib
import json
import random
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from omnirl_async.trainer.checkpoint import (CheckpointError, CheckpointManager, load_state, save_state,
                                             verify_checkpoint, verify_or_raise)


def _write_checkpoint(mgr: CheckpointManager, step: int) -> Path:
    gen = torch.Generator().manual_seed(step)
    tmp = mgr.begin(step)
    (tmp / "lora").mkdir()
    save_file({"lora_A": torch.randn(8, 4, generator=gen)}, str(tmp / "lora" / "adapter_model.safetensors"))
    (tmp / "lora" / "adapter_config.json").write_text(json.dumps({"r": 4}))
    save_state({"weights": torch.randn(32, 32, generator=gen), "exp_avg": torch.randn(32, 32, generator=gen),
                "rng": torch.get_rng_state()}, tmp, "learner")
    save_state({"global_step": step, "version": step}, tmp, "trainer")
    return mgr.commit(tmp, step)


@pytest.fixture
def two(tmp_path):
    mgr = CheckpointManager(tmp_path)
    return mgr, _write_checkpoint(mgr, 1), _write_checkpoint(mgr, 2)


def _header_len(path: Path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


def _overwrite(path: Path, offset: int, n: int, seed: int) -> None:
    data = bytearray(path.read_bytes())
    new = random.Random(seed).randbytes(n)
    assert new != bytes(data[offset:offset + n])
    data[offset:offset + n] = new
    path.write_bytes(bytes(data))


def truncate(folder):
    path = folder / "learner.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return "learner.safetensors", "truncated"


def garble_header(folder):
    path = folder / "learner.safetensors"
    _overwrite(path, 8, min(32, _header_len(path)), seed=1)
    return "learner.safetensors", "SHA-256 mismatch"


def garble_tensor_data(folder):
    path = folder / "learner.safetensors"
    _overwrite(path, 8 + _header_len(path) + 100, 64, seed=2)
    return "learner.safetensors", "SHA-256 mismatch"


def delete_file(folder):
    (folder / "lora" / "adapter_model.safetensors").unlink()
    return "lora/adapter_model.safetensors", "missing"


def delete_manifest(folder):
    (folder / "manifest.json").unlink()
    return "manifest.json", "no manifest.json (written by an older version or interrupted)"


def delete_complete(folder):
    (folder / "COMPLETE").unlink()
    return "COMPLETE", "missing"


DAMAGES = [truncate, garble_header, garble_tensor_data, delete_file, delete_manifest, delete_complete]


def test_intact_checkpoints_verify(two):
    mgr, first, second = two
    assert verify_checkpoint(first) == [] and verify_checkpoint(second) == []
    heard = []
    assert mgr.latest_verified(heard.append) == second and heard == []
    assert load_state(second, "trainer")["global_step"] == 2


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__)
def test_damaged_newest_is_named_and_previous_used(two, damage):
    mgr, first, second = two
    name, what = damage(second)
    problems = verify_checkpoint(second)
    assert any(name in p and what in p for p in problems), problems
    heard = []
    assert mgr.latest_verified(heard.append) == first
    assert len(heard) == 1 and str(second) in heard[0] and name in heard[0] and "previous" in heard[0]
    with pytest.raises(CheckpointError, match="global_step_2") as err:
        verify_or_raise(second)
    assert name in str(err.value) and "resume_mode=disable" in str(err.value)
    assert verify_or_raise(first) == first


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__)
def test_all_damaged_raises_listing_each(two, damage):
    mgr, first, second = two
    damage(first)
    name, _ = damage(second)
    heard = []
    with pytest.raises(CheckpointError) as err:
        mgr.latest_verified(heard.append)
    msg = str(err.value)
    assert str(first) in msg and str(second) in msg and name in msg
    assert "trainer.resume_mode=disable" in msg
    assert len(heard) == 2


def test_no_checkpoint_folder_means_none(tmp_path):
    assert CheckpointManager(tmp_path / "absent").latest_verified() is None
    assert CheckpointManager(tmp_path).latest_verified() is None


def test_manifest_hashes_match_hashlib(two):
    _, _, second = two
    raw = (second / "manifest.json").read_bytes()
    manifest = json.loads(raw)
    assert manifest["format_version"] == 1 and manifest["step"] == 2
    on_disk = sorted(p.relative_to(second).as_posix() for p in second.rglob("*") if p.is_file())
    listed = [e["path"] for e in manifest["files"]]
    assert listed == [p for p in on_disk if p not in ("manifest.json", "COMPLETE")]
    assert "lora/adapter_model.safetensors" in listed and "learner.msgpack" in listed
    for entry in manifest["files"]:
        data = (second / entry["path"]).read_bytes()
        assert entry["size"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert (second / "COMPLETE").read_text().split() == ["2", hashlib.sha256(raw).hexdigest()]


def test_edited_manifest_is_named(two):
    mgr, first, second = two
    path = second / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"][0]["sha256"] = "0" * 64
    path.write_text(json.dumps(manifest))
    assert any("manifest.json" in p and "COMPLETE" in p for p in verify_checkpoint(second))
    assert mgr.latest_verified() == first


def test_unparseable_manifest_is_named(two):
    mgr, first, second = two
    (second / "manifest.json").write_bytes(b"{not json")
    (second / "COMPLETE").write_text("2\n")  # an older COMPLETE without the manifest's hash
    assert any("manifest.json cannot be parsed" in p for p in verify_checkpoint(second))
    assert mgr.latest_verified() == first


def test_killed_mid_write_tmp_folder_is_ignored(two):
    mgr, _, second = two
    tmp = mgr.begin(3)
    save_state({"global_step": 3}, tmp, "trainer")
    (tmp / "learner.safetensors").write_bytes(b"\x00" * 10)  # the process died here
    heard = []
    assert mgr.latest_verified(heard.append) == second and heard == []
    third = _write_checkpoint(mgr, 4)
    assert not list(mgr.root.glob(".tmp_global_step_*"))  # the next commit cleans it up
    assert mgr.latest_verified() == third


def test_missing_folder_for_resume_path(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        verify_or_raise(tmp_path / "global_step_7")


def _truncate_msgpack(folder):
    path = folder / "learner.msgpack"
    path.write_bytes(path.read_bytes()[:-7])
    return "learner.msgpack"


def _garbage_safetensors(folder):
    path = folder / "learner.safetensors"
    _overwrite(path, 8, min(32, _header_len(path)), seed=3)
    return "learner.safetensors"


def _truncate_safetensors(folder):
    path = folder / "learner.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    return "learner.safetensors"


def _missing_safetensors(folder):
    (folder / "learner.safetensors").unlink()
    return "learner.safetensors"


@pytest.mark.parametrize("damage", [_truncate_msgpack, _garbage_safetensors, _truncate_safetensors,
                                    _missing_safetensors], ids=lambda f: f.__name__.strip("_"))
def test_load_state_names_the_unreadable_file(two, damage):
    _, _, second = two
    name = damage(second)
    with pytest.raises(CheckpointError) as err:
        load_state(second, "learner")
    assert str(second / name) in str(err.value)
