"""Prompt sets of the shapes world and the prompt-file format.

The grammar of :mod:`omnirl_async.data.shapes` is finite, so the whole prompt
space can be listed (:func:`enumerate_prompts`, 2,772 prompts in four
categories). A fixed seed splits it once into a **held-out** set, which only
evaluation sees, and a **training** set made of everything else. The two are
disjoint by construction, and the split depends only on the seed (sorted
enumeration + ``numpy.random.default_rng``), never on hash order or the
Python version.

The held-out set is stratified (:data:`HELDOUT_COMPOSITION`) rather than
drawn uniformly: a uniform draw from the space would be 97 % two-group prompts
and say almost nothing about counting.

Prompt files
------------
``.jsonl``: one JSON object per line with at least ``"prompt"`` (other keys,
such as ``"category"``, are kept). ``.txt``: one prompt per line. Blank lines
are skipped. A row without a prompt is an error that names the file and line.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Iterable, Sequence

import numpy as np

from omnirl_async.data.shapes import (
    COLORS,
    MAX_COUNT,
    PAIR_COUNTS,
    SHAPES,
    SPATIAL_RELATIONS,
    ObjectGroup,
    SceneSpec,
    parse_prompt,
)

__all__ = [
    "CATEGORIES",
    "HELDOUT_COMPOSITION",
    "HELDOUT_SEED",
    "prompt_category",
    "enumerate_prompts",
    "prompt_split",
    "train_prompts",
    "heldout_prompts",
    "write_prompt_file",
    "read_prompt_rows",
    "read_prompts",
]

CATEGORIES = ("single", "counting", "pair", "position")
#: Held-out prompts per category (256 in all). The rest of each category trains.
HELDOUT_COMPOSITION: dict[str, int] = {"single": 8, "counting": 24, "pair": 96, "position": 128}
HELDOUT_SEED = 20240611


def prompt_category(spec: SceneSpec | str) -> str:
    """``single`` (one object), ``counting`` (2–4 of one kind), ``pair``
    (two groups joined by "and") or ``position`` (a spatial relation)."""
    if isinstance(spec, str):
        spec = parse_prompt(spec)
    if spec.relation is None:
        return "single" if spec.groups[0].count == 1 else "counting"
    return "pair" if spec.relation == "and" else "position"


def enumerate_prompts(category: str) -> list[str]:
    """Every prompt of a category that :func:`shapes.sample_spec` can draw, sorted."""
    kinds = list(itertools.product(COLORS, SHAPES))
    specs: list[SceneSpec] = []
    if category == "single":
        specs = [SceneSpec((ObjectGroup(1, c, s),)) for c, s in kinds]
    elif category == "counting":
        specs = [SceneSpec((ObjectGroup(n, c, s),)) for n in range(2, MAX_COUNT + 1) for c, s in kinds]
    elif category in ("pair", "position"):
        pairs = [(a, b) for a in kinds for b in kinds if a[0] != b[0]]
        counts = PAIR_COUNTS if category == "pair" else ((1, 1),)
        relations = ("and",) if category == "pair" else SPATIAL_RELATIONS
        specs = [
            SceneSpec((ObjectGroup(n0, *a), ObjectGroup(n1, *b)), rel)
            for (a, b) in pairs
            for (n0, n1) in counts
            for rel in relations
        ]
    else:
        raise ValueError(f"`category` must be one of {CATEGORIES}, got {category!r}")
    return sorted(s.prompt for s in specs)


def prompt_split(
    seed: int = HELDOUT_SEED, composition: dict[str, int] | None = None
) -> tuple[list[str], list[str]]:
    """Split the prompt space into ``(train, heldout)``, disjoint and deterministic.

    ``composition`` maps category → number of held-out prompts
    (default :data:`HELDOUT_COMPOSITION`). Both lists are sorted.
    """
    composition = HELDOUT_COMPOSITION if composition is None else composition
    rng = np.random.default_rng(seed)
    train, heldout = [], []
    for category in CATEGORIES:
        prompts = enumerate_prompts(category)
        k = int(composition.get(category, 0))
        if not 0 <= k < len(prompts):
            raise ValueError(
                f"`composition[{category!r}]` must be in 0..{len(prompts) - 1} so that "
                f"training keeps at least one {category} prompt, got {k}"
            )
        chosen = set(rng.choice(len(prompts), size=k, replace=False).tolist())
        for i, p in enumerate(prompts):
            (heldout if i in chosen else train).append(p)
    return sorted(train), sorted(heldout)


def train_prompts(seed: int = HELDOUT_SEED) -> list[str]:
    """All prompts not in the held-out set (2,516 with the default split)."""
    return prompt_split(seed)[0]


def heldout_prompts(seed: int = HELDOUT_SEED) -> list[str]:
    """The 256 held-out evaluation prompts of the default split."""
    return prompt_split(seed)[1]


# ---------------------------------------------------------------- files
def write_prompt_file(path: str | os.PathLike, prompts: Iterable[str], *, with_category: bool = True) -> int:
    """Write prompts to ``path`` (``.jsonl`` rows, or ``.txt`` lines); returns the row count."""
    path = os.fspath(path)
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for prompt in prompts:
            if path.endswith(".txt"):
                if "\n" in prompt:
                    raise ValueError(f"prompt {prompt!r} holds a newline; write a .jsonl file instead")
                f.write(prompt + "\n")
            else:
                row = {"prompt": prompt}
                if with_category:
                    try:
                        row["category"] = prompt_category(prompt)
                    except ValueError:
                        pass  # prompts outside the shapes grammar are allowed in files
                f.write(json.dumps(row) + "\n")
            n += 1
    return n


def read_prompt_rows(path: str | os.PathLike) -> list[dict]:
    """Read a prompt file into rows (dicts with at least ``"prompt"``)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"prompt file {path!r} does not exist; check the `data.*_files` setting")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if path.endswith(".txt"):
                rows.append({"prompt": line.strip()})
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one object") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(
                    f"{path}:{lineno}: row has no string \"prompt\" field (got {line[:80]!r}); "
                    f"each line must look like {{\"prompt\": \"two red circles\"}}"
                )
            rows.append(row)
    return rows


def read_prompts(path: str | os.PathLike) -> list[str]:
    """Read just the prompt strings of a prompt file."""
    return [row["prompt"] for row in read_prompt_rows(path)]


def check_prompts(prompts: Sequence[str]) -> None:
    """Raise ``ValueError`` on the first prompt outside the shapes grammar."""
    for p in prompts:
        parse_prompt(p)
