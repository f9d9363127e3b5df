"""The offline table, filled from a run's offline store: every preference pair a group of two samples.

A pair of the store (:class:`~omnirl_async.buffer.offline_store.OfflineStore`)
becomes one complete group in the buffer's offline table:

* group ``offline/<id>`` (the pair's dataset id), ``group_size`` 2;
* member 0 the chosen (winner) sample, key ``offline/<id>/chosen``, reward 1;
  member 1 the rejected (loser) sample, key ``offline/<id>/rejected``, reward 0;
* ``tags.source`` = offline, ``tags.policy_version`` = None (no policy made
  them: never stale, never in the staleness counts), ``tags.prompt`` the
  prompt;
* fields ``x0`` (the clean latents), ``emb.<name>`` (the prompt embedding, as
  rollouts store it) and ``rewards``: the fields the direct-preference learner
  reads. The learner knows a row is offline from :data:`OFFLINE_FIELD`, which
  the trainer adds when it joins the online and the offline share of a batch.

:func:`fill_from_store` adds every pair of the store whose group is not in the
table yet (filling again after more ingests adds only the new pairs) and
records where each group's rows live in the store (``BufferCore.store_rows``),
so a buffer snapshot refers to the store's rows instead of copying them
(:mod:`.persistence`): the store is the run's copy of the offline data,
checkpoints stay small, and a restore reads the same bytes back.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import numpy as np

from omnirl_async.buffer.offline_store import OfflineStore
from omnirl_async.buffer.schema import spec_of
from omnirl_async.protocol import SampleMeta, SampleSource, SampleStatus, SampleTags

__all__ = ["OFFLINE_FIELD", "CHOSEN_REWARD", "REJECTED_REWARD", "group_uid", "pair_metas", "pair_fields",
           "fill_from_store", "FILL_CHUNK"]

#: bool field [B] the trainer adds to a learner batch: True on rows of the offline share
OFFLINE_FIELD = "offline"
#: the rewards of an offline pair's members (the learner maps them to r = 1 and r = 0)
CHOSEN_REWARD, REJECTED_REWARD = 1.0, 0.0
#: pairs per put when filling the table
FILL_CHUNK = 256
_SIDES = ("chosen", "rejected")


def group_uid(row_id: str) -> str:
    return f"offline/{row_id}"


def pair_metas(rows: Sequence[Any]) -> list[SampleMeta]:
    """Metas of the pairs ``rows`` (``OfflineRow``): chosen then rejected, pair after pair."""
    metas = []
    for r in rows:
        gid = group_uid(r.id)
        for i, side in enumerate(_SIDES):
            key = f"{gid}/{side}"
            metas.append(SampleMeta(
                key=key, status=SampleStatus.SUCCESS, reward=CHOSEN_REWARD if i == 0 else REJECTED_REWARD,
                tags=SampleTags(uid=key, group_uid=gid, sample_index=i, group_size=2, policy_version=None,
                                source=SampleSource.OFFLINE, prompt=r.prompt)))
    return metas


def pair_fields(store: OfflineStore, positions: Sequence[int]) -> dict[str, np.ndarray]:
    """Fields of the pairs at ``positions`` in the store, rows interleaved (chosen, rejected)."""
    f = store.pairs(positions)
    out = {k: v for k, v in f.items() if k == "x0" or k.startswith("emb.")}
    out["rewards"] = np.tile(np.asarray([CHOSEN_REWARD, REJECTED_REWARD], np.float32), len(positions))
    return out


def fill_from_store(core, run_dir: str | os.PathLike, *, wrap: Callable[[dict[str, np.ndarray]], Any],
                    timeout: float | None = None) -> dict[str, Any]:
    """Add the pairs of ``<run_dir>/offline/`` that the offline table lacks; ``wrap(arrays)`` makes a payload.

    Returns ``{"added": pairs added, "pairs": pairs in the table, "store": dir, "content_hash": ...}``.
    A store that does not fit the table is a ``ValueError`` naming the key to raise; a store of
    another set-up than the one already in the table is refused (fill a fresh buffer instead).
    """
    store = OfflineStore(run_dir)
    table = core.tables[SampleSource.OFFLINE.value]
    info = {"dir": str(store.dir), "content_hash": store.content_hash()}
    with core.cond:
        have = set(table.groups)
    rows = store.rows()
    todo = [i for i, r in enumerate(rows) if group_uid(r.id) not in have]
    if 2 * len(rows) > table.max_size:
        raise ValueError(f"the offline store {store.dir} holds {len(rows)} pairs = {2 * len(rows)} samples; the "
                         f"offline table holds at most `buffer.max_size` = {table.max_size} samples; raise "
                         f"`buffer.max_size` to at least {2 * len(rows)}")
    if todo:
        _check_room(core, store, len(todo), _row_nbytes(pair_fields(store, [0])))
    for lo in range(0, len(todo), FILL_CHUNK):
        positions = todo[lo:lo + FILL_CHUNK]
        fields = pair_fields(store, positions)
        core.put(pair_metas([rows[i] for i in positions]), wrap(fields), spec_of(fields), _row_nbytes(fields),
                 timeout=timeout)
        with core.cond:
            core.store_rows.update({group_uid(rows[i].id): i for i in positions})
    with core.cond:
        core.offline_store = info
        pairs = len(table.groups)
    return {"added": len(todo), "pairs": pairs, **info}


def _row_nbytes(fields: dict[str, np.ndarray]) -> int:
    return sum(int(v.dtype.itemsize * int(np.prod(v.shape[1:], dtype=np.int64))) for v in fields.values())


def _check_room(core, store: OfflineStore, pairs: int, row_nbytes: int) -> None:
    """The new pairs must fit the buffer's global bound now (the offline pool is never evicted)."""
    n, nbytes = 2 * pairs, 2 * pairs * row_nbytes
    with core.cond:
        if core._global_fits(n, nbytes):
            return
        if core.total_storage_size is not None:
            have = f"`transfer_queue.total_storage_size` = {core.total_storage_size} samples ({core.size} in use)"
            need = f"raise it to at least {core.size + n}"
        else:
            have = f"`transfer_queue.memory_budget_bytes` = {core.memory_budget_bytes} ({core.nbytes} in use)"
            need = f"raise it to at least {core.nbytes + nbytes}"
    raise ValueError(f"the offline store {store.dir}: {pairs} pairs ({n} samples, {nbytes} bytes) do not fit the "
                     f"buffer: {have}; {need} (online rollouts need room too)")
