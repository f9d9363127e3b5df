"""``omnirl-async ingest``: preference pairs checked, VAE-encoded and stored in the run's offline store."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from omnirl_async.buffer.offline_store import INDEX_FILE, NewPair, OfflineStore
from omnirl_async.data.preference_checks import PreferenceDataError
from omnirl_async.preflight import InputError
from omnirl_async.trainer.ingest import ingest_dataset, ingest_offline_files, store_signature

from .conftest import LATENT_SHAPE, PLANTED_BAD, PLANTED_GOOD, SIZE


@pytest.fixture(scope="module")
def config():
    from omnirl_async.config import load_config

    return load_config(["trainer.device=cpu"])  # the embedded shapes model, 32x32


@pytest.fixture(scope="module")
def policy(config):
    from omnirl_async.trainer.ingest import _load_policy

    return _load_policy(config)


def _ingest(path, run_dir, config, policy, **kw):
    return ingest_dataset(path, run_dir, config, policy=policy, printer=lambda line: None, progress=False, **kw)


def test_bad_rows_refuse_the_dataset_and_nothing_is_ingested(planted, tmp_path, config, policy):
    path, _ = planted
    run = tmp_path / "run"
    with pytest.raises(PreferenceDataError) as info:
        _ingest(path, run, config, policy)
    msg = str(info.value)
    for row, field in PLANTED_BAD.items():
        assert f"(row {row})" in msg
        if field != "<row>":
            assert any(f"(row {row}): `{field}`" in line for line in info.value.problems), (row, field)
    assert "nothing was ingested" in msg
    assert len(OfflineStore(run)) == 0 and not (run / "offline" / INDEX_FILE).exists()
    assert not list((run / "offline").glob("shard-*"))


def test_skip_invalid_ingests_exactly_the_good_rows(planted, tmp_path, config, policy):
    path, _ = planted
    run = tmp_path / "run"
    report = tmp_path / "skipped.jsonl"
    s = _ingest(path, run, config, policy, skip_invalid=True, report=report)
    assert (s.rows, s.added, s.skipped, s.already_present) == (11, 4, 7, 0)
    assert s.report == str(report) and s.bytes_written > 0 and s.store_rows == 4
    store = OfflineStore(run)
    assert [r.id for r in store.rows()] == PLANTED_GOOD
    assert store.rows()[0].metadata == {"k": 1} and store.rows()[0].chosen_score == 1.0
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    assert {r["row"]: r["problems"][0]["field"] for r in lines} == PLANTED_BAD
    assert "rows:            11" in s.text() and "skipped:         7" in s.text()


def test_ingest_is_idempotent_and_refuses_changed_content(planted, tmp_path, config, policy):
    path, _ = planted
    run = tmp_path / "run"
    _ingest(path, run, config, policy, skip_invalid=True)
    before = OfflineStore(run).content_hash()
    again = _ingest(path, run, config, policy, skip_invalid=True)
    assert (again.added, again.already_present, again.bytes_written) == (0, 4, 0)
    assert OfflineStore(run).content_hash() == before
    # the same id with other content: a bad row naming the id
    lines = path.read_text().splitlines()
    row = json.loads(lines[0])
    (path.parent / "changed.jsonl").write_text(json.dumps({**row, "chosen_score": 0.25}) + "\n")
    with pytest.raises(PreferenceDataError, match=r"`id` = 'g1': is already in the offline store .* other content"):
        _ingest(path.parent / "changed.jsonl", run, config, policy)
    assert OfflineStore(run).content_hash() == before


def test_stored_pairs_match_the_sources(planted, tmp_path, config, policy):
    from omnirl_async.models.latent_codec import encode_images

    path, extra = planted
    run = tmp_path / "run"
    _ingest(path, run, config, policy, skip_invalid=True)
    store = OfflineStore(run)
    ids = [r.id for r in store.rows()]
    f = store.pairs([ids.index("g3"), ids.index("g1")])
    assert f["x0"].shape == (4, *LATENT_SHAPE) and f["x0"].dtype == np.float32
    # latents go through the store bit-exactly, winner first
    assert f["x0"][0].tobytes() == extra["latents"]["g3.chosen"].tobytes()
    assert f["x0"][1].tobytes() == extra["latents"]["g3.rejected"].tobytes()
    # images are stored as their VAE latents, the layout rollouts store as x0
    z = encode_images(policy, np.stack([extra["images"]["g1a"], extra["images"]["g1b"]])).numpy()
    np.testing.assert_allclose(f["x0"][2:], z, atol=1e-5)
    # prompt embeddings as the rollout workers encode them, the same for both rows of a pair
    emb = policy.encode_prompt(["a red circle", "two red circles"], max_sequence_length=1).to_numpy()
    for name, arr in emb.items():
        np.testing.assert_allclose(f[f"emb.{name}"], np.repeat(arr, 2, axis=0), atol=1e-6)
    np.testing.assert_array_equal(f["scores"], np.array([np.nan, np.nan, 1.0, 0.5], np.float32))


def test_vae_encode_decode_round_trip(policy):
    from omnirl_async.data.shapes import render_batch
    from omnirl_async.models.latent_codec import encode_images, latent_shape
    from omnirl_async.rewards.tiny_geneval import tiny_geneval

    prompts = ["two red circles", "a blue square to the left of a yellow triangle", "three white triangles"]
    images, _ = render_batch(prompts, np.random.default_rng(3), size=SIZE)
    z = encode_images(policy, images, batch_size=2)
    assert tuple(z.shape) == (3, *latent_shape(policy, SIZE, SIZE)) == (3, *LATENT_SHAPE)
    assert torch.equal(z, encode_images(policy, images, batch_size=2))  # deterministic (posterior mean)
    back = policy.decode(z, SIZE, SIZE)
    assert np.abs(back.astype(int) - images.astype(int)).mean() < 8
    assert (tiny_geneval(back, prompts)["strict"] == 1).all()


def test_flux_latents_are_packed():
    from omnirl_async.models.latent_codec import encode_images, folder_latent_shape, latent_shape
    from omnirl_async.models.policy import FlowMatchPolicy
    from omnirl_async.models.resolve import resolve_model_path

    folder = resolve_model_path("embedded:tiny-flux")
    flux = FlowMatchPolicy.from_pretrained(folder)
    z = encode_images(flux, np.zeros((2, SIZE, SIZE, 3), np.uint8))
    assert tuple(z.shape[1:]) == latent_shape(flux, SIZE, SIZE) == tuple(flux.prepare_latents(1, SIZE, SIZE).shape[1:])
    assert folder_latent_shape(folder, SIZE, SIZE) == ("flux", latent_shape(flux, SIZE, SIZE))
    assert flux.decode(z, SIZE, SIZE).shape == (2, SIZE, SIZE, 3)


def test_store_refuses_another_model_setup(planted, tmp_path, config, policy):
    from omnirl_async.config import load_config

    path, _ = planted
    run = tmp_path / "run"
    _ingest(path, run, config, policy, skip_invalid=True)
    other = load_config(["trainer.device=cpu", "actor_rollout_ref.rollout.pipeline.max_sequence_length=4"])
    with pytest.raises(InputError, match=r"another model set-up \(max_sequence_length: store 1, now 4\)"):
        _ingest(path, run, other, policy, skip_invalid=True)


def test_store_commits_atomically(tmp_path, config):
    sig = store_signature(config)
    store = OfflineStore(tmp_path / "run")
    emb = {"p": {"prompt_embeds": np.ones((17, 64), np.float32), "pooled_prompt_embeds": np.ones(64, np.float32)}}

    def pair(i, value):
        return NewPair(id=i, content_hash=f"h{i}", prompt="p", chosen=np.full(LATENT_SHAPE, value, np.float32),
                       rejected=np.zeros(LATENT_SHAPE, np.float32), chosen_ref="a", rejected_ref="b", dataset="d")

    res = store.append([pair("a", 1.0)], signature=sig, embeddings=emb)
    assert res.added == 1
    h = store.content_hash()
    # a shard left by a crash before its index was committed: not read, removed by the next append
    orphan = store.dir / "shard-00001-deadbeef.safetensors"
    orphan.write_bytes(b"partial")
    reopened = OfflineStore(tmp_path / "run")
    assert len(reopened) == 1 and reopened.content_hash() == h and reopened.verify() == []
    reopened.append([pair("b", 2.0)], signature=sig, embeddings={})
    assert not orphan.exists() and len(OfflineStore(tmp_path / "run")) == 2
    with pytest.raises(ValueError, match="id 'a' is already in the offline store"):
        reopened.append([dataclasses.replace(pair("a", 1.0), content_hash="other")], signature=sig, embeddings={})
    assert len(OfflineStore(tmp_path / "run")) == 2
    np.testing.assert_array_equal(reopened.pairs([1])["x0"][0], np.full(LATENT_SHAPE, 2.0, np.float32))
    shard = reopened.dir / reopened.index.shards[0].file
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    assert "contents changed" in reopened.verify()[0]


def test_an_append_waits_for_another_ingests_lock_within_its_limit_and_names_the_holder(tmp_path, config):
    """Another process holding the store's lock (an ingest stopped with Ctrl-Z): a bounded wait, a message with its
    pid, nothing written; once it lets go, the append goes through."""
    import subprocess
    import sys
    import time

    from omnirl_async.buffer.offline_store import LOCK_FILE

    sig = store_signature(config)
    store = OfflineStore(tmp_path / "run")
    emb = {"p": {"prompt_embeds": np.ones((17, 64), np.float32), "pooled_prompt_embeds": np.ones(64, np.float32)}}
    pair = NewPair(id="a", content_hash="ha", prompt="p", chosen=np.ones(LATENT_SHAPE, np.float32),
                   rejected=np.zeros(LATENT_SHAPE, np.float32), chosen_ref="a", rejected_ref="b", dataset="d")
    store.dir.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"f = open({str(store.dir / LOCK_FILE)!r}, 'a+b'); fcntl.flock(f.fileno(), fcntl.LOCK_EX)\n"
        "f.truncate(0); f.write(str(os.getpid()).encode()); f.flush(); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as err:
            store.append([pair], signature=sig, embeddings=emb, lock_timeout_s=0.5)
        assert 0.5 <= time.monotonic() - t0 < 5
        assert f"lock {store.dir / LOCK_FILE} is held by another process (pid {holder.pid})" in str(err.value)
        assert "nothing was written" in str(err.value) and len(OfflineStore(tmp_path / "run")) == 0
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert store.append([pair], signature=sig, embeddings=emb, lock_timeout_s=5).added == 1


def test_cli_exits_2_with_the_message_only(planted, tmp_path, capsys):
    from omnirl_async.cli import main

    path, _ = planted
    assert main(["ingest", str(path), "--run-dir", str(tmp_path / "run"), "--no-progress", "trainer.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"omnirl-async: dataset {path}: 7 of 11 rows cannot be ingested")
    assert "Traceback" not in err and "(row 6): not valid JSON" in err
    assert main(["ingest", str(tmp_path / "missing.jsonl"), "--run-dir", str(tmp_path / "run")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_offline_files_key(planted, tmp_path, config, policy, monkeypatch):
    from omnirl_async.config import ConfigError, load_config
    from omnirl_async.trainer import ingest

    monkeypatch.setattr(ingest, "_load_policy", lambda cfg: policy)

    with pytest.raises(ConfigError, match=r"`data.offline_files` = \['d.jsonl'\] is refused while "
                                          r"`buffer.offline_mix_ratio` = 0.*set `buffer.offline_mix_ratio` > 0"):
        load_config(["data.offline_files=[d.jsonl]"])
    load_config(["data.offline_files=[d.jsonl]", "actor_rollout_ref.model.algorithm=dpo",
                 "buffer.offline_mix_ratio=0.25"])  # read by the run: accepted
    path, _ = planted
    run = tmp_path / "run"
    cfg = dataclasses.replace(config, data=dataclasses.replace(config.data, offline_files=[str(path)]),
                              trainer=dataclasses.replace(config.trainer, default_local_dir=str(run)))
    with pytest.raises(PreferenceDataError, match="drop the dataset from `data.offline_files`"):
        ingest_offline_files(cfg, printer=lambda line: None)
    assert len(OfflineStore(run)) == 0
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(path.read_text().splitlines()[:2]) + "\n")
    (tmp_path / "images").symlink_to(path.parent / "images")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, offline_files=str(good)))
    [summary] = ingest_offline_files(cfg, printer=lambda line: None)
    assert summary.added == 2 and [r.id for r in OfflineStore(run).rows()] == ["g1", "g2"]
    assert ingest_offline_files(dataclasses.replace(cfg, data=config.data)) == []


def test_model_samples_dataset_ingests_its_latents_bit_exactly(make_dataset_script, tmp_path, policy, monkeypatch):
    from safetensors.numpy import load_file

    from omnirl_async.config import load_config
    from omnirl_async.trainer import ingest

    cfg = load_config(["trainer.device=cpu", "actor_rollout_ref.rollout.pipeline.num_inference_steps=3"])
    prompts = ["two red circles", "a blue square to the left of a yellow triangle", "three white triangles"]
    rows = make_dataset_script.model_sample_pairs(cfg, prompts, k=3, seed=0, latents=True, progress=False)
    assert rows and all(r["chosen_score"] > r["rejected_score"] for r in rows)
    assert all(r["chosen"].shape == LATENT_SHAPE and r["chosen"].dtype == np.float32 for r in rows)
    path = make_dataset_script.write_dataset(rows, str(tmp_path / "ds"), fmt="jsonl")
    monkeypatch.setattr(ingest, "_load_policy", lambda c: policy)
    s = ingest_dataset(path, tmp_path / "run", cfg, printer=lambda line: None, progress=False)
    assert s.added == len(rows)
    shard = load_file(str(tmp_path / "ds" / "latents" / "part-00000.safetensors"))
    x0 = OfflineStore(tmp_path / "run").pairs(range(len(rows)))["x0"]
    for i, r in enumerate(rows):
        assert x0[2 * i].tobytes() == shard[f"{r['id']}.chosen"].tobytes()
        assert x0[2 * i + 1].tobytes() == shard[f"{r['id']}.rejected"].tobytes()


def test_model_samples_of_an_earlier_runs_lora_are_that_models_samples(make_dataset_script, tmp_path):
    """`actor_rollout_ref.model.lora_adapter_path` (bench_offline_mix.py --pairs-lora): the pairs are ranked samples
    of the base model with that LoRA, not of the base model, and the rows say which LoRA made them."""
    import torch

    from omnirl_async.config import load_config
    from omnirl_async.models.setup import build_policy

    over = ["trainer.device=cpu", "actor_rollout_ref.rollout.pipeline.num_inference_steps=3"]
    cfg = load_config(over + ["actor_rollout_ref.model.lora_rank=4"])
    trained = build_policy(cfg.actor_rollout_ref.model, torch.device("cpu"))
    with torch.no_grad():
        for p in trained.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p, generator=torch.Generator().manual_seed(0)))
    trained.save_lora(tmp_path / "lora")
    prompts = ["two red circles", "three white triangles"]
    base = make_dataset_script.model_sample_pairs(load_config(over), prompts, k=3, latents=True, progress=False)
    with_lora = make_dataset_script.model_sample_pairs(
        load_config(over + [f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'lora'}"]), prompts, k=3,
        latents=True, progress=False)
    assert base and with_lora
    assert all("lora" not in r["metadata"] for r in base)
    assert all(r["metadata"]["lora"] == str(tmp_path / "lora") for r in with_lora)
    same_seed = {(r["metadata"]["chosen_seed"]): r["chosen"] for r in base}
    pairs = [(same_seed[r["metadata"]["chosen_seed"]], r["chosen"]) for r in with_lora
             if r["metadata"]["chosen_seed"] in same_seed]
    others = [r["chosen"] for r in with_lora]
    assert all(not np.array_equal(a, b) for a, b in pairs)  # the same seed, another model: another sample
    assert not any(np.array_equal(a, b) for a in others for b in same_seed.values())
