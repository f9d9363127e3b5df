"""The trained LoRA loads into plain diffusers (`pipe.load_lora_weights`) and reproduces the policy.

PEFT's own file (keys ``base_model.model.…``) makes diffusers' ``load_lora_weights``
return normally having loaded nothing. ``FlowMatchPolicy.save_lora`` therefore
also writes the pipeline's own LoRA file, and ``omnirl-async export`` converts a
checkpoint's adapter. These tests load the result with a fresh, plain diffusers
pipeline (real diffusers, real peft) and compare ODE samples with the policy's.
"""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open

from omnirl_async import cli
from omnirl_async.models import FlowMatchPolicy
from omnirl_async.models import lora as L
from omnirl_async.models.export import export_lora, find_adapter_folder, load_in_diffusers
from omnirl_async.models.pretrain import ASSET_DIR
from omnirl_async.models.sampler import sample_with_logprob
from omnirl_async.preflight import InputError, check_lora_adapter

RANK, ALPHA = 4, 12.0  # alpha != rank: a loader that guessed alpha = rank would scale the LoRA wrongly
PROMPTS = ["a red circle", "two blue squares"]
SEEDS = [7, 8]
STEPS = 4
WANT = ("pass a checkpoint step folder (global_step_N), its lora/ folder, or a PEFT adapter folder "
        "(adapter_config.json + adapter_model.safetensors)")


@pytest.fixture(scope="module")
def models(tiny_paths) -> dict:
    """name -> (pipeline folder, pixel size, T5 token budget): the two tiny models and the pretrained shapes one."""
    return {"sd3": (tiny_paths["sd3"], 32, 8), "flux": (tiny_paths["flux"], 32, 8), "shapes": (ASSET_DIR, 32, 1)}


def _trained_policy(folder, seed=0) -> FlowMatchPolicy:
    """A policy whose LoRA is far from zero (as after training), in all A and B matrices."""
    policy = FlowMatchPolicy.from_pretrained(folder)
    policy.add_lora(RANK, ALPHA)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return policy


def _lora_layer_names(module) -> set[str]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {n for n, m in module.named_modules() if isinstance(m, BaseTunerLayer)}


def _pipe_latents(pipe, family, size, msl, noise=None, **kw):
    """The pipeline's own sampling with the policy's seeds (one generator per sample, as the policy).

    SD3: the same seeds give the same initial noise. Flux: the policy's sampler
    draws samples 2.. of a call directly in the packed layout (same distribution,
    other arrangement than FluxPipeline's), so the policy's initial noise
    ``noise`` is passed as ``latents`` instead.
    """
    guidance = 3.5 if family == "flux" else 1.0  # flux: the policy's default distilled guidance; sd3: no CFG
    kw = {"guidance_scale": guidance, **kw}
    if family == "flux":
        kw["latents"] = noise.clone()
    else:
        kw["generator"] = [torch.Generator().manual_seed(s) for s in SEEDS]
    return pipe(prompt=PROMPTS, height=size, width=size, num_inference_steps=STEPS,
                max_sequence_length=msl, return_dict=False, **kw)[0]


@pytest.fixture(scope="module", params=["sd3", "flux", "shapes"])
def saved(request, models, tmp_path_factory):
    """(name, family, base folder, size, msl, policy, lora folder) after `policy.save_lora`."""
    name = request.param
    folder, size, msl = models[name]
    policy = _trained_policy(folder)
    lora_dir = policy.save_lora(tmp_path_factory.mktemp(f"ckpt-{name}") / "global_step_3" / "lora")
    return name, policy.family, folder, size, msl, policy, lora_dir


# --------------------------------------------------------------------------- save_lora writes both formats
def test_save_lora_writes_peft_and_the_pipelines_own_lora_file(saved):
    name, family, folder, size, msl, policy, lora_dir = saved
    assert sorted(p.name for p in lora_dir.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "pytorch_lora_weights.safetensors"]
    # PEFT part unchanged: preflight accepts it, the project's loader reads it back exactly
    assert check_lora_adapter(str(lora_dir))["r"] == RANK
    config, peft_state = L.read_adapter(lora_dir)
    ours = policy.lora_state_dict()
    with safe_open(str(lora_dir / L.DIFFUSERS_WEIGHTS), "pt") as f:
        keys = set(f.keys())
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
        assert keys == {"transformer." + k for k in ours}
        for k in ours:
            assert torch.equal(f.get_tensor("transformer." + k), ours[k])
            assert torch.equal(peft_state[k], ours[k])
    # diffusers' metadata convention: LoraConfig fields under the component prefix
    assert meta["transformer.r"] == RANK and meta["transformer.lora_alpha"] == ALPHA
    assert meta["transformer.init_lora_weights"] is True and not meta["transformer.use_rslora"]


# --------------------------------------------------------------------------- plain diffusers reproduces the policy
@pytest.fixture(scope="module")
def loaded(saved):
    """A fresh plain-diffusers pipeline of the base folder with `load_lora_weights(lora folder)`."""
    import diffusers

    name, family, folder, size, msl, policy, lora_dir = saved
    cls = getattr(diffusers, type(policy.pipeline).__name__)
    nulls = {"text_encoder_3": None, "tokenizer_3": None} if family == "sd3" else {}
    pipe = cls.from_pretrained(str(folder), **nulls)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora_dir))  # the folder, no weight_name: diffusers must pick its own file
    base = cls.from_pretrained(str(folder), **nulls)
    base.set_progress_bar_config(disable=True)
    return pipe, base


def test_load_lora_weights_attaches_every_lora_layer_with_the_trained_scaling(saved, loaded):
    name, family, folder, size, msl, policy, lora_dir = saved
    pipe, base = loaded
    assert pipe.get_active_adapters() == ["default_0"]
    assert _lora_layer_names(pipe.transformer) == _lora_layer_names(policy.transformer)
    assert len(_lora_layer_names(pipe.transformer)) > 20
    cfg = pipe.transformer.peft_config["default_0"]
    assert (cfg.r, cfg.lora_alpha) == (RANK, ALPHA)
    assert not _lora_layer_names(base.transformer)


def test_diffusers_ode_samples_reproduce_the_policy_and_differ_from_the_base(saved, loaded):
    name, family, folder, size, msl, policy, lora_dir = saved
    pipe, base = loaded
    emb = policy.encode_prompt(PROMPTS, max_sequence_length=msl)
    ours = sample_with_logprob(policy, emb, seeds=SEEDS, height=size, width=size, num_inference_steps=STEPS,
                               noise_level=0.0)  # noise_level 0: every step is the Euler (ODE) step
    final, noise = ours.next_latents[:, -1], ours.latents[:, 0]  # every step is stored: [:, 0] is x_1
    theirs = _pipe_latents(pipe, family, size, msl, noise, output_type="latent")
    assert theirs.shape == final.shape
    assert (theirs - final).abs().max() < 1e-5, (theirs - final).abs().max()
    images = _pipe_latents(pipe, family, size, msl, noise, output_type="np")  # decoded end to end, float in [0, 1]
    assert np.abs(np.round(images * 255).astype(int) - ours.images.astype(int)).max() <= 1
    # the LoRA matters: the base model's samples with the same seeds are far away
    plain = _pipe_latents(base, family, size, msl, noise, output_type="latent")
    assert (plain - final).abs().max() > 1e-2
    with policy.disable_adapter():
        ref = sample_with_logprob(policy, emb, seeds=SEEDS, height=size, width=size, num_inference_steps=STEPS,
                                  noise_level=0.0).next_latents[:, -1]
    assert (plain - ref).abs().max() < 1e-5


def test_diffusers_cfg_samples_reproduce_the_policy_with_true_cfg(saved, loaded):
    name, family, folder, size, msl, policy, lora_dir = saved
    if family != "sd3":
        pytest.skip("FluxPipeline's guidance_scale is the distilled embedding, not true CFG")
    pipe, _ = loaded
    emb = policy.encode_prompt(PROMPTS, negative_prompts="", max_sequence_length=msl)
    ours = sample_with_logprob(policy, emb, seeds=SEEDS, height=size, width=size, num_inference_steps=STEPS,
                               noise_level=0.0, true_cfg_scale=3.0).next_latents[:, -1]
    theirs = _pipe_latents(pipe, family, size, msl, output_type="latent", guidance_scale=3.0, negative_prompt="")
    assert (theirs - ours).abs().max() < 1e-5


def test_the_peft_file_alone_loads_nothing_and_load_in_diffusers_says_so(models, tmp_path):
    """The pitfall this feature fixes, and the check that catches it."""
    folder = models["sd3"][0]
    policy = _trained_policy(folder)
    lora_dir = policy.save_lora(tmp_path / "lora")
    peft_only = tmp_path / "peft_only"
    peft_only.mkdir()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(lora_dir / f, peft_only / f)
    with pytest.raises(RuntimeError, match="diffusers loaded no LoRA layer"):
        load_in_diffusers(folder, peft_only)
    pipe = load_in_diffusers(folder, lora_dir)
    assert _lora_layer_names(pipe.transformer) == _lora_layer_names(policy.transformer)


def test_saving_again_overwrites_both_files(models, tmp_path):
    folder = models["sd3"][0]
    first, second = _trained_policy(folder, seed=1), _trained_policy(folder, seed=2)
    first.save_lora(tmp_path)
    second.save_lora(tmp_path)
    pipe = load_in_diffusers(folder, tmp_path)
    state = second.lora_state_dict()
    for name, module in pipe.transformer.named_modules():
        if hasattr(module, "lora_A") and "default_0" in module.lora_A:
            assert torch.equal(module.lora_A["default_0"].weight, state[f"{name}.lora_A.weight"])
            assert torch.equal(module.lora_B["default_0"].weight, state[f"{name}.lora_B.weight"])


def test_a_pissa_adapter_gets_no_diffusers_file(models, tmp_path, caplog):
    """PiSSA rewrites the base weights: its LoRA on the original base is not the trained model."""
    policy = FlowMatchPolicy.from_pretrained(models["sd3"][0])
    policy.add_lora(RANK, ALPHA, init_weights="pissa")
    (tmp_path / L.DIFFUSERS_WEIGHTS).write_bytes(b"stale")
    with caplog.at_level(logging.WARNING, logger="omnirl_async.models.lora"):
        policy.save_lora(tmp_path)
    assert not (tmp_path / L.DIFFUSERS_WEIGHTS).exists()
    assert "init_lora_weights='pissa'" in caplog.text
    check_lora_adapter(str(tmp_path))  # the PEFT adapter is still written
    with pytest.raises(InputError, match="init_lora_weights='pissa', which rewrites the base weights"):
        export_lora(tmp_path, tmp_path / "out")


# --------------------------------------------------------------------------- omnirl-async export
@pytest.fixture(scope="module")
def checkpoint(models, tmp_path_factory):
    """A checkpoint-like step folder: lora/ (PEFT only, as written before this feature) + learner files."""
    folder = models["sd3"][0]
    policy = _trained_policy(folder, seed=5)
    step = tmp_path_factory.mktemp("run") / "global_step_12"
    policy.save_lora(step / "lora")
    (step / "lora" / L.DIFFUSERS_WEIGHTS).unlink()  # an old checkpoint: export must convert from PEFT
    (step / "learner.msgpack").write_bytes(b"\x80")
    return step, policy


def test_export_cli_writes_a_loadable_diffusers_lora_and_prints_the_snippet(checkpoint, models, tmp_path, capsys):
    step, policy = checkpoint
    base = models["sd3"][0]
    out = tmp_path / "exported"
    assert cli.main(["export", str(step), "--out", str(out), "--base", str(base), "--check"]) == 0
    stdout = capsys.readouterr().out
    weights = out / L.DIFFUSERS_WEIGHTS
    assert sorted(p.name for p in out.iterdir()) == [L.DIFFUSERS_WEIGHTS]
    assert f"wrote {weights.resolve()}" in stdout
    n = len(_lora_layer_names(policy.transformer))
    assert f"StableDiffusion3Pipeline LoRA: {n} transformer modules, rank {RANK}, alpha {ALPHA:g}" in stdout
    assert f"checked: plain diffusers load_lora_weights attached {n} LoRA layers" in stdout
    assert f"pipe.load_lora_weights({str(out.resolve())!r})" in stdout
    # run the printed snippet up to the (costly, full-size) image call: it must load the LoRA
    snippet = stdout.split("load it with diffusers:\n", 1)[1]
    loading = snippet.split("# guidance_scale")[0]
    scope: dict = {}
    exec(compile(loading, "snippet", "exec"), scope)  # noqa: S102 - our own printed code
    pipe = scope["pipe"]
    assert _lora_layer_names(pipe.transformer) == _lora_layer_names(policy.transformer)
    # same ODE sample as the policy
    pipe.set_progress_bar_config(disable=True)
    emb = policy.encode_prompt(PROMPTS, max_sequence_length=8)
    ours = sample_with_logprob(policy, emb, seeds=SEEDS, height=32, width=32, num_inference_steps=STEPS,
                               noise_level=0.0).next_latents[:, -1]
    theirs = _pipe_latents(pipe, "sd3", 32, 8, output_type="latent")
    assert (theirs - ours).abs().max() < 1e-5


def test_export_accepts_the_lora_folder_and_a_peft_folder_and_matches_save_lora(checkpoint, models, tmp_path):
    step, policy = checkpoint
    res = export_lora(step / "lora", tmp_path / "a")  # no --base: the class is inferred from module names
    assert res.pipeline_class == "StableDiffusion3Pipeline" and res.base is None
    assert "path/to/base-model" in res.snippet() and "text_encoder_3=None" in res.snippet()
    policy.save_lora(tmp_path / "fresh")  # what a new checkpoint holds
    with safe_open(str(res.weights), "pt") as a, safe_open(str(tmp_path / "fresh" / L.DIFFUSERS_WEIGHTS), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
        assert a.metadata() == b.metadata()
    assert find_adapter_folder(tmp_path / "fresh") == tmp_path / "fresh"


def test_export_of_a_flux_adapter_names_the_flux_pipeline(models, tmp_path):
    folder = models["flux"][0]
    policy = _trained_policy(folder)
    policy.save_lora(tmp_path / "lora")
    res = export_lora(tmp_path / "lora", tmp_path / "out")
    assert res.pipeline_class == "FluxPipeline"
    assert "from diffusers import FluxPipeline" in res.snippet()
    pipe = load_in_diffusers(folder, res.folder)
    assert _lora_layer_names(pipe.transformer) == _lora_layer_names(policy.transformer)


def _export_error(capsys, ckpt, tmp_path) -> str:
    assert cli.main(["export", str(ckpt), "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    return captured.err


def test_export_of_a_non_lora_folder_is_a_one_line_error(models, checkpoint, tmp_path, capsys):
    base = models["sd3"][0]
    assert _export_error(capsys, base, tmp_path) == (
        f"omnirl-async: export: CKPT {str(base)!r} is not a LoRA: it is a diffusers pipeline folder (a base "
        f"model), not an adapter; {WANT}.\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _export_error(capsys, empty, tmp_path) == (
        f"omnirl-async: export: CKPT {str(empty)!r} is not a LoRA: no adapter_config.json or "
        f"adapter_model.safetensors there or in a lora/ folder inside; {WANT}.\n")
    missing = tmp_path / "missing"
    assert _export_error(capsys, missing, tmp_path) == (
        f"omnirl-async: export: CKPT {str(missing)!r} does not exist; {WANT}.\n")
    full_ft = tmp_path / "global_step_4"
    full_ft.mkdir()
    (full_ft / "learner.msgpack").write_bytes(b"\x80")
    assert _export_error(capsys, full_ft, tmp_path) == (
        f"omnirl-async: export: CKPT {str(full_ft)!r} is not a LoRA: it is a checkpoint without a lora/ folder "
        "(a full fine-tuning run, lora_rank=0, has no LoRA to export).\n")
    half = tmp_path / "global_step_5"
    (half / "lora").mkdir(parents=True)
    (half / "lora" / "adapter_config.json").write_text("{}")
    assert _export_error(capsys, half, tmp_path) == (
        f"omnirl-async: export: CKPT {str(half)!r} is not a LoRA: its lora/ folder has adapter_config.json but "
        f"no adapter_model.safetensors; {WANT}.\n")
    step, _ = checkpoint
    root = step.parent
    assert _export_error(capsys, root, tmp_path) == (
        f"omnirl-async: export: CKPT {str(root)!r} is not a LoRA: it is a checkpoint root folder; pass one of "
        f"its global_step_N folders, e.g. {step}.\n")
    assert not (tmp_path / "out").exists()


def test_export_of_a_damaged_adapter_is_a_one_line_error(checkpoint, tmp_path, capsys):
    step, _ = checkpoint
    bad = tmp_path / "global_step_12"
    shutil.copytree(step, bad)
    with open(bad / "lora" / "adapter_model.safetensors", "wb") as fh:
        fh.write(b"\x01\x00")
    err = _export_error(capsys, bad, tmp_path)
    assert err.startswith(f"omnirl-async: `CKPT`: {bad / 'lora' / 'adapter_model.safetensors'} is not a valid "
                          "safetensors file")


def test_export_checks_the_adapter_against_the_checkpoint_manifest(checkpoint, tmp_path, capsys):
    import hashlib

    step, _ = checkpoint
    ckpt = tmp_path / "global_step_12"
    shutil.copytree(step, ckpt)
    entries = [{"path": f"lora/{f}", "size": 1, "sha256": hashlib.sha256(b"other bytes").hexdigest()}
               for f in ("adapter_config.json", "adapter_model.safetensors")]
    (ckpt / "manifest.json").write_text(json.dumps({"format": "omnirl-async-checkpoint", "files": entries}))
    err = _export_error(capsys, ckpt, tmp_path)
    assert err == (f"omnirl-async: export: {ckpt / 'lora' / 'adapter_config.json'} differs from the SHA-256 "
                   f"recorded in {ckpt / 'manifest.json'} (damaged on disk); export an older global_step_N "
                   "folder instead.\n")


def test_export_check_needs_base(checkpoint, tmp_path, capsys):
    step, _ = checkpoint
    assert cli.main(["export", str(step), "--out", str(tmp_path), "--check"]) == 2
    assert capsys.readouterr().err == ("omnirl-async: export: --check needs --base (the model the LoRA was "
                                       "trained on) to load the LoRA into.\n")
