"""``omnirl-async ingest DATASET --run-dir DIR``: a preference dataset into the run's offline store.

Steps (:func:`ingest_dataset`):

1. the model's one-sample latent shape from its folder's configs (no weights
   loaded yet) and the store's signature (model, resolution, latent shape,
   prompt-encoding settings) - an existing store of another set-up is refused;
2. every row checked (:func:`omnirl_async.data.preference_checks.check_dataset`);
   a row whose id is already stored with other content is a bad row too, one
   with the same content is counted as already present and skipped;
3. any bad row: all of them written to a JSONL report and, by default, the
   dataset refused as a whole (:class:`PreferenceDataError`, exit code 2 in
   the CLI) - nothing is ingested; with ``skip_invalid`` the good rows go on;
4. the model loaded (frozen, no LoRA: only its VAE and text encoders run),
   images VAE-encoded in batches to ``x0`` (:func:`omnirl_async.models.latent_codec.encode_images`),
   latents read as they are, each new prompt encoded once as the rollout
   workers do (``pipeline.max_sequence_length``, the negative prompt with
   ``true_cfg_scale`` > 1), and appended shard by shard
   (:class:`omnirl_async.buffer.offline_store.OfflineStore`; every shard
   commits, so an interrupted ingest resumes where it stopped when run again).

:func:`ingest_offline_files` does the same for ``data.offline_files`` at the
start of ``train`` (into ``trainer.default_local_dir``), before Ray starts;
:func:`prepare_offline_store` runs it and then :func:`check_offline_store`: a run
that trains on offline pairs (``buffer.offline_mix_ratio`` > 0 or
``algorithm.sample_source=offline``) is refused before Ray starts when its store
is missing, empty, made for another model set-up, lacks a shard, or does not
fit ``buffer.max_size``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

import numpy as np

from omnirl_async.buffer.offline_store import NewPair, OfflineStore, StoreSignature, prompt_key
from omnirl_async.data.preference import LatentRef, open_dataset
from omnirl_async.data.preference_checks import (PROGRESS_MIN_ROWS, CheckedPair, check_dataset, load_image,
                                                 load_latents)
from omnirl_async.preflight import InputError

__all__ = ["IngestSummary", "ingest_dataset", "ingest_offline_files", "store_signature", "check_offline_store",
           "prepare_offline_store", "SHARD_BYTES"]

#: target size of one shard (latents of both sides)
SHARD_BYTES = 256 * 1024**2
#: prompts per text-encoder forward
PROMPT_BATCH = 64


@dataclasses.dataclass
class IngestSummary:
    dataset: str
    store: str
    rows: int
    added: int
    already_present: int
    skipped: int
    bytes_written: int
    store_rows: int
    store_bytes: int
    report: str | None
    seconds: float

    def text(self) -> str:
        lines = [f"ingested {self.dataset} into {self.store} in {self.seconds:.1f}s",
                 f"  rows:            {self.rows}",
                 f"  added:           {self.added}",
                 f"  already present: {self.already_present}",
                 f"  skipped:         {self.skipped}" + (f"   (listed in {self.report})" if self.report else ""),
                 f"  written:         {human_size(self.bytes_written)}",
                 f"  store:           {self.store_rows} pairs, {human_size(self.store_bytes)}"]
        return "\n".join(lines)


def human_size(n: float) -> str:
    """Bytes as B / KiB / MiB / GiB, for summaries."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def store_signature(config) -> StoreSignature:
    """The offline-store signature of ``config``'s model set-up (reads the model folder's configs only)."""
    from omnirl_async.models.latent_codec import folder_latent_shape
    from omnirl_async.models.resolve import resolve_model_path

    model_cfg, pcfg = config.actor_rollout_ref.model, config.actor_rollout_ref.rollout.pipeline
    try:
        folder = resolve_model_path(model_cfg.path)
        family, shape = folder_latent_shape(folder, pcfg.height, pcfg.width, model_cfg.transformer_subfolder)
    except (FileNotFoundError, ValueError) as err:
        raise InputError(str(err)) from None
    return StoreSignature(model=str(model_cfg.path), family=family, height=int(pcfg.height), width=int(pcfg.width),
                          latent_shape=list(shape), max_sequence_length=int(pcfg.max_sequence_length),
                          negative_prompt=pcfg.negative_prompt if pcfg.true_cfg_scale > 1 else None)


def _load_policy(config):
    from omnirl_async.models.policy import FlowMatchPolicy
    from omnirl_async.models.resolve import resolve_model_path
    from omnirl_async.models.setup import pick_device, quiet_hf_logging

    model_cfg = config.actor_rollout_ref.model
    quiet_hf_logging()
    return FlowMatchPolicy.from_pretrained(resolve_model_path(model_cfg.path),
                                           transformer_subfolder=model_cfg.transformer_subfolder,
                                           device=pick_device(config.trainer.device), dtype=model_cfg.dtype)


def _default_report(store: OfflineStore, dataset: str) -> str:
    name = os.path.splitext(os.path.basename(os.path.normpath(dataset)))[0] or "dataset"
    return str(store.dir / "reports" / f"ingest-{time.strftime('%Y%m%d-%H%M%S')}-{name}.jsonl")


def ingest_dataset(dataset: str | os.PathLike, run_dir: str | os.PathLike, config, *, skip_invalid: bool = False,
                   report: str | os.PathLike | None = None, batch_size: int = 16, policy=None,
                   printer: Callable[[str], None] = print, progress: bool = True,
                   fix: str | None = None) -> IngestSummary:
    """Check ``dataset`` and add its pairs to the offline store of ``run_dir`` (see the module docstring).

    ``policy``: an already loaded ``FlowMatchPolicy`` of ``config``'s model (or a callable returning one), else
    it is loaded when something needs encoding. ``report``: where the bad rows go (default
    ``<run_dir>/offline/reports/ingest-<time>-<dataset>.jsonl``). ``fix``: the error's advice instead of
    ``--skip-invalid``. Raises :class:`~omnirl_async.preflight.InputError` (a
    :class:`~omnirl_async.data.preference_checks.PreferenceDataError` for bad rows) when nothing was ingested.
    """
    t0 = time.perf_counter()
    dataset = os.fspath(dataset)
    pcfg = config.actor_rollout_ref.rollout.pipeline
    signature = store_signature(config)
    try:
        store = OfflineStore(run_dir)
    except ValueError as err:  # an index of another format or version
        raise InputError(f"`--run-dir` {os.fspath(run_dir)}: {err}") from None
    if store.signature is not None and store.signature != signature:
        raise InputError(f"the offline store at {store.dir} holds latents of another model set-up "
                         f"({'; '.join(store.signature.differences(signature))}); ingest with the config it was "
                         "made with, or into a new `--run-dir`")
    result = check_dataset(open_dataset(dataset), height=int(pcfg.height), width=int(pcfg.width),
                           latent_shape=signature.latent_shape, progress=progress)
    fresh: list[CheckedPair] = []
    present = 0
    for pair in list(result.pairs):
        old = store.find(pair.id)
        if old is None:
            fresh.append(pair)
        elif old.content_hash == pair.content_hash:
            present += 1
        else:
            result.refuse(pair, "id", pair.id, f"is already in the offline store {store.dir} with other content "
                                               f"(ingested from {old.dataset}); give the changed row a new id, or "
                                               "ingest into a new `--run-dir`")
    report_path = None
    if result.problems:
        report_path = result.write_report(report or _default_report(store, dataset))
        if not skip_invalid:
            err = result.error(report_path, skip_hint=fix is None)
            if fix:
                err.args = (f"{err.args[0]}\n{fix}",)
            raise err
        printer(f"skipping {len(result.bad_rows)} invalid rows of {dataset}; listed in {report_path}")
    added = written = 0
    if fresh:
        model = _load_policy(config) if policy is None else policy() if callable(policy) else policy
        added, written, more_present = _encode_and_append(model, store, fresh, dataset, signature, config,
                                                          batch_size=batch_size, progress=progress)
        present += more_present
    return IngestSummary(dataset=dataset, store=str(store.dir), rows=result.total_rows, added=added,
                         already_present=present, skipped=len(result.bad_rows), bytes_written=written,
                         store_rows=len(store), store_bytes=store.nbytes, report=report_path,
                         seconds=time.perf_counter() - t0)


def _encode_and_append(policy, store: OfflineStore, pairs: list[CheckedPair], dataset: str,
                       signature: StoreSignature, config, *, batch_size: int, progress: bool) -> tuple[int, int, int]:
    from tqdm import tqdm

    from omnirl_async.models.latent_codec import encode_images, latent_shape

    pcfg = config.actor_rollout_ref.rollout.pipeline
    have = list(latent_shape(policy, pcfg.height, pcfg.width))
    if have != list(signature.latent_shape):  # the folder's configs and the loaded model disagree: a broken folder
        raise InputError(f"`actor_rollout_ref.model.path` = {signature.model!r}: the loaded model's latents are "
                         f"{have}, its configs say {signature.latent_shape}; check the model folder")
    per_row = 2 * int(np.prod(signature.latent_shape)) * 4
    rows_per_shard = max(1, SHARD_BYTES // per_row)
    added = written = present = 0
    bar = tqdm(total=len(pairs), desc="encode", unit="pair", disable=not progress or len(pairs) < PROGRESS_MIN_ROWS)
    for lo in range(0, len(pairs), rows_per_shard):
        chunk = pairs[lo:lo + rows_per_shard]
        latents = _chunk_latents(policy, chunk, encode_images, batch_size, bar)
        embeddings = _encode_prompts(policy, [p.fields.prompt for p in chunk], store, signature)
        new = [NewPair(id=p.id, content_hash=p.content_hash, prompt=p.fields.prompt, chosen=latents[(i, "chosen")],
                       rejected=latents[(i, "rejected")], chosen_ref=p.fields.chosen.text,
                       rejected_ref=p.fields.rejected.text, dataset=dataset, chosen_score=p.fields.chosen_score,
                       rejected_score=p.fields.rejected_score, source=p.fields.source, metadata=p.fields.metadata)
               for i, p in enumerate(chunk)]
        try:
            res = store.append(new, signature=signature, embeddings=embeddings)
        except ValueError as err:  # another ingest committed a conflicting row meanwhile, or another set-up
            raise InputError(str(err)) from None
        added, written, present = added + res.added, written + res.bytes_written, present + res.already_present
    bar.close()
    return added, written, present


def _chunk_latents(policy, chunk: list[CheckedPair], encode_images, batch_size: int, bar) -> dict[tuple, np.ndarray]:
    """(pair index, side) -> fp32 latents; images VAE-encoded ``batch_size`` at a time."""
    out: dict[tuple, np.ndarray] = {}
    pending: list[tuple[tuple, Any, str]] = []

    def flush() -> None:
        if pending:
            images = np.stack([load_image(ref, h) for _, ref, h in pending])
            z = encode_images(policy, images, batch_size=batch_size).numpy()
            for (k, _, _), arr in zip(pending, z):
                out[k] = arr
            pending.clear()

    for i, p in enumerate(chunk):
        for side in ("chosen", "rejected"):
            ref, h = getattr(p.fields, side), getattr(p, f"{side}_hash")
            if isinstance(ref, LatentRef):
                out[(i, side)] = load_latents(ref, h)
            else:
                pending.append(((i, side), ref, h))
                if len(pending) >= batch_size:
                    flush()
        bar.update(1)
    flush()
    return out


def _encode_prompts(policy, prompts: list[str], store: OfflineStore,
                    signature: StoreSignature) -> dict[str, dict[str, np.ndarray]]:
    """Embeddings of the prompts the store does not hold yet, encoded as the rollout workers encode them."""
    todo = [p for p in dict.fromkeys(prompts) if prompt_key(p) not in store.index.embeddings]
    out: dict[str, dict[str, np.ndarray]] = {}
    for lo in range(0, len(todo), PROMPT_BATCH):
        batch = todo[lo:lo + PROMPT_BATCH]
        neg = [signature.negative_prompt] * len(batch) if signature.negative_prompt is not None else None
        emb = policy.encode_prompt(batch, negative_prompts=neg,
                                   max_sequence_length=signature.max_sequence_length).to_numpy()
        for j, p in enumerate(batch):
            out[p] = {name: arr[j] for name, arr in emb.items()}
    return out


def _offline_files(value: Any) -> list[str]:
    if isinstance(value, (str, os.PathLike)) and os.fspath(value):
        return [os.fspath(value)]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (str, os.PathLike)) and os.fspath(v)
                                                          for v in value):
        return [os.fspath(v) for v in value]
    raise InputError(f"`data.offline_files` = {value!r}: expected a dataset path or a non-empty list of them "
                     "(.jsonl, .parquet or a `datasets` folder; docs/PREFERENCE_DATA.md); null ingests nothing")


def ingest_offline_files(config, *, printer: Callable[[str], None] = print) -> list[IngestSummary]:
    """``data.offline_files`` into ``<trainer.default_local_dir>/offline/`` (the start of ``train``; no-op if unset)."""
    value = getattr(config.data, "offline_files", None)
    if value is None:
        return []
    run_dir = config.trainer.default_local_dir
    loaded: list[Any] = []

    def get_policy():
        if not loaded:
            loaded.append(_load_policy(config))
        return loaded[0]

    fix = ("Or ingest the good rows with `omnirl-async ingest DATASET --run-dir RUN_DIR --skip-invalid` (same config "
           "overrides) and drop the dataset from `data.offline_files`: the run reads what its offline store holds")
    out = []
    for path in _offline_files(value):
        summary = ingest_dataset(path, run_dir, config, policy=get_policy, printer=printer, progress=False, fix=fix)
        printer(summary.text())
        out.append(summary)
    return out


def _offline_key(config) -> str | None:
    """The setting that makes this run read the offline store (None: it does not)."""
    if config.algorithm.sample_source == "offline":
        return "`algorithm.sample_source` = offline"
    ratio = float(config.buffer.offline_mix_ratio)
    return f"`buffer.offline_mix_ratio` = {ratio:g}" if ratio > 0 else None


def check_offline_store(config) -> OfflineStore | None:
    """The run's offline store when the run trains on it, checked; None when it does not read it."""
    key = _offline_key(config)
    if key is None:
        return None
    run_dir = os.fspath(config.trainer.default_local_dir)
    try:
        store = OfflineStore(run_dir)
    except ValueError as err:
        raise InputError(f"{key}: {err}") from None
    if len(store) == 0:
        state = "is empty" if store.dir.is_dir() else "does not exist"
        raise InputError(f"{key} trains on the run's offline store, but {store.dir} {state}: ingest preference "
                         f"pairs first with `omnirl-async ingest DATASET --run-dir {run_dir}` (with this run's config "
                         "overrides), or set `data.offline_files=DATASET` to ingest them when `train` starts "
                         "(format: docs/PREFERENCE_DATA.md)")
    signature = store_signature(config)
    if store.signature != signature:
        raise InputError(f"{key}: the offline store {store.dir} holds latents of another model set-up "
                         f"({'; '.join(store.signature.differences(signature))}); train with the config it was "
                         "ingested with, or ingest the dataset again into this run's `trainer.default_local_dir`")
    gone = [s.file for s in store.index.shards if not (store.dir / s.file).is_file()]
    if gone:
        raise InputError(f"{key}: the offline store {store.dir} lacks {len(gone)} shard file(s) its index names "
                         f"(first: {gone[0]}); restore them, or ingest the dataset again into a new run dir")
    max_size = int(config.buffer.max_size)
    if 2 * len(store) > max_size:
        raise InputError(f"{key}: the offline store {store.dir} holds {len(store)} pairs = {2 * len(store)} samples, "
                         f"more than the offline table holds (`buffer.max_size` = {max_size} samples per table); set "
                         f"`buffer.max_size={2 * len(store)}` or more")
    return store


def prepare_offline_store(config, *, printer: Callable[[str], None] = print) -> OfflineStore | None:
    """Start of ``train``: ingest ``data.offline_files``, then :func:`check_offline_store`."""
    ingest_offline_files(config, printer=printer)
    return check_offline_store(config)
