"""Tiny pipelines: real diffusers folders, deterministic, loadable offline."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import load_file

from omnirl_async.models import FlowMatchPolicy, build_tiny_pipeline, build_tiny_sd3, ensure_tiny_model
from omnirl_async.models.tiny import build_clip_tokenizer, build_t5_tokenizer

from .conftest import HEIGHT, WIDTH


def test_clip_tokenizer_has_a_real_vocabulary_and_round_trips(tmp_path):
    tok = build_clip_tokenizer()
    assert len(tok) == 514  # 256 byte symbols x (plain, </w>) + bos + eos
    ids = tok("a cat").input_ids
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert len(ids) == 2 + len("acat")  # one token per character
    assert tok("a dog").input_ids != ids
    tok.save_pretrained(tmp_path)
    back = type(tok).from_pretrained(tmp_path)
    assert len(back) == 514 and back("a cat").input_ids == ids


def test_t5_tokenizer_has_a_real_vocabulary_and_round_trips(tmp_path):
    tok = build_t5_tokenizer()
    assert len(tok) == 4 + 2 * 94
    ids = tok("a cat").input_ids
    assert ids[-1] == tok.eos_token_id == 1 and tok.unk_token_id not in ids
    assert len(set(ids)) == len(ids) == 5  # ▁a ▁c a t </s>
    tok.save_pretrained(tmp_path)
    back = type(tok).from_pretrained(tmp_path)
    assert len(back) == len(tok) and back("a cat").input_ids == ids


def test_same_seed_gives_identical_transformer_bytes(tmp_path):
    a = build_tiny_sd3(tmp_path / "a", seed=3)
    b = build_tiny_sd3(tmp_path / "b", seed=3)
    c = build_tiny_sd3(tmp_path / "c", seed=4)
    name = "transformer/diffusion_pytorch_model.safetensors"
    assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / name).read_bytes() != (c / name).read_bytes()


def test_build_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_pipeline("flux", seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_components_are_tiny(tiny_paths):
    sd3 = load_file(tiny_paths["sd3"] / "transformer/diffusion_pytorch_model.safetensors")
    n = sum(t.numel() for t in sd3.values())
    assert 20_000 < n < 200_000
    index = (tiny_paths["sd3"] / "model_index.json").read_text()
    assert '"StableDiffusion3Pipeline"' in index


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_save_load_round_trip_is_exact(kind, tiny_paths):
    memory = FlowMatchPolicy(build_tiny_pipeline(kind, seed=0), family=kind)
    loaded = FlowMatchPolicy.from_pretrained(tiny_paths[kind])
    for comp in ("transformer", "vae", "text_encoder"):
        sd_m = getattr(memory.pipeline, comp).state_dict()
        sd_l = getattr(loaded.pipeline, comp).state_dict()
        assert sd_m.keys() == sd_l.keys()
        assert all(torch.equal(sd_m[k], sd_l[k]) for k in sd_m), comp

    emb_m = memory.encode_prompt(["a cat", "a dog"], max_sequence_length=8)
    emb_l = loaded.encode_prompt(["a cat", "a dog"], max_sequence_length=8)
    assert torch.equal(emb_m.prompt_embeds, emb_l.prompt_embeds)
    x = loaded.prepare_latents(2, HEIGHT, WIDTH, torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.9, 0.3])
    v_m = memory.predict_velocity(x, sigma, emb_m)
    v_l = loaded.predict_velocity(x, sigma, emb_l)
    assert v_l.abs().sum() > 0
    assert torch.equal(v_m, v_l)


def test_ensure_tiny_model_builds_once_and_is_race_safe(tmp_path):
    results, errors = [], []

    def call():
        try:
            results.append(ensure_tiny_model("sd3", tmp_path, seed=5))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    target = tmp_path / "tiny-sd3-seed5"
    assert results == [target] * 3
    assert (target / "model_index.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-sd3-seed5"]  # no temp leftovers
    mtime = (target / "model_index.json").stat().st_mtime_ns
    assert ensure_tiny_model("sd3", tmp_path, seed=5) == target
    assert (target / "model_index.json").stat().st_mtime_ns == mtime  # not rebuilt


def test_ensure_tiny_model_default_root_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIRL_ASYNC_CACHE_DIR", str(tmp_path))
    assert ensure_tiny_model("flux") == tmp_path / "tiny-flux-seed0"


def test_ensure_tiny_model_rejects_unknown_kind(tmp_path):
    with pytest.raises(ValueError, match=r"`kind`.*'sdxl'"):
        ensure_tiny_model("sdxl", tmp_path)
