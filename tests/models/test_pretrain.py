"""The pretraining script: a short fixed-step run yields a loadable pipeline; the loss weights."""

import json

import numpy as np
import pytest
import torch

from omnirl_async.data.shapes import render
from omnirl_async.models.pretrain import foreground_weights, pretrain, to_tensor


def test_foreground_weights_mark_objects_and_a_one_pixel_margin():
    img, objects = render("a red square", np.random.default_rng(0))
    w = foreground_weights(to_tensor(img[None]), 16, 4.0)
    assert w.shape == (1, 1, 16, 16)
    assert set(torch.unique(w).tolist()) == {1.0, 5.0}
    y0, x0, y1, x1 = objects[0].bbox
    on = w[0, 0]
    # every latent pixel covering the object (2x2 image pixels each) is weighted, plus one around it
    ly0, lx0, ly1, lx1 = y0 // 2, x0 // 2, (y1 - 1) // 2, (x1 - 1) // 2
    expected = torch.ones(16, 16)
    expected[max(ly0 - 1, 0):ly1 + 2, max(lx0 - 1, 0):lx1 + 2] = 5.0
    torch.testing.assert_close(on, expected)
    assert torch.equal(foreground_weights(to_tensor(img[None]), 16, 0.0), torch.ones(1, 1, 16, 16))


def test_short_fixed_step_run_saves_a_loadable_pipeline(tmp_path):
    from omnirl_async.models.policy import FlowMatchPolicy

    out = pretrain(tmp_path / "m", seed=0, minutes=5, ae_steps=12, flow_steps=12, batch_size=4, ae_batch_size=4,
                   eval_every=0, threads=1, processes=1, progress=False)
    log = json.loads((out / "pretrain_log.json").read_text())
    assert log["ae_steps"] == 12 and log["flow_steps"] == 12
    assert log["args"]["foreground_weight"] == 4.0
    assert 0.0 <= log["ae_check"]["strict"] <= 1.0 and log["ae_check"]["n"] == 1024
    policy = FlowMatchPolicy.from_pretrained(out)
    emb = policy.encode_prompt(["a red circle"], max_sequence_length=1)
    assert emb.prompt_embeds.shape[0] == 1
    size = policy.transformer.config.sample_size
    image = policy.decode(torch.zeros(1, policy.latent_channels, size, size), 32, 32)
    assert image.shape == (1, 32, 32, 3) and image.dtype == np.uint8


@pytest.mark.slow
def test_two_data_parallel_processes_train_in_step_and_save_once(tmp_path):
    """2 gloo processes: rank 0's plan is shared, gradients are averaged, weights end bit-identical."""
    from omnirl_async.models.policy import FlowMatchPolicy

    out = pretrain(tmp_path / "dp", seed=0, minutes=5, ae_steps=12, flow_steps=12, batch_size=4, ae_batch_size=4,
                   eval_every=0, threads=1, processes=2, progress=False)
    log = json.loads((out / "pretrain_log.json").read_text())
    assert log["processes"] == 2 and log["ae_steps"] == 12 and log["flow_steps"] == 12
    assert log["args"]["processes"] == 2 and log["ae_check"]["n"] == 1024
    FlowMatchPolicy.from_pretrained(out)  # rank 0 saved a loadable pipeline (the ranks' weights were checked equal)


def test_batch_must_split_evenly_over_processes(tmp_path):
    with pytest.raises(ValueError, match=r"`batch_size`=5 must be a multiple of `processes`=2"):
        pretrain(tmp_path / "x", batch_size=5, processes=2, progress=False)
    assert not (tmp_path / "x").exists()
