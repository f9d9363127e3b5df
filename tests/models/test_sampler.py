"""The rollout loop: stored steps, seeding, windows and log-prob recompute."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnirl_async.models.policy import FlowMatchPolicy
from omnirl_async.models.sampler import sample_with_logprob
from omnirl_async.models.sde import sde_step_with_logprob


@pytest.fixture(scope="module")
def policy(tiny_sd3_path):
    p = FlowMatchPolicy.from_pretrained(tiny_sd3_path)
    p.add_lora(rank=4, alpha=8)
    with torch.no_grad():  # a non-trivial adapter
        for name, param in p.transformer.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return p


@pytest.fixture(scope="module")
def emb(policy):
    return policy.encode_prompt(["two red circles"], max_sequence_length=8).repeat_interleave(3)


KW = dict(height=32, width=32, num_inference_steps=6)


def test_shapes_seeding_and_continuity(policy, emb):
    out = sample_with_logprob(policy, emb, seeds=[1, 2, 3], noise_level=0.7, **KW)
    assert out.images.shape == (3, 32, 32, 3) and out.images.dtype == np.uint8
    assert out.latents.shape[:2] == (3, 6) and out.log_probs.shape == (3, 6)
    # the state after step j is the state before step j + 1
    torch.testing.assert_close(out.latents[:, 1:], out.next_latents[:, :-1], rtol=0, atol=0)
    assert torch.all(out.sigmas > out.sigmas_next)
    again = sample_with_logprob(policy, emb, seeds=[1, 2, 3], noise_level=0.7, **KW)
    assert torch.equal(out.next_latents, again.next_latents)
    other = sample_with_logprob(policy, emb, seeds=[1, 2, 4], noise_level=0.7, **KW)
    assert torch.equal(out.next_latents[:2], other.next_latents[:2])  # a sample depends only on its seed
    assert not torch.equal(out.next_latents[2], other.next_latents[2])


def test_recomputed_log_probs_equal_the_rollout(policy, emb):
    out = sample_with_logprob(policy, emb, seeds=[5, 6, 7], noise_level=0.7, **KW)
    for j in range(out.latents.shape[1]):
        with torch.no_grad():
            v = policy.predict_velocity(out.latents[:, j], out.sigmas[:, j], emb)
        rec = sde_step_with_logprob(v, out.sigmas[:, j], out.sigmas_next[:, j], out.latents[:, j],
                                    noise_level=0.7, prev_sample=out.next_latents[:, j])
        torch.testing.assert_close(rec.log_prob, out.log_probs[:, j], rtol=0, atol=1e-5)
        torch.testing.assert_close(rec.mean, out.means[:, j], rtol=0, atol=1e-6)


def test_window_stores_only_sde_steps_and_ode_elsewhere(policy, emb):
    full_ode = sample_with_logprob(policy, emb, seeds=[1, 2, 3], noise_level=0.0, **KW)
    win = sample_with_logprob(policy, emb, seeds=[1, 2, 3], noise_level=0.7, window=(2, 4), **KW)
    assert win.latents.shape[1] == 2 and list(win.step_indices) == [2, 3]
    # before the window the trajectory is the deterministic ODE one
    torch.testing.assert_close(win.latents[:, 0], full_ode.latents[:, 2], rtol=0, atol=1e-6)
    # inside it, noise moves the state away from the ODE path
    assert (win.next_latents[:, 0] - full_ode.next_latents[:, 2]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="window"):
        sample_with_logprob(policy, emb, seeds=[1, 2, 3], noise_level=0.7, window=(4, 9), **KW)


def test_noise_zero_is_the_ode_and_shared_noise_groups(policy, emb):
    a = sample_with_logprob(policy, emb, seeds=[1, 2, 3], noise_level=0.0, **KW)
    b = sample_with_logprob(policy, emb, seeds=[1, 9, 9], noise_level=0.0, shared_noise_groups=[0, 0, 0], **KW)
    # with no SDE noise, the result depends only on the initial noise, which the group shares
    torch.testing.assert_close(b.next_latents[1], b.next_latents[0], rtol=0, atol=0)
    torch.testing.assert_close(b.next_latents[0], a.next_latents[0], rtol=0, atol=0)
