"""From a validated config to a finished run: input checks, prompts, Ray start-up, mode dispatch, shutdown.

:meth:`TaskRunner.run` checks every file and folder the config names
(:func:`omnirl_async.trainer.input_checks.check_inputs`) and reads the training prompts
before Ray starts, so bad input fails in the driver within a second with one
:class:`~omnirl_async.preflight.InputError` instead of inside every actor.
"""

from __future__ import annotations

import os

from omnirl_async.data.prompts import load_train_prompts
from omnirl_async.trainer.ingest import ingest_offline_files
from omnirl_async.trainer.run_dir import prepare_run_dir

__all__ = ["TaskRunner", "init_ray"]


def required_cpus(config) -> float:
    ro = config.actor_rollout_ref.rollout
    return (ro.num_workers * ro.num_cpus_per_worker + config.learner.num_workers * config.learner.num_cpus_per_worker
            + config.reward.num_workers * config.reward.num_cpus_per_worker)


def init_ray(config) -> bool:
    """Start (or join) Ray as ``ray_kwargs`` says; returns True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    rk = config.ray_kwargs
    kwargs = dict(rk.ray_init or {})
    kwargs.setdefault("include_dashboard", False)
    kwargs.setdefault("log_to_driver", True)
    if rk.address:
        ray.init(address=rk.address, **kwargs)
    else:
        num_cpus = rk.num_cpus or max(os.cpu_count() or 1, int(required_cpus(config) + 0.999))
        if config.actor_rollout_ref.rollout.nice > 0:
            # Ray starts every worker process at niceness 15, which would leave rollout workers (capped at 19)
            # barely below the learner; start workers at 0 so that they sit `nice` levels below it.
            system = dict(kwargs.pop("_system_config", None) or {})
            system.setdefault("worker_niceness", 0)
            kwargs["_system_config"] = system
        ray.init(num_cpus=num_cpus, **kwargs)
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
        ingest_offline_files(self.config, printer=self.printer)  # data.offline_files -> <run dir>/offline/
        prompts = load_train_prompts(self.config.data)

        import ray

        started = init_ray(self.config)
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
