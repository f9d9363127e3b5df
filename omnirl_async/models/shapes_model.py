"""The shapes text-to-image model: its untrained components, built by the project.

The embedded default model (``omnirl_async/assets/shapes-t2i``) is a real
diffusers ``StableDiffusion3Pipeline`` folder, so it loads with
``FlowMatchPolicy.from_pretrained`` like any SD3 checkpoint. This module builds
its parts with fresh weights; ``omnirl_async.models.pretrain`` trains them on
the renderer's stream (:mod:`omnirl_async.data.shapes`).

Components
----------
* **Tokenizers** (``tokenizer``, ``tokenizer_2``, identical): CLIP BPE
  tokenizers whose vocabulary and merges are learnt (BPE, deterministic) from
  the closed word list of the shapes grammar, so that every grammar word is
  exactly one token (``"left"`` -> ``left</w>``). Letters outside the grammar
  words fall back to ``<unk>``. ``model_max_length`` is :data:`MAX_TOKENS` (16):
  the longest prompt is 10 words + start/end tokens.
* **Text encoders** (``text_encoder``, ``text_encoder_2``): two 2-layer
  ``CLIPTextModelWithProjection`` of width 32. SD3 concatenates their
  penultimate hidden states (32 + 32 = 64 = ``joint_attention_dim``) and their
  projections (the pooled vector, 64). No T5 (``text_encoder_3=None``): the
  pipeline appends ``max_sequence_length`` zero tokens instead, so encode with
  the small value the model was trained with (:data:`MAX_SEQUENCE_LENGTH`).
* **VAE**: a small ``AutoencoderKL`` (2 blocks, 16/32 channels, no attention),
  32x32x3 images <-> 4x16x16 latents (``vae_scale_factor`` 2).
* **Transformer**: ``SD3Transformer2DModel`` on 16x16 latents with patch 2
  (64 image tokens), 4 joint blocks of width 64 (2 heads of 32).
* **Scheduler**: ``FlowMatchEulerDiscreteScheduler(shift=3.0)`` as SD3.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import torch

from omnirl_async.data.shapes import COLORS, COUNT_WORDS, RELATIONS, SHAPES

__all__ = [
    "GRAMMAR_WORDS",
    "MAX_TOKENS",
    "MAX_SEQUENCE_LENGTH",
    "ShapesModelConfig",
    "learn_word_bpe",
    "build_word_tokenizer",
    "build_text_encoder",
    "build_vae",
    "build_transformer",
    "build_scheduler",
    "build_shapes_pipeline",
    "encode_prompts",
]

#: Every word of the shapes grammar (counts, colours, shapes and plurals, connectors).
GRAMMAR_WORDS: tuple[str, ...] = tuple(sorted(
    set(COUNT_WORDS) | set(COLORS) | set(SHAPES) | {s + "s" for s in SHAPES}
    | {w for phrase in RELATIONS.values() for w in phrase.split()}
))
#: Punctuation the grammar tolerates (a trailing period, commas); one token each.
PUNCTUATION: tuple[str, ...] = (".", ",")
#: CLIP token budget: start + at most 10 words (+ a period) + end, with room to spare.
MAX_TOKENS = 16
#: The T5 budget the model was trained with (SD3 without T5 appends this many
#: zero tokens). Use it as ``actor_rollout_ref.rollout.pipeline.max_sequence_length``.
MAX_SEQUENCE_LENGTH = 1

BOS, EOS, UNK = "<|startoftext|>", "<|endoftext|>", "<unk>"
_BUILD_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class ShapesModelConfig:
    """Sizes of the shapes model (defaults = the committed model)."""

    text_hidden: int = 32
    text_layers: int = 2
    text_heads: int = 2
    vae_channels: tuple[int, ...] = (16, 32)
    latent_channels: int = 4
    width: int = 64  # transformer inner dim = heads * head_dim
    heads: int = 2
    layers: int = 4
    patch_size: int = 2
    image_size: int = 32
    shift: float = 3.0

    @property
    def latent_size(self) -> int:
        return self.image_size // 2 ** (len(self.vae_channels) - 1)


# --------------------------------------------------------------------------- tokenizer
def learn_word_bpe(words) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Learn BPE merges until every word in ``words`` is a single symbol.

    Classic BPE training, made deterministic: each word starts as its
    characters with CLIP's end-of-word suffix on the last one; repeatedly the
    most frequent adjacent pair (ties: the lexicographically smallest) is
    merged everywhere. Returns ``(vocab, merges)`` in CLIP's format: the
    vocabulary holds the special tokens, every character (plain and with
    ``</w>``), every merge result (so every word + ``</w>``) and the
    punctuation tokens.
    """
    seqs = []
    for w in sorted(set(words)):
        chars = list(w)
        chars[-1] += "</w>"
        seqs.append(chars)
    symbols = sorted({c for s in seqs for c in s})
    merges: list[tuple[str, str]] = []
    while any(len(s) > 1 for s in seqs):
        counts: collections.Counter = collections.Counter()
        for s in seqs:
            counts.update(zip(s, s[1:]))
        pair = min(counts, key=lambda p: (-counts[p], p))
        merges.append(pair)
        joined = pair[0] + pair[1]
        new_seqs = []
        for s in seqs:
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == pair:
                    out.append(joined)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            new_seqs.append(out)
        seqs = new_seqs
    vocab: dict[str, int] = {}
    for tok in (BOS, EOS, UNK):
        vocab[tok] = len(vocab)
    letters = sorted({c for w in words for c in w})
    for c in letters:
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    for p in PUNCTUATION:
        vocab.setdefault(p + "</w>", len(vocab))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    assert all(s in vocab for s in symbols)
    return vocab, merges


def build_word_tokenizer(*, model_max_length: int = MAX_TOKENS):
    """The word-level CLIP tokenizer of the shapes grammar (built in memory).

    transformers 5 ignores ``vocab_file``/``merges_file`` keywords, so the
    vocabulary and merges are passed as objects.
    """
    from transformers import CLIPTokenizer

    vocab, merges = learn_word_bpe(GRAMMAR_WORDS)
    return CLIPTokenizer(vocab=vocab, merges=merges, unk_token=UNK, bos_token=BOS, eos_token=EOS,
                         pad_token=EOS, model_max_length=model_max_length)


# --------------------------------------------------------------------------- modules
def build_text_encoder(tokenizer, cfg: ShapesModelConfig = ShapesModelConfig()):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.text_hidden,
        intermediate_size=2 * cfg.text_hidden,
        num_hidden_layers=cfg.text_layers,
        num_attention_heads=cfg.text_heads,
        max_position_embeddings=MAX_TOKENS,
        projection_dim=cfg.text_hidden,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_act="gelu",
    )
    return CLIPTextModelWithProjection(config)


def build_vae(cfg: ShapesModelConfig = ShapesModelConfig(), *, scaling_factor: float = 1.0,
              shift_factor: float = 0.0):
    """Small AutoencoderKL; ``scaling_factor``/``shift_factor`` are set after training."""
    from diffusers import AutoencoderKL

    n = len(cfg.vae_channels)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=cfg.vae_channels,
        layers_per_block=1,
        latent_channels=cfg.latent_channels,
        norm_num_groups=8,
        sample_size=cfg.image_size,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
    )


def build_transformer(cfg: ShapesModelConfig = ShapesModelConfig()):
    from diffusers import SD3Transformer2DModel

    text_dim = 2 * cfg.text_hidden
    return SD3Transformer2DModel(
        sample_size=cfg.latent_size,
        patch_size=cfg.patch_size,
        in_channels=cfg.latent_channels,
        out_channels=cfg.latent_channels,
        num_layers=cfg.layers,
        attention_head_dim=cfg.width // cfg.heads,
        num_attention_heads=cfg.heads,
        joint_attention_dim=text_dim,
        caption_projection_dim=cfg.width,
        pooled_projection_dim=text_dim,
        pos_embed_max_size=cfg.latent_size,
    )


def build_scheduler(cfg: ShapesModelConfig = ShapesModelConfig()):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=cfg.shift)


def build_shapes_pipeline(seed: int = 0, cfg: ShapesModelConfig = ShapesModelConfig(), *, vae=None):
    """A ``StableDiffusion3Pipeline`` with fresh (untrained) shapes-model weights.

    Weights are drawn under ``torch.manual_seed(seed)`` inside ``fork_rng``;
    pass a trained ``vae`` to reuse it.
    """
    from diffusers import StableDiffusion3Pipeline

    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tok1, tok2 = build_word_tokenizer(), build_word_tokenizer()
        te1, te2 = build_text_encoder(tok1, cfg), build_text_encoder(tok2, cfg)
        vae = vae if vae is not None else build_vae(cfg)
        transformer = build_transformer(cfg)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=build_scheduler(cfg), vae=vae,
        text_encoder=te1, tokenizer=tok1, text_encoder_2=te2, tokenizer_2=tok2,
        text_encoder_3=None, tokenizer_3=None,
    )


def encode_prompts(pipeline, prompts, *, max_sequence_length: int = MAX_SEQUENCE_LENGTH):
    """Differentiable version of SD3's ``encode_prompt`` for this model (no T5).

    Same numbers as ``StableDiffusion3Pipeline.encode_prompt``: per CLIP
    encoder the penultimate hidden states and the projected pooled output;
    hidden states concatenated on features, padded to ``joint_attention_dim``,
    followed by ``max_sequence_length`` zero tokens. Returns
    ``(prompt_embeds [B, L, D], pooled [B, P])``.
    """
    hidden, pooled = [], []
    for tok, enc in ((pipeline.tokenizer, pipeline.text_encoder), (pipeline.tokenizer_2, pipeline.text_encoder_2)):
        ids = tok(list(prompts), padding="max_length", max_length=tok.model_max_length, truncation=True,
                  return_tensors="pt").input_ids.to(enc.device)
        out = enc(ids, output_hidden_states=True)
        pooled.append(out[0])
        hidden.append(out.hidden_states[-2])
    clip = torch.cat(hidden, dim=-1)
    dim = pipeline.transformer.config.joint_attention_dim
    clip = torch.nn.functional.pad(clip, (0, dim - clip.shape[-1]))
    t5 = clip.new_zeros(clip.shape[0], int(max_sequence_length), dim)
    return torch.cat([clip, t5], dim=1), torch.cat(pooled, dim=-1)
