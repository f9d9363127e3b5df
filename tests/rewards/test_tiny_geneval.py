"""tiny_geneval against the renderer's ground truth, and against wrong prompts."""

import dataclasses

import numpy as np
import pytest

from omnirl_async.data.shapes import (COLORS, PALETTE, SHAPES, ObjectGroup, SceneSpec, render, render_batch,
                                      sample_spec, shape_template)
from omnirl_async.rewards import clause_accuracy, get_reward_fn
from omnirl_async.rewards.tiny_geneval import CLAUSE_TYPES, find_objects, label_components, segment_colors

N = 5000
tiny_geneval = get_reward_fn("tiny_geneval")


@pytest.fixture(scope="module")
def world():
    rng = np.random.default_rng(1234)
    specs = [sample_spec(rng) for _ in range(N)]
    images, objects = render_batch(specs, rng)
    return specs, images, objects


def test_agrees_with_ground_truth(world):
    specs, images, _ = world
    out = tiny_geneval(images, [s.prompt for s in specs])
    assert out["strict"].mean() >= 0.99
    assert out["score"].min() >= 0.0 and out["score"].max() <= 1.0
    for value in out.values():
        assert value.shape == (N,) and value.dtype == np.float32
    acc = clause_accuracy(out)
    assert all(acc[t] >= 0.99 for t in CLAUSE_TYPES), acc


def test_detected_objects_match_rendered_objects(world):
    specs, images, objects = world
    found = find_objects(images[:500])
    truth = sorted((i, COLORS.index(o.color), SHAPES.index(o.shape), o.bbox)
                   for i, objs in enumerate(objects[:500]) for o in objs)
    got = sorted(zip(found["image"].tolist(), found["color"].tolist(), found["shape"].tolist(),
                     map(tuple, found["bbox"].tolist())))
    assert got == truth


def _mutate(spec: SceneSpec, kind: str, rng: np.random.Generator) -> SceneSpec:
    g = int(rng.integers(len(spec.groups)))
    groups = list(spec.groups)
    old = groups[g]
    if kind == "count":
        new = dataclasses.replace(old, count=int(rng.choice([n for n in range(1, 5) if n != old.count])))
    elif kind == "color":  # a colour that is nowhere in the image
        absent = [c for c in COLORS if c not in {x.color for x in spec.groups}]
        new = dataclasses.replace(old, color=str(rng.choice(absent)))
    elif kind == "shape":
        new = dataclasses.replace(old, shape=str(rng.choice([s for s in SHAPES if s != old.shape])))
    else:  # position: the opposite relation
        flip = {"left": "right", "right": "left", "above": "below", "below": "above"}
        return SceneSpec(spec.groups, flip[spec.relation])
    groups[g] = new
    return SceneSpec(tuple(groups), spec.relation)


def test_fails_the_changed_clause(world):
    specs, images, _ = world
    rng = np.random.default_rng(7)
    kinds, prompts = [], []
    for spec in specs:
        options = ["count", "color", "shape"] + (["position"] if spec.relation not in (None, "and") else [])
        kind = options[int(rng.integers(len(options)))]
        kinds.append(kind)
        prompts.append(_mutate(spec, kind, rng).prompt)
    out = tiny_geneval(images, prompts)
    kinds = np.array(kinds)
    for kind in ("count", "color", "shape", "position"):
        sel = kinds == kind
        assert sel.sum() > 100
        failed = out[f"clause/{kind}"][sel] < out[f"clause/{kind}_total"][sel]
        assert failed.mean() >= 0.99, (kind, failed.mean())
    assert out["strict"].max() == 0.0 and out["score"].max() < 1.0


def test_partial_credit_and_clause_counts():
    rng = np.random.default_rng(0)
    image, _ = render("two red circles", rng)
    images = np.stack([image] * 4)
    prompts = ["two red circles", "three red circles", "two red squares", "two blue squares"]
    out = tiny_geneval(images, prompts)
    np.testing.assert_allclose(out["score"], [1.0, 2 / 3, 1 / 3, 0.0], rtol=1e-6)
    assert out["strict"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert out["clause/position_total"].tolist() == [0.0] * 4
    assert out["clause/count_total"].tolist() == [1.0] * 4

    image, _ = render("a blue square to the left of a yellow triangle", rng)
    out = tiny_geneval(np.stack([image] * 2), ["a blue square to the left of a yellow triangle",
                                               "a blue square to the right of a yellow triangle"])
    np.testing.assert_allclose(out["score"], [1.0, 6 / 7], rtol=1e-6)
    assert out["clause/position"].tolist() == [1.0, 0.0]
    assert out["clause/color_total"].tolist() == [2.0, 2.0]
    acc = clause_accuracy(out)
    assert acc["position"] == 0.5 and acc["count"] == 1.0 and acc["strict"] == 0.5


def _draw(objects) -> np.ndarray:
    """A 32x32 image with ``(colour, shape, y, x)`` objects of size 10."""
    image = np.zeros((32, 32, 3), np.uint8)
    for color, shape, y, x in objects:
        image[y:y + 10, x:x + 10][shape_template(shape, 10)] = PALETTE[color]
    return image


def test_penalize_extras_fails_shape_and_count_in_score_only():
    # "a red square" drawn with an extra red circle: GenEval's clauses all pass.
    hedge = _draw([("red", "square", 4, 2), ("red", "circle", 4, 18)])
    exact = _draw([("red", "square", 4, 2), ("blue", "circle", 4, 18)])
    pair = _draw([("red", "square", 2, 2), ("red", "circle", 18, 2), ("blue", "circle", 2, 18)])
    images = np.stack([hedge, exact, pair, pair])
    prompts = ["a red square", "a red square", "a red square and a blue circle",
               "a red square and a red circle"]  # one colour in both groups: both objects are asked for
    plain = tiny_geneval(images, prompts)
    excl = tiny_geneval(images, prompts, penalize_extras=True)
    np.testing.assert_allclose(plain["score"], [1.0, 1.0, 1.0, 1.0])
    np.testing.assert_allclose(excl["score"], [1 / 3, 1.0, 4 / 6, 1.0], rtol=1e-6)
    for key in plain:
        if key != "score":
            np.testing.assert_array_equal(plain[key], excl[key], err_msg=key)
    assert plain["strict"].tolist() == [1.0] * 4


def test_penalize_extras_agrees_with_ground_truth(world):
    specs, images, _ = world
    out = tiny_geneval(images[:1000], [s.prompt for s in specs[:1000]], penalize_extras=True)
    np.testing.assert_array_equal(out["score"] == 1.0, out["strict"] == 1.0)
    assert out["strict"].mean() >= 0.99


def test_empty_image_scores_zero():
    out = tiny_geneval(np.zeros((1, 32, 32, 3), np.uint8), ["a red circle and two blue squares"])
    assert out["score"].tolist() == [0.0]


def test_robust_to_noise_and_mild_blur(world):
    specs, images, _ = world
    rng = np.random.default_rng(3)
    x = images[:1000].astype(np.float32)
    prompts = [s.prompt for s in specs[:1000]]
    noisy = np.clip(x + rng.normal(0, 15, x.shape), 0, 255).astype(np.uint8)
    assert tiny_geneval(noisy, prompts)["strict"].mean() >= 0.99
    # 3×3 blur with weights (1, 2, 1)/4 per axis (≈ Gaussian sigma 0.7)
    pad = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    rows = (pad[:, :-2] + 2 * pad[:, 1:-1] + pad[:, 2:]) / 4
    blurred = ((rows[:, :, :-2] + 2 * rows[:, :, 1:-1] + rows[:, :, 2:]) / 4).round().astype(np.uint8)
    assert tiny_geneval(blurred, prompts)["strict"].mean() >= 0.97


def test_numpy_labelling_matches_scipy():
    pytest.importorskip("scipy")
    rng = np.random.default_rng(0)
    classes = segment_colors(rng.integers(0, 256, (40, 32, 32, 3), dtype=np.uint8), 150.0)
    a, na = label_components(classes, use_scipy=True)
    b, nb = label_components(classes, use_scipy=False)
    assert na == nb
    # same partition: the label pairs are a bijection
    pairs = set(zip(a.ravel().tolist(), b.ravel().tolist()))
    assert len(pairs) == na + 1


def test_numpy_path_gives_same_scores(world):
    specs, images, _ = world
    prompts = [s.prompt for s in specs[:300]]
    a = tiny_geneval(images[:300], prompts, use_scipy=False)
    b = tiny_geneval(images[:300], prompts, chunk_size=64)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


def test_bad_inputs():
    with pytest.raises(ValueError, match="cannot parse prompt 'a red elephant'"):
        tiny_geneval(np.zeros((1, 32, 32, 3), np.uint8), ["a red elephant"])
    with pytest.raises(ValueError, match="uint8"):
        tiny_geneval(np.zeros((1, 32, 32), np.uint8), ["a red circle"])
    with pytest.raises(ValueError, match="2 entries"):
        tiny_geneval(np.zeros((1, 32, 32, 3), np.uint8), ["a red circle"] * 2)


def test_crowded_prompts_render_and_verify():
    rng = np.random.default_rng(5)
    prompts = ["four red circles above four blue squares", "four white triangles and four green circles",
               "four purple squares to the right of three yellow triangles"] * 5
    images, _ = render_batch(prompts, rng)
    assert tiny_geneval(images, prompts)["strict"].mean() >= 0.9
    spec = SceneSpec((ObjectGroup(4, "red", "circle"),))
    assert tiny_geneval(render(spec, rng)[0][None], [spec.prompt])["strict"][0] == 1.0


@pytest.mark.parametrize("density", [0.1, 0.3, 0.5, 0.7])
def test_numpy_labelling_matches_scipy_on_random_masks(density):
    ndimage = pytest.importorskip("scipy.ndimage")
    from omnirl_async.rewards.tiny_geneval import _label_numpy

    rng = np.random.default_rng(int(density * 10))
    planes = rng.random((30, 17, 23)) < density
    ours, n = _label_numpy(planes)
    structure = np.zeros((3, 3, 3), bool)
    structure[1] = True  # 8-connected within a plane, nothing across planes
    ref, n_ref = ndimage.label(planes, structure=structure)
    assert n == n_ref
    assert len(set(zip(ours.ravel().tolist(), ref.ravel().tolist()))) == n + 1


def test_works_without_scipy(world, monkeypatch):
    import omnirl_async.rewards.tiny_geneval as tg

    monkeypatch.setattr(tg, "_ndimage", None)
    specs, images, _ = world
    out = tiny_geneval(images[:200], [s.prompt for s in specs[:200]])
    assert out["strict"].mean() >= 0.99
    empty = tiny_geneval(np.zeros((2, 32, 32, 3), np.uint8), ["a red circle"] * 2)
    assert empty["score"].tolist() == [0.0, 0.0]
