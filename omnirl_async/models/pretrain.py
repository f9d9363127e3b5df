"""Pretrain the shapes text-to-image model (the embedded default) on 2 CPU cores.

::

    python -m omnirl_async.models.pretrain --out DIR --seed 0 --minutes 25

Two stages, both on the renderer's stream of *training* prompts
(:func:`omnirl_async.data.prompts.train_prompts`; the held-out prompts are
never rendered here):

1. **Autoencoder** (``--ae-fraction`` of the budget): the ``AutoencoderKL`` of
   :mod:`omnirl_async.models.shapes_model` learns 32x32x3 <-> 4x16x16 with an
   L1 + MSE reconstruction loss and a small KL term. Afterwards its latent
   statistics set ``shift_factor``/``scaling_factor`` (so latents are ~N(0, 1)
   per element) and the reconstruction accuracy under ``tiny_geneval`` is
   measured and logged.
2. **Flow matching** (the rest): the SD3 transformer and both CLIP text
   encoders learn jointly: ``x_t = (1 - t) x0 + t eps``, target ``v = eps - x0``,
   ``t = shift(u)`` with ``u ~ U(0, 1)`` and SD3's shift 3 (the density with
   which the inference grid visits t), each rendered batch used for two
   steps, 10 % of the prompts dropped to ``""`` (so true CFG works), the
   squared error weighted ``1 + --foreground-weight`` on latent pixels on or
   next to objects (:func:`foreground_weights`), AdamW with warm-up and cosine
   decay, EMA of the weights (the EMA weights are what is saved).

Reproducibility: everything is seeded. With ``--minutes`` the number of steps
of each stage is fixed after timing the first steps (logged); passing
``--ae-steps``/``--flow-steps`` with those numbers reruns the same schedule on
any machine. The output folder is a ``StableDiffusion3Pipeline`` written with
``save_pretrained`` (safetensors, fp32) plus ``pretrain_log.json`` (arguments,
step counts, loss curve, periodic sample accuracy on training prompts).

Evaluation of a saved folder the way the RL system samples
(:func:`evaluate`, also ``--eval-only``)::

    python -m omnirl_async.models.pretrain --eval-only omnirl_async/assets/shapes-t2i
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

# With 2 threads on cores shared with other jobs, OpenMP's default busy-waiting
# makes a step 10-30x slower; passive waiting keeps it near the quiet speed.
# The variable is read when torch loads, so `main` re-executes itself with it set.
_OMP_ENV = "OMP_WAIT_POLICY"

import numpy as np
import torch

from omnirl_async.data.prompts import CATEGORIES, enumerate_prompts, heldout_prompts, prompt_category, train_prompts
from omnirl_async.data.shapes import CATEGORY_WEIGHTS, render_batch
from omnirl_async.models.data_parallel import SINGLE, Group, launch
from omnirl_async.models.shapes_model import (
    MAX_SEQUENCE_LENGTH,
    ShapesModelConfig,
    build_shapes_pipeline,
    build_vae,
    encode_prompts,
)

logger = logging.getLogger(__name__)

#: Seed offset between data-parallel ranks (rank r draws its own batches and noise).
_RANK_SEED_STRIDE = 7919

#: Where the committed model lives inside the package.
ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "shapes-t2i"


# --------------------------------------------------------------------------- data
class PromptStream:
    """Seeded stream of (prompts, images) from the training prompts.

    A category is drawn with :data:`~omnirl_async.data.shapes.CATEGORY_WEIGHTS`
    (so single objects and counting are not drowned by the ~2,500 two-group
    prompts), then a training prompt of that category uniformly.
    """

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        train = set(train_prompts())
        self.by_cat = {c: [p for p in enumerate_prompts(c) if p in train] for c in CATEGORIES}
        p = np.array([CATEGORY_WEIGHTS[c] for c in CATEGORIES])
        self.p = p / p.sum()

    def prompts(self, n: int) -> list[str]:
        cats = self.rng.choice(len(CATEGORIES), size=n, p=self.p)
        out = []
        for c in cats:
            pool = self.by_cat[CATEGORIES[c]]
            out.append(pool[int(self.rng.integers(len(pool)))])
        return out

    def batch(self, n: int) -> tuple[list[str], torch.Tensor]:
        prompts = self.prompts(n)
        images, _ = render_batch(prompts, self.rng)
        return prompts, to_tensor(images)


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> float [B, 3, H, W] in [-1, 1]."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def to_uint8(x: torch.Tensor) -> np.ndarray:
    """Inverse of :func:`to_tensor` with the rounding of ``FlowMatchPolicy.decode``."""
    img = (x.float() / 2 + 0.5).clamp(0, 1)
    return (img * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def _lr_factor(step: int, total: int, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return (step + 1) / warmup
    frac = min((step - warmup) / max(total - warmup, 1), 1.0)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))


def _score(images: np.ndarray, prompts: list[str]) -> dict[str, float]:
    from omnirl_async.rewards.tiny_geneval import clause_accuracy, tiny_geneval

    out = tiny_geneval(images, prompts)
    res = clause_accuracy(out)
    res["score"] = float(np.mean(out["score"]))
    return res


def _plan_steps(step_fn, budget_s: float, fixed: int | None, probe: int = 10) -> tuple[int, float]:
    """Run ``probe`` steps (inside the warm-up), return (total steps that fit into ``budget_s``, s/step).

    The first steps are slow (allocator, oneDNN kernels), so only the second half is timed.
    """
    t_start = time.perf_counter()
    for i in range(probe):
        if i == probe // 2:
            t0 = time.perf_counter()
        step_fn(i, probe * 1000)
    per = (time.perf_counter() - t0) / (probe - probe // 2)
    if fixed is not None:
        return int(fixed), per
    left = budget_s - (time.perf_counter() - t_start)
    return max(probe + int(left / per), probe + 1), per


def _replan(i: int, total: int, t_start: float, t_mark: float, i_mark: int, budget_s: float) -> int:
    """Re-estimate the step count from the recent speed (used once, early in a stage)."""
    per = (time.perf_counter() - t_mark) / max(i - i_mark, 1)
    left = budget_s - (time.perf_counter() - t_start)
    return max(i + 1 + int(left / per), i + 2)


def _run_stage(name: str, step, *, seconds: float, steps: int | None, progress: bool, curve: list,
               every: int = 50, replan_at: float = 0.1, overrun: float = 1.1, after_step=None,
               group: Group = SINGLE) -> int:
    """The training loop every stage shares; returns the number of steps run.

    ``step(i, total) -> loss``. With ``steps=None`` the step count is fitted to
    ``seconds`` from the first (probe) steps, re-planned once after
    ``replan_at`` of the budget, and the stage stops early past ``overrun``
    times the budget. ``after_step(i, total, stopping)`` runs after each step
    (periodic checks, rank 0 only); ``curve`` collects ``[step, EMA of the loss]``.
    With several processes (``group``), rank 0's timing decides the step
    count and the stop, and every rank follows it.
    """
    from tqdm import tqdm

    t_start = time.perf_counter()
    probe = 10
    total, per = _plan_steps(step, seconds, steps, probe)
    total = int(group.share([total])[0])
    logger.info("%s: %.3f s/step -> %d steps", name, per, total)
    bar = tqdm(total=total, initial=probe, desc=name, disable=not (progress and group.is_main), file=sys.stderr)
    avg, i, mark = None, probe, (time.perf_counter(), probe)
    while i < total:
        loss = step(i, total)
        avg = loss if avg is None else 0.98 * avg + 0.02 * loss
        if i % every == 0 or i == total - 1:
            curve.append([i, round(avg, 5)])
            bar.set_postfix(loss=f"{avg:.4f}")
        if steps is None and mark is not None and time.perf_counter() - t_start > replan_at * seconds:
            total = _replan(i, total, t_start, mark[0], mark[1], seconds)
            bar.total, mark = total, None
            logger.info("%s: re-planned to %d steps", name, total)
        stopping = steps is None and time.perf_counter() - t_start > seconds * overrun
        if group.active and steps is None:
            shared_total, shared_stop = group.share([total, stopping])
            total, stopping = int(shared_total), bool(shared_stop)
            bar.total = total
        if after_step is not None and group.is_main:
            after_step(i, total, stopping)
        bar.update(1)
        i += 1
        if stopping:
            logger.warning("%s: time budget exceeded at step %d of %d; stopping", name, i, total)
            break
    bar.close()
    return i


# --------------------------------------------------------------------------- stage 1
def train_autoencoder(cfg: ShapesModelConfig, stream: PromptStream, *, seconds: float, steps: int | None,
                      batch_size: int, lr: float, kl_weight: float, seed: int, log: dict, progress: bool,
                      group: Group = SINGLE):
    """``batch_size`` is per process; every rank starts from the same weights and averages gradients."""
    torch.manual_seed(seed)
    vae = build_vae(cfg)
    vae.train()
    if group.rank:
        torch.manual_seed(seed + _RANK_SEED_STRIDE * group.rank)  # own latent noise per rank
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0, fused=True)
    curve = log.setdefault("ae_loss", [])

    def step(i: int, total: int) -> float:
        for g in opt.param_groups:
            g["lr"] = lr * _lr_factor(i, total, warmup=50)
        _, x = stream.batch(batch_size)
        post = vae.encode(x).latent_dist
        z = post.sample()
        rec = vae.decode(z).sample
        l1 = (rec - x).abs().mean()
        mse = (rec - x).pow(2).mean()
        kl = post.kl().mean() / z[0].numel()
        loss = l1 + mse + kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        group.average_gradients(vae.parameters())
        opt.step()
        return float(loss.detach())

    i = _run_stage("autoencoder", step, seconds=seconds, steps=steps, progress=progress, curve=curve,
                   replan_at=0.15, group=group)
    log["ae_steps"] = i
    vae.eval()
    return vae


@torch.no_grad()
def calibrate_and_check_vae(vae, stream: PromptStream, n: int = 1024) -> dict:
    """Set shift/scaling from latent statistics; measure reconstruction accuracy."""
    prompts, x = stream.batch(n)
    z = torch.cat([vae.encode(x[i:i + 256]).latent_dist.mode() for i in range(0, n, 256)])
    mean, std = float(z.mean()), float(z.std())
    vae.register_to_config(shift_factor=mean, scaling_factor=1.0 / std)
    rec = torch.cat([vae.decode(z[i:i + 256]).sample for i in range(0, n, 256)])
    res = _score(to_uint8(rec), prompts)
    res.update(latent_mean=mean, latent_std=std, n=n)
    return res


# --------------------------------------------------------------------------- stage 2
def _sigmas(scheduler, n: int) -> torch.Tensor:
    sched = type(scheduler).from_config(scheduler.config)
    sched.set_timesteps(num_inference_steps=n)
    return sched.sigmas.float()


@torch.no_grad()
def quick_sample(pipe, prompts: list[str], seed: int, steps: int = 10) -> np.ndarray:
    """ODE (Euler) samples with the same grid and noise layout as the RL sampler."""
    pe, pooled = encode_prompts(pipe, prompts)
    cfg = pipe.vae.config
    c, h = pipe.transformer.config.in_channels, pipe.transformer.config.sample_size
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(prompts))]
    x = torch.cat([torch.randn((1, c, h, h), generator=g) for g in gens])
    sig = _sigmas(pipe.scheduler, steps)
    for i in range(steps):
        t = sig[i].expand(len(prompts))
        v = pipe.transformer(hidden_states=x, encoder_hidden_states=pe, pooled_projections=pooled,
                             timestep=t * 1000.0, return_dict=False)[0]
        x = x + (sig[i + 1] - sig[i]) * v
    img = pipe.vae.decode(x / cfg.scaling_factor + cfg.shift_factor).sample
    return to_uint8(img)


def foreground_weights(img: torch.Tensor, latent_size: int, weight: float) -> torch.Tensor:
    """Per-latent-pixel loss weights ``[B, 1, h, w]``: ``1 + weight`` on and next to objects, 1 elsewhere.

    Objects cover a small part of each image; without this, most of the loss is
    spent on the black background and shape edges are learnt last.
    """
    mask = (img.amax(1, keepdim=True) > -0.5).float()  # any channel brighter than ~25 % of full scale
    mask = torch.nn.functional.adaptive_max_pool2d(mask, latent_size)
    mask = torch.nn.functional.max_pool2d(mask, 3, stride=1, padding=1)  # one latent pixel of margin
    return 1.0 + float(weight) * mask


def train_flow(pipe, stream: PromptStream, *, seconds: float, steps: int | None, batch_size: int, lr: float,
               text_lr: float, ema_decay: float, dropout: float, seed: int, eval_every: int, log: dict,
               progress: bool, foreground_weight: float = 0.0, group: Group = SINGLE):
    """``batch_size`` is per process (see :func:`train_autoencoder`)."""
    torch.manual_seed(seed + 1 + _RANK_SEED_STRIDE * group.rank)
    vae = pipe.vae
    vae.requires_grad_(False)
    modules = {"transformer": pipe.transformer, "text_encoder": pipe.text_encoder,
               "text_encoder_2": pipe.text_encoder_2}
    for m in modules.values():
        m.train()
        m.requires_grad_(True)
    ema = {k: copy.deepcopy(m).eval().requires_grad_(False) for k, m in modules.items()}
    groups = [{"params": list(pipe.transformer.parameters()), "lr": lr, "base": lr},
              {"params": list(pipe.text_encoder.parameters()) + list(pipe.text_encoder_2.parameters()),
               "lr": text_lr, "base": text_lr}]
    opt = torch.optim.AdamW(groups, weight_decay=0.01, betas=(0.9, 0.99), fused=True)
    live_params = [p for m in modules.values() for p in m.parameters()]
    ema_params = [p for k in modules for p in ema[k].parameters()]
    sf, sh = vae.config.scaling_factor, vae.config.shift_factor
    shift = float(pipe.scheduler.config.shift)
    rng = torch.Generator().manual_seed(seed + 2 + _RANK_SEED_STRIDE * group.rank)
    curve = log.setdefault("flow_loss", [])
    evals = log.setdefault("flow_eval", [])
    eval_prompts = stream.__class__(seed + 3).prompts(64)
    cache: dict = {}

    def step(i: int, total: int) -> float:
        for g in opt.param_groups:
            g["lr"] = g["base"] * _lr_factor(i, total, warmup=200)
        if i % 2 == 0:  # each rendered + encoded batch serves two steps (fresh t, noise, dropout)
            prompts, img = stream.batch(batch_size)
            with torch.no_grad():
                cache["x0"] = (vae.encode(img).latent_dist.sample(generator=rng) - sh) * sf
            cache["prompts"] = prompts
            cache["w"] = foreground_weights(img, cache["x0"].shape[-1], foreground_weight)
        x0, w = cache["x0"], cache["w"]
        drop = torch.rand(batch_size, generator=rng) < dropout
        prompts = ["" if d else p for p, d in zip(cache["prompts"], drop.tolist())]
        # t = shift(u), u ~ U(0, 1): the density with which the (shifted) inference grid visits t.
        u = torch.rand(batch_size, generator=rng)
        t = shift * u / (1 + (shift - 1) * u)
        eps = torch.randn(x0.shape, generator=rng)
        tb = t.view(-1, 1, 1, 1)
        xt = (1 - tb) * x0 + tb * eps
        pe, pooled = encode_prompts(pipe, prompts)
        v = pipe.transformer(hidden_states=xt, encoder_hidden_states=pe, pooled_projections=pooled,
                             timestep=t * 1000.0, return_dict=False)[0]
        loss = ((v - (eps - x0)).pow(2) * w).mean() / w.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        group.average_gradients(live_params)
        torch.nn.utils.clip_grad_norm_(live_params, 1.0)
        opt.step()
        with torch.no_grad():
            d = min(ema_decay, (1 + i) / (10 + i))
            torch._foreach_lerp_(ema_params, live_params, 1 - d)
        return float(loss.detach())

    def run_eval(i: int) -> None:
        live = {k: getattr(pipe, k) for k in modules}
        for k in modules:
            setattr(pipe, k, ema[k])
        res = _score(quick_sample(pipe, eval_prompts, seed=10_000), eval_prompts)
        for k, m in live.items():
            setattr(pipe, k, m)
        evals.append({"step": i, **{k: round(v, 4) for k, v in res.items()}})
        logger.info("flow step %d: train-prompt sample accuracy %s", i, evals[-1])

    def after_step(i: int, total: int, stopping: bool) -> None:
        if eval_every and (i % eval_every == 0 or i == total - 1 or stopping):
            run_eval(i)

    # ~3 % of the budget is kept for the periodic evals
    i = _run_stage("flow matching", step, seconds=seconds * 0.97, steps=steps, progress=progress, curve=curve,
                   overrun=1.08 / 0.97, after_step=after_step, group=group)
    log["flow_steps"] = i
    for k in modules:
        setattr(pipe, k, ema[k])
    return pipe


# --------------------------------------------------------------------------- evaluation
#: Images per held-out prompt in the documented evaluation, as in GenEval.
IMAGES_PER_PROMPT = 4


def evaluate(folder, prompts: list[str] | None = None, *, seed: int = 0, noise_level: float = 0.0,
             num_inference_steps: int = 10, batch_size: int = 64, true_cfg_scale: float = 1.0,
             images_per_prompt: int = 1, policy=None) -> dict:
    """Held-out accuracy of a saved model, sampled as the RL rollout does.

    ``prompts`` defaults to the 256 held-out prompts; each gets
    ``images_per_prompt`` samples (GenEval draws 4), listed prompt-major, and
    sample ``i`` of that list uses seed ``seed + i``.
    ``noise_level`` 0 is the ODE sampler, > 0 the Flow-GRPO SDE.
    ``true_cfg_scale`` > 1 samples with classifier-free guidance against the
    empty prompt (the model saw 10 % empty prompts in training). Returns score
    and strict accuracy over all images, ``overall`` (GenEval's: the mean of the
    per-category strict accuracies), per-clause accuracy and per-category
    score/strict, plus the images.
    """
    from omnirl_async.models.policy import FlowMatchPolicy
    from omnirl_async.models.sampler import sample_with_logprob
    from omnirl_async.rewards.tiny_geneval import clause_accuracy, tiny_geneval

    if images_per_prompt < 1:
        raise ValueError(f"`images_per_prompt` must be >= 1, got {images_per_prompt}")
    prompts = [p for p in (heldout_prompts() if prompts is None else prompts) for _ in range(images_per_prompt)]
    policy = policy or FlowMatchPolicy.from_pretrained(folder)
    images = []
    for s in range(0, len(prompts), batch_size):
        chunk = prompts[s:s + batch_size]
        neg = [""] * len(chunk) if true_cfg_scale > 1 else None
        emb = policy.encode_prompt(chunk, negative_prompts=neg, max_sequence_length=MAX_SEQUENCE_LENGTH)
        out = sample_with_logprob(policy, emb, seeds=[seed + s + i for i in range(len(chunk))], height=32, width=32,
                                  num_inference_steps=num_inference_steps, noise_level=noise_level, sde_type="sde",
                                  true_cfg_scale=true_cfg_scale)
        images.append(out.images)
    images = np.concatenate(images)
    extra = tiny_geneval(images, prompts)
    res = {"n": len(prompts), "score": float(np.mean(extra["score"])), **clause_accuracy(extra)}
    cats = np.array([prompt_category(p) for p in prompts])
    res["by_category"] = {
        c: {"n": int((cats == c).sum()), "score": float(extra["score"][cats == c].mean()),
            "strict": float(extra["strict"][cats == c].mean())}
        for c in CATEGORIES if (cats == c).any()
    }
    res["overall"] = float(np.mean([r["strict"] for r in res["by_category"].values()]))
    res["images_per_prompt"] = images_per_prompt
    res["images"] = images
    return res


def evaluation_report(folder, *, seed: int = 0) -> dict:
    """Everything ``docs/shapes_model.md`` reports about a saved model.

    Held-out accuracy (256 prompts x :data:`IMAGES_PER_PROMPT` images, ODE and
    SDE 0.7), the 64-prompt subset the test uses (``heldout_prompts()[::4]``,
    one image each, ODE), parameter counts and the time of one transformer
    forward at batch 16 on one thread.
    """
    from omnirl_async.models.policy import FlowMatchPolicy

    policy = FlowMatchPolicy.from_pretrained(folder)
    report: dict = {"seed": seed, "num_inference_steps": 10, "max_sequence_length": MAX_SEQUENCE_LENGTH}
    for name, prompts, nl, k in (("heldout_ode", None, 0.0, IMAGES_PER_PROMPT),
                                 ("heldout_sde07", None, 0.7, IMAGES_PER_PROMPT),
                                 ("subset_ode", heldout_prompts()[::4], 0.0, 1)):
        res = evaluate(folder, prompts, seed=seed, noise_level=nl, images_per_prompt=k, policy=policy)
        res.pop("images")
        report[name] = res
        print(f"{name} (noise_level={nl}, seed {seed}, 10 steps, {k} image(s) per prompt):\n{_fmt(res)}", flush=True)
    pipe = policy.pipeline
    report["parameters"] = {k: sum(p.numel() for p in getattr(pipe, k).parameters())
                            for k in ("transformer", "text_encoder", "text_encoder_2", "vae")}
    report["parameters"]["vae_decoder"] = sum(p.numel() for p in pipe.vae.decoder.parameters())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    size = pipe.transformer.config.sample_size
    x = torch.randn(16, policy.latent_channels, size, size)
    emb = policy.encode_prompt(["a red circle"] * 16, max_sequence_length=MAX_SEQUENCE_LENGTH)
    sig = torch.full((16,), 0.5)
    times = []
    with torch.no_grad():
        for _ in range(23):
            t = time.perf_counter()
            policy.predict_velocity(x, sig, emb)
            times.append(time.perf_counter() - t)
        dec = []
        for _ in range(8):
            t = time.perf_counter()
            policy.decode(x, 32, 32)
            dec.append(time.perf_counter() - t)
    torch.set_num_threads(threads)
    report["timing_ms_1thread_batch16"] = {"transformer_forward_median": round(1000 * sorted(times[3:])[10], 1),
                                           "transformer_forward_min": round(1000 * min(times[3:]), 1),
                                           "vae_decode_median": round(1000 * sorted(dec)[4], 1)}
    print(report["parameters"], report["timing_ms_1thread_batch16"], flush=True)
    return report


def _fmt(res: dict) -> str:
    head = f"n={res['n']}  overall={res['overall']:.3f}  score={res['score']:.3f}  strict={res['strict']:.3f}  "
    lines = [head + "  ".join(f"{t}={res[t]:.3f}" for t in ("color", "shape", "count", "position"))]
    for c, r in res["by_category"].items():
        lines.append(f"  {c:9s} n={r['n']:3d}  score={r['score']:.3f}  strict={r['strict']:.3f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main
def pretrain(out, *, seed: int = 0, minutes: float = 25.0, ae_fraction: float = 0.18, ae_steps: int | None = None,
             flow_steps: int | None = None, batch_size: int = 32, ae_batch_size: int = 32, lr: float = 2e-3,
             text_lr: float = 2e-3, ae_lr: float = 2e-3, kl_weight: float = 1e-3, ema_decay: float = 0.998,
             prompt_dropout: float = 0.1, foreground_weight: float = 4.0, eval_every: int = 500, threads: int = 1,
             processes: int = 2, progress: bool = True, cfg: ShapesModelConfig = ShapesModelConfig()) -> Path:
    """Train both stages and ``save_pretrained`` the pipeline into ``out``.

    ``processes`` data-parallel processes with ``threads`` threads each share
    every batch (``batch_size`` and ``ae_batch_size`` are totals over the
    processes and must divide evenly); the default, 2 x 1, is the fastest
    layout on 2 cores (:mod:`omnirl_async.models.data_parallel`).
    """
    args = {k: v for k, v in locals().items() if k not in ("out", "cfg")}
    args["out"] = str(out)
    for name, b in (("batch_size", batch_size), ("ae_batch_size", ae_batch_size)):
        if processes < 1 or b % processes:
            raise ValueError(f"`{name}`={b} must be a multiple of `processes`={processes} (every process "
                             f"draws {name} / processes samples of each batch); change one of them.")
    launch(_pretrain_worker, int(processes), threads=int(threads), args=(Path(out), args, cfg))
    return Path(out)


def _pretrain_worker(group: Group, out: Path, args: dict, cfg: ShapesModelConfig) -> None:
    if group.active and not logging.getLogger().handlers:  # a spawned process: log like the parent
        logging.basicConfig(level=logging.INFO if group.is_main else logging.WARNING,
                            format=f"%(asctime)s %(levelname)s [rank {group.rank}] %(message)s")
    t0 = time.perf_counter()
    seed, world = args["seed"], group.world
    log: dict = {"args": args, "config": {k: list(v) if isinstance(v, tuple) else v
                                          for k, v in vars(cfg).items()}}
    budget = float(args["minutes"]) * 60.0
    stream = PromptStream(seed + _RANK_SEED_STRIDE * group.rank)
    vae = train_autoencoder(cfg, stream, seconds=budget * args["ae_fraction"], steps=args["ae_steps"],
                            batch_size=args["ae_batch_size"] // world, lr=args["ae_lr"],
                            kl_weight=args["kl_weight"], seed=seed, log=log, progress=args["progress"], group=group)
    check = calibrate_and_check_vae(vae, PromptStream(seed + 100)) if group.is_main else {}
    mean, std = group.share([check.get("latent_mean", 0.0), check.get("latent_std", 1.0)])
    vae.register_to_config(shift_factor=mean, scaling_factor=1.0 / std)
    log["ae_check"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in check.items()}
    logger.info("autoencoder reconstructions: %s", log["ae_check"])
    log["ae_seconds"] = round(time.perf_counter() - t0, 1)
    pipe = build_shapes_pipeline(seed, cfg, vae=vae)
    remaining = budget - (time.perf_counter() - t0) - 20.0  # keep ~20 s for saving
    remaining = group.share([remaining])[0]
    train_flow(pipe, stream, seconds=remaining, steps=args["flow_steps"], batch_size=args["batch_size"] // world,
               lr=args["lr"], text_lr=args["text_lr"], ema_decay=args["ema_decay"], dropout=args["prompt_dropout"],
               seed=seed, eval_every=args["eval_every"], log=log, progress=args["progress"],
               foreground_weight=args["foreground_weight"], group=group)
    trained = [vae, pipe.transformer, pipe.text_encoder, pipe.text_encoder_2]
    if not group.parameters_agree(trained):  # gloo's all_reduce gives every rank the same bits; check it
        raise RuntimeError("data-parallel ranks ended with different weights; the run is not reproducible")
    log["processes"] = world
    log["flow_seconds"] = round(time.perf_counter() - t0 - log["ae_seconds"], 1)
    log["total_seconds"] = round(time.perf_counter() - t0, 1)
    if group.is_main:
        out.mkdir(parents=True, exist_ok=True)
        pipe.save_pretrained(out, safe_serialization=True)
        (out / "pretrain_log.json").write_text(json.dumps(log, indent=1))
        logger.info("saved %s after %.1f min", out, log["total_seconds"] / 60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omnirl_async.models.pretrain", description=__doc__.split("\n")[0])
    p.add_argument("--out", help="output folder (a StableDiffusion3Pipeline is saved there)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=25.0, help="total wall-clock budget, both stages")
    p.add_argument("--ae-fraction", type=float, default=0.18, help="share of the budget for the autoencoder")
    p.add_argument("--ae-steps", type=int, default=None, help="fixed autoencoder steps (overrides the timing)")
    p.add_argument("--flow-steps", type=int, default=None, help="fixed flow steps (overrides the timing)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--foreground-weight", type=float, default=4.0,
                   help="extra flow-loss weight on latent pixels on or next to objects (0: plain MSE)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--processes", type=int, default=2,
                   help="data-parallel training processes (each takes batch-size / processes samples)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (and for --eval-only)")
    p.add_argument("--eval-every", type=int, default=500, help="steps between train-prompt sample checks (0: off)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--eval-only", metavar="FOLDER", help="only evaluate a saved model on the held-out prompts")
    p.add_argument("--eval-seed", type=int, default=0)
    p.add_argument("--write-json", action="store_true", help="with --eval-only: write FOLDER/eval.json")
    a = p.parse_args(argv)
    if _OMP_ENV not in os.environ and (a.threads > 1 or a.processes > 1):
        env = dict(os.environ, **{_OMP_ENV: "PASSIVE"})
        args = sys.argv[1:] if argv is None else list(argv)
        os.execve(sys.executable, [sys.executable, "-m", "omnirl_async.models.pretrain", *args], env)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if a.eval_only:
        torch.set_num_threads(max(a.threads, a.processes))
        report = evaluation_report(a.eval_only, seed=a.eval_seed)
        if a.write_json:
            (Path(a.eval_only) / "eval.json").write_text(json.dumps(report, indent=1))
        return 0
    if not a.out:
        p.error("--out is required (or use --eval-only FOLDER)")
    pretrain(a.out, seed=a.seed, minutes=a.minutes, ae_fraction=a.ae_fraction, ae_steps=a.ae_steps,
             flow_steps=a.flow_steps,
             batch_size=a.batch_size, lr=a.lr, text_lr=a.lr, foreground_weight=a.foreground_weight,
             eval_every=a.eval_every, threads=a.threads, processes=a.processes,
             progress=not a.no_progress)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
