"""The offline store of a run: ingested preference pairs as latents, ready for the learner.

Layout of ``<run_dir>/offline/``::

    index.msgpack                      OfflineIndex: format, the model signature, shards, rows, prompt embeddings
    shard-00000-<uid>.safetensors      one ingest batch: `chosen` [R, *latent], `rejected` [R, *latent] (fp32),
                                       `emb.<name>` [E, ...] for the E prompts first seen in it
    reports/ingest-<time>.jsonl        the rows an ingest skipped or refused (written by the ingest)

No pickle: the index decodes into typed msgspec Structs, tensors load through
safetensors. Every write goes to a temporary name, is fsynced and renamed into
place; the index is the commit point (a shard that no index names is left
over from a crash and is removed by the next append). Appends hold an
exclusive lock on ``offline/.lock``; readers need none (committed shards never
change, the index is replaced atomically).

Rows are keyed by their dataset ``id``; :meth:`OfflineStore.append` skips a row
whose id is present with the same content hash and refuses one whose id is
present with another. The **signature** (:class:`StoreSignature`: model,
resolution, latent shape, prompt-encoding settings) is fixed by the first
append; later appends must match it, since latents and embeddings of another
model mean nothing to this one.

Reading: ``OfflineStore(run_dir)`` then ``len(store)``, ``store.rows()``
(:class:`OfflineRow`), ``store.pairs(indices)`` -> ``{"x0": [2P, *latent],
"emb.<name>": [2P, ...], "scores": [2P]}`` with the winner of pair ``i`` in row
``2i`` and the loser in ``2i + 1`` (the order of the preference learner's
pairs), ``store.content_hash()`` (changes with any row, shard or signature) and
``store.verify()`` (re-hashes every shard).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Sequence

import msgspec
import numpy as np

__all__ = ["OFFLINE_DIR", "INDEX_FILE", "FORMAT", "FORMAT_VERSION", "StoreSignature", "OfflineRow", "ShardRecord",
           "EmbLoc", "OfflineIndex", "NewPair", "AppendResult", "OfflineStore", "offline_dir", "prompt_key"]

OFFLINE_DIR = "offline"
INDEX_FILE = "index.msgpack"
LOCK_FILE = ".lock"
LOCK_TIMEOUT_S = 300.0  # an append holds the lock while it writes one shard and the index
FORMAT = "omnirl-async-offline"
FORMAT_VERSION = 1
_ENCODER = msgspec.msgpack.Encoder(order="sorted")


class StoreSignature(msgspec.Struct, kw_only=True, frozen=True):
    """What the stored latents and embeddings are for; every append must match the first."""

    model: str                       # actor_rollout_ref.model.path as configured
    family: str                      # sd3 | flux
    height: int
    width: int
    latent_shape: list[int]          # one sample, model layout (x0)
    max_sequence_length: int
    negative_prompt: str | None      # None: encoded without negatives (true_cfg_scale <= 1)

    def differences(self, other: "StoreSignature") -> list[str]:
        return [f"{f}: store {getattr(self, f)!r}, now {getattr(other, f)!r}" for f in self.__struct_fields__
                if getattr(self, f) != getattr(other, f)]


class OfflineRow(msgspec.Struct, kw_only=True):
    """One stored pair. ``shard`` / ``row``: where its latents are; ``prompt_key``: its embedding."""

    id: str
    content_hash: str
    prompt: str
    chosen_score: float | None = None
    rejected_score: float | None = None
    source: str | None = None
    metadata: dict[str, Any] = {}
    chosen_ref: str
    rejected_ref: str
    dataset: str
    shard: int
    row: int
    prompt_key: str
    ingested_at: float


class ShardRecord(msgspec.Struct, kw_only=True):
    file: str
    sha256: str
    nbytes: int
    rows: int
    prompts: int


class EmbLoc(msgspec.Struct, kw_only=True):
    shard: int
    row: int


class OfflineIndex(msgspec.Struct, kw_only=True):
    format: str
    format_version: int
    signature: StoreSignature | None
    emb_fields: dict[str, list[int]]            # name -> per-prompt shape
    shards: list[ShardRecord]
    rows: list[OfflineRow]
    embeddings: dict[str, EmbLoc]               # prompt_key -> location

    @classmethod
    def empty(cls) -> "OfflineIndex":
        return cls(format=FORMAT, format_version=FORMAT_VERSION, signature=None, emb_fields={}, shards=[], rows=[],
                   embeddings={})


@dataclasses.dataclass
class NewPair:
    """A pair to append: its index entry (less its location) and its latents, one sample each."""

    id: str
    content_hash: str
    prompt: str
    chosen: np.ndarray
    rejected: np.ndarray
    chosen_ref: str
    rejected_ref: str
    dataset: str
    chosen_score: float | None = None
    rejected_score: float | None = None
    source: str | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class AppendResult:
    added: int
    already_present: int
    bytes_written: int
    shard: str | None


def offline_dir(run_dir: str | os.PathLike) -> Path:
    return Path(os.path.expanduser(os.fspath(run_dir))).resolve() / OFFLINE_DIR


def prompt_key(prompt: str) -> str:
    """The key of a prompt's embedding in the store."""
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:32]


class OfflineStore:
    """The offline store of the run in ``run_dir`` (its ``offline/`` folder; absent = empty)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(os.path.expanduser(os.fspath(run_dir))).resolve()
        self.dir = self.run_dir / OFFLINE_DIR
        self.index = _read_index(self.dir)
        self._by_id = {r.id: i for i, r in enumerate(self.index.rows)}

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self.index.rows)

    @property
    def signature(self) -> StoreSignature | None:
        return self.index.signature

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.index.shards)

    def rows(self) -> list[OfflineRow]:
        return list(self.index.rows)

    def find(self, row_id: str) -> OfflineRow | None:
        i = self._by_id.get(row_id)
        return None if i is None else self.index.rows[i]

    def content_hash(self) -> str:
        """SHA-256 over the signature, every row's id, content hash and location, and every shard's hash."""
        ix = self.index
        return hashlib.sha256(_ENCODER.encode([FORMAT, FORMAT_VERSION, ix.signature, ix.emb_fields,
                                               [(s.file, s.sha256) for s in ix.shards],
                                               [(r.id, r.content_hash, r.shard, r.row, r.prompt_key) for r in ix.rows],
                                               sorted((k, v.shard, v.row) for k, v in ix.embeddings.items())])
                              ).hexdigest()

    def pairs(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """Pairs ``indices`` (positions in :meth:`rows`) as learner fields, winner and loser interleaved.

        ``x0`` float32 [2P, *latent]; ``emb.<name>`` float32 [2P, ...]; ``scores`` float32 [2P]
        (``chosen_score`` / ``rejected_score``, NaN where the dataset gave none).
        """
        from safetensors import safe_open

        idx = [int(i) for i in np.asarray(indices, dtype=np.int64).reshape(-1)]
        n = len(self.index.rows)
        for i in idx:
            if not 0 <= i < n:
                raise IndexError(f"`indices` holds {i}; the offline store at {self.dir} has {n} rows (0..{n - 1})")
        shape = tuple(self.index.signature.latent_shape) if self.index.signature else ()
        out = {"x0": np.zeros((2 * len(idx), *shape), np.float32), "scores": np.full(2 * len(idx), np.nan, np.float32)}
        for name, s in self.index.emb_fields.items():
            out[f"emb.{name}"] = np.zeros((2 * len(idx), *s), np.float32)
        rows = [self.index.rows[i] for i in idx]
        with contextlib.ExitStack() as stack:
            files: dict[int, Any] = {}

            def shard(k: int):
                if k not in files:
                    files[k] = stack.enter_context(safe_open(str(self.dir / self.index.shards[k].file), "numpy"))
                return files[k]

            for j, r in enumerate(rows):
                f = shard(r.shard)
                out["x0"][2 * j] = f.get_slice("chosen")[r.row:r.row + 1][0]
                out["x0"][2 * j + 1] = f.get_slice("rejected")[r.row:r.row + 1][0]
                loc = self.index.embeddings[r.prompt_key]
                fe = shard(loc.shard)
                for name in self.index.emb_fields:
                    v = fe.get_slice(f"emb.{name}")[loc.row:loc.row + 1][0]
                    out[f"emb.{name}"][2 * j] = v
                    out[f"emb.{name}"][2 * j + 1] = v
                out["scores"][2 * j] = np.nan if r.chosen_score is None else r.chosen_score
                out["scores"][2 * j + 1] = np.nan if r.rejected_score is None else r.rejected_score
        return out

    def verify(self) -> list[str]:
        """Re-hash every shard; one line per missing or changed shard (empty: intact)."""
        problems = []
        for s in self.index.shards:
            p = self.dir / s.file
            if not p.is_file():
                problems.append(f"{p}: missing")
            elif _file_sha(p) != s.sha256:
                problems.append(f"{p}: contents changed (SHA-256 differs from the index)")
        return problems

    # ------------------------------------------------------------------ writing
    def conflict(self, row_id: str, content_hash: str) -> OfflineRow | None:
        """The stored row with id ``row_id`` when its content differs from ``content_hash`` (None: new or same)."""
        r = self.find(row_id)
        return r if r is not None and r.content_hash != content_hash else None

    def append(self, pairs: Sequence[NewPair], *, signature: StoreSignature,
               embeddings: dict[str, dict[str, np.ndarray]], lock_timeout_s: float = LOCK_TIMEOUT_S) -> AppendResult:
        """Add ``pairs`` as one shard and commit the index.

        ``embeddings``: prompt -> {name: array of one prompt} for every prompt of ``pairs`` not yet stored
        (more are ignored). A pair whose id is stored with the same content hash is skipped; with another
        content hash it is a ``ValueError`` naming the id, and nothing is written. Another append holding the
        store's lock past ``lock_timeout_s`` is a ``TimeoutError`` naming its process; nothing is written.
        """
        self.dir.mkdir(parents=True, exist_ok=True)
        with _locked(self.dir / LOCK_FILE, lock_timeout_s):
            index = _read_index(self.dir)  # another ingest may have committed meanwhile
            if index.signature is not None and index.signature != signature:
                raise ValueError(f"the offline store at {self.dir} holds latents of another model set-up ("
                                 f"{'; '.join(index.signature.differences(signature))}); ingest with the same "
                                 "model, resolution and prompt settings, or into a new `--run-dir`")
            by_id = {r.id: r for r in index.rows}
            new, present = [], 0
            for p in pairs:
                old = by_id.get(p.id)
                if old is None:
                    by_id[p.id] = p  # two pairs with one id in one append: the second is checked against the first
                    new.append(p)
                elif old.content_hash == p.content_hash:
                    present += 1
                else:
                    raise ValueError(f"id {p.id!r} is already in the offline store at {self.dir} with other content "
                                     f"(from {getattr(old, 'dataset', '?')}); give the changed row a new id, or "
                                     "ingest into a new `--run-dir`")
            _remove_leftovers(self.dir, index)
            if not new:
                self._reload(index)
                return AppendResult(0, present, 0, None)
            shape = list(signature.latent_shape)
            for p in new:
                for side in ("chosen", "rejected"):
                    arr = getattr(p, side)
                    if list(arr.shape) != shape:
                        raise ValueError(f"pair {p.id!r}: `{side}` latents have shape {list(arr.shape)}, the store "
                                         f"holds {shape}")
            prompts = [pr for pr in dict.fromkeys(p.prompt for p in new) if prompt_key(pr) not in index.embeddings]
            emb_arrays = _stack_embeddings(prompts, embeddings, index)
            k = len(index.shards)
            fname = f"shard-{k:05d}-{uuid.uuid4().hex[:8]}.safetensors"
            arrays = {"chosen": np.stack([np.asarray(p.chosen, np.float32) for p in new]),
                      "rejected": np.stack([np.asarray(p.rejected, np.float32) for p in new]), **emb_arrays}
            nbytes, sha = _write_shard(self.dir, fname, arrays)
            now = time.time()
            index.shards.append(ShardRecord(file=fname, sha256=sha, nbytes=nbytes, rows=len(new), prompts=len(prompts)))
            for j, pr in enumerate(prompts):
                index.embeddings[prompt_key(pr)] = EmbLoc(shard=k, row=j)
            for j, p in enumerate(new):
                index.rows.append(OfflineRow(
                    id=p.id, content_hash=p.content_hash, prompt=p.prompt, chosen_score=p.chosen_score,
                    rejected_score=p.rejected_score, source=p.source, metadata=dict(p.metadata),
                    chosen_ref=p.chosen_ref, rejected_ref=p.rejected_ref, dataset=p.dataset, shard=k, row=j,
                    prompt_key=prompt_key(p.prompt), ingested_at=now))
            index.signature = signature
            _write_index(self.dir, index)
            self._reload(index)
            return AppendResult(len(new), present, nbytes, fname)

    def _reload(self, index: OfflineIndex) -> None:
        self.index = index
        self._by_id = {r.id: i for i, r in enumerate(index.rows)}


# ---------------------------------------------------------------------------- files
def _stack_embeddings(prompts: list[str], embeddings: dict[str, dict[str, np.ndarray]],
                      index: OfflineIndex) -> dict[str, np.ndarray]:
    if not prompts:
        return {}
    missing = [p for p in prompts if p not in embeddings]
    if missing:
        raise ValueError(f"`embeddings` lacks the prompt embeddings of {missing[:3]!r}; encode every new prompt")
    names = sorted(embeddings[prompts[0]])
    fields = index.emb_fields or {n: list(np.asarray(embeddings[prompts[0]][n]).shape) for n in names}
    out = {}
    for name, shape in fields.items():
        rows = []
        for p in prompts:
            if name not in embeddings[p]:
                raise ValueError(f"prompt embeddings of {p!r} lack `{name}`; the store holds {sorted(fields)}")
            v = np.asarray(embeddings[p][name], dtype=np.float32)
            if list(v.shape) != list(shape):
                raise ValueError(f"prompt embedding `{name}` of {p!r} has shape {list(v.shape)}, the store holds "
                                 f"{list(shape)}; encode with the same model and `max_sequence_length`")
            rows.append(v)
        out[f"emb.{name}"] = np.stack(rows)
    index.emb_fields = {n: list(s) for n, s in fields.items()}
    return out


def _read_index(folder: Path) -> OfflineIndex:
    path = folder / INDEX_FILE
    if not path.is_file():
        return OfflineIndex.empty()
    raw = path.read_bytes()
    head = msgspec.msgpack.decode(raw)
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise ValueError(f"{path} is not an offline store index ({FORMAT}); move it away or use another run dir")
    if head.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: offline store format version {head.get('format_version')!r}, this build reads "
                         f"version {FORMAT_VERSION}; read it with the version that wrote it")
    return msgspec.msgpack.decode(raw, type=OfflineIndex)


def _write_shard(folder: Path, fname: str, arrays: dict[str, np.ndarray]) -> tuple[int, str]:
    from safetensors.numpy import save_file

    tmp = folder / f".{fname}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp), metadata={"format": FORMAT})
        _fsync(tmp)
        sha, nbytes = _file_sha(tmp), tmp.stat().st_size
        os.rename(tmp, folder / fname)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(folder)
    return nbytes, sha


def _write_index(folder: Path, index: OfflineIndex) -> None:
    tmp = folder / f".{INDEX_FILE}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(msgspec.msgpack.encode(index))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / INDEX_FILE)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(folder)


def _remove_leftovers(folder: Path, index: OfflineIndex) -> None:
    """Shards and temporary files of an append that crashed before its index was committed."""
    named = {s.file for s in index.shards}
    for p in folder.iterdir():
        if (p.name.startswith("shard-") and p.name.endswith(".safetensors") and p.name not in named) \
                or (p.name.startswith(".") and ".tmp-" in p.name):
            p.unlink(missing_ok=True)


def _file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync(path)
    except OSError:  # some filesystems refuse fsync on directories
        pass


@contextlib.contextmanager
def _locked(path: Path, timeout_s: float) -> Iterator[None]:
    """``path`` locked for this process (its pid written in it, for whoever waits), within ``timeout_s``."""
    import fcntl

    deadline = time.monotonic() + timeout_s
    with open(path, "a+b") as f:
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    f.seek(0)
                    holder = f.read(32).decode(errors="replace").strip() or "unknown"
                    raise TimeoutError(
                        f"the offline store's lock {path} is held by another process (pid {holder}) for longer than "
                        f"{timeout_s:g} s: another ingest into this store is running or stuck (stopped with Ctrl-Z?). "
                        "Let it finish or end it, then run again; nothing was written.") from None
                time.sleep(0.05)
        try:
            f.truncate(0)
            f.write(str(os.getpid()).encode())
            f.flush()
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
