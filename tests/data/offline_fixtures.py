"""Offline stores for the offline-mixing tests: synthetic (no model) or for a configured model (its embeddings)."""

from __future__ import annotations

import hashlib

import numpy as np

from omnirl_async.buffer.offline_store import NewPair, OfflineStore, StoreSignature

PROMPTS = ["one red circle", "two blue squares", "a green triangle", "three yellow circles", "a red square",
           "two green circles"]


def _pair(i: int, prompt: str, shape, rng, source: str = "test") -> NewPair:
    chosen = rng.standard_normal(shape).astype(np.float32)
    rejected = rng.standard_normal(shape).astype(np.float32)
    h = hashlib.sha256(chosen.tobytes() + rejected.tobytes() + prompt.encode()).hexdigest()
    return NewPair(id=f"p{i:04d}", content_hash=h, prompt=prompt, chosen=chosen, rejected=rejected,
                   chosen_ref=f"latents:x.safetensors#p{i}.c", rejected_ref=f"latents:x.safetensors#p{i}.r",
                   dataset="synthetic.jsonl", chosen_score=1.0, rejected_score=0.25 * (i % 4), source=source)


def synthetic_store(run_dir, n_pairs: int, *, latent_shape=(2, 4, 4), seed: int = 0, start: int = 0,
                    emb_shapes=None) -> OfflineStore:
    """A store of ``n_pairs`` random pairs (ids ``p<start>..``) with made-up embeddings; no model needed."""
    emb_shapes = emb_shapes or {"prompt_embeds": (3, 8), "pooled_prompt_embeds": (8,)}
    rng = np.random.default_rng(seed)
    sig = StoreSignature(model="synthetic", family="sd3", height=8, width=8, latent_shape=list(latent_shape),
                         max_sequence_length=3, negative_prompt=None)
    pairs = [_pair(start + i, PROMPTS[(start + i) % len(PROMPTS)], latent_shape, rng,
                   source="judge" if i % 3 == 0 else "render") for i in range(n_pairs)]
    emb = {p: {k: rng.standard_normal(s).astype(np.float32) for k, s in emb_shapes.items()} for p in PROMPTS}
    store = OfflineStore(run_dir)
    store.append(pairs, signature=sig, embeddings=emb)
    return store


def model_store(run_dir, config, policy, n_pairs: int, *, seed: int = 0) -> OfflineStore:
    """A store for ``config``'s model: random latents of its shape, its own prompt embeddings."""
    from omnirl_async.trainer.ingest import store_signature

    sig = store_signature(config)
    rng = np.random.default_rng(seed)
    pairs = [_pair(i, PROMPTS[i % len(PROMPTS)], tuple(sig.latent_shape), rng) for i in range(n_pairs)]
    enc = policy.encode_prompt(PROMPTS, max_sequence_length=sig.max_sequence_length).to_numpy()
    emb = {p: {k: v[j] for k, v in enc.items()} for j, p in enumerate(PROMPTS)}
    store = OfflineStore(run_dir)
    store.append(pairs, signature=sig, embeddings=emb)
    return store


def latent_dataset(folder, config, n_pairs: int, *, seed: int = 0):
    """A JSONL preference dataset for ``config``'s model whose pairs reference latents in a safetensors shard."""
    import json
    from pathlib import Path

    from safetensors.numpy import save_file

    from omnirl_async.trainer.ingest import store_signature

    folder = Path(folder)
    (folder / "latents").mkdir(parents=True, exist_ok=True)
    shape = tuple(store_signature(config).latent_shape)
    rng = np.random.default_rng(seed)
    tensors, lines = {}, []
    for i in range(n_pairs):
        for side in ("chosen", "rejected"):
            tensors[f"p{i}.{side}"] = rng.standard_normal(shape).astype(np.float32)
        lines.append(json.dumps({"id": f"p{i:04d}", "prompt": PROMPTS[i % len(PROMPTS)],
                                 "chosen": f"latents:latents/part-0.safetensors#p{i}.chosen",
                                 "rejected": f"latents:latents/part-0.safetensors#p{i}.rejected",
                                 "chosen_score": 1.0, "rejected_score": 0.0, "source": "test"}))
    save_file(tensors, str(folder / "latents" / "part-0.safetensors"))
    (folder / "data.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "data.jsonl"
