"""Fixtures for the model tests: each tiny pipeline is built once per session."""

from __future__ import annotations

import pytest
import torch

from omnirl_async.models import FlowMatchPolicy, build_tiny_flux, build_tiny_sd3

HEIGHT = WIDTH = 32  # default tiny image size (latent 8x8)


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny-models")
    return {"sd3": build_tiny_sd3(root / "sd3", seed=0), "flux": build_tiny_flux(root / "flux", seed=0)}


@pytest.fixture(scope="module", params=["sd3", "flux"])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def make_policy(tiny_paths):
    """Factory: a freshly loaded (so independently mutable) policy of a family."""

    def make(kind: str, **kwargs) -> FlowMatchPolicy:
        return FlowMatchPolicy.from_pretrained(tiny_paths[kind], **kwargs)

    return make


@pytest.fixture(scope="module")
def policy(make_policy, family) -> FlowMatchPolicy:
    """Shared by a module's tests: treat it as read-only (use `make_policy` to mutate)."""
    return make_policy(family)


@pytest.fixture(scope="module")
def batch(policy):
    """(x, sigma, emb) for a batch of 4 with negative prompts."""
    emb = policy.encode_prompt(["a red cat", "a blue dog", "tree", "a house at night"], negative_prompts="",
                               max_sequence_length=16)
    x = policy.prepare_latents(4, HEIGHT, WIDTH, torch.Generator().manual_seed(0))
    sigma = torch.tensor([1.0, 0.75, 0.5, 0.1])
    return x, sigma, emb
