"""One API over 0 (in-process) or N Ray learner actors.

``LearnerGroup(config, use_ray=False)`` runs a single :class:`Learner` in the
calling process – unit tests need no cluster. With ``use_ray=True`` it starts
``learner.num_workers`` actors; for N > 1 they form one torch.distributed
group (gloo on CPU, NCCL on GPU) and average gradients of the trainable
parameters, so N learners give the same update as one on the same batch.

Every call to the actors is a bounded wait (``trainer.wait_timeout_s``):

* a learner actor that died (crash, out-of-memory kill, lost node,
  ``ray.kill``) becomes one :class:`LearnerDiedError` naming the rank, the call
  and Ray's reason in one line – raised as soon as that rank's reply fails,
  even while the other ranks still wait in a collective for it; the group is
  then unusable and later calls fail at once;
* no answer by the deadline becomes a :class:`TimeoutError` naming the call
  and the ranks that did not answer;
* an exception raised inside a learner method comes back as Ray raises it
  (the original type), except :class:`~omnirl_async.learners.learner.NonFiniteError`,
  which is re-raised as itself without the remote traceback.

On a cluster: the learners are reserved together in one placement group
(:mod:`omnirl_async.placement`: ``learner.num_cpus_per_worker`` /
``num_gpus_per_worker`` / ``ray_kwargs.role_resources.learner`` per learner,
packed; a cluster that cannot hold them ends in a ``PlacementError`` after
``ray_kwargs.placement_timeout_s``), so a group never half-starts. They meet
at rank 0's node address as Ray sees it (``ray.util.get_node_ip_address()``,
not ``gethostbyname(gethostname())``, which is often 127.0.1.1), and gloo
binds to the network interface that holds that address. Files (the LoRA
adapter of a checkpoint) are written by the caller of :meth:`LearnerGroup.save_lora`,
not by rank 0: rank 0 may run on another node.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnirl_async.learners.learner import Learner, NonFiniteError
from omnirl_async.metrics import reduce_metrics
from omnirl_async.placement import RolePlacement, role_request

__all__ = ["LearnerDiedError", "LearnerGroup", "LearnerWorker", "PendingUpdate", "wait_for_learners",
           "rendezvous_address", "interface_of", "read_folder", "write_folder"]

#: after one rank raised, how long to look for a rank that died (its death, not the survivor's
#: broken collective, is the cause to report)
_DEATH_GRACE_S = 5.0
#: longest a graceful ``stop`` waits before the actors are killed
_STOP_GRACE_S = 30.0


class LearnerDiedError(RuntimeError):
    """A learner actor died; training cannot continue with that rank missing.

    ``rank`` is the learner that died, ``call`` the group method it was
    serving (``update``, ``publish``, ...), ``cause`` Ray's reason in one line.
    The trainer knows the checkpoint to resume from and adds it with
    :meth:`extended`.
    """

    def __init__(self, message: str, *, rank: int | None = None, call: str = "", cause: str = ""):
        super().__init__(message)
        self.rank, self.call, self.cause = rank, call, cause

    def extended(self, line: str) -> LearnerDiedError:
        """A copy with ``line`` appended to the message and the same rank, call and cause."""
        return type(self)(f"{self}\n{line}", rank=self.rank, call=self.call, cause=self.cause)


def _one_line(err: BaseException, limit: int = 400) -> str:
    """``err``'s message on one line (Ray's are multi-line ``key: value`` lists), without a final period."""
    text = ""
    for part in filter(None, (line.strip() for line in str(err).splitlines())):
        if text:
            text += " " if text[-1] in ".:;" else "; "
        text += part
    text = text.rstrip(".")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _died(rank: int, call: str, err: BaseException) -> LearnerDiedError:
    cause = f"{type(err).__name__}: {_one_line(err)}"
    return LearnerDiedError(
        f"learner rank {rank} died during `{call}`; training cannot continue without it. Cause: {cause}. "
        "Likely causes: out of host or GPU memory (lower `actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu` "
        "or `data.train_batch_size`), a crash in native code, a lost node, or the actor was killed; the worker's "
        "log (under /tmp/ray/session_latest/logs) has the details.", rank=rank, call=call, cause=cause)


def _timed_out(call: str, ranks: list[int], timeout_s: float) -> TimeoutError:
    return TimeoutError(
        f"learner call `{call}` got no answer from rank(s) {ranks} within `trainer.wait_timeout_s` = "
        f"{timeout_s:g} s. Likely causes: the call needs longer (a large batch or model: raise "
        "`trainer.wait_timeout_s`); a rank waits in a collective for another that hangs or failed; the "
        "cluster cannot place the learners (`learner.num_cpus_per_worker` / `learner.num_gpus_per_worker` "
        "above the free resources, see `ray status`); a hung worker (`py-spy dump --pid <pid>`; worker logs "
        "under /tmp/ray/session_latest/logs).")


def _result(ref, rank: int, call: str, others: dict) -> Any:
    """``ref``'s value (it is ready); a dead actor → LearnerDiedError. ``others``: still pending, ref → rank."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    try:
        return ray.get(ref)
    except RayTaskError as err:  # the learner is alive and its method raised (checked first: the error
        # of a dead *other* actor it called is also a RayActorError)
        _raise_if_one_died(others, call)
        if isinstance(err.cause, NonFiniteError):
            raise err.cause from None
        raise
    except RayActorError as err:
        raise _died(rank, call, err) from None


def _raise_if_one_died(pending: dict, call: str) -> None:
    """A rank that died is the root cause when a survivor's collective broke with it: report that rank."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    if not pending:
        return
    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_DEATH_GRACE_S)
    for ref in ready:
        try:
            ray.get(ref)
        except RayTaskError:
            continue
        except RayActorError as err:
            raise _died(pending[ref], call, err) from None


def wait_for_learners(refs: dict[int, Any], call: str, timeout_s: float) -> dict[int, Any]:
    """The replies of ``refs`` (rank → ObjectRef) by rank, each rank checked as soon as it answers.

    A rank that died raises :class:`LearnerDiedError` at once (the others may
    be blocked in a collective waiting for it); no reply from some rank within
    ``timeout_s`` seconds raises :class:`TimeoutError`.
    """
    import ray

    deadline = time.monotonic() + timeout_s
    pending = {ref: rank for rank, ref in refs.items()}
    results: dict[int, Any] = {}
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise _timed_out(call, sorted(pending.values()), timeout_s)
        for ref in ready:
            rank = pending.pop(ref)
            results[rank] = _result(ref, rank, call, pending)
    return results


def rendezvous_address() -> tuple[str, int]:
    """This node's address as Ray sees it and a TCP port that was free on it a moment ago."""
    import ray.util

    ip = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
        s.bind((ip, 0))
        return ip, int(s.getsockname()[1])


def interface_of(ip: str) -> str | None:
    """The name of the network interface that holds ``ip`` (gloo binds there), or None."""
    try:
        import psutil  # installed with peft and accelerate
    except ImportError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == ip for a in addrs):
            return name
    return None


def read_folder(folder: str | os.PathLike) -> dict[str, bytes]:
    """Every file under ``folder`` as ``{relative posix path: bytes}``."""
    root = Path(folder)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def write_folder(folder: str | os.PathLike, files: dict[str, bytes]) -> None:
    """Write ``files`` (from :func:`read_folder`) under ``folder``, refusing paths that leave it."""
    root = Path(folder)
    for rel, data in files.items():
        parts = Path(rel).parts
        if Path(rel).is_absolute() or ".." in parts:
            raise ValueError(f"refusing to write {rel!r} outside {root}")
        path = root.joinpath(*parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def learner_class(config) -> type[Learner]:
    """The learner of ``algorithm.trainer_type``: policy gradient, or direct preference."""
    if config.algorithm.trainer_type == "direct_preference":
        from omnirl_async.learners.preference_learner import PreferenceLearner

        return PreferenceLearner
    return Learner


class LearnerWorker:
    """The body of one learner actor."""

    def __init__(self, config, rank: int, world_size: int, num_threads: int | None = None):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.config, self.rank, self.world_size = config, rank, world_size
        self.learner: Learner | None = None

    def address(self) -> tuple[str, int]:
        """Where the process group meets (called on rank 0): this node's Ray address and a free port."""
        return rendezvous_address()

    def setup(self, master: tuple[str, int] | None) -> bool:
        if self.world_size > 1:
            import torch.distributed as dist

            backend = self.config.learner.backend
            if backend == "auto":
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "gloo" and not os.environ.get("GLOO_SOCKET_IFNAME"):
                # gloo binds to what the hostname resolves to (often 127.0.1.1): other nodes could not reach it
                iface = interface_of(rendezvous_address()[0])
                if iface:
                    os.environ["GLOO_SOCKET_IFNAME"] = iface
            dist.init_process_group(backend=backend, init_method=f"tcp://{master[0]}:{master[1]}",
                                    rank=self.rank, world_size=self.world_size)
        self.learner = learner_class(self.config)(self.config, rank=self.rank, world_size=self.world_size)
        return True

    def update(self, fields, group_ids, run_progress=None):
        return self.learner.update(fields, group_ids, run_progress)

    def get_weights(self) -> dict[str, np.ndarray]:
        return {k: v.detach().cpu().float().numpy() if v.dtype == torch.bfloat16 else v.detach().cpu().numpy()
                for k, v in self.learner.get_weights().items()}

    def get_state(self) -> dict[str, Any]:
        return self.learner.get_state()

    def set_state(self, state) -> bool:
        self.learner.set_state(state)
        return True

    def save_lora(self, folder: str) -> bool:
        self.learner.save_lora(folder)
        return True

    def lora_files(self) -> dict[str, bytes]:
        """The adapter folder ``save_lora`` writes, as bytes: saved on this node, written by the caller."""
        with tempfile.TemporaryDirectory(prefix="omnirl_lora_") as tmp:
            self.learner.save_lora(tmp)
            return read_folder(tmp)

    def publish(self, store, version: int):
        """Put this rank's weights into the object store owned by ``store`` (called on rank 0)."""
        from omnirl_async.learners.weight_store import publish_weights

        return publish_weights(store, version, self.get_weights(),
                               is_lora=self.config.actor_rollout_ref.model.lora_rank > 0,
                               adapter_versions=self.adapter_versions())

    def adapter_versions(self) -> dict[str, int]:
        return self.learner.adapter_versions()

    def assert_healthy(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid(), "step": self.learner.global_step if self.learner else -1}

    def stop(self) -> bool:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        return True


def _rank0_reply(replies: list) -> Any:
    """What a call made on rank 0 alone returned."""
    return replies[0]


class PendingUpdate:
    """An update the learners are running (:meth:`LearnerGroup.start_update`); with ``combine``, any other call
    started on them (:meth:`LearnerGroup.start_publish`)."""

    def __init__(self, collect, refs: list | None = None, combine=reduce_metrics) -> None:
        self._collect = collect
        self._refs = refs or []  # the ranks' replies (none: it ran in this process)
        self._combine = combine
        self._metrics: Any = None
        self._ok: set = set()  # replies seen to be values, not errors

    def wait(self, timeout_s: float) -> bool:
        """Whether :meth:`result` would answer now: every rank has replied, or one has failed (the others may be
        blocked in a collective waiting for it); waits up to ``timeout_s`` for that. Errors come with ``result``."""
        if self._collect is None or not self._refs:
            return True
        import ray

        deadline = time.monotonic() + timeout_s
        pending = [ref for ref in self._refs if ref not in self._ok]
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                return False
            if any(self._failed(ref) for ref in ready):
                return True
        return True

    def _failed(self, ref) -> bool:
        """Whether ``ref`` (ready, not yet seen to be a value) holds an error; a value is remembered."""
        import ray

        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayError:
            return True
        self._ok.add(ref)
        return False

    def result(self) -> Any:
        """The ranks' metrics, averaged (waiting for them); raises what :meth:`LearnerGroup.update` would."""
        if self._collect is not None:
            collect, self._collect = self._collect, None
            self._metrics = self._combine(collect())
        return self._metrics


class LearnerGroup:
    """The learners of a run behind one API: one in-process :class:`LearnerWorker`, or N Ray actors.

    Every call waits at most ``trainer.wait_timeout_s``; see the module docstring for what a dead or
    silent rank becomes, and for placement on a cluster.
    """

    #: the body of each learner actor (a subclass may stand in another, e.g. ``benchmarks/bench_scale.py``)
    worker_class: type = LearnerWorker

    def __init__(self, config, *, use_ray: bool = True, num_threads: int | None = None, printer=None):
        self.config = config
        lcfg = config.learner
        self.num_workers = lcfg.num_workers
        self.use_ray = use_ray
        self.timeout_s = float(config.trainer.wait_timeout_s)
        self.dead: LearnerDiedError | None = None  # set once a rank died: the group is unusable
        self.hung = False  # a call timed out: its ranks may still be busy
        self.actors: list = []
        self.local: LearnerWorker | None = None
        self.placement: RolePlacement | None = None
        if not use_ray:
            if self.num_workers != 1:
                raise ValueError(f"`learner.num_workers` = {self.num_workers} needs Ray; the in-process learner "
                                 "group has exactly one learner.")
            self.local = self.worker_class(config, 0, 1, num_threads)
            self.local.setup(None)
            return
        import ray

        # all learners or none: one placement group, a bounded wait (PlacementError names what is missing)
        self.placement = RolePlacement(role_request(config, "learner"),
                                       timeout_s=config.ray_kwargs.placement_timeout_s, printer=printer)
        cls = ray.remote(self.worker_class)
        self.actors = [cls.options(**self.placement.options(r)).remote(config, r, self.num_workers, num_threads)
                       for r in range(self.num_workers)]
        try:
            master = self._rank0("address") if self.num_workers > 1 else None
            self._all("setup", master)
        except BaseException:
            self._kill()
            raise

    # ------------------------------------------------------------------ calls
    def _call(self, method: str, ranks: list[int], *args) -> list:
        """``method(*args)`` on the actors of ``ranks``, bounded by ``trainer.wait_timeout_s``."""
        return self._collect(method, ranks, self._submit(method, ranks, *args))

    def _submit(self, method: str, ranks: list[int], *args) -> dict[int, Any]:
        if self.dead is not None:
            raise LearnerDiedError(f"`{method}` cannot run: learner rank {self.dead.rank} died earlier, during "
                                   f"`{self.dead.call}` ({self.dead.cause}).", rank=self.dead.rank,
                                   call=self.dead.call, cause=self.dead.cause) from None
        return {r: getattr(self.actors[r], method).remote(*args) for r in ranks}

    def _collect(self, method: str, ranks: list[int], refs: dict[int, Any]) -> list:
        """The replies of a :meth:`_submit` (the wait starts now: ``trainer.wait_timeout_s`` from here)."""
        try:
            results = wait_for_learners(refs, method, self.timeout_s)
        except LearnerDiedError as err:
            self.dead = err
            raise
        except TimeoutError:
            self.hung = True
            raise
        return [results[r] for r in ranks]

    def _all(self, method: str, *args) -> list:
        if self.local is not None:
            return [getattr(self.local, method)(*args)]
        return self._call(method, list(range(len(self.actors))), *args)

    def _rank0(self, method: str, *args):
        if self.local is not None:
            return getattr(self.local, method)(*args)
        return self._call(method, [0], *args)[0]

    def update(self, fields: dict[str, np.ndarray], group_ids: list[str],
               run_progress: float | None = None) -> dict[str, float]:
        """One update on ``fields`` (or what :meth:`stage` made of them); the ranks' metrics, averaged.
        ``run_progress``: the fraction of the run done, for the learning-rate schedule (``Learner.update``)."""
        return self.start_update(fields, group_ids, run_progress).result()

    def stage(self, fields: dict[str, np.ndarray]) -> Any:
        """``fields`` put into the object store once, shared by every rank (what :meth:`update` would put),
        so that it can be done ahead of the update; the in-process group takes them as they are."""
        if self.local is not None:
            return fields
        import ray

        return ray.put(fields)

    def start_update(self, fields: Any, group_ids: list[str], run_progress: float | None = None) -> PendingUpdate:
        """Start an update on every rank and return at once; :meth:`PendingUpdate.result` waits for it (bounded
        by ``trainer.wait_timeout_s`` from then). The in-process group runs it here. Calls made on the group
        before ``result()`` run after the update on each rank (an actor serves its calls in order)."""
        if self.local is not None:
            metrics = self.local.update(fields, group_ids, run_progress)
            return PendingUpdate(lambda: [metrics])
        import ray

        ref = fields if isinstance(fields, ray.ObjectRef) else self.stage(fields)
        ranks = list(range(len(self.actors)))
        refs = self._submit("update", ranks, ref, group_ids, run_progress)
        return PendingUpdate(lambda: self._collect("update", ranks, refs), list(refs.values()))

    def get_weights(self) -> dict[str, np.ndarray]:
        return self._rank0("get_weights")

    def get_state(self) -> dict[str, Any]:
        return self._rank0("get_state")

    def adapter_versions(self) -> dict[str, int]:
        """The learner update each published policy state holds (``default``; ``old`` with DiffusionNFT)."""
        return self._rank0("adapter_versions")

    def set_state(self, state) -> None:
        self._all("set_state", state)

    def save_lora(self, folder: str) -> None:
        """Write the adapter under ``folder`` *in this process* (rank 0 may run on another node)."""
        if self.local is not None:
            self.local.save_lora(folder)
            return
        write_folder(folder, self._rank0("lora_files"))

    def publish(self, store, version: int):
        """Rank 0 publishes weights ``version`` through the weight store; returns its WeightsInfo."""
        return self.start_publish(store, version).result()

    def start_publish(self, store, version: int) -> PendingUpdate:
        """Start :meth:`publish` and return at once (``result()`` is its WeightsInfo): rank 0 publishes the
        weights it holds once the calls made before this one are done, and before any call made after it, so an
        update started next trains on after publishing (an actor serves its calls in order)."""
        if self.local is not None:
            info = self.local.publish(store, version)
            return PendingUpdate(lambda: [info], combine=_rank0_reply)
        refs = self._submit("publish", [0], store, version)
        return PendingUpdate(lambda: self._collect("publish", [0], refs), list(refs.values()), combine=_rank0_reply)

    def assert_healthy(self) -> list[dict]:
        return self._all("assert_healthy")

    def stop(self) -> None:
        """Leave the process group gracefully when the group is healthy, then kill the actors; never raises
        for a dead or hung learner (it is being removed anyway)."""
        if self.actors:
            import ray

            try:
                if self.dead is None and not self.hung:
                    refs = [a.stop.remote() for a in self.actors]
                    ray.wait(refs, num_returns=len(refs), timeout=min(_STOP_GRACE_S, self.timeout_s))
            finally:
                self._kill()
        elif self.local is not None:
            self.local.stop()

    def _kill(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)
        self.actors = []
        if self.placement is not None:
            self.placement.remove()
