"""Named LoRA policy states: the frozen ``old`` adapter beside the trained ``default`` one."""

from __future__ import annotations

import pytest
import torch

from omnirl_async.models.policy import FlowMatchPolicy


@pytest.fixture()
def policy(tiny_sd3_path):
    p = FlowMatchPolicy.from_pretrained(tiny_sd3_path)
    p.add_lora(4, 8)
    with torch.no_grad():  # a non-trivial default adapter (B = 0 at init would make every adapter equal the base)
        g = torch.Generator().manual_seed(0)
        for name, param in p.transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    return p


def _velocity(p, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = p.prepare_latents(2, 32, 32, g)
    emb = p.encode_prompt(["a red circle", "two squares"], max_sequence_length=8)
    return p.predict_velocity(x, torch.tensor([0.7, 0.3]), emb)


def test_old_starts_as_a_copy_frozen_and_default_stays_active(policy):
    trainable = [id(q) for q in policy.trainable_parameters()]
    v_default = _velocity(policy)
    policy.add_policy_state("old")
    assert policy.adapter_names == ["default", "old"]
    assert [id(q) for q in policy.trainable_parameters()] == trainable  # only the default adapter trains
    assert torch.equal(_velocity(policy), v_default)  # default is still the active adapter
    with policy.use_adapter("old"), torch.no_grad():
        v_old = _velocity(policy)
    assert torch.allclose(v_old, v_default, atol=1e-6)  # the old adapter is a copy
    assert [id(q) for q in policy.trainable_parameters()] == trainable  # flags restored after the block


def test_use_adapter_computes_with_the_old_weights(policy):
    policy.add_policy_state("old")
    with torch.no_grad():
        for name, param in policy.transformer.named_parameters():
            if ".default." in name and "lora_B" in name:
                param.mul_(3.0)  # the trained adapter moves on; old does not
    v_default = _velocity(policy)
    with policy.use_adapter("old"), torch.no_grad():
        v_old = _velocity(policy)
    with policy.disable_adapter(), torch.no_grad():
        v_base = _velocity(policy)
    assert not torch.allclose(v_old, v_default) and not torch.allclose(v_old, v_base)
    assert torch.equal(_velocity(policy), v_default)


def test_ema_update_moves_old_towards_default(policy):
    policy.add_policy_state("old")
    old0 = policy.lora_state_dict("old")
    with torch.no_grad():
        for name, param in policy.transformer.named_parameters():
            if ".default." in name and "lora_A" in name:
                param.add_(0.5)
    default = policy.lora_state_dict()
    policy.ema_policy_state("old", 0.75)
    old = policy.lora_state_dict("old")
    for k in old:
        assert torch.allclose(old[k], 0.75 * old0[k] + 0.25 * default[k], atol=1e-6)
    assert all(torch.equal(policy.lora_state_dict()[k], default[k]) for k in default)  # default untouched
    policy.ema_policy_state("old", 1.0)
    assert all(torch.equal(policy.lora_state_dict("old")[k], old[k]) for k in old)  # d = 1 keeps old
    with pytest.raises(ValueError, match="old_policy_decay"):
        policy.ema_policy_state("old", 1.5)


def test_bad_requests_name_the_adapter(policy, tiny_sd3_path):
    with pytest.raises(ValueError, match="policy_state_adapters"):
        with policy.use_adapter("old"):
            pass
    policy.add_policy_state("old")
    with pytest.raises(ValueError, match="already exists"):
        policy.add_policy_state("old")
    frozen = FlowMatchPolicy.from_pretrained(tiny_sd3_path)
    with pytest.raises(ValueError, match="add_lora"):
        frozen.add_policy_state("old")
