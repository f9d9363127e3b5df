"""``tiny_geneval``: a verifiable, GenEval-style reward for the shapes world.

GenEval scores a text-to-image model by detecting objects in its images and
checking the prompt's claims (count, colour, position) one by one. The shapes
world (:mod:`omnirl_async.data.shapes`) is simple enough to replace the
object detector with exact image processing, so the reward is cheap,
deterministic and agrees with the renderer's ground truth.

Pipeline (all steps vectorised over the batch)
----------------------------------------------
1. **Colour segmentation.** A blurred edge pixel is a mix of its object's
   colour and black, so each pixel is projected onto the ray from black
   through every palette colour and takes the colour of the nearest ray, if
   it is within ``color_tolerance`` (RGB distance) of that ray and at least
   ``min_intensity`` (default half) of the way out to the colour; otherwise
   it is background. Thresholding at half intensity keeps a blurred shape's
   outline where the sharp outline was, for every colour alike (plain
   nearest-colour matching would shrink bright colours such as white much
   more than dark ones). Palette colours are ≥ 165 apart, so slightly-off
   model colours still land on the right class.
2. **Connected components** per colour, 8-connected: ``scipy.ndimage.label``
   over a ``[B, colour, H, W]`` one-hot with no links across images or
   colours, or, without scipy, a numpy union-find over horizontal runs that
   gives the same components (tested) at a similar speed. Components smaller
   than ``min_area`` pixels are noise and are dropped.
3. **Shape** per component from two numbers: the share of its pixels in the
   lower half of its bounding box (upward triangles ≈ 0.67–0.71, circles and
   squares 0.5) and its fill ratio ``area / bbox area`` (squares 1.0, circles
   ≤ 0.84). A component whose box is more than ``max_aspect`` times longer
   than wide (two blobs fused, a smear) is shape ``other`` and matches no
   prompt shape.
4. **Clauses.** For each group "N COLOUR SHAPE" of the prompt:

   * ``color`` – some object of COLOUR exists (any shape);
   * ``shape`` – some object of COLOUR has SHAPE (colour-bound, so a red
     square does not satisfy "a blue square");
   * ``count`` – exactly N objects are COLOUR + SHAPE.

   With a spatial relation, ``position`` – both groups are present and the
   mean centroid of group 0 lies left of / right of / above / below that of
   group 1 (strictly, by more than ``position_margin`` pixels).

Output
------
``score`` = fraction of the prompt's clauses met, in [0, 1] (3 clauses for one
group, 6 for "A and B", 7 with a position). With ``penalize_extras=True`` (a
training signal; see :func:`tiny_geneval`) the shape and count clauses of
``score`` also fail when the image holds an object of the group's colour that
the prompt does not ask for. Extras, all ``float32 [B]``:

* ``strict`` – 1.0 iff every clause is met (GenEval's accuracy);
* ``clause/<type>`` – how many clauses of that type are met, and
  ``clause/<type>_total`` – how many the prompt has, for type in color, shape,
  count, position. Counts instead of per-sample fractions so that a batch
  mean never meets a "not applicable" NaN: accuracy of a type over any set of
  samples is ``sum(clause/t) / sum(clause/t_total)`` (:func:`clause_accuracy`).

A prompt outside the shapes grammar raises ``ValueError`` naming it, which the
reward manager turns into a failed batch with that reason.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from omnirl_async.data.shapes import PALETTE, SHAPES, SPATIAL_RELATIONS, SceneSpec, parse_prompt
from omnirl_async.rewards.base import register_reward

try:  # scipy is optional: a numpy labelling below gives the same components.
    from scipy import ndimage as _ndimage
except ImportError:  # pragma: no cover - depends on the environment
    _ndimage = None

__all__ = [
    "CLAUSE_TYPES",
    "tiny_geneval",
    "segment_colors",
    "label_components",
    "find_objects",
    "clause_accuracy",
]

CLAUSE_TYPES = ("color", "shape", "count", "position")
_COLORS = tuple(PALETTE)
_K = len(_COLORS)
_S = len(SHAPES) + 1  # + "other"
_OTHER = len(SHAPES)
_SHAPE_ID = {s: i for i, s in enumerate(SHAPES)}
_COLOR_ID = {c: i for i, c in enumerate(_COLORS)}
_REL_ID = {None: 0, "and": 0, **{r: i + 1 for i, r in enumerate(SPATIAL_RELATIONS)}}
# Row 0 is black = background, rows 1..K the palette in PALETTE order.
_PALETTE_RGB = np.array([(0, 0, 0)] + list(PALETTE.values()), dtype=np.float32)
_PALETTE_SQ = (_PALETTE_RGB[1:] ** 2).sum(1)

#: Shape thresholds, midway between the renderer's classes (see module docstring):
#: upward triangles hold ≥ 0.667 of their pixels in the lower half of the box,
#: circles and squares 0.5; squares fill 1.0 of their box, circles ≤ 0.84.
TRIANGLE_MIN_BOTTOM = 0.6
SQUARE_MIN_FILL = 0.92

# scipy structure: 8-connected inside one (image, colour) plane, nothing across planes.
_STRUCTURE = np.zeros((3, 3, 3, 3), dtype=bool)
_STRUCTURE[1, 1] = True


# ------------------------------------------------------------ segmentation
def segment_colors(
    images: np.ndarray, color_tolerance: float = 80.0, min_intensity: float = 0.5
) -> np.ndarray:
    """Colour class per pixel, ``int8 [B, H, W]``: 0 = background, ``1 + i`` =
    ``PALETTE`` colour ``i``.

    A blurred edge pixel is a mix of an object colour ``p`` and black, i.e. a
    point ``a·p`` on the ray from black through ``p``. So each pixel ``x`` is
    projected onto every palette ray (``a = x·p / |p|²``) and takes the colour
    whose ray is nearest, provided the pixel is bright enough along it
    (``a ≥ min_intensity``: the half-maximum contour of a blurred edge is where
    the sharp edge was) and close enough to it (distance ≤ ``color_tolerance``,
    so off-palette colours stay background). Plain nearest-colour matching
    would instead shrink bright colours (white) far more than dark ones.
    """
    flat = images.reshape(-1, 3)
    out = np.zeros(flat.shape[0], dtype=np.int8)
    # a ≥ min_intensity needs |x| ≥ min_intensity·|p|: skip the (mostly black) rest.
    xx = np.einsum("ij,ij->i", flat, flat, dtype=np.int32)
    cand = np.flatnonzero(xx >= (float(min_intensity) ** 2) * _PALETTE_SQ.min())
    if cand.size == 0:
        return out.reshape(images.shape[:-1])
    x = flat[cand].astype(np.float32)
    dots = x @ _PALETTE_RGB[1:].T  # [n, K]
    alpha = dots / _PALETTE_SQ
    # squared distance to the ray: |x|² − (x·p)²/|p|² (for a ≤ 1), |x − p|² beyond the colour.
    xc = xx[cand, None].astype(np.float32)
    d2 = np.where(alpha <= 1.0, xc - dots * alpha, xc - 2.0 * dots + _PALETTE_SQ)
    best = d2.argmin(1)[:, None]
    ok = (np.take_along_axis(d2, best, 1)[:, 0] <= float(color_tolerance) ** 2) & (
        np.take_along_axis(alpha, best, 1)[:, 0] >= float(min_intensity)
    )
    out[cand] = np.where(ok, best[:, 0] + 1, 0)
    return out.reshape(images.shape[:-1])


def _label_numpy(planes: np.ndarray) -> tuple[np.ndarray, int]:
    """8-connected labels of ``bool [N, H, W]`` without scipy, by union-find over runs.

    1. Split every row into **runs** (maximal horizontal stretches of
       foreground); a run id is a cumulative sum of run starts, so this is
       one vectorised pass. A 32×32 scene has a few dozen runs, not 1024 pixels.
    2. Two runs in adjacent rows touch when some pixel of one is a vertical or
       diagonal neighbour of a pixel of the other; those pixel pairs give the
       run-graph edges (repeats along a row are dropped).
    3. Union-find on the run graph, all edges at once: hook each edge's larger
       root under its smaller one (``np.minimum.at``), then compress paths by
       pointer jumping, until both ends of every edge share a root.
    """
    n, h, w = planes.shape
    starts = planes.copy()
    starts[:, :, 1:] &= ~planes[:, :, :-1]
    run_of = np.cumsum(starts.reshape(-1), dtype=np.int64).reshape(n, h, w)  # valid on foreground
    num_runs = int(run_of[-1, -1, -1]) if run_of.size else 0

    top, bottom = planes[:, :-1, :], planes[:, 1:, :]
    run_top, run_bottom = run_of[:, :-1, :], run_of[:, 1:, :]
    ends_a, ends_b = [], []
    for sl_top, sl_bottom in (
        (slice(None), slice(None)),  # straight down
        (slice(None, -1), slice(1, None)),  # down-right
        (slice(1, None), slice(None, -1)),  # down-left
    ):
        touch = top[:, :, sl_top] & bottom[:, :, sl_bottom]
        a, b = run_top[:, :, sl_top][touch], run_bottom[:, :, sl_bottom][touch]
        new = np.ones(a.shape, dtype=bool)
        new[1:] = (a[1:] != a[:-1]) | (b[1:] != b[:-1])
        ends_a.append(a[new])
        ends_b.append(b[new])
    a, b = np.concatenate(ends_a), np.concatenate(ends_b)

    parent = np.arange(num_runs + 1, dtype=np.int64)
    while True:
        ra, rb = parent[a], parent[b]
        differ = ra != rb
        if not differ.any():
            break
        ra, rb = ra[differ], rb[differ]
        np.minimum.at(parent, np.maximum(ra, rb), np.minimum(ra, rb))
        while True:  # pointer jumping until every run points at its root
            jumped = parent[parent]
            if np.array_equal(jumped, parent):
                break
            parent = jumped

    roots, compact = np.unique(parent[1:], return_inverse=True)
    labels = np.zeros((n, h, w), dtype=np.int32)
    labels[planes] = compact.astype(np.int32)[run_of[planes] - 1] + 1
    return labels, len(roots)


def label_components(classes: np.ndarray, *, use_scipy: bool | None = None) -> tuple[np.ndarray, int]:
    """Label same-colour connected components.

    ``classes`` is ``int [B, H, W]`` from :func:`segment_colors`; returns
    ``(labels int32 [B, K, H, W], n)`` with labels ``1..n`` (0 = none).
    """
    planes = classes[:, None, :, :] == np.arange(1, _K + 1, dtype=classes.dtype)[None, :, None, None]
    if use_scipy is None:
        use_scipy = _ndimage is not None
    if use_scipy:
        labels, n = _ndimage.label(planes, structure=_STRUCTURE)
        return labels.astype(np.int32, copy=False), int(n)
    b, k, h, w = planes.shape
    planes = planes.reshape(b * k, h, w)
    used = np.flatnonzero(planes.any(axis=(1, 2)))  # most images use 1–2 of the colours
    labels = np.zeros(planes.shape, dtype=np.int32)
    labels[used], n = _label_numpy(planes[used])
    return labels.reshape(b, k, h, w), n


# ------------------------------------------------------------------ objects
def find_objects(
    images: np.ndarray,
    *,
    color_tolerance: float = 80.0,
    min_intensity: float = 0.5,
    min_area: int = 6,
    max_aspect: float = 1.5,
    use_scipy: bool | None = None,
) -> dict[str, np.ndarray]:
    """Detect objects; returns per-object arrays (one entry per object):

    ``image`` (batch index), ``color`` (index into PALETTE order), ``shape``
    (index into SHAPES, ``len(SHAPES)`` = other), ``area``, ``cy``, ``cx``
    (centroid), ``fill``, ``bottom`` (share of pixels in the lower half of the
    box), ``bbox`` (``[n, 4]`` y0, x0, y1, x1 end-exclusive).
    """
    classes = segment_colors(images, color_tolerance, min_intensity)
    labels, n = label_components(classes, use_scipy=use_scipy)
    flat_idx = np.flatnonzero(labels)
    lab = labels.reshape(-1)[flat_idx].astype(np.intp)
    b, k, y, x = np.unravel_index(flat_idx, labels.shape)
    m = n + 1
    area = np.bincount(lab, minlength=m).astype(np.float64)
    ymin = np.full(m, 1 << 30, np.int64)
    xmin = np.full(m, 1 << 30, np.int64)
    ymax = np.full(m, -1, np.int64)
    xmax = np.full(m, -1, np.int64)
    np.minimum.at(ymin, lab, y)
    np.minimum.at(xmin, lab, x)
    np.maximum.at(ymax, lab, y)
    np.maximum.at(xmax, lab, x)
    comp_b = np.zeros(m, np.int64)
    comp_k = np.zeros(m, np.int64)
    comp_b[lab], comp_k[lab] = b, k
    safe = np.maximum(area, 1.0)
    cy = np.bincount(lab, weights=y, minlength=m) / safe
    cx = np.bincount(lab, weights=x, minlength=m) / safe
    h = (ymax - ymin + 1).astype(np.float64)
    w = (xmax - xmin + 1).astype(np.float64)
    mid = (ymin + ymax)[lab]  # 2 × box centre row, in integers
    lower = (2 * y > mid) + 0.5 * (2 * y == mid)
    bottom = np.bincount(lab, weights=lower, minlength=m) / safe
    fill = area / np.maximum(h * w, 1.0)

    shape = np.where(fill >= SQUARE_MIN_FILL, _SHAPE_ID["square"], _SHAPE_ID["circle"])
    shape = np.where(bottom > TRIANGLE_MIN_BOTTOM, _SHAPE_ID["triangle"], shape)
    shape = np.where(np.maximum(h, w) > max_aspect * np.minimum(h, w), _OTHER, shape)
    keep = area >= min_area
    keep[0] = False
    return {
        "image": comp_b[keep],
        "color": comp_k[keep],
        "shape": shape[keep],
        "area": area[keep],
        "cy": cy[keep],
        "cx": cx[keep],
        "fill": fill[keep],
        "bottom": bottom[keep],
        "bbox": np.stack([ymin, xmin, ymax + 1, xmax + 1], 1)[keep],
    }


# ------------------------------------------------------------------ clauses
def _encode(spec: SceneSpec) -> tuple[int, ...]:
    g0 = spec.groups[0]
    g1 = spec.groups[1] if len(spec.groups) > 1 else None
    return (
        _COLOR_ID[g0.color], _SHAPE_ID[g0.shape], g0.count,
        _COLOR_ID[g1.color] if g1 else 0, _SHAPE_ID[g1.shape] if g1 else 0, g1.count if g1 else 0,
        int(g1 is not None), _REL_ID[spec.relation],
    )  # fmt: skip


_ENCODED: dict[str, tuple[int, ...]] = {}


def _encode_prompts(prompts: Sequence[str]) -> np.ndarray:
    rows = []
    for p in prompts:
        row = _ENCODED.get(p)
        if row is None:
            row = _ENCODED[p] = _encode(parse_prompt(p))
            if len(_ENCODED) > 100_000:
                _ENCODED.clear()
        rows.append(row)
    return np.array(rows, dtype=np.int64).reshape(len(prompts), 8)


@register_reward("tiny_geneval")
def tiny_geneval(
    images: np.ndarray,
    prompts: Sequence[str],
    *,
    color_tolerance: float = 80.0,
    min_intensity: float = 0.5,
    min_area: int = 6,
    max_aspect: float = 1.5,
    position_margin: float = 0.0,
    penalize_extras: bool = False,
    chunk_size: int = 1024,
    use_scipy: bool | None = None,
    **_unused,
) -> dict[str, np.ndarray]:
    """Score shapes-world images against their prompts (see the module docstring).

    ``penalize_extras=True`` is a training-signal variant: in ``score``, a
    group's shape and count clauses then also need that the image holds no
    object of the group's colour that the prompt does not ask for. Under
    GenEval's clauses, "a red square" drawn as a red square next to a red
    circle meets every clause, so with a model whose shapes are uncertain,
    drawing extra objects of the colour raises the odds of meeting the shape
    and count clauses, and a policy trained on that score learns to draw
    extras. Only ``score`` changes: ``strict`` and the ``clause/*`` extras keep
    GenEval's definitions, so they stay comparable across runs.

    ``chunk_size`` bounds memory (the one-hot planes are ``B × 6 × H × W``).
    """
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"`images` must be uint8 [B, H, W, 3], got {images.dtype} {tuple(images.shape)}")
    if len(prompts) != len(images):
        raise ValueError(f"`prompts` has {len(prompts)} entries but `images` holds {len(images)} images")
    batch = len(images)
    enc = _encode_prompts(prompts)

    # 1.-3. objects → per (image, colour, shape) counts and centroid sums.
    counts = np.zeros(batch * _K * _S)
    sum_y = np.zeros(batch * _K * _S)
    sum_x = np.zeros(batch * _K * _S)
    for start in range(0, batch, max(int(chunk_size), 1)):
        chunk = images[start : start + chunk_size]
        obj = find_objects(
            chunk,
            color_tolerance=color_tolerance,
            min_intensity=min_intensity,
            min_area=min_area,
            max_aspect=max_aspect,
            use_scipy=use_scipy,
        )
        cell = ((obj["image"] + start) * _K + obj["color"]) * _S + obj["shape"]
        size = batch * _K * _S
        counts += np.bincount(cell, minlength=size)
        sum_y += np.bincount(cell, weights=obj["cy"], minlength=size)
        sum_x += np.bincount(cell, weights=obj["cx"], minlength=size)
    counts = counts.reshape(batch, _K, _S)
    sum_y, sum_x = sum_y.reshape(counts.shape), sum_x.reshape(counts.shape)

    # 4. clauses, gathered per sample.
    rows = np.arange(batch)
    k0, s0, n0, k1, s1, n1, two, rel = enc.T
    two = two.astype(bool)

    def group(k, s, n):
        c, c_color = counts[rows, k, s], counts[rows, k].sum(1)
        return c_color > 0, c > 0, c == n, c, c_color

    color0, shape0, count0, c0, c_color0 = group(k0, s0, n0)
    color1, shape1, count1, c1, c_color1 = group(k1, s1, n1)
    color1 &= two
    shape1 &= two
    count1 &= two

    spatial = rel > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        y0, x0 = sum_y[rows, k0, s0] / c0, sum_x[rows, k0, s0] / c0
        y1, x1 = sum_y[rows, k1, s1] / c1, sum_x[rows, k1, s1] / c1
    margin = float(position_margin)
    rel_ok = np.select(
        [rel == 1, rel == 2, rel == 3, rel == 4],
        [x0 < x1 - margin, x0 > x1 + margin, y0 < y1 - margin, y0 > y1 + margin],
        default=False,
    )
    position = spatial & (c0 > 0) & (c1 > 0) & rel_ok

    n_groups = 1.0 + two
    met = {
        "color": color0.astype(np.float32) + color1,
        "shape": shape0.astype(np.float32) + shape1,
        "count": count0.astype(np.float32) + count1,
        "position": position.astype(np.float32),
    }
    total = {"color": n_groups, "shape": n_groups, "count": n_groups, "position": spatial.astype(np.float32)}
    n_met = sum(met.values())
    n_total = sum(total.values())
    out = {"strict": (n_met == n_total).astype(np.float32)}
    if penalize_extras:  # objects of the group's colour that no group of the prompt asks for
        shared = two & (k0 == k1)
        extra0 = c_color0 - c0 - np.where(shared & (s0 != s1), c1, 0) > 0
        extra1 = c_color1 - c1 - np.where(shared & (s0 != s1), c0, 0) > 0
        kept = [(shape0 & ~extra0), (shape1 & ~extra1), (count0 & ~extra0), (count1 & ~extra1)]
        n_met = n_met - met["shape"] - met["count"] + sum(k.astype(np.float32) for k in kept)
    out["score"] = (n_met / n_total).astype(np.float32)
    for t in CLAUSE_TYPES:
        out[f"clause/{t}"] = met[t].astype(np.float32)
        out[f"clause/{t}_total"] = np.asarray(total[t], dtype=np.float32)
    return out


def clause_accuracy(extra: Mapping[str, np.ndarray], prefix: str = "") -> dict[str, float]:
    """Aggregate tiny_geneval extras of many samples into accuracies.

    ``prefix`` is what precedes the keys (``"tiny_geneval/"`` when reading a
    :class:`~omnirl_async.rewards.base.RewardResult`'s ``extra``). Returns
    ``{"strict": …, "color": …, "shape": …, "count": …, "position": …}``;
    a clause type no sample had is NaN.
    """
    res = {"strict": float(np.mean(extra[prefix + "strict"])) if len(extra[prefix + "strict"]) else float("nan")}
    for t in CLAUSE_TYPES:
        met = float(np.sum(extra[f"{prefix}clause/{t}"]))
        tot = float(np.sum(extra[f"{prefix}clause/{t}_total"]))
        res[t] = met / tot if tot > 0 else float("nan")
    return res
