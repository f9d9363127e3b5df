"""The shapes-world grammar and renderer."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnirl_async.data.prompts import CATEGORIES, enumerate_prompts
from omnirl_async.data.shapes import (
    COLORS,
    MIN_SIZE,
    PALETTE,
    SHAPES,
    SIZE_RANGE,
    ObjectGroup,
    SceneSpec,
    parse_prompt,
    render,
    render_batch,
    sample_prompt,
    sample_scene,
    sample_spec,
    shape_template,
)


@pytest.mark.parametrize("prompt, groups, relation", [
    ("two red circles", [(2, "red", "circle")], None),
    ("one purple circle", [(1, "purple", "circle")], None),
    ("three green triangles", [(3, "green", "triangle")], None),
    ("A blue square to the left of a yellow triangle.", [(1, "blue", "square"), (1, "yellow", "triangle")], "left"),
    ("an white square below four red circles", [(1, "white", "square"), (4, "red", "circle")], "below"),
    ("a red circle and two blue squares", [(1, "red", "circle"), (2, "blue", "square")], "and"),
    ("two green squares to the right of a red square", [(2, "green", "square"), (1, "red", "square")], "right"),
    ("a yellow circle above a yellow square", [(1, "yellow", "circle"), (1, "yellow", "square")], "above"),
])
def test_parse(prompt, groups, relation):
    spec = parse_prompt(prompt)
    assert [(g.count, g.color, g.shape) for g in spec.groups] == groups
    assert spec.relation == relation


@pytest.mark.parametrize("prompt, fragment", [
    ("five red circles", "expected a count word"),
    ("two magenta circles", "expected a colour"),
    ("two red", "expected a shape"),
    ("two red hexagons", "at 'hexagons'"),
    ("two red circles next to a blue square", "expected end of prompt or a connector"),
    ("two red circles above", "expected a count word"),
    ("a red circle and a blue square and a white circle", "trailing words"),
    ("a red circle left of a red circle", "connector"),
    ("a red circle above two red circles", "must differ in colour or shape"),
    ("", "expected a count word"),
])
def test_parse_errors_name_prompt_and_part(prompt, fragment):
    with pytest.raises(ValueError) as e:
        parse_prompt(prompt)
    assert fragment in str(e.value) and repr(prompt) in str(e.value)


def test_parse_rejects_non_str():
    with pytest.raises(ValueError, match="must be a str"):
        parse_prompt(3)


def test_canonical_prompts_round_trip():
    for category in CATEGORIES:
        for prompt in enumerate_prompts(category):
            assert parse_prompt(prompt).prompt == prompt


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_sampled_prompts_parse_back(seed):
    prompt, spec = sample_prompt(np.random.default_rng(seed))
    assert parse_prompt(prompt) == spec
    if len(spec.groups) == 2:
        assert spec.groups[0].color != spec.groups[1].color


def test_spec_validation():
    with pytest.raises(ValueError, match="`count`"):
        ObjectGroup(5, "red", "circle")
    with pytest.raises(ValueError, match="`relation` must be set exactly"):
        SceneSpec((ObjectGroup(1, "red", "circle"),), "left")
    with pytest.raises(ValueError, match="`category`"):
        sample_spec(np.random.default_rng(0), "dance")


def _check_scene(spec, image, objects):
    size = image.shape[0]
    # counts, colours and shapes per group
    for gi, group in enumerate(spec.groups):
        mine = [o for o in objects if o.group == gi]
        assert len(mine) == group.count
        assert all(o.color == group.color and o.shape == group.shape for o in mine)
    # inside the canvas, no overlap, at least one black pixel between boxes
    for i, a in enumerate(objects):
        y0, x0, y1, x1 = a.bbox
        assert 0 <= y0 < y1 <= size and 0 <= x0 < x1 <= size and y1 - y0 == x1 - x0
        for b in objects[i + 1:]:
            gap_y = max(b.bbox[0] - a.bbox[2], a.bbox[0] - b.bbox[2])
            gap_x = max(b.bbox[1] - a.bbox[3], a.bbox[1] - b.bbox[3])
            assert max(gap_y, gap_x) >= 1
    # pixels: exactly the templates in their colours, black elsewhere
    expected = np.zeros_like(image)
    for o in objects:
        y0, x0, y1, x1 = o.bbox
        expected[y0:y1, x0:x1][shape_template(o.shape, y1 - y0)] = PALETTE[o.color]
    np.testing.assert_array_equal(image, expected)
    # position: every object of group 0 is wholly on its side of every object of group 1
    if spec.relation not in (None, "and"):
        for a in (o for o in objects if o.group == 0):
            for b in (o for o in objects if o.group == 1):
                ok = {"left": a.bbox[3] <= b.bbox[1], "right": a.bbox[1] >= b.bbox[3],
                      "above": a.bbox[2] <= b.bbox[0], "below": a.bbox[0] >= b.bbox[2]}[spec.relation]
                assert ok, (spec.prompt, a, b)


def test_render_is_faithful():
    rng = np.random.default_rng(0)
    for _ in range(1500):
        spec = sample_spec(rng)
        image, objects = render(spec, rng)
        assert image.dtype == np.uint8 and image.shape == (32, 32, 3)
        _check_scene(spec, image, objects)


@pytest.mark.parametrize("prompt", ["four red circles above four blue squares",
                                    "four green triangles to the right of four white circles",
                                    "four purple squares and four yellow triangles"])
def test_render_crowded(prompt):
    rng = np.random.default_rng(1)
    for _ in range(10):
        image, objects = render(prompt, rng)
        _check_scene(parse_prompt(prompt), image, objects)


def test_render_sizes_vary_and_templates_fill_their_box():
    rng = np.random.default_rng(2)
    sizes = {o.bbox[2] - o.bbox[0] for _ in range(200) for o in render("a red circle", rng)[1]}
    assert sizes == set(range(SIZE_RANGE[0], SIZE_RANGE[1] + 1))
    crowded = {o.bbox[2] - o.bbox[0] for _ in range(100) for o in render("four red circles", rng)[1]}
    assert min(crowded) >= MIN_SIZE and max(crowded) <= SIZE_RANGE[1]
    for shape in SHAPES:
        for s in range(MIN_SIZE, SIZE_RANGE[1] + 1):
            m = shape_template(shape, s)
            assert m.any(0).all() and m.any(1).all()  # the shape spans its box


def test_render_is_seeded():
    specs = [sample_spec(np.random.default_rng(i)) for i in range(50)]
    a, _ = render_batch(specs, np.random.default_rng(9))
    b, _ = render_batch(specs, np.random.default_rng(9))
    c, _ = render_batch(specs, np.random.default_rng(10))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    p1 = [sample_prompt(np.random.default_rng(3))[0] for _ in range(3)]
    assert len(set(p1)) == 1


def test_sample_scene_from_list():
    rng = np.random.default_rng(0)
    prompts = ["two red circles", "a blue square"]
    seen = {sample_scene(rng, prompts)[0] for _ in range(50)}
    assert seen == set(prompts)
    with pytest.raises(ValueError, match="empty"):
        sample_scene(rng, [])


def test_palette_is_segmentation_friendly():
    rgb = np.array([PALETTE[c] for c in COLORS], float)
    d = np.linalg.norm(rgb[:, None] - rgb[None], axis=-1)
    assert d[~np.eye(len(rgb), dtype=bool)].min() >= 160
    assert np.linalg.norm(rgb, axis=1).min() >= 200
    assert len(COLORS) >= 5 and len(SHAPES) >= 3
