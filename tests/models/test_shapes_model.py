"""The embedded shapes text-to-image model: tokenizer, committed folder, base accuracy.

The accuracy test samples a fixed-seed subset of the held-out prompts the way
the RL rollout does (ODE, 10 steps) and checks the strict accuracy against the
value measured when the weights were committed (docs/shapes_model.md), with a
tolerance for float differences between machines and thread counts.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from omnirl_async.data.prompts import CATEGORIES, enumerate_prompts, heldout_prompts
from omnirl_async.models.pretrain import ASSET_DIR, IMAGES_PER_PROMPT, evaluate
from omnirl_async.models.shapes_model import (
    GRAMMAR_WORDS,
    MAX_SEQUENCE_LENGTH,
    MAX_TOKENS,
    build_word_tokenizer,
    encode_prompts,
)

#: Vocabulary of the word-level tokenizer: 3 special tokens, the 21 letters of
#: the grammar words (plain and word-final), "." and ",", and one entry per BPE
#: merge result (69), which include every grammar word.
EXPECTED_VOCAB_SIZE = 116
#: The strict accuracy expected on ``heldout_prompts()[::4]`` (64 prompts), seeds 0..63,
#: ODE, 10 steps, is the one measured when the weights were saved (eval.json, subset_ode).
SUBSET_TOLERANCE = 0.08  # ~5 of 64 prompts may flip between machines


@pytest.fixture(scope="module")
def policy():
    from omnirl_async.models import FlowMatchPolicy

    return FlowMatchPolicy.from_pretrained(ASSET_DIR)


def test_tokenizer_is_word_level():
    tok = build_word_tokenizer()
    assert len(tok) == EXPECTED_VOCAB_SIZE
    for word in GRAMMAR_WORDS:
        ids = tok(word).input_ids
        assert len(ids) == 3, (word, tok.convert_ids_to_tokens(ids))
        assert tok.convert_ids_to_tokens(ids[1]) == word + "</w>"
    for category in CATEGORIES:
        for prompt in enumerate_prompts(category):
            ids = tok(prompt).input_ids
            assert len(ids) == len(prompt.split()) + 2 <= MAX_TOKENS
    # text outside the grammar still tokenizes (characters or <unk>), no error
    assert len(tok("a purple cat!").input_ids) > 3


def test_committed_folder_loads_offline(policy):
    pipe = policy.pipeline
    assert policy.family == "sd3"
    assert pipe.text_encoder_3 is None and pipe.tokenizer_3 is None
    for tok in (pipe.tokenizer, pipe.tokenizer_2):
        assert len(tok) == EXPECTED_VOCAB_SIZE
        assert tok.model_max_length == MAX_TOKENS
        assert tok.convert_ids_to_tokens(tok("two red circles").input_ids) == [
            "<|startoftext|>", "two</w>", "red</w>", "circles</w>", "<|endoftext|>"]
    assert pipe.vae.config.shift_factor is not None
    assert policy.vae_scale_factor == 2 and policy.latent_grid(32, 32) == (16, 16)
    files = list(ASSET_DIR.rglob("*.safetensors"))
    assert len(files) == 4  # transformer, vae, two text encoders
    assert sum(f.stat().st_size for f in ASSET_DIR.rglob("*") if f.is_file()) < 8 * 2**20
    for module in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
        assert all(p.dtype == torch.float32 for p in module.parameters())


def test_encode_prompt_matches_training_encoder(policy):
    prompts = ["a red circle", "two blue squares to the left of a green triangle", ""]
    emb = policy.encode_prompt(prompts, max_sequence_length=MAX_SEQUENCE_LENGTH)
    pe, pooled = encode_prompts(policy.pipeline, prompts, max_sequence_length=MAX_SEQUENCE_LENGTH)
    assert emb.prompt_embeds.shape == (3, MAX_TOKENS + MAX_SEQUENCE_LENGTH, 64)
    torch.testing.assert_close(emb.prompt_embeds, pe)
    torch.testing.assert_close(emb.pooled_prompt_embeds, pooled)


def test_documented_evaluation_follows_geneval_protocol():
    """eval.json: 4 images per held-out prompt, and ``overall`` = the mean over the four categories."""
    measured = json.loads((ASSET_DIR / "eval.json").read_text())
    for key in ("heldout_ode", "heldout_sde07"):
        res = measured[key]
        assert res["images_per_prompt"] == IMAGES_PER_PROMPT == 4
        assert res["n"] == len(heldout_prompts()) * 4 == 1024
        assert set(res["by_category"]) == set(CATEGORIES)
        assert res["overall"] == pytest.approx(np.mean([c["strict"] for c in res["by_category"].values()]))
        n_strict = sum(c["strict"] * c["n"] for c in res["by_category"].values())
        assert res["strict"] == pytest.approx(n_strict / res["n"])


#: How far a recomputation of the held-out ``overall`` may drift from eval.json across machines and
#: thread counts: 0.03 is ~4 of the 32 single-object images, or ~40 of the 384 pair images, flipping.
OVERALL_TOLERANCE = 0.03


@pytest.mark.slow
def test_base_accuracy_leaves_room_for_rl(policy):
    """Issue 3: held-out strict accuracy of the base model in [20 %, 60 %], measured here with fixed seeds.

    The protocol of eval.json's ``heldout_ode``: 256 held-out prompts x 4 images, seeds 0..1023, ODE,
    10 steps; GenEval's ``overall`` (the mean of the four category accuracies).
    """
    measured = json.loads((ASSET_DIR / "eval.json").read_text())["heldout_ode"]
    assert 0.2 <= measured["overall"] <= 0.6, measured["overall"]
    assert measured["images_per_prompt"] == 4 and measured["n"] == 1024
    res = evaluate(None, seed=0, noise_level=0.0, num_inference_steps=10, images_per_prompt=4, policy=policy)
    assert res["n"] == 1024
    assert abs(res["overall"] - measured["overall"]) <= OVERALL_TOLERANCE, (res["overall"], measured["overall"])
    assert 0.2 - OVERALL_TOLERANCE <= res["overall"] <= 0.6 + OVERALL_TOLERANCE, res["overall"]
    # room for RL: most images miss at least one clause, yet colours are drawn right
    assert res["strict"] < 0.5 and res["color"] > 0.9, (res["strict"], res["color"])


def test_heldout_accuracy_matches_documented_value(policy):
    measured = json.loads((ASSET_DIR / "eval.json").read_text())
    expected = measured["subset_ode"]["strict"]
    prompts = heldout_prompts()[::4]
    torch.manual_seed(0)
    res = evaluate(None, prompts, seed=0, noise_level=0.0, num_inference_steps=10, policy=policy)
    assert res["n"] == 64
    assert abs(res["strict"] - expected) <= SUBSET_TOLERANCE, (res["strict"], expected)
    assert abs(res["color"] - measured["subset_ode"]["color"]) <= SUBSET_TOLERANCE
    assert isinstance(res["images"], np.ndarray) and res["images"].shape == (64, 32, 32, 3)
    assert res["overall"] == pytest.approx(np.mean([c["strict"] for c in res["by_category"].values()]))


def test_evaluate_draws_several_images_per_prompt(policy):
    prompts = heldout_prompts()[:3]
    one = evaluate(None, prompts, seed=0, num_inference_steps=2, policy=policy)
    two = evaluate(None, prompts, seed=0, num_inference_steps=2, images_per_prompt=2, policy=policy)
    assert two["n"] == 6 and two["images_per_prompt"] == 2 and two["images"].shape[0] == 6
    np.testing.assert_array_equal(two["images"][0], one["images"][0])  # row i of the 6 uses seed i
    alone = evaluate(None, prompts[1:2], seed=2, num_inference_steps=2, policy=policy)
    np.testing.assert_array_equal(two["images"][2], alone["images"][0])  # prompt 1's first image: seed 2
    assert not np.array_equal(two["images"][0], two["images"][1])
    with pytest.raises(ValueError, match="images_per_prompt"):
        evaluate(None, prompts, images_per_prompt=0, policy=policy)
