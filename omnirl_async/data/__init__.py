"""Data of the embedded shapes world: the renderer and the prompt sets.

* :mod:`~omnirl_async.data.shapes` – prompt grammar, :class:`SceneSpec`, and a
  seeded numpy renderer of 32×32 scenes (the pretraining stream and the ground
  truth the ``tiny_geneval`` reward is tested against).
* :mod:`~omnirl_async.data.prompts` – the fixed train / held-out prompt split,
  the prompt datasets (.jsonl, .parquet, .txt, ``datasets`` folders), and the
  readers of ``data.train_files`` / ``data.val_files`` (:func:`load_train_prompts`,
  :func:`load_val_prompts`), which return a :class:`PromptSet`: the prompts and
  the other fields of their rows.
"""

from omnirl_async.data.prompts import (
    CATEGORIES,
    HELDOUT_COMPOSITION,
    PromptSet,
    enumerate_prompts,
    heldout_prompts,
    load_train_prompts,
    load_val_prompts,
    prompt_category,
    prompt_split,
    read_prompt_files,
    read_prompt_rows,
    read_prompt_set,
    read_prompts,
    train_prompts,
    write_prompt_file,
)
from omnirl_async.data.shapes import (
    COLORS,
    PALETTE,
    SHAPES,
    ObjectGroup,
    Scene,
    SceneObject,
    SceneSpec,
    parse_prompt,
    render,
    render_batch,
    sample_prompt,
    sample_scene,
    sample_spec,
)

__all__ = [
    "CATEGORIES",
    "HELDOUT_COMPOSITION",
    "PromptSet",
    "enumerate_prompts",
    "heldout_prompts",
    "load_train_prompts",
    "load_val_prompts",
    "prompt_category",
    "prompt_split",
    "read_prompt_files",
    "read_prompt_rows",
    "read_prompt_set",
    "read_prompts",
    "train_prompts",
    "write_prompt_file",
    "COLORS",
    "PALETTE",
    "SHAPES",
    "ObjectGroup",
    "Scene",
    "SceneObject",
    "SceneSpec",
    "parse_prompt",
    "render",
    "render_batch",
    "sample_prompt",
    "sample_scene",
    "sample_spec",
]
