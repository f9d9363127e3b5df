"""The shapes world: a tiny, verifiable text-to-image task.

Every image is a black 32×32 canvas with a few flat-coloured circles, squares
and triangles on it, and every prompt says exactly what should be there::

    "two red circles"
    "a blue square to the left of a yellow triangle"
    "a green triangle and three white squares"

Because the vocabulary is closed, a prompt parses into a :class:`SceneSpec`
(groups of ``count × colour × shape`` plus an optional relation between two
groups), the renderer draws a scene that satisfies the spec, and the reward
:mod:`omnirl_async.rewards.tiny_geneval` checks a generated image against the
spec. That is the GenEval recipe (count, colour, position) shrunk to a size a
CPU can train on.

Grammar (lower case, one optional trailing period)::

    prompt   := group [connector group]
    group    := COUNT COLOUR SHAPE        e.g. "a red circle", "three blue squares"
    COUNT    := a | an | one | two | three | four
    connector:= and | to the left of | to the right of | above | below

A relation reads "group 0 RELATION group 1"; "above" means a smaller row index
(image rows grow downwards).

Rendering rules that the reward relies on
-----------------------------------------
* Colours are exact palette RGB values on black (:data:`PALETTE`); the palette
  is chosen so that any two colours are at least 165 apart in RGB, which lets
  the reward segment blurry model outputs by nearest colour.
* Objects never overlap and keep at least one black pixel between their
  bounding boxes, so each object is one connected component of its colour.
* Triangles point up. Squares fill their box, circles fill 67–84 % of it and
  triangles 59–68 % with two thirds or more of their mass in the lower half;
  those two numbers are what the reward's shape classifier measures.
* With a position relation, the canvas is split by a random line and each group
  is drawn wholly on its side, so every object of group 0 is left of (above, …)
  every object of group 1.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Sequence

import numpy as np

__all__ = [
    "PALETTE",
    "COLORS",
    "SHAPES",
    "RELATIONS",
    "COUNT_WORDS",
    "IMAGE_SIZE",
    "ObjectGroup",
    "SceneSpec",
    "SceneObject",
    "Scene",
    "parse_prompt",
    "sample_spec",
    "sample_prompt",
    "sample_scene",
    "render",
    "render_batch",
    "shape_template",
]

IMAGE_SIZE = 32

#: Colour name → RGB. Pairwise distances are ≥ 165 and every colour is ≥ 200
#: from black, so nearest-colour segmentation tolerates a lot of blur.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (230, 25, 25),
    "green": (25, 200, 40),
    "blue": (30, 70, 255),
    "yellow": (245, 225, 20),
    "purple": (190, 40, 230),
    "white": (245, 245, 245),
}
COLORS: tuple[str, ...] = tuple(PALETTE)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
_PLURALS = {s + "s": s for s in SHAPES}

#: Relation keyword → phrase in the prompt. ``"and"`` has no spatial meaning.
RELATIONS: dict[str, str] = {
    "and": "and",
    "left": "to the left of",
    "right": "to the right of",
    "above": "above",
    "below": "below",
}
SPATIAL_RELATIONS = ("left", "right", "above", "below")
COUNT_WORDS: dict[str, int] = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4}
_NUMBER_NAMES = {1: "one", 2: "two", 3: "three", 4: "four"}
MAX_COUNT = 4

#: Default object size range in pixels (inclusive), before crowding shrinks it.
SIZE_RANGE = (8, 14)
MIN_SIZE = 5


# --------------------------------------------------------------------- specs
@dataclasses.dataclass(frozen=True)
class ObjectGroup:
    """``count`` objects of one colour and one shape, e.g. "two red circles"."""

    count: int
    color: str
    shape: str

    def __post_init__(self):
        if not 1 <= self.count <= MAX_COUNT:
            raise ValueError(f"`count` must be in 1..{MAX_COUNT}, got {self.count!r}")
        if self.color not in PALETTE:
            raise ValueError(f"`color` must be one of {COLORS}, got {self.color!r}")
        if self.shape not in SHAPES:
            raise ValueError(f"`shape` must be one of {SHAPES}, got {self.shape!r}")

    @property
    def text(self) -> str:
        if self.count == 1:
            return f"a {self.color} {self.shape}"
        return f"{_NUMBER_NAMES[self.count]} {self.color} {self.shape}s"


@dataclasses.dataclass(frozen=True)
class SceneSpec:
    """What a prompt asks for: one or two groups and how the two relate.

    ``relation`` is ``None`` for one group, else a key of :data:`RELATIONS`
    read as "groups[0] relation groups[1]".
    """

    groups: tuple[ObjectGroup, ...]
    relation: str | None = None

    def __post_init__(self):
        if len(self.groups) not in (1, 2):
            raise ValueError(f"`groups` must hold 1 or 2 groups, got {len(self.groups)}")
        if (len(self.groups) == 2) != (self.relation is not None):
            raise ValueError(
                f"`relation` must be set exactly when there are two groups; got "
                f"{len(self.groups)} group(s) and relation={self.relation!r}"
            )
        if self.relation is not None and self.relation not in RELATIONS:
            raise ValueError(f"`relation` must be one of {tuple(RELATIONS)}, got {self.relation!r}")
        if len(self.groups) == 2:
            a, b = self.groups
            if (a.color, a.shape) == (b.color, b.shape):
                raise ValueError(
                    f"the two groups of a prompt must differ in colour or shape, got "
                    f"{a.color} {a.shape} twice; merge them into one group instead"
                )

    @property
    def prompt(self) -> str:
        """The canonical prompt text for this spec."""
        text = self.groups[0].text
        if self.relation is not None:
            text += f" {RELATIONS[self.relation]} {self.groups[1].text}"
        return text

    @property
    def num_objects(self) -> int:
        return sum(g.count for g in self.groups)


@dataclasses.dataclass(frozen=True)
class SceneObject:
    """One drawn object. ``bbox`` is ``(y0, x0, y1, x1)``, end-exclusive."""

    color: str
    shape: str
    bbox: tuple[int, int, int, int]
    group: int

    @property
    def centroid(self) -> tuple[float, float]:
        y0, x0, y1, x1 = self.bbox
        return ((y0 + y1) / 2.0, (x0 + x1) / 2.0)


@dataclasses.dataclass(frozen=True)
class Scene:
    """A rendered scene: the spec, the objects as drawn, and the image."""

    spec: SceneSpec
    objects: tuple[SceneObject, ...]
    image: np.ndarray


# ------------------------------------------------------------------- parsing
_RELATION_PHRASES = sorted(((v.split(), k) for k, v in RELATIONS.items()), key=lambda t: -len(t[0]))


def _parse_group(prompt: str, words: list[str], i: int) -> tuple[ObjectGroup, int]:
    """Parse "COUNT COLOUR SHAPE" starting at word ``i``; return it and the next index."""

    def fail(at: int, what: str) -> ValueError:
        rest = " ".join(words[at:]) or "<end of prompt>"
        return ValueError(f"cannot parse prompt {prompt!r}: expected {what} at {rest!r}")

    if i >= len(words) or words[i] not in COUNT_WORDS:
        raise fail(i, f"a count word ({', '.join(COUNT_WORDS)})")
    if i + 1 >= len(words) or words[i + 1] not in PALETTE:
        raise fail(i + 1, f"a colour ({', '.join(COLORS)})")
    shape_word = words[i + 2] if i + 2 < len(words) else ""
    shape = shape_word if shape_word in SHAPES else _PLURALS.get(shape_word)
    if shape is None:
        raise fail(i + 2, f"a shape ({', '.join(SHAPES)}, singular or plural)")
    return ObjectGroup(COUNT_WORDS[words[i]], words[i + 1], shape), i + 3


@functools.lru_cache(maxsize=8192)
def parse_prompt(prompt: str) -> SceneSpec:
    """Parse a prompt of the shapes grammar into a :class:`SceneSpec`.

    Raises ``ValueError`` naming the prompt and the part that did not parse.
    Results are cached: training repeats the same prompts many times.
    """
    if not isinstance(prompt, str):
        raise ValueError(f"`prompt` must be a str, got {type(prompt).__name__}: {prompt!r}")
    words = re.sub(r"[.!]+$", "", prompt.strip().lower()).replace(",", " ").split()
    group0, i = _parse_group(prompt, words, 0)
    if i == len(words):
        return SceneSpec((group0,), None)
    for phrase, relation in _RELATION_PHRASES:
        if words[i : i + len(phrase)] == phrase:
            group1, j = _parse_group(prompt, words, i + len(phrase))
            if j != len(words):
                raise ValueError(
                    f"cannot parse prompt {prompt!r}: unexpected trailing words "
                    f"{' '.join(words[j:])!r}; a prompt holds at most two groups"
                )
            try:
                return SceneSpec((group0, group1), relation)
            except ValueError as e:
                raise ValueError(f"cannot parse prompt {prompt!r}: {e}") from None
    raise ValueError(
        f"cannot parse prompt {prompt!r}: expected end of prompt or a connector "
        f"({', '.join(repr(v) for v in RELATIONS.values())}) at {' '.join(words[i:])!r}"
    )


# ------------------------------------------------------------------ sampling
#: Prompt categories and how often :func:`sample_spec` draws each.
CATEGORY_WEIGHTS: dict[str, float] = {"single": 0.15, "counting": 0.30, "pair": 0.25, "position": 0.30}
#: Count pairs used for "pair" prompts (at most four objects in all).
PAIR_COUNTS: tuple[tuple[int, int], ...] = ((1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (2, 2))


def sample_spec(rng: np.random.Generator, category: str | None = None) -> SceneSpec:
    """Draw a random spec. ``category`` is one of :data:`CATEGORY_WEIGHTS`
    ("single": one object; "counting": 2–4 of one kind; "pair": two groups
    joined by "and"; "position": two single objects and a spatial relation).
    Two-group specs always use two different colours."""
    if category is None:
        cats = list(CATEGORY_WEIGHTS)
        p = np.array([CATEGORY_WEIGHTS[c] for c in cats])
        category = cats[rng.choice(len(cats), p=p / p.sum())]
    if category not in CATEGORY_WEIGHTS:
        raise ValueError(f"`category` must be one of {tuple(CATEGORY_WEIGHTS)}, got {category!r}")
    c0, c1 = rng.choice(len(COLORS), size=2, replace=False)
    s0, s1 = rng.integers(len(SHAPES), size=2)
    if category == "single":
        return SceneSpec((ObjectGroup(1, COLORS[c0], SHAPES[s0]),))
    if category == "counting":
        return SceneSpec((ObjectGroup(int(rng.integers(2, MAX_COUNT + 1)), COLORS[c0], SHAPES[s0]),))
    if category == "pair":
        n0, n1 = PAIR_COUNTS[rng.integers(len(PAIR_COUNTS))]
        relation = "and"
    else:
        n0 = n1 = 1
        relation = SPATIAL_RELATIONS[rng.integers(len(SPATIAL_RELATIONS))]
    return SceneSpec(
        (ObjectGroup(n0, COLORS[c0], SHAPES[s0]), ObjectGroup(n1, COLORS[c1], SHAPES[s1])), relation
    )


def sample_prompt(rng: np.random.Generator, category: str | None = None) -> tuple[str, SceneSpec]:
    """Draw a random prompt; returns ``(prompt, spec)``."""
    spec = sample_spec(rng, category)
    return spec.prompt, spec


def sample_scene(
    rng: np.random.Generator, prompts: Sequence[str] | None = None
) -> tuple[str, SceneSpec]:
    """Draw ``(prompt, spec)`` from ``prompts`` (uniformly) or, when ``None``,
    from the whole grammar (:func:`sample_prompt`). Pass the training prompt
    list (:func:`omnirl_async.data.prompts.train_prompts`) to keep held-out
    prompts out of a pretraining stream."""
    if prompts is None:
        return sample_prompt(rng)
    if len(prompts) == 0:
        raise ValueError("`prompts` is empty; pass None to sample from the whole grammar")
    prompt = prompts[int(rng.integers(len(prompts)))]
    return prompt, parse_prompt(prompt)


# ----------------------------------------------------------------- rendering
@functools.lru_cache(maxsize=None)
def shape_template(shape: str, size: int) -> np.ndarray:
    """Boolean ``[size, size]`` mask of a shape whose bounding box is the full square.

    Pixel centres are tested against the continuous shape: a disc of radius
    ``size/2`` shrunk slightly (so small circles lose their corners), and an
    upward triangle with apex at the top centre and base on the bottom row.
    """
    c = np.arange(size) + 0.5
    yy, xx = np.meshgrid(c, c, indexing="ij")
    half = size / 2.0
    if shape == "square":
        mask = np.ones((size, size), dtype=bool)
    elif shape == "circle":
        mask = (yy - half) ** 2 + (xx - half) ** 2 <= half * half - size / 4.0
    elif shape == "triangle":
        row = np.arange(size)[:, None]
        mask = np.abs(xx - half) <= (row + 1) / 2.0 + 1e-9
    else:
        raise ValueError(f"`shape` must be one of {SHAPES}, got {shape!r}")
    mask.setflags(write=False)
    return mask


_RGB = {k: np.array(v, dtype=np.uint8) for k, v in PALETTE.items()}


def _regions(spec: SceneSpec, rng: np.random.Generator, size: int) -> list[tuple[int, int, int, int]]:
    """Per group, the allowed area ``(y0, x0, y1, x1)`` for its boxes."""
    full = (0, 0, size, size)
    if spec.relation is None or spec.relation == "and":
        return [full] * len(spec.groups)
    n0, n1 = spec.groups[0].count, spec.groups[1].count
    # Split proportionally to the counts, with jitter, so both sides fit.
    frac = n0 / (n0 + n1)
    cut = int(round(size * (0.25 + 0.5 * frac) + rng.integers(-3, 4)))
    cut = min(max(cut, MIN_SIZE + 1), size - MIN_SIZE - 1)
    first, second = (0, 0, size, cut), (0, cut, size, size)  # left / right halves
    if spec.relation in ("above", "below"):
        first, second = (0, 0, cut, size), (cut, 0, size, size)
    if spec.relation in ("left", "above"):
        return [first, second]
    return [second, first]


def _try_place(spec, rng, size, max_size, tries_per_object=40):
    regions = _regions(spec, rng, size)
    occupied = np.zeros((size, size), dtype=bool)
    boxes = []
    for gi, group in enumerate(spec.groups):
        ry0, rx0, ry1, rx1 = regions[gi]
        for _ in range(group.count):
            for _ in range(tries_per_object):
                s = int(rng.integers(SIZE_RANGE[0] if max_size >= SIZE_RANGE[0] else MIN_SIZE, max_size + 1))
                if ry1 - ry0 < s or rx1 - rx0 < s:
                    continue
                y0 = int(rng.integers(ry0, ry1 - s + 1))
                x0 = int(rng.integers(rx0, rx1 - s + 1))
                # 1-px gap: the box grown by one must not touch another box.
                if not occupied[max(y0 - 1, 0) : y0 + s + 1, max(x0 - 1, 0) : x0 + s + 1].any():
                    occupied[y0 : y0 + s, x0 : x0 + s] = True
                    boxes.append((gi, group, (y0, x0, y0 + s, x0 + s)))
                    break
            else:
                return None
    return boxes


def render(
    spec: SceneSpec | str, rng: np.random.Generator, *, size: int = IMAGE_SIZE
) -> tuple[np.ndarray, list[SceneObject]]:
    """Draw one scene satisfying ``spec`` (a :class:`SceneSpec` or prompt text).

    Returns ``(image uint8 [size, size, 3], objects)``. Object sizes are drawn
    from :data:`SIZE_RANGE`; a crowded spec that does not fit retries with
    smaller objects (down to :data:`MIN_SIZE`) before giving up with a
    ``ValueError``. Same spec + same rng state → same image.
    """
    if isinstance(spec, str):
        spec = parse_prompt(spec)
    boxes = None
    for max_size in range(SIZE_RANGE[1], MIN_SIZE - 1, -1):
        for _ in range(3):
            boxes = _try_place(spec, rng, size, max_size)
            if boxes is not None:
                break
        if boxes is not None:
            break
    if boxes is None:
        raise ValueError(
            f"cannot place the {spec.num_objects} objects of {spec.prompt!r} on a "
            f"{size}×{size} canvas without overlap; use fewer objects or a larger `size`"
        )
    image = np.zeros((size, size, 3), dtype=np.uint8)
    objects = []
    for gi, group, (y0, x0, y1, x1) in boxes:
        mask = shape_template(group.shape, y1 - y0)
        image[y0:y1, x0:x1][mask] = _RGB[group.color]
        objects.append(SceneObject(group.color, group.shape, (y0, x0, y1, x1), gi))
    return image, objects


def render_batch(
    specs: Sequence[SceneSpec | str], rng: np.random.Generator, *, size: int = IMAGE_SIZE
) -> tuple[np.ndarray, list[list[SceneObject]]]:
    """Render many specs into one ``uint8 [B, size, size, 3]`` array."""
    images = np.zeros((len(specs), size, size, 3), dtype=np.uint8)
    all_objects = []
    for i, spec in enumerate(specs):
        images[i], objects = render(spec, rng, size=size)
        all_objects.append(objects)
    return images, all_objects
