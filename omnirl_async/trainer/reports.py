"""What the loop shows of a run besides its metrics: validation images, trained samples, rollout dumps.

:class:`RunReports` is a part of :class:`~omnirl_async.trainer.base.BaseTrainer`
(its base class), kept in a module of its own; it reads the trainer's
``config``, ``tracking``, ``global_step``, ``version``, ``workers``,
``learners``, ``n`` and ``wait_timeout_s`` and starts a worker with its
``make_worker`` where a run has none (``algorithm.sample_source=offline``).
"""

from __future__ import annotations

from pathlib import Path

from omnirl_async.buffer.base import SampledBatch
from omnirl_async.waits import bounded_get

__all__ = ["RunReports"]


class RunReports:
    """Validation (``trainer.test_freq``), trained samples to the image loggers, rollout grids
    (``trainer.rollout_data_save_freq``)."""

    def should_validate(self, done: bool, step: int | None = None) -> bool:
        """Validate after update ``step`` (default: the one just done)?"""
        freq = self.config.trainer.test_freq
        step = self.global_step if step is None else step
        return freq > 0 and (done or step % freq == 0)

    def validate(self) -> dict[str, float]:
        """Score the validation prompts on rollout worker 0 (it holds the newest weights)."""
        from omnirl_async.data.prompts import load_val_prompts
        from omnirl_async.models.evaluate import save_grid

        if self._val_prompts is None:
            self._val_prompts = load_val_prompts(self.config.data, self.config.data.val_max_samples)
        n, limit = len(self._val_prompts), self.config.reward.timeout_s
        reward = ("a reward call hangs (`reward.timeout_s` is unset: set it to bound each call)" if limit is None
                  else f"the worker is stuck (each reward call is bounded by `reward.timeout_s` = {limit:g} s)")
        what = f"step {self.global_step}: validation of {n} prompts on rollout worker 0"
        out = bounded_get(self.validation_worker().validate.remote(self._val_prompts, seed=self.config.data.seed),
                          self.wait_timeout_s, what,
                          f"Likely causes: {reward}, or the worker ran out of memory; raise `trainer.wait_timeout_s` "
                          "if validation is just slow (fewer prompts: `data.val_max_samples`; images per prompt: "
                          "`actor_rollout_ref.rollout.val_kwargs.n`).")
        if out.get("failures"):
            self.printer(f"step {self.global_step}: validation: {out['failures']}")
        cap = self.config.trainer.validation_data_max_samples or 32
        strict = out["strict"][:cap] > 0.5 if out["strict"] is not None else None
        title = f"step {self.global_step} strict={out['metrics'].get('val/strict', 0):.3f}"
        grid = save_grid(out["images"][:cap], out["prompts"][:cap],
                         Path(self.config.trainer.default_local_dir) / "validation" / f"step_{self.global_step}.png",
                         marks=strict, title=title)
        prompts = out["prompts"][:cap]
        marks = ["pass " if ok else "fail " for ok in strict] if strict is not None else [""] * len(prompts)
        self.tracking.log_images("val/images", [grid], self.global_step, captions=[title],
                                 text="\n".join(f"- {m}{p}" for m, p in zip(marks, prompts)))
        return out["metrics"]

    def validation_worker(self):
        """Rollout worker 0 (it holds the newest weights); with ``algorithm.sample_source=offline``, which starts
        no rollout workers, one worker actor started at the first validation, given the learner's weights."""
        import ray

        if self.workers:
            return self.workers[0]
        if self._validator is None:
            self._validator = self.make_worker(0)
        bounded_get(self._validator.set_weights.remote(self.version, ray.put(self.learners.get_weights())),
                    self.wait_timeout_s, f"the validation worker, installing weights version {self.version},",
                    "It may still be loading the model, or Ray lacks the CPUs/GPUs it asks for (see `ray status`).")
        return self._validator

    def log_rollout_samples(self, batch: SampledBatch, num: int = 8) -> None:
        """A few of this step's trained samples, with their prompts and rewards, to the image loggers."""
        if not len(batch):
            return
        k = min(num, len(batch))
        rewards = batch.fields["rewards"][:k]
        captions = [f"reward {r:.3f}: {m.tags.prompt}" for m, r in zip(batch.metas[:k], rewards)]
        self.tracking.log_images("rollout/samples", list(batch.fields["images"][:k]), self.global_step,
                                 captions=captions)

    def dump_rollout(self, batch: SampledBatch) -> None:
        """Every ``rollout_data_save_freq`` steps, a grid of this step's trained samples with their rewards."""
        tcfg = self.config.trainer
        if tcfg.rollout_data_save_freq <= 0 or self.global_step % tcfg.rollout_data_save_freq or not len(batch):
            return
        from omnirl_async.models.evaluate import save_grid

        images, rewards = batch.fields["images"], batch.fields["rewards"]
        cap = tcfg.rollout_data_max_samples or len(images)
        captions = [f"{r:.2f} {m.tags.prompt}" for m, r in zip(batch.metas[:cap], rewards[:cap])]
        save_grid(images[:cap], captions, Path(tcfg.default_local_dir) / "rollout_data" / f"step_{self.global_step}.png",
                  cols=self.n)
