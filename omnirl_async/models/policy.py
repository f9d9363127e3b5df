"""`FlowMatchPolicy`: one interface over diffusers SD3 and Flux pipelines.

The RL code never calls a diffusers pipeline's ``__call__``: the denoising
loop is written out by the sampler so that every step's log-probability stays
visible (see ``sde.py``). What it needs from the model is a handful of
primitives, all here:

1. ``encode_prompt``   text -> :class:`PromptEmbeds` (frozen text encoders).
2. ``prepare_latents`` initial Gaussian noise x_1 in the transformer's layout.
3. ``make_sigmas``     the shifted sigma grid s_0=1 > ... > s_{N-1} > s_N=0, as the
   family's diffusers pipeline builds it.
4. ``predict_velocity`` v_theta(x_s, s | prompt) with optional true CFG. This is
   the only differentiable call; gradients reach the LoRA (or full) weights.
5. ``decode``          latents -> uint8 images for the reward models.

Notation (diffusers FlowMatchEulerDiscreteScheduler): x_s = (1-s) x_0 + s eps,
v = eps - x_0, timestep = 1000 s. SD3's transformer takes ``1000 s``; Flux's
takes ``s`` and multiplies by 1000 inside (its pipeline passes ``t / 1000``).

Layouts: SD3 latents are images ``[B, C, h, w]`` (h = H / vae_scale_factor);
Flux latents are *packed* 2x2 patches ``[B, (h/2)(w/2), 4C]``. Everything a
caller stores or passes around (latents, velocities, sigmas) is fp32, whatever
the transformer's dtype.

The weights part (LoRA / full fine-tuning) lives in ``lora.py``; the methods
here only choose the mode and delegate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from omnirl_async.models import adapters as _adapters
from omnirl_async.models import lora as _lora

logger = logging.getLogger(__name__)

#: ``_class_name`` in ``model_index.json`` -> policy family.
SUPPORTED_PIPELINES = {"StableDiffusion3Pipeline": "sd3", "FluxPipeline": "flux"}
#: Flux pipelines' default distilled-guidance strength.
FLUX_DEFAULT_GUIDANCE = 3.5

_EMB_FIELDS = ("prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds", "negative_pooled_prompt_embeds")


# --------------------------------------------------------------------------- prompt embeddings
@dataclasses.dataclass
class PromptEmbeds:
    """Text conditioning for a batch, batch dimension first, fp32.

    ``prompt_embeds`` [B, L, D] is the token sequence the transformer attends to;
    ``pooled_prompt_embeds`` [B, P] is the global vector it adds to the time
    embedding. The ``negative_*`` pair is present when the prompts were encoded
    with negative prompts, i.e. when true classifier-free guidance is possible.
    """

    prompt_embeds: torch.Tensor
    pooled_prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor | None = None
    negative_pooled_prompt_embeds: torch.Tensor | None = None

    def _fields(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in _EMB_FIELDS if getattr(self, k) is not None}

    def _map(self, fn) -> PromptEmbeds:
        return PromptEmbeds(**{k: fn(v) for k, v in self._fields().items()})

    @property
    def has_negative(self) -> bool:
        return self.negative_prompt_embeds is not None

    def __len__(self) -> int:
        return int(self.prompt_embeds.shape[0])

    def to_numpy(self) -> dict[str, np.ndarray]:
        """Field name -> float32 array (the cross-process tensor format)."""
        return {k: v.detach().to("cpu", torch.float32).numpy() for k, v in self._fields().items()}

    @classmethod
    def from_numpy(cls, d: dict[str, np.ndarray]) -> PromptEmbeds:
        """Inverse of :meth:`to_numpy`. Copies (Ray hands out read-only views)."""
        unknown = set(d) - set(_EMB_FIELDS)
        missing = {"prompt_embeds", "pooled_prompt_embeds"} - set(d)
        if unknown or missing:
            raise KeyError(
                f"PromptEmbeds.from_numpy: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}; "
                f"expected {list(_EMB_FIELDS)} (negatives optional), as written by `to_numpy()`."
            )
        return cls(**{k: torch.tensor(np.asarray(v)) for k, v in d.items()})

    def select(self, idx) -> PromptEmbeds:
        """Rows ``idx`` (int, slice, list, array or tensor); an int keeps the batch dim."""
        if isinstance(idx, (int, np.integer)):
            idx = slice(int(idx), int(idx) + 1)
        elif not isinstance(idx, slice):
            idx = torch.as_tensor(np.asarray(idx), dtype=torch.long)
        return self._map(lambda t: t[idx.to(t.device) if isinstance(idx, torch.Tensor) else idx])

    def repeat_interleave(self, n: int) -> PromptEmbeds:
        """Each row ``n`` times in a row: one prompt -> a group of n samples."""
        return self._map(lambda t: t.repeat_interleave(int(n), dim=0))

    def to(self, device=None, dtype: torch.dtype | None = None) -> PromptEmbeds:
        return self._map(lambda t: t.to(device=device, dtype=dtype))

    @classmethod
    def cat(cls, items: Sequence[PromptEmbeds]) -> PromptEmbeds:
        """Concatenate along the batch; all items must agree on having negatives."""
        if not items:
            raise ValueError("`items` is empty: PromptEmbeds.cat needs at least one PromptEmbeds.")
        keys = set(items[0]._fields())
        if any(set(it._fields()) != keys for it in items):
            raise ValueError("PromptEmbeds.cat: some `items` have negative embeds and others not; encode all "
                             "with the same `negative_prompts` setting.")
        return cls(**{k: torch.cat([getattr(it, k) for it in items]) for k in keys})


# --------------------------------------------------------------------------- policy
class FlowMatchPolicy:
    """A frozen diffusers SD3/Flux pipeline plus optional trainable weights.

    Weight modes (``self.mode``): ``"frozen"`` after loading (every parameter has
    ``requires_grad=False``), ``"lora"`` after ``add_lora(rank>0)``, ``"full"``
    after ``add_lora(rank=0)`` (all transformer weights trainable, as
    ``lora_rank=0`` means in the config).
    """

    def __init__(self, pipeline, *, family: str, path: Path | None = None):
        if family not in SUPPORTED_PIPELINES.values():
            raise ValueError(f"`family` must be one of {sorted(set(SUPPORTED_PIPELINES.values()))}, got {family!r}.")
        self.pipeline = pipeline
        self.family = family
        self.path = path
        self.mode = "frozen"
        for module in pipeline.components.values():
            if isinstance(module, torch.nn.Module):
                module.requires_grad_(False)
                module.eval()

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        transformer_subfolder: str = "transformer",
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
    ) -> FlowMatchPolicy:
        """Load a local diffusers pipeline folder (offline) and freeze it.

        The family is read from ``model_index.json``. ``transformer_subfolder``
        selects another transformer folder inside ``path`` (e.g. a fine-tuned
        copy saved next to the original). ``dtype`` is a ``torch.dtype`` or
        ``"fp32" | "bf16" | "fp16"``.
        """
        import diffusers

        path = Path(path)
        index_file = path / "model_index.json"
        if not index_file.is_file():
            raise FileNotFoundError(
                f"`path`={str(path)!r} is not a diffusers pipeline folder (no model_index.json there). "
                "Pass a folder written by `save_pretrained`, e.g. from `omnirl_async.models.tiny.ensure_tiny_model`."
            )
        index = json.loads(index_file.read_text())
        class_name = index.get("_class_name")
        if class_name not in SUPPORTED_PIPELINES:
            raise ValueError(
                f"`path`={str(path)!r} holds a {class_name!r} pipeline; supported pipeline classes are "
                f"{sorted(SUPPORTED_PIPELINES)}."
            )
        torch_dtype = _lora.resolve_dtype(dtype, arg="dtype") or torch.float32
        pipeline_cls = getattr(diffusers, class_name)

        # Components saved as [null, null] (e.g. SD3 without T5) must be passed
        # explicitly as None, otherwise diffusers refuses to build the pipeline.
        kwargs = {}
        expected, _ = pipeline_cls._get_signature_keys(pipeline_cls)
        for name in expected:
            entry = index.get(name)
            if entry is None or entry == [None, None]:
                kwargs[name] = None
        if transformer_subfolder != "transformer":
            sub = path / transformer_subfolder
            if not (sub / "config.json").is_file():
                raise FileNotFoundError(
                    f"`transformer_subfolder`={transformer_subfolder!r}: {str(sub)!r} has no config.json. "
                    "Use the name of a folder inside `path` that holds a saved transformer."
                )
            transformer_cls = getattr(diffusers, index["transformer"][1])
            kwargs["transformer"] = transformer_cls.from_pretrained(
                str(path), subfolder=transformer_subfolder, dtype=torch_dtype, local_files_only=True)
        pipeline = pipeline_cls.from_pretrained(str(path), dtype=torch_dtype, local_files_only=True, **kwargs)
        pipeline.set_progress_bar_config(disable=True)
        pipeline.to(device)
        return cls(pipeline, family=SUPPORTED_PIPELINES[class_name], path=path)

    # ---- components ----------------------------------------------------------------------
    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipeline.transformer

    @property
    def vae(self) -> torch.nn.Module:
        return self.pipeline.vae

    @property
    def scheduler(self):
        return self.pipeline.scheduler

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def latent_channels(self) -> int:
        return int(self.vae.config.latent_channels)

    @property
    def _patch(self) -> int:
        """Spatial patch of one transformer token: SD3's patch_size; Flux packs 2x2."""
        return int(self.transformer.config.patch_size) if self.family == "sd3" else 2

    def latent_grid(self, height: int, width: int) -> tuple[int, int]:
        """Latent (h, w) for an image of ``height`` x ``width`` pixels (validated)."""
        step = self.vae_scale_factor * self._patch
        for arg, value in (("height", height), ("width", width)):
            if int(value) <= 0 or int(value) % step:
                raise ValueError(
                    f"`{arg}`={value!r} must be a positive multiple of {step} for this {self.family} model "
                    f"(vae_scale_factor {self.vae_scale_factor} x patch {self._patch})."
                )
        return int(height) // self.vae_scale_factor, int(width) // self.vae_scale_factor

    # ---- 1. prompts ----------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompt(
        self,
        prompts: str | Sequence[str],
        negative_prompts: str | Sequence[str] | None = None,
        max_sequence_length: int = 77,
    ) -> PromptEmbeds:
        """Encode prompts with the pipeline's own ``encode_prompt`` (frozen encoders).

        ``negative_prompts`` (a string for all, or one per prompt; ``""`` is the
        usual unconditional prompt) adds the negative pair needed for
        ``true_cfg_scale > 1``. ``max_sequence_length`` is the T5 token budget
        (SD3 without T5 still appends that many zero tokens, as diffusers does).
        """
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"`prompts` must be a non-empty string or list of strings, got {prompts!r}.")
        if negative_prompts is not None:
            if isinstance(negative_prompts, str):
                negative_prompts = [negative_prompts] * len(prompts)
            negative_prompts = list(negative_prompts)
            if len(negative_prompts) != len(prompts):
                raise ValueError(
                    f"`negative_prompts` has {len(negative_prompts)} entries for {len(prompts)} prompts; "
                    "pass one string for all prompts or one per prompt."
                )
        pipe, dev = self.pipeline, self.device
        if self.family == "sd3":
            pe, npe, pooled, npooled = pipe.encode_prompt(
                prompt=prompts, prompt_2=None, prompt_3=None, device=dev,
                do_classifier_free_guidance=negative_prompts is not None,
                negative_prompt=negative_prompts, max_sequence_length=int(max_sequence_length))
        else:
            pe, pooled, _ = pipe.encode_prompt(
                prompt=prompts, prompt_2=None, device=dev, max_sequence_length=int(max_sequence_length))
            npe = npooled = None
            if negative_prompts is not None:
                npe, npooled, _ = pipe.encode_prompt(
                    prompt=negative_prompts, prompt_2=None, device=dev, max_sequence_length=int(max_sequence_length))
        emb = PromptEmbeds(pe, pooled, npe, npooled)
        return emb.to(dtype=torch.float32)

    # ---- 2. noise ------------------------------------------------------------------------
    def prepare_latents(
        self,
        batch_size: int,
        height: int,
        width: int,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
    ) -> torch.Tensor:
        """Initial noise x_1 ~ N(0, I), fp32, in the transformer's layout.

        ``generator`` may be one generator for the batch or one per sample (so
        that a sample's noise depends only on its own seed). Noise is drawn on
        the generator's device, then moved to the policy's device.
        """
        h, w = self.latent_grid(height, width)
        c = self.latent_channels
        if isinstance(generator, (list, tuple)):
            if len(generator) != batch_size:
                raise ValueError(f"`generator` is a list of {len(generator)} for `batch_size`={batch_size}; "
                                 "pass one generator, or exactly one per sample.")
            noise = torch.cat([torch.randn((1, c, h, w), generator=g, device=g.device) for g in generator])
        else:
            gdev = generator.device if generator is not None else "cpu"
            noise = torch.randn((int(batch_size), c, h, w), generator=generator, device=gdev)
        noise = noise.to(self.device, torch.float32)
        return self.pack(noise) if self.family == "flux" else noise

    @staticmethod
    def pack(latents: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] -> Flux's packed [B, (h/2)(w/2), 4C] (2x2 patches)."""
        b, c, h, w = latents.shape
        x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // 2) * (w // 2), c * 4)

    def unpack(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Inverse of :meth:`pack` for an image of ``height`` x ``width`` pixels."""
        h, w = self.latent_grid(height, width)
        b, n, c4 = latents.shape
        if n != (h // 2) * (w // 2):
            raise ValueError(f"packed latents have {n} tokens, a {height}x{width} image needs {(h // 2) * (w // 2)}; "
                             "pass the `height`/`width` the latents were prepared for.")
        x = latents.view(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, c4 // 4, h, w)

    # ---- 3. sigma grid -------------------------------------------------------------------
    def make_sigmas(self, num_inference_steps: int, height: int, width: int) -> torch.Tensor:
        """fp32 Tensor[N+1]: the family's pipeline grid, time-shifted, then 0.

        The unshifted grid is the one each diffusers pipeline uses, so a policy
        rollout reproduces the pipeline's own sampling:

        * Flux: ``linspace(1, 1/N, N)`` (FluxPipeline passes these sigmas).
        * SD3: ``linspace(1, s_min, N)`` with ``s_min`` the scheduler's smallest
          training sigma (``shift(1/1000)``), the scheduler's default grid that
          StableDiffusion3Pipeline uses.

        The shift is the scheduler's: static ``s' = shift s / (1 + (shift-1) s)``
        for SD3, resolution-dependent (``mu`` from the image token count, as in
        the pipelines) when the config has ``use_dynamic_shifting``. A fresh
        scheduler copy is used; the pipeline's own one is not mutated.
        """
        n = int(num_inference_steps)
        if n < 1 or n != num_inference_steps:
            raise ValueError(f"`num_inference_steps` must be a positive integer, got {num_inference_steps!r}.")
        h, w = self.latent_grid(height, width)
        sched = type(self.scheduler).from_config(self.scheduler.config)
        mu = None
        if sched.config.get("use_dynamic_shifting", False):
            from diffusers.pipelines.flux.pipeline_flux import calculate_shift

            cfg = sched.config
            mu = calculate_shift((h // self._patch) * (w // self._patch), cfg.get("base_image_seq_len", 256),
                                 cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                                 cfg.get("max_shift", 1.15))
        if self.family == "flux":
            sched.set_timesteps(sigmas=np.linspace(1.0, 1.0 / n, n), mu=mu)
        else:
            sched.set_timesteps(num_inference_steps=n, mu=mu)
        return sched.sigmas.to("cpu", torch.float32)

    # ---- 4. velocity ---------------------------------------------------------------------
    def predict_velocity(
        self,
        x: torch.Tensor,
        sigma_b: torch.Tensor | float,
        emb: PromptEmbeds,
        *,
        true_cfg_scale: float = 1.0,
        guidance_scale: float | None = None,
        height: int | None = None,
        width: int | None = None,
    ) -> torch.Tensor:
        """v_theta(x, sigma | prompt), fp32, same shape as ``x``. Differentiable.

        ``sigma_b``: Tensor[B] (or a scalar) in [0, 1]. ``emb`` has B rows or 1
        (broadcast). ``true_cfg_scale`` s > 1 runs real classifier-free guidance,
        ``v = v_neg + s (v_pos - v_neg)``, with both halves in one batched
        forward; it needs ``emb`` encoded with ``negative_prompts``.
        ``guidance_scale`` feeds the distilled-guidance embedding of Flux-dev
        style transformers (default 3.5) and is ignored by models without one.
        ``height``/``width`` (pixels) are only needed for non-square Flux latents.
        """
        b = x.shape[0]
        want = 4 if self.family == "sd3" else 3
        if x.dim() != want:
            layout = "[B, C, h, w]" if self.family == "sd3" else "packed [B, seq, 4C]"
            raise ValueError(f"`x` has shape {tuple(x.shape)}; {self.family} latents are {layout}. "
                             "Use `prepare_latents` to make them.")
        sigma = torch.as_tensor(sigma_b, dtype=torch.float32, device=x.device).reshape(-1)
        if sigma.numel() == 1:
            sigma = sigma.expand(b)
        if sigma.numel() != b:
            raise ValueError(f"`sigma_b` has {sigma.numel()} values for a batch of {b}; pass Tensor[B] or a scalar.")
        if len(emb) not in (1, b):
            raise ValueError(f"`emb` has {len(emb)} rows for a batch of {b}; pass B rows or 1 to broadcast.")
        emb = emb.to(self.device)
        scale = float(true_cfg_scale)
        if scale <= 1.0:
            return self._forward(x, sigma, emb.prompt_embeds, emb.pooled_prompt_embeds, guidance_scale, height, width)
        if not emb.has_negative:
            raise ValueError(
                f"`true_cfg_scale`={true_cfg_scale} needs negative prompt embeddings, but `emb` has none. Encode "
                "with `encode_prompt(prompts, negative_prompts=\"\")` or set `true_cfg_scale` to 1.0."
            )
        pe, npe = self._expand(emb.prompt_embeds, b), self._expand(emb.negative_prompt_embeds, b)
        pooled, npooled = self._expand(emb.pooled_prompt_embeds, b), self._expand(emb.negative_pooled_prompt_embeds, b)
        if pe.shape == npe.shape:  # one forward over [negative; positive]
            v = self._forward(torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([npe, pe]),
                              torch.cat([npooled, pooled]), guidance_scale, height, width)
            v_neg, v_pos = v.chunk(2)
        else:  # different token lengths cannot share a batch
            v_pos = self._forward(x, sigma, pe, pooled, guidance_scale, height, width)
            v_neg = self._forward(x, sigma, npe, npooled, guidance_scale, height, width)
        return v_neg + scale * (v_pos - v_neg)

    @staticmethod
    def _expand(t: torch.Tensor, b: int) -> torch.Tensor:
        return t.expand(b, *t.shape[1:]) if t.shape[0] == 1 and b != 1 else t

    def _forward(self, x, sigma, pe, pooled, guidance_scale, height, width) -> torch.Tensor:
        b, dt = x.shape[0], self.dtype
        pe, pooled = self._expand(pe, b).to(dt), self._expand(pooled, b).to(dt)
        if self.family == "sd3":
            out = self.transformer(hidden_states=x.to(dt), encoder_hidden_states=pe, pooled_projections=pooled,
                                   timestep=sigma * 1000.0, return_dict=False)[0]
            return out.float()
        gh, gw = self._flux_grid(x.shape[1], height, width)
        img_ids = torch.zeros(gh, gw, 3, device=x.device)
        img_ids[..., 1] += torch.arange(gh, device=x.device)[:, None]
        img_ids[..., 2] += torch.arange(gw, device=x.device)[None, :]
        txt_ids = torch.zeros(pe.shape[1], 3, device=x.device, dtype=dt)
        guidance = None
        if self.transformer.config.guidance_embeds:
            g = FLUX_DEFAULT_GUIDANCE if guidance_scale is None else float(guidance_scale)
            guidance = torch.full((b,), g, device=x.device, dtype=torch.float32)
        out = self.transformer(hidden_states=x.to(dt), timestep=sigma.to(dt), guidance=guidance,
                               pooled_projections=pooled, encoder_hidden_states=pe, txt_ids=txt_ids,
                               img_ids=img_ids.reshape(gh * gw, 3).to(dt), return_dict=False)[0]
        return out.float()

    def _flux_grid(self, seq: int, height: int | None, width: int | None) -> tuple[int, int]:
        """Token grid (h/2, w/2) of packed latents; square unless height/width say otherwise."""
        if height is not None and width is not None:
            h, w = self.latent_grid(height, width)
            gh, gw = h // 2, w // 2
        else:
            gh = gw = math.isqrt(seq)
        if gh * gw != seq:
            raise ValueError(f"packed latents have {seq} tokens, which is not a square grid (or does not match "
                             f"`height`={height}, `width`={width}); pass the image `height` and `width`.")
        return gh, gw

    # ---- 5. images -----------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> np.ndarray:
        """Latents (model layout) -> ``np.uint8 [B, height, width, 3]``.

        Undoes the VAE normalisation (``z / scaling_factor + shift_factor``),
        decodes, and maps [-1, 1] to [0, 255] with rounding, like diffusers'
        ``VaeImageProcessor.postprocess``.
        """
        if self.family == "flux":
            latents = self.unpack(latents, height, width)
        elif tuple(latents.shape[-2:]) != self.latent_grid(height, width):
            raise ValueError(f"latents of shape {tuple(latents.shape)} do not decode to {height}x{width}; "
                             f"expected latent size {self.latent_grid(height, width)}.")
        cfg = self.vae.config
        z = latents / cfg.scaling_factor + (cfg.shift_factor or 0.0)
        img = self.vae.decode(z.to(self.vae.device, self.vae.dtype), return_dict=False)[0]
        img = (img.float() / 2 + 0.5).clamp(0, 1)
        return (img * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()

    # ---- trainable weights ---------------------------------------------------------------
    def add_lora(
        self,
        rank: int,
        alpha: float,
        *,
        init_weights: bool | str = "gaussian",
        target_modules: str | Sequence[str] = "all-linear",
        exclude_modules: str | Sequence[str] | None = None,
        adapter_path: str | os.PathLike | None = None,
        lora_dtype=None,
    ) -> None:
        """Make the transformer trainable: a LoRA adapter, or (``rank=0``) all of it.

        See ``lora.add_lora`` for the LoRA details. ``rank=0`` without
        ``adapter_path`` switches to full fine-tuning: every transformer
        parameter gets ``requires_grad=True``; use ``full_state_dict`` to move
        weights and note that no reference (``disable_adapter``) exists then.
        """
        if self.mode != "frozen":
            raise ValueError(f"`add_lora` was already applied (mode {self.mode!r}); call it once per policy.")
        if adapter_path is None and int(rank) == 0:
            self.transformer.requires_grad_(True)
            self.mode = "full"
            return
        if int(rank) < 0:
            raise ValueError(f"`rank` must be >= 0 (0 = full fine-tuning), got {rank!r}.")
        targets = _lora.add_lora(self.transformer, rank=rank, alpha=alpha, init_weights=init_weights,
                                 target_modules=target_modules, exclude_modules=exclude_modules,
                                 adapter_path=adapter_path, lora_dtype=lora_dtype)
        config = self.transformer.peft_config[_lora.ADAPTER_NAME]
        if adapter_path is not None and (config.r != int(rank) or float(config.lora_alpha) != float(alpha)):
            logger.warning("adapter at %s has rank %s / alpha %s; the requested rank %s / alpha %s are ignored",
                           adapter_path, config.r, config.lora_alpha, rank, alpha)
        self.lora_targets = targets
        self.mode = "lora"

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters with ``requires_grad`` (LoRA weights, or the whole transformer)."""
        return [p for p in self.transformer.parameters() if p.requires_grad]

    def _require(self, mode: str, what: str) -> None:
        if self.mode != mode:
            fix = "call `add_lora(rank>0, ...)` first" if mode == "lora" else "use `add_lora(rank=0, ...)`"
            raise ValueError(f"`{what}` needs weight mode {mode!r} but the policy is {self.mode!r}: {fix}.")

    def lora_state_dict(self, adapter: str = _lora.ADAPTER_NAME) -> dict[str, torch.Tensor]:
        """CPU copy of the adapter weights, peft keys without the adapter name."""
        self._require("lora", "lora_state_dict")
        return _lora.lora_state_dict(self.transformer, adapter)

    def load_lora_state_dict(self, state_dict: dict[str, torch.Tensor], adapter: str = _lora.ADAPTER_NAME) -> None:
        """In-place, strict load of adapter weights (see ``lora_state_dict``)."""
        self._require("lora", "load_lora_state_dict")
        _lora.load_lora_state_dict(self.transformer, state_dict, adapter)

    def add_policy_state(self, name: str) -> None:
        """A second, frozen LoRA adapter ``name`` (e.g. DiffusionNFT's ``old``), starting as a copy of the default."""
        self._require("lora", f"add_policy_state({name!r})")
        _adapters.add_named_adapter(self.transformer, name)

    def use_adapter(self, name: str):
        """Context manager: compute with adapter ``name`` inside the block (``default``: no change)."""
        return _adapters.use_adapter(self.transformer, name)

    def ema_policy_state(self, name: str, decay: float) -> None:
        """``name`` <- decay * ``name`` + (1 - decay) * default, in place."""
        _adapters.ema_update(self.transformer, name, decay)

    @property
    def adapter_names(self) -> list[str]:
        return _adapters.adapter_names(self.transformer)

    def save_lora(self, directory: str | os.PathLike) -> Path:
        """Write the adapter into ``directory`` in two formats; return the folder.

        * PEFT: ``adapter_model.safetensors`` + ``adapter_config.json``, read back
          by ``add_lora(adapter_path=...)``, ``eval --lora`` and peft.
        * the pipeline's own LoRA file, ``pytorch_lora_weights.safetensors``
          (``save_lora_weights`` of the pipeline class, keys ``transformer.…``),
          so that a plain diffusers ``pipe.load_lora_weights(directory)`` applies
          the trained adapter (it loads nothing from the PEFT file alone).
        """
        self._require("lora", "save_lora")
        return _lora.save_lora(self.transformer, directory, pipeline_cls=type(self.pipeline))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """CPU copy of the whole transformer state dict (the ``lora_rank=0`` weights)."""
        return _lora.full_state_dict(self.transformer)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """In-place, strict load of a ``full_state_dict``."""
        _lora.load_full_state_dict(self.transformer, state_dict)

    def disable_adapter(self):
        """Context manager: inside, the policy is the base model (the RL reference).

        Without an adapter (mode ``"frozen"``) the policy already is the base,
        so this is a no-op. In mode ``"full"`` the base weights were overwritten
        and there is nothing to switch back to: it raises.
        """
        if self.mode == "lora":
            return _lora.disabled_adapter(self.transformer)
        if self.mode == "frozen":
            return contextlib.nullcontext()
        raise ValueError("`disable_adapter` has no base to return to with full fine-tuning (`lora_rank`=0). "
                         "Use LoRA (`lora_rank` > 0) or turn off reference terms (`use_kl_loss`=false).")
