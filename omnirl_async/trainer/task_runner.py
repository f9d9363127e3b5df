"""From a validated config to a finished run: input checks, prompts, Ray start-up, mode dispatch, shutdown.

:meth:`TaskRunner.run` checks every file and folder the config names
(:func:`omnirl_async.trainer.input_checks.check_inputs`) and reads the training prompts
before Ray starts, so bad input fails in the driver within a second with one
:class:`~omnirl_async.preflight.InputError` instead of inside every actor.
"""

from __future__ import annotations

import os

from omnirl_async.data.prompts import load_train_prompts
from omnirl_async.trainer.ingest import prepare_offline_store
from omnirl_async.trainer.run_dir import prepare_run_dir

__all__ = ["TaskRunner", "init_ray", "ray_init_kwargs", "cluster_to_join", "local_cluster_address", "START_ONLY"]


def required_cpus(config) -> float:
    ro = config.actor_rollout_ref.rollout
    return (ro.num_workers * ro.num_cpus_per_worker + config.learner.num_workers * config.learner.num_cpus_per_worker
            + config.reward.num_workers * config.reward.num_cpus_per_worker)


#: ``ray.init`` arguments that only a new local Ray takes: Ray refuses (or ignores) them when it connects to a
#: running cluster, whose nodes got theirs from ``ray start``.
START_ONLY = ("num_cpus", "num_gpus", "resources", "labels", "object_store_memory", "include_dashboard",
              "dashboard_host", "dashboard_port", "enable_resource_isolation", "cgroup_path", "system_reserved_cpu",
              "system_reserved_memory", "_system_config", "_enable_object_reconstruction", "_node_name", "_memory",
              "_plasma_directory", "_object_spilling_directory", "_redis_max_memory", "_driver_object_store_memory")


def local_cluster_address() -> str | None:
    """The cluster that the last ``ray start`` on this machine began (``ray.init()`` joins it), if any."""
    try:
        from ray._private.services import find_bootstrap_address

        return find_bootstrap_address(None) or None
    except Exception:  # noqa: BLE001 - a private helper of Ray: if it moved, only this detection is lost
        return None


def cluster_to_join(address, environ=None, local_address=None) -> str | None:
    """What ``ray.init`` will connect to, or None when it starts a new local Ray.

    Ray's own order: ``address`` (``ray_kwargs.address``; ``local`` forces a new Ray), else ``$RAY_ADDRESS``
    (set by ``ray job submit`` for its entrypoint), else the cluster of a ``ray start`` on this machine
    (``local_address``; :func:`local_cluster_address`).
    """
    environ = os.environ if environ is None else environ
    if address == "local":
        return None
    if address:
        return str(address)
    return environ.get("RAY_ADDRESS") or local_address or None


def ray_init_kwargs(config, *, joining: bool) -> tuple[dict, list[str]]:
    """``ray.init`` keyword arguments from ``ray_kwargs`` and the start-only arguments left out.

    Starting: ``num_cpus`` (``ray_kwargs.num_cpus``, else at least what the roles ask for), workers at
    niceness 0 when rollout workers are niced, the dashboard as Ray chooses. Joining: the address and the
    connection arguments only; start-only ones (:data:`START_ONLY`) would make Ray refuse to connect.
    """
    rk = config.ray_kwargs
    kwargs = dict(rk.ray_init or {})
    kwargs.setdefault("log_to_driver", True)
    if joining:
        dropped = sorted(k for k in kwargs if k in START_ONLY)
        for k in dropped:
            kwargs.pop(k)
        dropped = [f"ray_kwargs.ray_init.{k}" for k in dropped]
        if rk.num_cpus:
            dropped.append("ray_kwargs.num_cpus")
        # $RAY_ADDRESS, then the local `ray start` cluster, as Ray resolves them; auto never starts a new Ray
        kwargs["address"] = rk.address or kwargs.get("address") or "auto"
        return kwargs, dropped
    kwargs["address"] = "local"  # never join a cluster by accident after deciding to start one
    kwargs.setdefault("include_dashboard", None)  # Ray's choice: on when ray[default] is installed
    kwargs.setdefault("num_cpus", rk.num_cpus or max(os.cpu_count() or 1, int(required_cpus(config) + 0.999)))
    if config.actor_rollout_ref.rollout.nice > 0:
        # Ray starts every worker process at niceness 15, which would leave rollout workers (capped at 19)
        # barely below the learner; start workers at 0 so that they sit `nice` levels below it.
        system = dict(kwargs.pop("_system_config", None) or {})
        system.setdefault("worker_niceness", 0)
        kwargs["_system_config"] = system
    return kwargs, []


def init_ray(config, printer=print) -> bool:
    """Start or join Ray as ``ray_kwargs`` (and the environment) say; True when this call connected this
    process to Ray (the caller shuts it down), False when it was connected already.

    Joins ``ray_kwargs.address``, ``$RAY_ADDRESS`` (``ray job submit`` sets it) or the cluster of a
    ``ray start`` on this machine, passing no start-only argument (each one left out is named); otherwise
    starts a local Ray. The dashboard is Ray's choice (on when its dependencies, ``ray[default]``, are
    installed) unless ``ray_kwargs.ray_init.include_dashboard`` says otherwise; its address is printed.
    """
    import ray

    if ray.is_initialized():
        return False
    rk = config.ray_kwargs
    address = rk.address or (rk.ray_init or {}).get("address")
    target = cluster_to_join(address, local_address=None if address else local_cluster_address())
    kwargs, dropped = ray_init_kwargs(config, joining=target is not None)
    if target is not None:
        printer(f"joining the running Ray cluster ({target})")
        if dropped:
            printer(f"not used when joining a running cluster (its nodes' `ray start` options set them): "
                    f"{', '.join(dropped)}")
        if config.actor_rollout_ref.rollout.nice > 0:
            printer("`actor_rollout_ref.rollout.nice` > 0: start the cluster's nodes with RAY_worker_niceness=0 "
                    "so that rollout workers sit below the learners (Ray starts workers at niceness 15)")
    ctx = ray.init(**kwargs)
    if target is not None:
        printer(f"joined: {len(ray.nodes())} node(s), {ray.cluster_resources().get('CPU', 0):g} CPUs, "
                f"{ray.cluster_resources().get('GPU', 0):g} GPUs")
    url = getattr(ctx, "dashboard_url", None)
    if url:
        printer(f"Ray dashboard: http://{url}")
    return True


class TaskRunner:
    """Runs one training job. ``run()`` returns the trainer's summary."""

    def __init__(self, config, *, printer=print):
        self.config = config
        self.printer = printer

    def run(self) -> dict:
        from omnirl_async.trainer.input_checks import check_inputs

        check_inputs(self.config)  # raises InputError before anything starts
        # a resume must fit the saved config; then resolved_config.yaml goes beside the checkpoints and logs
        prepare_run_dir(self.config, printer=self.printer)
        # data.offline_files -> <run dir>/offline/; a run that trains on offline pairs needs them there
        prepare_offline_store(self.config, printer=self.printer)
        prompts = load_train_prompts(self.config.data)

        import ray

        started = init_ray(self.config, printer=self.printer)
        try:
            mode = self.config.trainer.v1.trainer_mode
            if mode == "sync":
                from omnirl_async.trainer.sync import SyncTrainer as cls
            elif mode == "separate_async":
                from omnirl_async.trainer.separate_async import SeparateAsyncTrainer as cls
            else:  # validation refuses modes that are not built
                raise ValueError(f"`trainer.v1.trainer_mode` = {mode!r} is not available")
            trainer = cls(self.config, prompts, printer=self.printer)
            try:
                trainer.maybe_resume()
                return trainer.fit()
            finally:
                trainer.stop()
        finally:
            if started:
                ray.shutdown()
