"""Tiny random-weight SD3 and Flux pipelines, built locally and saved to disk.

Why this module exists
----------------------
Every part of the system (rollout workers, learners, the replay buffer, the
trainer modes) has to be testable on a laptop CPU with no model hub. These
builders produce *real* diffusers pipeline folders (``model_index.json`` plus
one sub-folder per component, weights as safetensors) whose components are
shrunk to a few tens of thousands of parameters. Loading them goes through
exactly the same ``from_pretrained`` code path as a production checkpoint, so
a test that passes on a tiny model exercises the production wiring.

What is inside
--------------
* SD3: ``SD3Transformer2DModel`` (2 layers, 2 heads of dim 16), two tiny
  ``CLIPTextModelWithProjection`` encoders with character-level BPE
  tokenizers, no T5 (``text_encoder_3=None``; the pipeline then feeds zeros in
  its place, as SD3 allows), a tiny ``AutoencoderKL`` with a 4x spatial
  compression and a ``FlowMatchEulerDiscreteScheduler(shift=3.0)``.
* Flux: ``FluxTransformer2DModel`` (1 double + 1 single block, guidance
  embedding on, like FLUX.1-dev), a tiny ``CLIPTextModel``, a tiny
  ``T5EncoderModel`` with a character-level Unigram ``T5Tokenizer``, a tiny
  ``AutoencoderKL`` and a scheduler configured for Flux's resolution-dependent
  ("dynamic") time shift.

Default image size is 32x32 for both (latent 8x8, 4 latent channels).

The weights are random: images are noise. The point is shapes, dtypes and
data flow, not quality. Building is deterministic: the same ``seed`` gives
byte-identical safetensors files, so a cached folder can be shared between
processes and test runs.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

#: Families this module can build, and the argument value that selects each.
TINY_KINDS = ("sd3", "flux")

#: Environment variable that overrides the default cache root.
CACHE_ENV = "OMNIRL_ASYNC_CACHE_DIR"

# Tiny sizes shared by both families.
_LATENT_CHANNELS = 4
_VAE_BLOCKS = (8, 16, 16)  # three blocks -> vae_scale_factor = 2**2 = 4
_CLIP_MAX_LENGTH = 77
# Module construction draws from torch's global RNG: builds in two threads of
# one process would interleave draws, so they take turns.
_BUILD_LOCK = threading.Lock()


# --------------------------------------------------------------------------- tokenizers
def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2/CLIP byte -> printable-unicode table (a well-known formula).

    Printable latin-1 bytes map to themselves; the remaining bytes are moved to
    code points from 256 upwards so that every byte has a visible character.
    """
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_clip_tokenizer(*, model_max_length: int = _CLIP_MAX_LENGTH):
    """A character-level CLIP BPE tokenizer built in memory (no files needed).

    The vocabulary holds every byte symbol twice (plain and with CLIP's
    end-of-word suffix ``</w>``) plus the two special tokens, 514 entries in
    all, and no merges: each character is one token. That is enough for the
    pipeline's padding/truncation logic and gives distinct ids for distinct
    prompts.

    Note: transformers 5 ignores ``vocab_file``/``merges_file`` keyword
    arguments of ``CLIPTokenizer`` and silently yields a 2-token vocabulary,
    so the vocabulary is passed as a dict.
    """
    from transformers import CLIPTokenizer

    symbols = list(_bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for sym in symbols:
        vocab[sym] = len(vocab)
    for sym in symbols:
        vocab[sym + "</w>"] = len(vocab)
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    tok = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)
    return tok


def build_t5_tokenizer():
    """A character-level Unigram ``T5Tokenizer`` built in memory.

    Pieces: ``<pad>``=0, ``</s>``=1, ``<unk>``=2, the word-start marker ``▁``,
    then printable ASCII characters both plain and word-initial (``▁a``). No
    sentinel ``<extra_id_*>`` tokens (they only matter for T5 pre-training).
    """
    from transformers import T5Tokenizer

    chars = [chr(c) for c in range(33, 127)]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [("▁" + c, -1.0) for c in chars]
    vocab += [(c, -1.5) for c in chars]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


# --------------------------------------------------------------------------- components
def _tiny_vae(*, shift_factor: float, scaling_factor: float, quant_conv: bool):
    from diffusers import AutoencoderKL

    n = len(_VAE_BLOCKS)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=_VAE_BLOCKS,
        layers_per_block=1,
        latent_channels=_LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=32,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=quant_conv,
        use_post_quant_conv=quant_conv,
    )
    return vae


def _tiny_clip(tokenizer, *, hidden: int, projection: int | None):
    """A 2-layer CLIP text encoder; with projection when ``projection`` is set."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=_CLIP_MAX_LENGTH,
        projection_dim=projection or hidden,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_act="gelu",
    )
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return cls(config).eval()


def _tiny_t5(tokenizer, *, d_model: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return T5EncoderModel(config).eval()


def _build_sd3_pipeline(seed: int):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=32,
        pooled_projection_dim=32,
        pos_embed_max_size=32,
    )
    tok1, tok2 = build_clip_tokenizer(), build_clip_tokenizer()
    # Two CLIP encoders of hidden 16: concatenated hidden states (32) must fit
    # into joint_attention_dim, concatenated projections (32) = pooled dim.
    te1 = _tiny_clip(tok1, hidden=16, projection=16)
    te2 = _tiny_clip(tok2, hidden=16, projection=16)
    vae = _tiny_vae(shift_factor=0.0609, scaling_factor=1.5305, quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=te1,
        tokenizer=tok1,
        text_encoder_2=te2,
        tokenizer_2=tok2,
        text_encoder_3=None,
        tokenizer_3=None,
    )


def _build_flux_pipeline(seed: int):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=_LATENT_CHANNELS * 4,  # 2x2 packed latents
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,  # = T5 d_model
        pooled_projection_dim=16,  # = CLIP hidden size
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    )
    clip_tok, t5_tok = build_clip_tokenizer(), build_t5_tokenizer()
    clip = _tiny_clip(clip_tok, hidden=16, projection=None)
    t5 = _tiny_t5(t5_tok, d_model=32)
    vae = _tiny_vae(shift_factor=0.1159, scaling_factor=0.3611, quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        time_shift_type="exponential",
    )
    return FluxPipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=clip,
        tokenizer=clip_tok,
        text_encoder_2=t5,
        tokenizer_2=t5_tok,
    )


# --------------------------------------------------------------------------- public API
def build_tiny_pipeline(kind: str, *, seed: int = 0):
    """The in-memory tiny pipeline of ``kind`` (``"sd3"`` or ``"flux"``).

    Weights are drawn under ``torch.manual_seed(seed)`` inside
    ``torch.random.fork_rng``: the caller's global RNG state is left as it was.
    """
    builders = {"sd3": _build_sd3_pipeline, "flux": _build_flux_pipeline}
    if kind not in builders:
        raise ValueError(f"`kind` must be one of {TINY_KINDS}, got {kind!r}.")
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        return builders[kind](seed)


def build_tiny_sd3(path: str | os.PathLike, seed: int = 0) -> Path:
    """Build a tiny random SD3 pipeline and ``save_pretrained`` it to ``path``.

    Returns the folder as a ``Path``. ``path`` may exist (files are overwritten).
    """
    path = Path(path)
    build_tiny_pipeline("sd3", seed=seed).save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_flux(path: str | os.PathLike, seed: int = 0) -> Path:
    """Build a tiny random Flux pipeline and ``save_pretrained`` it to ``path``."""
    path = Path(path)
    build_tiny_pipeline("flux", seed=seed).save_pretrained(path, safe_serialization=True)
    return path


_BUILDERS = {"sd3": build_tiny_sd3, "flux": build_tiny_flux}


def default_cache_root() -> Path:
    """``$OMNIRL_ASYNC_CACHE_DIR`` if set, else ``~/.cache/omnirl_async``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "omnirl_async"


def ensure_tiny_model(kind: str, cache_dir: str | os.PathLike | None = None, *, seed: int = 0) -> Path:
    """Return the folder of a tiny ``kind`` model, building it on first use.

    The folder is ``<cache_dir>/tiny-<kind>-seed<seed>`` where ``cache_dir``
    defaults to :func:`default_cache_root`. A build goes to a private temporary
    folder next to the target and is then renamed into place; ``rename`` is
    atomic on one filesystem, so concurrent callers (several Ray actors, several
    pytest workers) either see no folder or a complete one. A loser of the race
    discards its own copy. Both copies are byte-identical anyway (deterministic
    build).
    """
    if kind not in _BUILDERS:
        raise ValueError(f"`kind` must be one of {TINY_KINDS}, got {kind!r}.")
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / f"tiny-{kind}-seed{seed}"
    if (target / "model_index.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-tiny-{kind}-", dir=root))
    try:
        _BUILDERS[kind](tmp, seed=seed)
        (tmp / "omnirl_tiny.json").write_text(json.dumps({"kind": kind, "seed": seed}))
        try:
            os.rename(tmp, target)
            logger.info("built tiny %s model in %s", kind, target)
        except OSError:
            # Someone else won the race (target exists and is not empty).
            if not (target / "model_index.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
