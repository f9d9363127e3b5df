"""FlowMatchPolicy: loading, prompts, noise, sigmas, velocity, decoding."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from omnirl_async.models import FlowMatchPolicy, PromptEmbeds

from .conftest import HEIGHT, WIDTH


# --------------------------------------------------------------------------- loading
def test_family_is_read_from_model_index(make_policy):
    assert make_policy("sd3").family == "sd3"
    assert make_policy("flux").family == "flux"


def test_all_weights_frozen_on_load(policy):
    mods = [m for m in policy.pipeline.components.values() if isinstance(m, torch.nn.Module)]
    assert len(mods) >= 4
    assert not any(p.requires_grad for m in mods for p in m.parameters())
    assert policy.trainable_parameters() == [] and policy.mode == "frozen"


def test_missing_folder_names_the_path(tmp_path):
    bad = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        FlowMatchPolicy.from_pretrained(bad)


def test_unsupported_pipeline_class_names_class_path_and_supported(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(ValueError) as err:
        FlowMatchPolicy.from_pretrained(tmp_path)
    msg = str(err.value)
    assert "StableDiffusionXLPipeline" in msg and str(tmp_path) in msg
    assert "FluxPipeline" in msg and "StableDiffusion3Pipeline" in msg


def test_transformer_subfolder(tiny_paths, tmp_path):
    import shutil

    src = tiny_paths["sd3"]
    dst = tmp_path / "sd3"
    shutil.copytree(src, dst)
    base = FlowMatchPolicy.from_pretrained(dst)
    w = base.transformer.proj_out.weight
    with torch.no_grad():
        base.transformer.proj_out.weight.mul_(2.0)
    base.transformer.save_pretrained(dst / "transformer_ft")
    ft = FlowMatchPolicy.from_pretrained(dst, transformer_subfolder="transformer_ft")
    assert torch.equal(ft.transformer.proj_out.weight, w)
    assert not torch.equal(FlowMatchPolicy.from_pretrained(dst).transformer.proj_out.weight, w)
    with pytest.raises(FileNotFoundError, match="`transformer_subfolder`='nope'"):
        FlowMatchPolicy.from_pretrained(dst, transformer_subfolder="nope")


def test_bad_dtype_names_argument(tiny_paths):
    with pytest.raises(ValueError, match="`dtype`.*'fp8'"):
        FlowMatchPolicy.from_pretrained(tiny_paths["sd3"], dtype="fp8")


# --------------------------------------------------------------------------- prompts
def test_encode_prompt_shapes_and_negatives(policy):
    emb = policy.encode_prompt(["a cat", "a dog"], max_sequence_length=16)
    assert not emb.has_negative and len(emb) == 2
    assert emb.prompt_embeds.dtype == torch.float32
    cfg = policy.transformer.config
    assert emb.prompt_embeds.shape[-1] == cfg.joint_attention_dim
    assert emb.pooled_prompt_embeds.shape == (2, cfg.pooled_projection_dim)
    seq = 77 + 16 if policy.family == "sd3" else 16  # SD3: CLIP tokens + (zero) T5 tokens
    assert emb.prompt_embeds.shape[1] == seq
    assert not torch.equal(emb.prompt_embeds[0], emb.prompt_embeds[1])

    neg = policy.encode_prompt(["a cat", "a dog"], negative_prompts="blurry", max_sequence_length=16)
    assert neg.has_negative and neg.negative_prompt_embeds.shape == neg.prompt_embeds.shape
    assert torch.equal(neg.prompt_embeds, emb.prompt_embeds)
    blurry = policy.encode_prompt("blurry", max_sequence_length=16)
    assert torch.allclose(neg.negative_prompt_embeds[1], blurry.prompt_embeds[0])
    with pytest.raises(ValueError, match="`negative_prompts` has 3 entries for 2"):
        policy.encode_prompt(["a", "b"], negative_prompts=["x", "y", "z"])
    with pytest.raises(ValueError, match="`prompts`"):
        policy.encode_prompt([])


def test_prompt_embeds_numpy_select_repeat_cat():
    emb = PromptEmbeds(torch.arange(24.0).reshape(3, 4, 2), torch.arange(6.0).reshape(3, 2),
                       torch.zeros(3, 4, 2), torch.ones(3, 2))
    d = emb.to_numpy()
    assert set(d) == {"prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds",
                      "negative_pooled_prompt_embeds"}
    for v in d.values():
        v.flags.writeable = False  # as Ray hands them out
    back = PromptEmbeds.from_numpy(d)
    assert torch.equal(back.prompt_embeds, emb.prompt_embeds) and back.has_negative
    one = emb.select(1)
    assert one.prompt_embeds.shape == (1, 4, 2) and torch.equal(one.pooled_prompt_embeds[0], torch.tensor([2.0, 3.0]))
    picked = emb.select(np.array([2, 0]))
    assert picked.pooled_prompt_embeds[:, 0].tolist() == [4.0, 0.0]
    rep = emb.repeat_interleave(2)
    assert rep.pooled_prompt_embeds[:, 0].tolist() == [0.0, 0.0, 2.0, 2.0, 4.0, 4.0]
    cat = PromptEmbeds.cat([emb.select(0), emb.select(2)])
    assert cat.pooled_prompt_embeds[:, 0].tolist() == [0.0, 4.0] and cat.has_negative
    with pytest.raises(KeyError, match="bogus"):
        PromptEmbeds.from_numpy({**d, "bogus": d["prompt_embeds"]})


# --------------------------------------------------------------------------- noise and sigmas
def test_prepare_latents_layout_and_seeding(policy):
    x = policy.prepare_latents(3, HEIGHT, WIDTH, torch.Generator().manual_seed(7))
    expected = (3, 4, 8, 8) if policy.family == "sd3" else (3, 16, 16)
    assert tuple(x.shape) == expected and x.dtype == torch.float32
    assert abs(float(x.mean())) < 0.2 and abs(float(x.std()) - 1) < 0.2
    same = policy.prepare_latents(3, HEIGHT, WIDTH, torch.Generator().manual_seed(7))
    assert torch.equal(x, same)
    per_sample = policy.prepare_latents(2, HEIGHT, WIDTH, [torch.Generator().manual_seed(s) for s in (7, 7)])
    assert torch.equal(per_sample[0], per_sample[1])
    assert torch.equal(per_sample[0], x[0])
    with pytest.raises(ValueError, match="`height`=30"):
        policy.prepare_latents(1, 30, WIDTH, None)


def test_flux_pack_unpack_round_trip(make_policy):
    p = make_policy("flux")
    z = torch.randn(2, 4, 8, 12)
    packed = p.pack(z)
    assert packed.shape == (2, 24, 16)
    assert torch.equal(p.unpack(packed, 32, 48), z)


def test_make_sigmas_sd3_static_shift(make_policy):
    p = make_policy("sd3")
    n, shift = 10, 3.0
    sig = p.make_sigmas(n, HEIGHT, WIDTH)
    def shifted(s):
        return shift * s / (1 + (shift - 1) * s)

    # StableDiffusion3Pipeline's grid: from 1 to the smallest (shifted) training sigma, then shifted
    s = torch.linspace(1.0, shifted(1 / 1000), n, dtype=torch.float64)
    expected = shifted(s)
    assert sig.shape == (n + 1,) and sig.dtype == torch.float32
    assert sig[0] == 1.0 and sig[-1] == 0.0
    assert torch.all(sig[1:] < sig[:-1])
    assert torch.allclose(sig[:-1].double(), expected, atol=1e-6)
    assert float(sig[-2]) == pytest.approx(shifted(shifted(0.001)), abs=1e-6)


def test_make_sigmas_flux_dynamic_shift_depends_on_resolution(make_policy):
    p = make_policy("flux")
    n = 6
    sig = p.make_sigmas(n, HEIGHT, WIDTH)
    seq = (32 // 4 // 2) ** 2  # 16 image tokens
    m = (1.15 - 0.5) / (4096 - 256)
    mu = 0.5 + m * (seq - 256)
    s = np.linspace(1.0, 1.0 / n, n)
    expected = math.exp(mu) / (math.exp(mu) + (1 / s - 1))
    assert sig[0] == pytest.approx(1.0) and sig[-1] == 0.0 and torch.all(sig[1:] < sig[:-1])
    assert np.allclose(sig[:-1].numpy(), expected, atol=1e-6)
    bigger = p.make_sigmas(n, 256, 256)  # more tokens -> larger mu -> more time at high noise
    assert torch.all(bigger[1:-1] > sig[1:-1])
    with pytest.raises(ValueError, match="`num_inference_steps`"):
        p.make_sigmas(0, HEIGHT, WIDTH)


# --------------------------------------------------------------------------- velocity
def test_predict_velocity_shape_dtype_and_broadcast(policy, batch):
    x, sigma, emb = batch
    v = policy.predict_velocity(x, sigma, emb)
    assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    assert not torch.equal(v[0], v[1])
    # one prompt row broadcast over the batch == that row repeated
    v_b = policy.predict_velocity(x, sigma, emb.select(2))
    v_r = policy.predict_velocity(x, sigma, emb.select([2, 2, 2, 2]))
    assert torch.allclose(v_b, v_r, atol=1e-6)
    # scalar sigma == a constant vector
    assert torch.allclose(policy.predict_velocity(x, 0.5, emb), policy.predict_velocity(x, torch.full((4,), 0.5), emb),
                          atol=1e-6)
    with pytest.raises(ValueError, match="`sigma_b` has 3"):
        policy.predict_velocity(x, sigma[:3], emb)
    with pytest.raises(ValueError, match="`x` has shape"):
        policy.predict_velocity(x.flatten(1), sigma, emb)


def test_true_cfg_equals_manual_combination(policy, batch):
    x, sigma, emb = batch
    v_pos = policy.predict_velocity(x, sigma, emb)
    neg_as_pos = PromptEmbeds(emb.negative_prompt_embeds, emb.negative_pooled_prompt_embeds)
    v_neg = policy.predict_velocity(x, sigma, neg_as_pos)
    v = policy.predict_velocity(x, sigma, emb, true_cfg_scale=4.5)
    assert torch.allclose(v, v_neg + 4.5 * (v_pos - v_neg), atol=1e-5)
    assert (v - v_pos).abs().max() > 1e-3
    with pytest.raises(ValueError, match="`true_cfg_scale`=2.0 needs negative"):
        policy.predict_velocity(x, sigma, neg_as_pos, true_cfg_scale=2.0)


def test_flux_guidance_scale_reaches_the_transformer(make_policy):
    p = make_policy("flux")
    assert p.transformer.config.guidance_embeds
    emb = p.encode_prompt(["a cat"], max_sequence_length=8)
    x = p.prepare_latents(1, HEIGHT, WIDTH, torch.Generator().manual_seed(0))
    default = p.predict_velocity(x, torch.tensor([0.5]), emb)
    assert torch.equal(default, p.predict_velocity(x, torch.tensor([0.5]), emb, guidance_scale=3.5))
    assert not torch.allclose(default, p.predict_velocity(x, torch.tensor([0.5]), emb, guidance_scale=1.0))


def _pipeline_latents(policy, emb, x, steps):
    """Run the diffusers pipeline's own loop (no CFG) and return its final latents."""
    kw = dict(prompt_embeds=emb.prompt_embeds, pooled_prompt_embeds=emb.pooled_prompt_embeds, latents=x.clone(),
              height=HEIGHT, width=WIDTH, num_inference_steps=steps, output_type="latent", return_dict=False)
    kw["guidance_scale"] = 1.0 if policy.family == "sd3" else 3.5
    return policy.pipeline(**kw)[0]


def test_euler_loop_matches_the_diffusers_pipeline(policy):
    """Timestep convention, Flux ids/guidance and the sigma grid agree with diffusers."""
    emb = policy.encode_prompt(["a cat", "a dog"], max_sequence_length=8)
    x = policy.prepare_latents(2, HEIGHT, WIDTH, torch.Generator().manual_seed(3))
    steps = 3
    sig = policy.make_sigmas(steps, HEIGHT, WIDTH)
    ours = x.clone()
    with torch.no_grad():
        for i in range(steps):
            v = policy.predict_velocity(ours, sig[i].expand(2), emb)
            ours = ours + (sig[i + 1] - sig[i]) * v
    theirs = _pipeline_latents(policy, emb, x, steps)
    assert (ours - x).abs().max() > 1e-2
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()


def test_gradient_flows_through_transformer(make_policy):
    p = make_policy("sd3")
    p.transformer.proj_out.weight.requires_grad_(True)
    emb = p.encode_prompt(["a cat"], max_sequence_length=8)
    x = p.prepare_latents(1, HEIGHT, WIDTH, torch.Generator().manual_seed(0))
    p.predict_velocity(x, torch.tensor([0.5]), emb).square().sum().backward()
    g = p.transformer.proj_out.weight.grad
    assert g is not None and g.abs().sum() > 0


# --------------------------------------------------------------------------- decoding
def test_decode_gives_uint8_images_like_the_pipeline(policy):
    emb = policy.encode_prompt(["a cat"], max_sequence_length=8)
    x = policy.prepare_latents(2, HEIGHT, WIDTH, torch.Generator().manual_seed(0))
    imgs = policy.decode(x, HEIGHT, WIDTH)
    assert imgs.shape == (2, HEIGHT, WIDTH, 3) and imgs.dtype == np.uint8
    assert imgs.max() > imgs.min()
    # the pipeline's own decode of the same final latents (1 Euler step from x)
    kw = dict(prompt_embeds=emb.prompt_embeds.expand(2, -1, -1),
              pooled_prompt_embeds=emb.pooled_prompt_embeds.expand(2, -1), latents=x.clone(), height=HEIGHT, width=WIDTH, num_inference_steps=1, output_type="np",
              guidance_scale=1.0 if policy.family == "sd3" else 3.5, return_dict=False)
    ref = policy.pipeline(**kw)[0]
    v = policy.predict_velocity(x, torch.ones(2), emb)
    ours = policy.decode(x - v.detach(), HEIGHT, WIDTH)
    assert np.abs(ours.astype(int) - np.round(ref * 255).astype(int)).max() <= 1
    if policy.family == "sd3":
        with pytest.raises(ValueError, match="do not decode to 64x64"):
            policy.decode(x, 64, 64)
