"""Build a preference dataset (docs/PREFERENCE_DATA.md) from the embedded shapes world.

Two modes:

* **renders** (default): for each prompt, ``chosen`` is a render that meets
  every clause of the prompt and ``rejected`` a render of the same prompt with
  one clause broken - one group's count, colour or shape changed, or the
  position relation reversed (``metadata.broken`` says which). Both are
  checked with the ``tiny_geneval`` reward (chosen strict = 1, rejected
  strict = 0) and carry its score as ``chosen_score`` / ``rejected_score``.
* ``--model-samples K``: K samples of the configured model per prompt, ranked
  by the configured reward (``tiny_geneval`` by default); the best is chosen,
  the worst rejected, prompts whose best and worst tie are left out. With
  ``--latents`` the rows reference the samples' clean latents ``x0`` (a
  safetensors shard) instead of PNGs.

Images are drawn at the model's resolution (``actor_rollout_ref.rollout.pipeline.height``
/ ``width`` of the config, overridable like ``omnirl-async``'s subcommands, or
``--size``). Prompts are the embedded training prompts (the held-out
validation prompts never appear), shuffled with ``--seed``, or ``--prompts FILE``.

    python scripts/make_preference_dataset.py --out pref_data --num-prompts 256
    omnirl-async ingest pref_data/data.jsonl --run-dir checkpoints/omnirl_async/my_run

Output (``--format``): ``OUT/data.jsonl`` + ``OUT/images/*.png`` (jsonl, the default);
``OUT/data.parquet`` + ``OUT/images/`` (parquet); or a ``datasets`` folder ``OUT``
saved with ``save_to_disk`` whose ``chosen`` / ``rejected`` columns are ``Image``
features holding the PNG bytes (datasets).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from typing import Any

import numpy as np

from omnirl_async.data.shapes import COLORS, SHAPES, SPATIAL_RELATIONS, ObjectGroup, SceneSpec, parse_prompt, render
from omnirl_async.rewards.tiny_geneval import tiny_geneval

__all__ = ["break_one_clause", "render_pairs", "model_sample_pairs", "write_dataset", "main"]

_OPPOSITE = {"left": "right", "right": "left", "above": "below", "below": "above"}
MAX_OBJECTS = 4


# --------------------------------------------------------------------------------------------- renders
def _mutate(spec: SceneSpec, clause: str, gi: int | None, rng: np.random.Generator) -> SceneSpec | None:
    groups = list(spec.groups)
    if clause == "position":
        return SceneSpec(spec.groups, _OPPOSITE[spec.relation])
    g = groups[gi]
    others = [o for i, o in enumerate(groups) if i != gi]
    if clause == "count":
        room = MAX_OBJECTS - sum(o.count for o in others)
        choices = [c for c in (g.count - 1, g.count + 1) if 1 <= c <= room]
        if not choices:
            return None
        groups[gi] = ObjectGroup(int(rng.choice(choices)), g.color, g.shape)
    elif clause == "color":
        choices = [c for c in COLORS if c not in {o.color for o in spec.groups}]
        groups[gi] = ObjectGroup(g.count, str(rng.choice(choices)), g.shape)
    else:  # shape
        choices = [s for s in SHAPES if s != g.shape and all((o.color, o.shape) != (g.color, s) for o in others)]
        if not choices:
            return None
        groups[gi] = ObjectGroup(g.count, g.color, str(rng.choice(choices)))
    try:
        return SceneSpec(tuple(groups), spec.relation)
    except ValueError:
        return None


def break_one_clause(spec: SceneSpec, rng: np.random.Generator) -> tuple[SceneSpec, str]:
    """A spec that differs from ``spec`` in one clause (count, color, shape of one group, or position)."""
    options: list[tuple[str, int | None]] = [(c, gi) for gi in range(len(spec.groups))
                                             for c in ("count", "color", "shape")]
    if spec.relation in SPATIAL_RELATIONS:
        options.append(("position", None))
    for k in rng.permutation(len(options)):
        clause, gi = options[int(k)]
        broken = _mutate(spec, clause, gi, rng)
        if broken is not None:
            return broken, clause
    raise ValueError(f"no clause of {spec.prompt!r} can be broken")


def render_pairs(prompts: list[str], *, size: int, seed: int = 0, tries: int = 5) -> list[dict[str, Any]]:
    """One pair per prompt (rows with ``chosen`` / ``rejected`` as ``uint8 [size, size, 3]`` arrays).

    A pair is kept only when ``tiny_geneval`` finds every clause met in ``chosen`` and not in ``rejected``
    (a render is redrawn up to ``tries`` times; a prompt that never passes is left out).
    """
    rng = np.random.default_rng(seed)
    rows = []
    for i, prompt in enumerate(prompts):
        spec = parse_prompt(prompt)
        for _ in range(tries):
            chosen, _ = render(spec, rng, size=size)
            broken, clause = break_one_clause(spec, rng)
            rejected, _ = render(broken, rng, size=size)
            r = tiny_geneval(np.stack([chosen, rejected]), [prompt, prompt])
            if r["strict"][0] == 1.0 and r["strict"][1] == 0.0:
                rows.append({"id": f"shapes-{i:05d}", "prompt": prompt, "chosen": chosen, "rejected": rejected,
                             "chosen_score": round(float(r["score"][0]), 6),
                             "rejected_score": round(float(r["score"][1]), 6),
                             "source": "shapes-render",
                             "metadata": {"broken": clause, "rejected_spec": broken.prompt}})
                break
    return rows


# --------------------------------------------------------------------------------------------- model samples
def model_sample_pairs(config, prompts: list[str], *, k: int, seed: int = 0, latents: bool = False,
                       progress: bool = True) -> list[dict[str, Any]]:
    """Best vs worst of ``k`` samples of ``config``'s model per prompt, ranked by ``config``'s reward.

    ``chosen`` / ``rejected`` are images (``uint8 [H, W, 3]``), or with ``latents`` the samples' ``x0``.
    """
    import torch
    from tqdm import tqdm

    from omnirl_async.models.sampler import sample_with_logprob
    from omnirl_async.models.setup import build_policy, pick_device
    from omnirl_async.rewards import RewardManager

    if k < 2:
        raise SystemExit(f"--model-samples {k}: ranking needs at least 2 samples per prompt")
    aro = config.actor_rollout_ref
    pcfg, acfg = aro.rollout.pipeline, aro.rollout.algo
    policy = build_policy(aro.model, pick_device(config.trainer.device), seed=config.data.seed)
    reward = RewardManager.from_config(config.reward)
    lora = {} if aro.model.lora_adapter_path is None else {"lora": str(aro.model.lora_adapter_path)}
    rows = []
    for i, prompt in enumerate(tqdm(prompts, desc="sample", disable=not progress)):
        neg = [pcfg.negative_prompt] if pcfg.true_cfg_scale > 1 else None
        emb = policy.encode_prompt([prompt], negative_prompts=neg, max_sequence_length=pcfg.max_sequence_length)
        seeds = [seed * 1_000_003 + i * k + j for j in range(k)]
        with torch.no_grad():
            out = sample_with_logprob(policy, emb.repeat_interleave(k), seeds=seeds, height=pcfg.height,
                                      width=pcfg.width, num_inference_steps=pcfg.num_inference_steps,
                                      noise_level=acfg.noise_level, sde_type=acfg.sde_type,
                                      true_cfg_scale=pcfg.true_cfg_scale, guidance_scale=pcfg.guidance_scale,
                                      keep_trajectory=False)
        scored = reward(out.images, [prompt] * k)
        scores = np.where(scored.failed, -np.inf, scored.scores)
        best, worst = int(np.argmax(scores)), int(np.argmin(scores))
        if not np.isfinite(scores[best]) or scores[best] == scores[worst]:
            continue  # a tie carries no preference
        pick = out.x0.numpy() if latents else out.images
        rows.append({"id": f"model-{i:05d}", "prompt": prompt, "chosen": pick[best], "rejected": pick[worst],
                     "chosen_score": round(float(scores[best]), 6), "rejected_score": round(float(scores[worst]), 6),
                     "source": "model-samples",
                     "metadata": {"model": str(aro.model.path), **lora, "samples": k, "chosen_seed": seeds[best],
                                  "rejected_seed": seeds[worst]}})
    return rows


# --------------------------------------------------------------------------------------------- writing
def _png(image: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.asarray(image, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_dataset(rows: list[dict[str, Any]], out: str, *, fmt: str = "jsonl") -> str:
    """Write ``rows`` (images or latents in ``chosen`` / ``rejected``) as a dataset under ``out``; return the path
    to give ``omnirl-async ingest``."""
    os.makedirs(out, exist_ok=True)
    table, shard = [], {}
    shard_name = "latents/part-00000.safetensors"
    for row in rows:
        rec = dict(row)
        for side in ("chosen", "rejected"):
            value = np.asarray(row[side])
            if value.dtype != np.uint8:  # latents
                key = f"{row['id']}.{side}"
                shard[key] = np.ascontiguousarray(value, dtype=np.float32)
                rec[side] = f"latents:{shard_name}#{key}"
            elif fmt == "datasets":
                rec[side] = {"bytes": _png(value), "path": f"{row['id']}-{side}.png"}
            else:
                rel = f"images/{row['id']}-{side}.png"
                os.makedirs(os.path.join(out, "images"), exist_ok=True)
                with open(os.path.join(out, rel), "wb") as f:
                    f.write(_png(value))
                rec[side] = rel
        table.append(rec)
    if shard:
        from safetensors.numpy import save_file

        os.makedirs(os.path.join(out, "latents"), exist_ok=True)
        save_file(shard, os.path.join(out, shard_name))
    if fmt == "jsonl":
        path = os.path.join(out, "data.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for rec in table:
                f.write(json.dumps(rec) + "\n")
        return path
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = os.path.join(out, "data.parquet")
        pq.write_table(pa.Table.from_pylist(table), path)
        return path
    if fmt == "datasets":
        import datasets

        ds = datasets.Dataset.from_list(table)
        for side in ("chosen", "rejected"):
            if isinstance(table[0][side], dict):
                ds = ds.cast_column(side, datasets.Image())
        ds.save_to_disk(out)
        return out
    raise ValueError(f"`fmt` = {fmt!r}: use jsonl, parquet or datasets")


# --------------------------------------------------------------------------------------------- CLI
def _prompts(args) -> list[str]:
    from omnirl_async.data.prompts import read_prompts, train_prompts

    prompts = read_prompts(args.prompts) if args.prompts else train_prompts()
    order = np.random.default_rng(args.seed).permutation(len(prompts))
    return [prompts[i] for i in order[:args.num_prompts]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompts", default=None, help="prompt file (.jsonl/.txt); default: the embedded train prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", choices=("jsonl", "parquet", "datasets"), default="jsonl")
    p.add_argument("--size", type=int, default=None, help="image size (default: the config's pipeline height/width)")
    p.add_argument("--model-samples", type=int, default=0, metavar="K",
                   help="rank K samples of the configured model per prompt instead of rendering")
    p.add_argument("--latents", action="store_true", help="with --model-samples: reference x0 latents, not PNGs")
    p.add_argument("--config-name", default="diffusion_trainer")
    p.add_argument("--config-dir", default=None)
    p.add_argument("overrides", nargs="*", help="config overrides (key=value), as for omnirl-async")
    args = p.parse_args(argv)
    if args.latents and not args.model_samples:
        p.error("--latents needs --model-samples K (renders are images)")
    if args.latents and args.format == "datasets":
        p.error("--latents writes a safetensors shard referenced by path; use --format jsonl or parquet")
    config = None
    if args.model_samples or args.size is None:
        from omnirl_async.config import load_config

        config = load_config(args.overrides, config_name=args.config_name, config_dir=args.config_dir)
    prompts = _prompts(args)
    if args.model_samples:
        rows = model_sample_pairs(config, prompts, k=args.model_samples, seed=args.seed, latents=args.latents)
    else:
        size = args.size
        if size is None:
            pcfg = config.actor_rollout_ref.rollout.pipeline
            if pcfg.height != pcfg.width:
                p.error(f"the shapes world is square; the config's pipeline is {pcfg.width}x{pcfg.height}: pass --size")
            size = int(pcfg.height)
        rows = render_pairs(prompts, size=size, seed=args.seed)
    if not rows:
        print("no pair was made (every prompt tied or failed)", file=sys.stderr)
        return 1
    path = write_dataset(rows, args.out, fmt=args.format)
    print(f"wrote {len(rows)} pairs of {len(prompts)} prompts: {path}")
    print(f"ingest them with: omnirl-async ingest {path} --run-dir RUN_DIR")
    return 0


if __name__ == "__main__":
    sys.exit(main())
