"""Evaluation: generate a prompt set with ``rollout.val_kwargs``, score it, draw a grid.

Used three ways: ``omnirl-async eval`` (base model or a LoRA checkpoint), the
trainer every ``trainer.test_freq`` steps (on a rollout worker, with the
weights it holds), and the benchmarks. Image j of prompt i is drawn with seed
``seed + 1009 * i + j`` (``val_kwargs.n`` images per prompt), so two
evaluations of the same weights agree, whatever the batch size.

It sits in the models layer: it needs a policy and the sampler, and takes the
reward as any callable ``reward(images, prompts) -> RewardResult`` (a
:class:`~omnirl_async.rewards.RewardManager`), so it imports nothing from
rewards, actors or the trainer.

Metric names: ``val/score``, ``val/strict`` (all clauses met, mean over images),
``val/clause/<type>`` (accuracy per clause type when the reward reports clause
counts), and for prompts of the embedded shapes world
``val/category/<name>/strict`` and ``val/overall``: the unweighted mean of the
per-category strict accuracies, as GenEval's "Overall" averages its tasks, so a
category with few prompts counts as much as one with many.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from omnirl_async.models.sampler import sample_with_logprob

__all__ = ["EvalResult", "evaluate_policy", "save_grid", "summarize", "validation_settings"]


@dataclass
class EvalResult:
    prompts: list[str]
    images: np.ndarray  # uint8 [N, H, W, 3]
    scores: np.ndarray  # float32 [N]
    extra: dict[str, np.ndarray] = field(default_factory=dict)
    failed: np.ndarray | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    reasons: list[str | None] | None = None  # why each failed sample failed (None: it did not)

    def failure_note(self) -> str | None:
        """One line on the samples the reward failed (scored 0 in the metrics), with the commonest reason; None
        when none failed."""
        if self.failed is None or not self.failed.any():
            return None
        n, k = len(self.failed), int(self.failed.sum())
        reasons = collections.Counter(r for r, f in zip(self.reasons or [None] * n, self.failed) if f and r)
        why = ""
        if reasons:
            reason, count = reasons.most_common(1)[0]
            why = f"; {'all' if count == k else count} of them: {reason}"
        every = "every sample" if k == n else f"{k} of {n} samples"
        return (f"the reward failed {every} (scored 0 in val/*, `val/failed_frac` = {k / n:.3f}){why}. A reward "
                "that needs the prompt rows' fields (e.g. `ground_truth`) needs validation prompts that carry them: "
                "`data.val_files`")


def _category(prompt: str) -> str | None:
    try:
        from omnirl_async.data.prompts import prompt_category

        return prompt_category(prompt)
    except ValueError:
        return None


def summarize(prompts: list[str], scores: np.ndarray, extra: dict[str, np.ndarray], prefix: str = "val") -> dict:
    m = {f"{prefix}/score": float(np.mean(scores))}
    strict_key = next((k for k in extra if k.endswith("/strict") or k == "strict"), None)
    if strict_key is not None:
        strict = np.asarray(extra[strict_key], dtype=np.float64)
        m[f"{prefix}/strict"] = float(strict.mean())
        cats: dict[str, list[float]] = {}
        for p, s in zip(prompts, strict):
            c = _category(p)
            if c is not None:
                cats.setdefault(c, []).append(float(s))
        by_cat = {c: float(np.mean(vals)) for c, vals in sorted(cats.items())}
        for c, acc in by_cat.items():
            m[f"{prefix}/category/{c}/strict"] = acc
        if by_cat:  # GenEval's "overall": every task (category) counts the same, however many prompts it has
            m[f"{prefix}/overall"] = float(np.mean(list(by_cat.values())))
    for key, met in extra.items():
        total = extra.get(f"{key}_total")
        if total is not None and "/clause/" in f"/{key}":
            denom = float(np.sum(total))
            if denom > 0:
                m[f"{prefix}/clause/{key.rsplit('/', 1)[-1]}"] = float(np.sum(met)) / denom
    return m


def validation_settings(config) -> dict:
    """``batch_size`` and ``negative_prompt`` of validation from the root config.

    ``data.val_batch_size`` prompts per generation forward (each gives
    ``rollout.val_kwargs.n`` images; null = 32 images per forward), and
    ``rollout.val_kwargs.pipeline.negative_prompt`` (empty = the rollout's).
    """
    ro = config.actor_rollout_ref.rollout
    vbs = config.data.val_batch_size
    batch_size = int(vbs) * int(ro.val_kwargs.n) if vbs else 32
    negative = ro.val_kwargs.pipeline.negative_prompt or ro.pipeline.negative_prompt
    return {"batch_size": batch_size, "negative_prompt": negative}


@torch.no_grad()
def evaluate_policy(policy, reward, prompts: list[str], val_cfg, *, seed: int = 0, batch_size: int = 32,
                    progress: bool = False, negative_prompt: str = "") -> EvalResult:
    """Generate ``val_cfg.n`` images per prompt with ``val_cfg.pipeline`` / ``val_cfg.algo`` and score them."""
    pcfg, acfg = val_cfg.pipeline, val_cfg.algo
    rows = [(i, p, j) for i, p in enumerate(prompts) for j in range(val_cfg.n)]
    images, all_prompts = [], []
    bar = tqdm(total=len(rows), desc="eval", unit="img", disable=not progress, dynamic_ncols=True)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        texts = [p for _, p, _ in chunk]
        neg = [negative_prompt] * len(texts) if pcfg.true_cfg_scale > 1 else None
        emb = policy.encode_prompt(texts, negative_prompts=neg, max_sequence_length=pcfg.max_sequence_length)
        seeds = [seed + i * 1009 + j for i, _, j in chunk]  # image j of prompt i, whatever the batching
        out = sample_with_logprob(policy, emb, seeds=seeds, height=pcfg.height, width=pcfg.width,
                                  num_inference_steps=pcfg.num_inference_steps, noise_level=acfg.noise_level,
                                  sde_type=acfg.sde_type, true_cfg_scale=pcfg.true_cfg_scale,
                                  guidance_scale=pcfg.guidance_scale)
        images.append(out.images)
        all_prompts.extend(texts)
        bar.update(len(chunk))
    bar.close()
    imgs = np.concatenate(images)
    row_fields = getattr(prompts, "fields", None)  # a PromptSet: each prompt's row, for the reward
    if row_fields is not None:
        scored = reward(imgs, all_prompts, [row_fields[i] for i, _, _ in rows])
    else:
        scored = reward(imgs, all_prompts)
    scores = np.where(scored.failed, 0.0, scored.scores).astype(np.float32)
    metrics = summarize(all_prompts, scores, scored.extra)
    metrics["val/failed_frac"] = float(np.mean(scored.failed))
    return EvalResult(all_prompts, imgs, scores, dict(scored.extra), scored.failed, metrics,
                      list(getattr(scored, "reasons", None) or []) or None)


def save_grid(images: np.ndarray, captions: list[str], path: str | Path, *, cols: int = 8, scale: int = 4,
              marks: np.ndarray | None = None, title: str | None = None) -> Path:
    """A PNG grid with each image upscaled ``scale``x and its prompt written under it.

    ``marks`` (bool per image) draws a green (True) or red (False) frame, e.g. strict success.
    """
    from PIL import Image, ImageDraw, ImageFont

    n = len(images)
    h, w = images.shape[1] * scale, images.shape[2] * scale
    cell_w = max(w, 128)
    font = ImageFont.load_default()
    chars = max(8, cell_w // 6)
    wrapped = [_wrap(c, chars) for c in captions]
    cap_h = 12 * max((len(x) for x in wrapped), default=1) + 4
    cols = min(cols, n) or 1
    rows = math.ceil(n / cols)
    top = 18 if title else 0
    canvas = Image.new("RGB", (cols * (cell_w + 6), top + rows * (h + cap_h + 6)), "white")
    draw = ImageDraw.Draw(canvas)
    if title:
        draw.text((4, 3), title, fill="black", font=font)
    for k in range(n):
        r, c = divmod(k, cols)
        x0, y0 = c * (cell_w + 6) + 3 + (cell_w - w) // 2, top + r * (h + cap_h + 6) + 3
        tile = Image.fromarray(images[k]).resize((w, h), Image.NEAREST)
        canvas.paste(tile, (x0, y0))
        if marks is not None:
            draw.rectangle([x0 - 2, y0 - 2, x0 + w + 1, y0 + h + 1], outline="green" if marks[k] else "red", width=2)
        for li, line in enumerate(wrapped[k]):
            draw.text((c * (cell_w + 6) + 3, y0 + h + 3 + 12 * li), line, fill="black", font=font)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)
    return path


def _wrap(text: str, width: int) -> list[str]:
    lines, cur = [], ""
    for word in text.split():
        if cur and len(cur) + 1 + len(word) > width:
            lines.append(cur)
            cur = word
        else:
            cur = f"{cur} {word}".strip()
    return lines + ([cur] if cur else [])
