"""Fixtures of the preference-data tests: a dataset with planted bad rows, and the dataset script."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
SIZE = 32
LATENT_SHAPE = (4, 16, 16)  # the embedded shapes model at 32x32

#: row number -> the field named by its problem, for the planted dataset below
PLANTED_BAD = {3: "chosen", 4: "chosen", 5: "rejected", 6: "<row>", 7: "id", 8: "prompt", 9: "rejected"}
PLANTED_GOOD = ["g1", "g2", "g3", "g4"]


def _png(path: Path, image: np.ndarray) -> str:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path)
    return str(path)


def write_planted(folder: Path) -> tuple[Path, dict]:
    """A JSONL dataset: good rows g1..g4 (g3 references latents) and one bad row per kind of problem.

    Returns the file and ``{"latents": {key: array}}`` (what g3 references).
    """
    from safetensors.numpy import save_file

    from omnirl_async.data.shapes import render

    rng = np.random.default_rng(0)
    img = {}
    for name, prompt in [("g1a", "two red circles"), ("g1b", "three red circles"), ("g2a", "a blue square"),
                         ("g2b", "a green square"), ("g4a", "a white triangle"), ("g4b", "a white circle"),
                         ("x", "a yellow circle"), ("y", "a purple square")]:
        img[name], _ = render(prompt, rng, size=SIZE)
        _png(folder / "images" / f"{name}.png", img[name])
    small, _ = render("a red circle", rng, size=16)
    _png(folder / "images" / "small.png", small)
    (folder / "images" / "garbage.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    latents = {"g3.chosen": rng.standard_normal(LATENT_SHAPE).astype(np.float32),
               "g3.rejected": rng.standard_normal(LATENT_SHAPE).astype(np.float32)}
    (folder / "latents").mkdir(parents=True, exist_ok=True)
    save_file(latents, str(folder / "latents" / "part-0.safetensors"))

    def row(i, prompt, chosen, rejected, **kw):
        return json.dumps({"id": i, "prompt": prompt, "chosen": chosen, "rejected": rejected, **kw})

    lines = [
        row("g1", "two red circles", "images/g1a.png", "images/g1b.png", chosen_score=1.0, rejected_score=0.5,
            source="test", metadata={"k": 1}),                                                    # row 1
        row("g2", "a blue square", "images/g2a.png", "images/g2b.png"),                            # row 2
        "",                                                                                        # blank line
        row("b-missing", "a red circle", "images/nope.png", "images/x.png"),                       # row 3
        row("b-garbage", "a red circle", "images/garbage.png", "images/x.png"),                    # row 4
        row("b-size", "a red circle", "images/x.png", "images/small.png"),                         # row 5
        '{"id": "b-json", "prompt": "a red circle", "chosen": ',                                   # row 6
        row("g1", "a yellow circle", "images/x.png", "images/y.png"),                              # row 7
        row("b-prompt", "   ", "images/x.png", "images/y.png"),                                    # row 8
        row("b-same", "a yellow circle", "images/x.png", "./images/x.png"),                        # row 9
        row("g3", "a red circle", "latents:latents/part-0.safetensors#g3.chosen",
            "latents:latents/part-0.safetensors#g3.rejected"),                                     # row 10
        row("g4", "a white triangle", "images/g4a.png", "images/g4b.png", source="test"),          # row 11
    ]
    path = folder / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, {"latents": latents, "images": img}


@pytest.fixture
def planted(tmp_path):
    return write_planted(tmp_path / "planted")


@pytest.fixture(scope="session")
def make_dataset_script():
    """``scripts/make_preference_dataset.py`` as a module."""
    path = REPO / "scripts" / "make_preference_dataset.py"
    spec = importlib.util.spec_from_file_location("make_preference_dataset", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
