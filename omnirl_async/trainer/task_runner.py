"""From a validated config to a finished run: Ray start-up, prompts, mode dispatch, shutdown."""

from __future__ import annotations

import os

from omnirl_async.data.prompts import heldout_prompts, read_prompt_rows, train_prompts

__all__ = ["TaskRunner", "load_train_prompts", "load_val_prompts", "read_prompt_files", "init_ray"]


def load_train_prompts(data_cfg) -> list[str]:
    files = data_cfg.train_files
    if files is None:
        return train_prompts()
    files = [files] if isinstance(files, str) else list(files)
    return read_prompt_files(files, data_cfg.prompt_key, "data.train_files")


def read_prompt_files(files: list[str], prompt_key: str, what: str) -> list[str]:
    """Prompts from .jsonl (field ``prompt_key``) or .txt files; a row without it is an error naming file:line."""
    prompts: list[str] = []
    for f in files:
        path = os.path.expanduser(f)
        if prompt_key == "prompt" or path.endswith(".txt"):
            prompts.extend(row["prompt"] for row in read_prompt_rows(path))
            continue
        import json

        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg}).") from None
                if not isinstance(row, dict) or not isinstance(row.get(prompt_key), str):
                    raise ValueError(f"{path}:{lineno}: row has no string {prompt_key!r} field "
                                     f"(`data.prompt_key` = {prompt_key!r}).")
                prompts.append(row[prompt_key])
    if not prompts:
        raise ValueError(f"`{what}` = {files!r} holds no prompts.")
    return prompts


def load_val_prompts(data_cfg, limit: int | None) -> list[str]:
    """Validation prompts: ``data.val_files`` or the embedded held-out shapes prompts, capped at ``limit``."""
    files = data_cfg.val_files
    if files is None:
        prompts = heldout_prompts()
    else:
        files = [files] if isinstance(files, str) else list(files)
        prompts = read_prompt_files(files, data_cfg.prompt_key, "data.val_files")
    return prompts[:limit] if limit else prompts


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
        import ray

        started = init_ray(self.config)
        try:
            prompts = load_train_prompts(self.config.data)
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
