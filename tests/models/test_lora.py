"""LoRA on the policy: identity at init, exact reference, exact round trips, PEFT files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from omnirl_async.models.lora import resolve_target_modules

from .conftest import HEIGHT, WIDTH


@pytest.fixture(scope="module")
def inputs(make_policy, family):
    p = make_policy(family)
    emb = p.encode_prompt(["a red cat", "a dog"], max_sequence_length=8)
    x = p.prepare_latents(2, HEIGHT, WIDTH, torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        base = p.predict_velocity(x, sigma, emb)
    return x, sigma, emb, base


def _velocity(policy, inputs):
    x, sigma, emb, _ = inputs
    with torch.no_grad():
        return policy.predict_velocity(x, sigma, emb)


def _perturb(policy, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def test_all_linear_covers_every_linear_and_exclude_removes(make_policy, family):
    from peft.tuners.lora import LoraLayer

    policy = make_policy(family)
    linears = {n for n, m in policy.transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    assert len(linears) > 20
    assert set(resolve_target_modules(policy.transformer, "all-linear")) == linears
    # a list matches names or dotted suffixes (peft's rule): "to_q" hits every block's to_q
    kept = set(resolve_target_modules(policy.transformer, "all-linear", ["proj_out", "to_q"]))
    assert "proj_out" in linears and "proj_out" not in kept
    dropped = {n for n in linears if n == "proj_out" or n.endswith((".proj_out", ".to_q"))}
    assert len(dropped) >= 3 and kept == linears - dropped
    # a string is a regex on the full name: drop every feed-forward layer
    no_ff = set(resolve_target_modules(policy.transformer, "all-linear", r".*\.ff(_context)?\..*"))
    assert not any(".ff" in n for n in no_ff) and any(".ff." in n for n in linears) and no_ff < linears
    only_attn = set(resolve_target_modules(policy.transformer, ["to_q", "to_k", "to_v"]))
    assert only_attn == {n for n in linears if n.endswith((".to_q", ".to_k", ".to_v"))}

    policy.add_lora(4, 8.0, exclude_modules=["proj_out"])
    wrapped = {n for n, m in policy.transformer.named_modules() if isinstance(m, LoraLayer)}
    assert wrapped == {n for n in linears if not (n == "proj_out" or n.endswith(".proj_out"))}
    assert len(policy.trainable_parameters()) == 2 * len(wrapped)
    assert not any(p.requires_grad for n, p in policy.transformer.named_parameters() if "lora_" not in n)
    with pytest.raises(ValueError, match="selects no module"):
        resolve_target_modules(policy.transformer, ["no_such_layer"])


def test_lora_at_init_is_the_base_model(make_policy, family, inputs):
    policy = make_policy(family)
    policy.add_lora(4, 8.0)
    assert policy.mode == "lora"
    b = [p for n, p in policy.transformer.named_parameters() if "lora_B" in n]
    assert b and all(torch.count_nonzero(p) == 0 for p in b)
    assert torch.equal(_velocity(policy, inputs), inputs[3])


def test_disable_adapter_gives_the_base_after_training(make_policy, family, inputs):
    policy = make_policy(family)
    policy.add_lora(4, 8.0)
    _perturb(policy)
    tuned = _velocity(policy, inputs)
    assert (tuned - inputs[3]).abs().max() > 1e-3
    with policy.disable_adapter():
        assert torch.equal(_velocity(policy, inputs), inputs[3])
    assert torch.equal(_velocity(policy, inputs), tuned)
    assert all(p.requires_grad for p in policy.trainable_parameters())  # flags restored


def test_gradients_reach_lora_only(make_policy, family, inputs):
    policy = make_policy(family)
    policy.add_lora(4, 8.0)
    x, sigma, emb, _ = inputs
    policy.predict_velocity(x, sigma, emb).square().mean().backward()
    grads = {n: p.grad for n, p in policy.transformer.named_parameters() if "lora_B" in n}
    assert all(g is not None for g in grads.values())
    # With B = 0 only B gets gradient at first. (SD3's last block computes context
    # queries whose output is discarded, so that one B legitimately gets zero.)
    nonzero = sum(bool(g.abs().sum() > 0) for g in grads.values())
    assert nonzero >= len(grads) - 1
    assert all(p.grad is None for n, p in policy.transformer.named_parameters() if "lora_" not in n)


def test_state_dict_round_trip_is_exact_and_strict(make_policy, family, inputs):
    policy = make_policy(family)
    policy.add_lora(4, 8.0)
    _perturb(policy, seed=1)
    sd = policy.lora_state_dict()
    tuned = _velocity(policy, inputs)
    assert all(".default" not in k and v.device.type == "cpu" for k, v in sd.items())
    assert any(k.endswith("lora_A.weight") for k in sd) and any(k.endswith("lora_B.weight") for k in sd)
    params_before = [id(p) for p in policy.trainable_parameters()]
    _perturb(policy, seed=2)
    assert not torch.equal(_velocity(policy, inputs), tuned)
    assert torch.equal(policy.lora_state_dict()[next(iter(sd))], policy.lora_state_dict()[next(iter(sd))])
    policy.load_lora_state_dict(sd)
    assert torch.equal(_velocity(policy, inputs), tuned)
    assert [id(p) for p in policy.trainable_parameters()] == params_before  # in place: optimizers stay valid

    key = next(iter(sd))
    with pytest.raises(KeyError, match="missing"):
        policy.load_lora_state_dict({k: v for k, v in sd.items() if k != key})
    with pytest.raises(KeyError, match="bogus.lora_A.weight"):
        policy.load_lora_state_dict({**sd, "bogus.lora_A.weight": sd[key]})
    with pytest.raises(ValueError, match="shape"):
        policy.load_lora_state_dict({**sd, key: torch.zeros(1, 1)})


def test_lora_state_dict_is_a_copy(make_policy):
    policy = make_policy("flux")
    policy.add_lora(2, 2.0)
    sd = policy.lora_state_dict()
    before = {k: v.clone() for k, v in sd.items()}
    _perturb(policy)
    assert all(torch.equal(sd[k], before[k]) for k in sd)


def test_save_lora_then_adapter_path_reproduces_the_policy(make_policy, family, inputs, tmp_path):
    policy = make_policy(family)
    policy.add_lora(4, 8.0, exclude_modules=["proj_out"])
    _perturb(policy, seed=3)
    tuned = _velocity(policy, inputs)
    out = policy.save_lora(tmp_path / "adapter")
    assert (out / "adapter_model.safetensors").is_file()
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert "proj_out" not in config["target_modules"]
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        assert all(k.startswith("base_model.model.") for k in f.keys())

    again = make_policy(family)
    again.add_lora(4, 8.0, adapter_path=out)
    assert torch.equal(_velocity(again, inputs), tuned)
    assert again.trainable_parameters() and all(p.requires_grad for p in again.trainable_parameters())
    with again.disable_adapter():
        assert torch.equal(_velocity(again, inputs), inputs[3])


def test_saved_adapter_loads_in_peft_and_diffusers(make_policy, inputs, tmp_path, family):
    from peft import PeftModel

    policy = make_policy(family)
    policy.add_lora(4, 8.0)
    _perturb(policy, seed=4)
    tuned = _velocity(policy, inputs)
    policy.save_lora(tmp_path)

    other = make_policy(family)  # swap its transformer for peft's wrapper, forward unchanged
    wrapped = PeftModel.from_pretrained(other.transformer, str(tmp_path))
    assert torch.equal(_velocity(other, inputs), tuned)
    del wrapped

    third = make_policy(family)
    third.transformer.load_lora_adapter(str(tmp_path), weight_name="adapter_model.safetensors",
                                        prefix="base_model.model")
    assert torch.allclose(_velocity(third, inputs), tuned, atol=1e-6)


def test_adapter_path_errors_name_the_folder(make_policy, tmp_path):
    policy = make_policy("sd3")
    with pytest.raises(FileNotFoundError, match="`adapter_path`=.*adapter_model.safetensors"):
        policy.add_lora(4, 8.0, adapter_path=tmp_path)


def test_lora_dtype_casts_adapter_only(make_policy, inputs, family):
    policy = make_policy(family)
    policy.add_lora(4, 8.0, lora_dtype="bf16")
    assert {p.dtype for p in policy.trainable_parameters()} == {torch.bfloat16}
    assert policy.transformer.proj_out.base_layer.weight.dtype == torch.float32
    _perturb(policy)
    v = _velocity(policy, inputs)
    assert v.dtype == torch.float32 and torch.isfinite(v).all() and not torch.equal(v, inputs[3])
    with pytest.raises(ValueError, match="`lora_dtype`.*'int8'"):
        make_policy(family).add_lora(4, 8.0, lora_dtype="int8")


def test_init_weights_validation_and_random_b(make_policy, inputs, family):
    with pytest.raises(ValueError, match="`init_weights`.*'bogus'"):
        make_policy(family).add_lora(4, 8.0, init_weights="bogus")
    policy = make_policy(family)
    policy.add_lora(4, 8.0, init_weights=False)  # peft: random B as well -> not the base
    assert not torch.equal(_velocity(policy, inputs), inputs[3])


def test_rank_zero_is_full_finetuning(make_policy, inputs, family):
    policy = make_policy(family)
    policy.add_lora(0, 0.0)
    assert policy.mode == "full"
    n_params = len(list(policy.transformer.parameters()))
    assert len(policy.trainable_parameters()) == n_params
    sd = policy.full_state_dict()
    _perturb(policy)
    assert not torch.equal(_velocity(policy, inputs), inputs[3])
    policy.load_full_state_dict(sd)
    assert torch.equal(_velocity(policy, inputs), inputs[3])
    with pytest.raises(ValueError, match="`disable_adapter`"):
        policy.disable_adapter()
    with pytest.raises(ValueError, match="`lora_state_dict` needs weight mode 'lora'"):
        policy.lora_state_dict()
    with pytest.raises(KeyError, match="missing"):
        policy.load_full_state_dict({k: v for k, v in list(sd.items())[1:]})


def test_add_lora_twice_and_frozen_reference(make_policy, inputs, family):
    policy = make_policy(family)
    with policy.disable_adapter():  # no adapter: the policy already is the base
        assert torch.equal(_velocity(policy, inputs), inputs[3])
    with pytest.raises(ValueError, match="call `add_lora"):
        policy.lora_state_dict()
    policy.add_lora(2, 4.0)
    with pytest.raises(ValueError, match="already applied"):
        policy.add_lora(2, 4.0)
    with pytest.raises(ValueError, match="`rank` must be >= 0"):
        make_policy(family).add_lora(-1, 4.0)
