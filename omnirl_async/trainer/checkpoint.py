"""Checkpoints that can be trusted: no pickle, atomic, with a SHA-256 manifest.

A nested state (dicts, lists, numbers, strings, tensors, numpy arrays) is split
by :func:`flatten_state` into a flat ``{name: tensor}`` map and a skeleton in
which every tensor is replaced by ``{"__tensor__": name}``; tensors go to
safetensors, the skeleton to msgpack. Loading reverses it. Integer dict keys
(optimizer state) survive because msgpack keeps key types. A file that does not
parse raises :class:`CheckpointError` naming the file.

Layout of ``<default_local_dir>/global_step_<N>/``::

    lora/                    PEFT adapter (adapter_model.safetensors + adapter_config.json)
    learner.safetensors      learner tensors (weights, optimizer moments, RNG)
    learner.msgpack          learner skeleton
    trainer.safetensors / trainer.msgpack   driver state (step, version, prompt cursor, RNG)
    buffer/                  replay-buffer snapshot (when buffer.snapshot_with_checkpoint)
    manifest.json            every other file: relative path, size in bytes, SHA-256
    COMPLETE                 written last: the step, then the SHA-256 of manifest.json

and ``latest_checkpointed_iteration.txt`` beside them, as in verl.

Who writes the files (on a multi-node Ray cluster): every file is written on
the *driver's* node, so ``trainer.default_local_dir`` only has to be a path
the driver can write. The driver writes ``learner.*`` and ``trainer.*`` (the
learner state comes from rank 0 through the object store) and ``lora/``
(rank 0 saves the adapter into a temporary folder on its own node and hands
the bytes over, :meth:`~omnirl_async.learners.learner_group.LearnerGroup.save_lora`);
``buffer/`` is written (and read on resume) by the transfer-queue controller,
which the trainer pins to the driver's node and which gathers the payloads
from the storage units, wherever they run, through the object store. A later
job resumes from the folder only if its driver sees it too: keep
``default_local_dir`` on storage every node shares (NFS, a mounted bucket),
or run the driver on the same node each time (``ray job submit`` runs it on
the head node).

Writing (:meth:`CheckpointManager.begin` / :meth:`CheckpointManager.commit`):
the files are written into ``.tmp_global_step_<N>_*``; ``commit`` hashes every
file under it, writes ``manifest.json``, fsyncs every file and directory, writes
and fsyncs ``COMPLETE``, renames the folder to ``global_step_<N>`` and fsyncs
the root. A crash at any point leaves either no ``global_step_<N>`` or a whole
one; leftover ``.tmp_*`` folders are never read and are removed by the next
commit.

``manifest.json`` looks like::

    {"format": "omnirl-async-checkpoint", "format_version": 1, "step": 12,
     "files": [{"path": "learner.msgpack", "size": 5321, "sha256": "9f2c..."}, ...]}

Reading: :func:`verify_checkpoint` re-hashes every listed file (streaming) and
returns the problems found; :meth:`CheckpointManager.latest_verified` picks the
newest folder that passes, reporting each damaged newer one, and
:func:`verify_or_raise` checks a folder named by the user. A folder without a
manifest (written before manifests existed, or interrupted) counts as damaged.
Files not listed in the manifest are ignored.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import msgspec
import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

__all__ = ["flatten_state", "unflatten_state", "save_state", "load_state", "CheckpointManager",
           "CheckpointError", "verify_checkpoint", "verify_or_raise", "write_manifest"]

FORMAT_VERSION = 1
MANIFEST_FORMAT = "omnirl-async-checkpoint"
MANIFEST_VERSION = 1
MANIFEST = "manifest.json"
COMPLETE = "COMPLETE"
LATEST_MARKER = "latest_checkpointed_iteration.txt"
NO_MANIFEST = f"no {MANIFEST} (written by an older version or interrupted)"
START_FRESH = "set trainer.resume_mode=disable to start fresh"
SUPERSEDED = "superseded"  # where a fresh run moves an earlier run's checkpoints
_CHUNK = 1 << 20
_TENSOR = "__tensor__"
_NDARRAY = "__ndarray__"
_TUPLE = "__tuple__"


class CheckpointError(ValueError):
    """A checkpoint folder or file is damaged, incomplete or unreadable; the message says which and why."""


# ---------------------------------------------------------------------------- state <-> files
def flatten_state(obj: Any, prefix: str = "s") -> tuple[dict[str, torch.Tensor], Any]:
    tensors: dict[str, torch.Tensor] = {}

    def walk(x, name):
        if isinstance(x, torch.Tensor):
            tensors[name] = x.detach().cpu().contiguous()
            return {_TENSOR: name}
        if isinstance(x, np.ndarray):
            tensors[name] = torch.from_numpy(np.ascontiguousarray(x))
            return {_NDARRAY: name}
        if isinstance(x, dict):
            return {k: walk(v, f"{name}.{k}") for k, v in x.items()}
        if isinstance(x, tuple):
            return {_TUPLE: [walk(v, f"{name}.{i}") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [walk(v, f"{name}.{i}") for i, v in enumerate(x)]
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, (np.integer, np.floating)):
            return x.item()
        raise TypeError(f"cannot checkpoint a value of type {type(x).__name__} at `{name}`")

    return tensors, walk(obj, prefix)


def unflatten_state(tensors: dict[str, torch.Tensor], skeleton: Any) -> Any:
    def walk(x):
        if isinstance(x, dict):
            if set(x) == {_TENSOR}:
                return tensors[x[_TENSOR]]
            if set(x) == {_NDARRAY}:
                return tensors[x[_NDARRAY]].numpy()
            if set(x) == {_TUPLE}:
                return tuple(walk(v) for v in x[_TUPLE])
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(skeleton)


def save_state(state: Any, folder: Path, name: str) -> None:
    tensors, skeleton = flatten_state(state)
    save_file(tensors, str(folder / f"{name}.safetensors"))
    (folder / f"{name}.msgpack").write_bytes(msgspec.msgpack.encode({"format": FORMAT_VERSION, "state": skeleton}))


def load_state(folder: Path, name: str) -> Any:
    """Read ``<name>.msgpack`` + ``<name>.safetensors``; any failure is a :class:`CheckpointError` naming the file."""
    folder = Path(folder)
    skeleton = _load_skeleton(folder / f"{name}.msgpack")
    tensors = _load_tensors(folder / f"{name}.safetensors")
    try:
        return unflatten_state(tensors, skeleton)
    except KeyError as err:
        raise CheckpointError(f"{folder / (name + '.msgpack')} refers to tensor {err.args[0]!r}, which "
                              f"{folder / (name + '.safetensors')} lacks: the two files are from different "
                              f"saves or one is damaged; resume from another checkpoint or {START_FRESH}.") from err


def _load_skeleton(path: Path) -> Any:
    try:
        raw = msgspec.msgpack.decode(path.read_bytes(), strict=False)
    except (OSError, msgspec.DecodeError) as err:
        raise CheckpointError(f"{path}: cannot read the msgpack state ({err}); the file is damaged or "
                              f"missing; resume from another checkpoint or {START_FRESH}.") from err
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_VERSION or "state" not in raw:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise CheckpointError(f"{path}: unsupported checkpoint format {found!r}; expected {FORMAT_VERSION} "
                              "(a dict with `format` and `state`); it was written by another version or "
                              f"is not a checkpoint; {START_FRESH}.")
    return raw["state"]


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as err:
        raise CheckpointError(f"{path}: cannot read the safetensors data ({err}); the file is damaged or "
                              f"missing; resume from another checkpoint or {START_FRESH}.") from err


# ---------------------------------------------------------------------------- durability helpers
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:  # some file systems cannot fsync a directory
        if err.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _replace_durably(path: Path, data: bytes) -> None:
    """Write ``path`` through a temporary sibling + fsync + os.replace, then fsync the parent."""
    tmp = path.with_name(f".{path.name}.tmp")
    _write_durably(tmp, data)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _hash_file(path: Path, *, fsync: bool = False) -> tuple[int, str]:
    """(size, SHA-256 hex) of ``path``, read in chunks; with ``fsync`` also flush it to disk."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(f.fileno())
    return size, digest.hexdigest()


# ---------------------------------------------------------------------------- manifest
class FileEntry(msgspec.Struct):
    path: str
    size: int
    sha256: str


class Manifest(msgspec.Struct):
    format: str
    format_version: int
    step: int
    files: list[FileEntry]


def _walk_files(folder: Path) -> list[Path]:
    found = []
    for dirpath, _, filenames in os.walk(folder):
        found += [Path(dirpath, n) for n in filenames]
    return sorted(found)


def write_manifest(folder: Path, step: int) -> str:
    """Hash and fsync every file under ``folder``, write ``manifest.json``; returns the manifest's SHA-256."""
    folder = Path(folder)
    entries = []
    for path in _walk_files(folder):
        rel = path.relative_to(folder).as_posix()
        if rel in (MANIFEST, COMPLETE):
            continue
        size, sha = _hash_file(path, fsync=True)
        entries.append(FileEntry(path=rel, size=size, sha256=sha))
    manifest = Manifest(format=MANIFEST_FORMAT, format_version=MANIFEST_VERSION, step=step, files=entries)
    data = msgspec.json.format(msgspec.json.encode(manifest), indent=1)
    _write_durably(folder / MANIFEST, data)
    return hashlib.sha256(data).hexdigest()


def _fsync_tree(folder: Path) -> None:
    for dirpath, _, _ in os.walk(folder, topdown=False):
        _fsync_dir(Path(dirpath))


# ---------------------------------------------------------------------------- verification
def verify_checkpoint(folder: Path) -> list[str]:
    """Problems that make ``folder`` unusable, one clause each naming the file; ``[]`` means it verified."""
    folder = Path(folder)
    if not folder.is_dir():
        return [f"{folder} does not exist or is not a directory"]
    problems = _check_complete(folder)
    manifest, manifest_problems = _read_manifest(folder)
    problems += manifest_problems
    if manifest is not None:
        for entry in manifest.files:
            problem = _check_entry(folder, entry)
            if problem:
                problems.append(problem)
    return problems


def _check_complete(folder: Path) -> list[str]:
    if not (folder / COMPLETE).is_file():
        return [f"{COMPLETE} is missing (the write was interrupted before the checkpoint was committed)"]
    return []


def _complete_manifest_sha(folder: Path) -> str | None:
    """The manifest's SHA-256 recorded on the second line of COMPLETE, if any."""
    try:
        lines = (folder / COMPLETE).read_text(errors="replace").split()
    except OSError:
        return None
    return lines[1] if len(lines) > 1 else None


def _read_manifest(folder: Path) -> tuple[Manifest | None, list[str]]:
    path = folder / MANIFEST
    if not path.is_file():
        return None, [NO_MANIFEST]
    try:
        data = path.read_bytes()
    except OSError as err:
        return None, [f"{MANIFEST} cannot be read ({err})"]
    expected = _complete_manifest_sha(folder)
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        return None, [f"{MANIFEST}: its SHA-256 differs from the one recorded in {COMPLETE} "
                      "(the manifest was changed or damaged after the commit)"]
    try:
        manifest = msgspec.json.decode(data, type=Manifest)
    except msgspec.DecodeError as err:
        return None, [f"{MANIFEST} cannot be parsed ({err})"]
    if manifest.format != MANIFEST_FORMAT or manifest.format_version != MANIFEST_VERSION:
        return None, [f"{MANIFEST}: unsupported format {manifest.format!r} version {manifest.format_version}; "
                      f"expected {MANIFEST_FORMAT!r} version {MANIFEST_VERSION}"]
    return manifest, []


def _check_entry(folder: Path, entry: FileEntry) -> str | None:
    rel = Path(entry.path)
    if rel.is_absolute() or ".." in rel.parts:
        return f"{MANIFEST} lists an unsafe path {entry.path!r} (absolute or outside the checkpoint)"
    path = folder / rel
    if not path.is_file():
        return f"{entry.path} is missing (listed in {MANIFEST} with {entry.size} bytes)"
    size = path.stat().st_size
    if size != entry.size:
        how = "truncated" if size < entry.size else "extended"
        return f"{entry.path} is {how}: {size} bytes on disk, {MANIFEST} says {entry.size}"
    try:
        sha = _hash_file(path)[1]
    except OSError as err:
        return f"{entry.path} cannot be read ({err})"
    if sha != entry.sha256:
        return f"{entry.path}: SHA-256 mismatch, its bytes differ from those written at commit (damaged on disk)"
    return None


def verify_or_raise(folder: Path) -> Path:
    """``folder`` if it verifies; else :class:`CheckpointError` naming the folder and every problem."""
    folder = Path(folder)
    problems = verify_checkpoint(folder)
    if problems:
        raise CheckpointError(f"checkpoint {folder} cannot be used: {'; '.join(problems)}. Fix: point "
                              "trainer.resume_from_path at a checkpoint that verifies (an older global_step_N "
                              f"folder), or {START_FRESH}.")
    return folder


# ---------------------------------------------------------------------------- manager
class CheckpointManager:
    """Writes step folders atomically with a manifest and finds the newest one that verifies."""

    def __init__(self, root: str | os.PathLike, *, max_to_keep: int | None = None):
        self.root = Path(root)
        self.max_to_keep = max_to_keep
        self._known_good: set[tuple] = set()  # fingerprints of folders this manager wrote or verified

    def step_dir(self, step: int) -> Path:
        return self.root / f"global_step_{step}"

    def begin(self, step: int) -> Path:
        """A fresh temporary folder to fill; :meth:`commit` moves it into place."""
        self.root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".tmp_global_step_{step}_", dir=self.root))

    def commit(self, tmp: Path, step: int) -> Path:
        """Seal ``tmp`` (manifest, fsync, COMPLETE), rename it to ``global_step_<step>``, update the marker, prune."""
        tmp = Path(tmp)
        manifest_sha = write_manifest(tmp, step)
        _fsync_tree(tmp)
        _write_durably(tmp / COMPLETE, f"{step}\n{manifest_sha}\n".encode())
        _fsync_dir(tmp)
        final = self._move_into_place(tmp, step)
        self._remember_good(final)
        _replace_durably(self.root / LATEST_MARKER, str(step).encode())
        self._prune(keep=final)
        return final

    def _move_into_place(self, tmp: Path, step: int) -> Path:
        final = self.step_dir(step)
        old = None
        if final.exists():
            old = self.root / f".old_global_step_{step}_{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def step_folders(self) -> list[tuple[int, Path]]:
        """``(N, folder)`` for every ``global_step_<N>`` directory, newest first."""
        found = []
        if self.root.is_dir():
            for d in self.root.glob("global_step_*"):
                suffix = d.name[len("global_step_"):]
                if suffix.isdigit() and d.is_dir():
                    found.append((int(suffix), d))
        return sorted(found, reverse=True)

    def set_aside(self, extra: tuple[str, ...] = ()) -> Path | None:
        """Move an earlier run's step folders, its latest marker and ``extra`` files to ``superseded/<UTC time>/``.

        A fresh run (``trainer.resume_mode=disable``) into a folder that holds
        checkpoints calls this first, so that its own checkpoints are never mixed
        with older ones (an older ``global_step_87`` would otherwise be what
        ``resume_mode=auto`` or the newest-checkpoint lookup finds after this
        run's step 77), and nothing is deleted. Returns the folder they went to,
        or None when there was nothing to move.
        """
        names = [d.name for _, d in self.step_folders()]
        names += [n for n in (LATEST_MARKER, *extra) if (self.root / n).is_file()]
        if not names:
            return None
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        dest = self.root / SUPERSEDED / stamp
        while dest.exists():  # two fresh runs within a second
            dest = dest.with_name(f"{stamp}_{uuid.uuid4().hex[:4]}")
        dest.mkdir(parents=True)
        for name in names:
            os.replace(self.root / name, dest / name)
        _fsync_dir(dest)
        _fsync_dir(self.root)
        return dest

    def latest_verified(self, report: Callable[[str], None] | None = None) -> Path | None:
        """Newest folder that verifies; ``report`` hears one line per damaged newer folder.

        None when there is no checkpoint folder at all; :class:`CheckpointError` when there are
        some but none verifies.
        """
        folders = self.step_folders()
        rejected: list[tuple[Path, list[str]]] = []
        for i, (_, folder) in enumerate(folders):
            problems = verify_checkpoint(folder)
            if not problems:
                self._remember_good(folder)
                return folder
            rejected.append((folder, problems))
            if report is not None:
                then = "trying the previous one" if i + 1 < len(folders) else "no older checkpoint is left"
                report(f"checkpoint {folder}: {'; '.join(problems)}; skipping it, {then}")
        if rejected:
            raise CheckpointError(self._none_verified_message(rejected))
        return None

    def _none_verified_message(self, rejected: list[tuple[Path, list[str]]]) -> str:
        lines = [f"no checkpoint in {self.root} can be resumed from; every one is damaged or incomplete:"]
        lines += [f"  {folder}: {'; '.join(problems)}" for folder, problems in rejected]
        lines.append(f"Fix: {START_FRESH} (or move {self.root} away), or repair a checkpoint and retry.")
        return "\n".join(lines)

    def latest(self) -> Path | None:
        """Same as :meth:`latest_verified` without a report."""
        return self.latest_verified()

    @staticmethod
    def _fingerprint(folder: Path) -> tuple | None:
        """Name, size and mtime of every file in ``folder``: any rewrite, truncation or removal changes it."""
        if not (folder / COMPLETE).is_file():
            return None
        try:
            stats = [(p.relative_to(folder).as_posix(), p.stat()) for p in _walk_files(folder)]
        except OSError:
            return None
        return folder.name, tuple((rel, st.st_size, st.st_mtime_ns) for rel, st in stats)

    def _remember_good(self, folder: Path) -> None:
        key = self._fingerprint(folder)
        if key is not None:
            self._known_good.add(key)

    def _is_good(self, folder: Path) -> bool:
        """Verified-complete; a folder unchanged since this manager wrote or verified it is not hashed again."""
        key = self._fingerprint(folder)
        if key is None:
            return False
        if key not in self._known_good:
            if verify_checkpoint(folder):
                return False
            self._known_good.add(key)
        return True

    def _prune(self, keep: Path) -> None:
        """Keep ``keep`` plus the newest verified others up to max_to_keep; damaged folders are left alone."""
        if self.max_to_keep:
            kept = 1
            for _, folder in self.step_folders():
                if folder == keep or not self._is_good(folder):
                    continue
                if kept < self.max_to_keep:
                    kept += 1
                else:
                    shutil.rmtree(folder, ignore_errors=True)
        self._known_good = {k for k in self._known_good if (self.root / k[0]).is_dir()}
        for pattern in (".tmp_global_step_*", ".old_global_step_*"):
            for d in self.root.glob(pattern):
                shutil.rmtree(d, ignore_errors=True)
