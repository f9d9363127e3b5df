"""The one training loop and the machinery every trainer mode shares.

A trainer owns the prompt dispatcher, the rollout workers (Ray actors), the
replay buffer (the Ray transfer queue in every mode) and the learner group,
and knows the current policy version. :meth:`BaseTrainer.run_loop` is the only
training loop; a mode supplies one step hook, :meth:`training_step` (sync:
generate a batch, then train on it; separate_async: wait for the next batch
the rollout workers made, then train on it), and a few small hooks around it
(start and end of the run, what an update settles, whether the run is over,
its rollout metrics). Everything after the update -- publishing weights every
``parameter_sync_step`` updates, checkpoints, validation, rollout dumps, the
audit trail, reward-failure accounting and the metrics -- is shared, so both
modes log the same metric keys with the same meaning.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from omnirl_async.actors.prompt_dispatcher import PromptDispatcher
from omnirl_async.actors.rollout_worker import RolloutWorker
from omnirl_async.actors.ticket_layout import run_progress
from omnirl_async.buffer import make_replay_buffer
from omnirl_async.buffer.base import SampledBatch
from omnirl_async.learners.learner_group import LearnerGroup
from omnirl_async.metrics import (Timer, Tracking, compute_data_metrics, compute_staleness_metrics,
                                  compute_throughput_metrics, compute_timing_metrics)
from omnirl_async.placement import Placements, driver_node_options
from omnirl_async.protocol import WeightsInfo
from omnirl_async.rewards.worker_pool import make_reward_actors
from omnirl_async.trainer.checkpoint import CheckpointManager, load_state, save_state
from omnirl_async.trainer.failures import FailureMonitor
from omnirl_async.trainer.offline_mix import OfflineData, group_schedule, learner_inputs
from omnirl_async.trainer.reports import RunReports
from omnirl_async.trainer.run_dir import config_dict, wandb_resume_id, write_wandb_run_id
from omnirl_async.trainer.trained_log import FILE_NAME as TRAINED_LOG_FILE
from omnirl_async.trainer.trained_log import TrainedLog
from omnirl_async.waits import bounded_get

__all__ = ["BaseTrainer", "PreparedUpdate", "StepResult"]


@dataclass
class PreparedUpdate:
    """A sampled batch made ready for the learners (:meth:`BaseTrainer.prepare_update`)."""

    batch: SampledBatch
    fields: Any = None                                       # staged learner inputs; None for an empty batch
    group_ids: list[str] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)    # metrics of the offline share


@dataclass
class StepResult:
    """What a mode's :meth:`BaseTrainer.training_step` hands back to the loop."""

    batch: SampledBatch                                      # what the learner trained on (may be empty)
    metrics: dict[str, float] = field(default_factory=dict)  # the learner's metrics


class BaseTrainer(RunReports):
    def __init__(self, config, prompts: list[str], *, printer=print):
        self.config = config
        self.printer = printer
        # roles reserved in placement groups at their first actor (bounded by ray_kwargs.placement_timeout_s)
        self.placements = Placements(config, printer=printer)
        # _validator: with sample_source=offline, one worker actor for validation, started when needed
        self.workers, self.reward_actors, self._validator = [], [], None
        try:
            self._setup(config, prompts, printer)
        except BaseException:
            self._release_partial_setup()
            raise

    def _release_partial_setup(self) -> None:
        """Setup failed midway: free what it had started. Placement groups outlive their handles (on a
        cluster they would stay reserved until Ray stops), actors are killed rather than left to refcounting."""
        import ray

        for name, close in (("learners", "stop"), ("buffer", "close")):
            part = getattr(self, name, None)
            if part is not None:
                try:
                    getattr(part, close)()
                except Exception as exc:  # noqa: BLE001 - the setup error is the one to raise
                    self.printer(f"while releasing a failed setup: {name}.{close}() raised {exc!r}")
        for actor in self.workers + self.reward_actors + [getattr(self, "dispatcher", None)]:
            if isinstance(actor, ray.actor.ActorHandle):  # sync keeps its dispatcher in the driver
                ray.kill(actor)
        self.placements.remove_all()

    def _setup(self, config, prompts: list[str], printer) -> None:
        aro = config.actor_rollout_ref
        self.n = aro.rollout.n
        self.prompts = prompts
        # offline pairs take the place of some groups (batch_prompts: the first update's; a tapered share hands
        # them back along the run)
        self.group_schedule = group_schedule(config)
        self.batch_prompts = self.group_schedule.at(0)
        if not self.group_schedule.fixed:  # the run's length in updates sizes a tapered share's steps
            self.group_schedule = dataclasses.replace(self.group_schedule, total_steps=self.total_steps())
        self.dispatcher = self.make_dispatcher(prompts)
        self.buffer = self.make_buffer()
        # offline preference pairs: mixed into each batch, or (sample_source=offline) trained alone, no rollouts
        self.offline = OfflineData(config, self.buffer, schedule=self.group_schedule, printer=printer)
        self.reward_actors = [] if self.offline.only else make_reward_actors(  # [] = score inline
            config.reward, timeout_s=config.trainer.wait_timeout_s,
            placement=lambda i: self.placements.options("reward", i))
        self.workers = [self.make_worker(i) for i in range(0 if self.offline.only else aro.rollout.num_workers)]
        self.learners = self.make_learners()
        self._await_workers_started(float(config.trainer.wait_timeout_s))
        self.version = 0
        self.global_step = 0
        self.ckpt = CheckpointManager(config.trainer.default_local_dir,
                                      max_to_keep=config.trainer.max_actor_ckpt_to_keep)
        self.tracking = Tracking(config.trainer, printer=printer, config=config_dict(config),
                                 wandb_id=wandb_resume_id(config))
        if self.tracking.wandb_run is not None:
            write_wandb_run_id(config, self.tracking.wandb_run.id)
        self.weight_bytes = 0
        self._val_prompts: list[str] | None = None
        self.wait_timeout_s = float(config.trainer.wait_timeout_s)
        self.monitor = FailureMonitor(config.reward, printer=printer)
        self.trained = TrainedLog(config.trainer.default_local_dir)
        self.resumed_from: Path | None = None
        self.empty_steps = 0
        self.last_metrics: dict[str, float] = {}
        self.sync_step = self.updates_per_version()
        self.all_staleness: list[np.ndarray] = []
        self.learner_busy_s = 0.0
        self.deadline: float | None = None  # monotonic end of `trainer.total_time_minutes`, set by run_loop
        self.trained_s_before = 0.0  # training time of the run before this process (restored from a checkpoint)
        self.loop_started: float | None = None  # monotonic start of this process's run_loop

    def _await_workers_started(self, timeout_s: float) -> None:
        import ray

        try:
            ray.get([w.assert_healthy.remote() for w in self.workers], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{len(self.workers)} rollout workers did not start within `trainer.wait_timeout_s` = "
                               f"{timeout_s:g} s: Ray may lack the CPUs/GPUs they ask for "
                               "(`actor_rollout_ref.rollout.num_cpus_per_worker`, `num_gpus_per_worker`; see "
                               "`ray status`), or loading the model is slow") from None

    # ------------------------------------------------------------------ construction (overridable)
    def sampler_config(self):
        """``trainer.v1.sampler`` as this mode applies it (sync: threshold 0)."""
        return self.config.trainer.v1.sampler

    def dispatcher_kwargs(self) -> dict:
        aro = self.config.actor_rollout_ref
        return dict(n=self.n, shuffle=self.config.data.shuffle, data_seed=self.config.data.seed,
                    rollout_seed=aro.rollout.seed, total_epochs=self.config.trainer.total_epochs,
                    negative_prompt=aro.rollout.pipeline.negative_prompt or None, batch_groups=self.batch_prompts)

    def make_dispatcher(self, prompts: list[str]):
        return PromptDispatcher(prompts, **self.dispatcher_kwargs())

    def make_buffer(self):
        return make_replay_buffer(self.config.buffer, self.sampler_config(), self.config.transfer_queue,
                                  use_ray=True, seed=self.config.data.seed, **self.buffer_actor_options())

    def buffer_actor_options(self) -> dict:
        """Where the transfer queue runs: storage units by ``ray_kwargs.role_resources.storage``, the controller
        (it writes and reads the buffer snapshots of checkpoints) on the driver's node."""
        return dict(unit_options=lambda i: self.placements.options("storage", i),
                    controller_options=driver_node_options())

    def updates_per_version(self) -> int:
        """Learner updates between weight publications (``parameter_sync_step``; sync: every update)."""
        return 1

    def make_learners(self) -> LearnerGroup:
        """The learner group (``learner.num_workers`` Ray actors); ``benchmarks/bench_scale.py`` stands in its own."""
        return LearnerGroup(self.config, use_ray=True,
                            num_threads=max(1, int(self.config.learner.num_cpus_per_worker)))

    def make_worker(self, index: int, **options):
        import ray

        ro = self.config.actor_rollout_ref.rollout
        # bundle `index` of the rollout placement group (offline-only runs place one worker, for validation)
        placed = self.placements.options("rollout", index, count=1 if self.offline.only else None)
        cls = ray.remote(**placed, **options)(RolloutWorker)
        return cls.remote(self.config, worker_index=index, num_threads=max(1, int(ro.num_cpus_per_worker)),
                          reward_actors=self.reward_actors)

    def dcall(self, method: str, *args, **kwargs):
        """Call the dispatcher, in-process or as a Ray actor."""
        if isinstance(self.dispatcher, PromptDispatcher):
            return getattr(self.dispatcher, method)(*args, **kwargs)
        return bounded_get(getattr(self.dispatcher, method).remote(*args, **kwargs), self.wait_timeout_s,
                           f"the prompt dispatcher's `{method}`",
                           "Its calls answer at once: the dispatcher actor is alive but stuck, or its process is "
                           "starved of CPU (`py-spy dump --pid <pid>` on it; see `ray list actors`).")

    # ------------------------------------------------------------------ weights
    def publish_weights(self) -> dict[str, float]:
        """Put the learner's weights into the object store once; every worker installs them."""
        import ray

        t0 = time.perf_counter()
        weights = self.learners.get_weights()
        info = WeightsInfo(version=self.version, num_bytes=int(sum(v.nbytes for v in weights.values())),
                           is_lora=self.config.actor_rollout_ref.model.lora_rank > 0,
                           adapter_versions=self.learners.adapter_versions())
        ref = ray.put(weights)
        try:
            ray.get([w.set_weights.remote(info.version, ref) for w in self.workers], timeout=self.wait_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"rollout workers did not install weights version {info.version} "
                               f"({info.num_bytes} bytes) within `trainer.wait_timeout_s` = {self.wait_timeout_s:g} "
                               "s; a worker may be stuck in a reward call or out of memory") from None
        self.weight_bytes = info.num_bytes
        return {"timing_s/update_weights": time.perf_counter() - t0,
                "perf/weight_sync_bytes": float(info.num_bytes)}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        tmp = self.ckpt.begin(self.global_step)
        self.learners.save_lora(str(tmp / "lora"))
        save_state(self.learners.get_state(), tmp, "learner")
        save_state({"global_step": self.global_step, "version": self.version, "empty_steps": self.empty_steps,
                    "trained_s": self.trained_s(), "dispatcher": self.dispatcher_state()}, tmp, "trainer")
        if self.config.buffer.snapshot_with_checkpoint:
            self.buffer.snapshot(str(tmp / "buffer"))
        return self.ckpt.commit(tmp, self.global_step)

    def dispatcher_state(self) -> dict:
        """The dispatcher's state for a checkpoint."""
        return self.dcall("get_state")

    def find_checkpoint(self) -> Path | None:
        """The checkpoint to resume from: the newest one whose manifest verifies (damaged ones are named)."""
        tcfg = self.config.trainer
        if tcfg.resume_mode == "disable":
            return None
        if tcfg.resume_mode == "resume_path":
            from omnirl_async.trainer.checkpoint import verify_or_raise

            return verify_or_raise(Path(tcfg.resume_from_path))
        return self.ckpt.latest_verified(report=self.printer)

    def maybe_resume(self) -> bool:
        """Restore learner, driver, prompt cursor and buffer from a checkpoint; ``fit`` then publishes once."""
        folder = self.find_checkpoint()
        if folder is None:
            if self.config.trainer.resume_mode == "disable":
                moved = self.ckpt.set_aside(extra=(TRAINED_LOG_FILE,))
                if moved is not None:
                    self.printer(f"trainer.resume_mode=disable starts a fresh run: the earlier run's checkpoints "
                                 f"in {self.ckpt.root} were moved to {moved} (kept, never mixed with this run's)")
            return False
        self.learners.set_state(load_state(folder, "learner"))
        state = load_state(folder, "trainer")
        self.global_step, self.version = int(state["global_step"]), int(state["version"])
        self.empty_steps = int(state.get("empty_steps", 0))
        self.trained_s_before = float(state.get("trained_s", 0.0))  # absent in checkpoints of older versions
        restored = (folder / "buffer").is_dir()
        if restored:
            self.buffer.restore(str(folder / "buffer"))
        redo = self.dcall("set_state", state["dispatcher"], samples_restored=restored)
        self.trained.resumed(self.global_step)
        self.resumed_from = folder
        self.printer(f"resumed from {folder} at step {self.global_step} (policy version {self.version})"
                     + (f"; {redo} admitted groups not yet trained are generated again" if redo else ""))
        return True

    def last_checkpoint_text(self) -> str:
        try:
            latest = self.ckpt.latest_verified()
        except Exception:  # noqa: BLE001 - only for a message
            latest = None
        if latest is None:
            return "no checkpoint was written yet (set `trainer.save_freq` to checkpoint during training)"
        return f"the last complete checkpoint is {latest}; rerun with `trainer.resume_mode=auto` to continue from it"

    # ------------------------------------------------------------------ run (template)
    def fit(self) -> dict:
        """Run the mode's loop; a learner that died is reported once, with the checkpoint to resume from."""
        from omnirl_async.learners.learner import NonFiniteError
        from omnirl_async.learners.learner_group import LearnerDiedError

        try:
            return self.run_loop()
        except LearnerDiedError as err:
            raise err.extended(self.last_checkpoint_text()) from None
        except NonFiniteError as err:
            raise NonFiniteError(f"{err}\n{self.last_checkpoint_text()}", quantity=err.quantity, step=err.step,
                                 count=err.count) from None

    # ------------------------------------------------------------------ the loop
    def run_loop(self) -> dict:
        tcfg = self.config.trainer
        # ---- set-up: publish the current version once (0, or the restored one), validate, start the mode
        self.start_run()
        if tcfg.val_before_train:
            self.tracking.log(self.validate(), self.global_step)
        self.on_run_start()
        bar = tqdm(total=None if tcfg.total_time_minutes else self.total_steps(), initial=self.global_step,
                   desc=self.progress_label(), unit="step", disable=not tcfg.progress_bar, dynamic_ncols=True)
        self.loop_started = time.monotonic()
        self.deadline = (self.loop_started + 60.0 * tcfg.total_time_minutes - self.trained_s_before
                         if tcfg.total_time_minutes else None)
        cap = int(tcfg.total_training_steps) if tcfg.total_training_steps else None
        if self.past_deadline():
            self.printer(f"`trainer.total_time_minutes` = {tcfg.total_time_minutes:g} is used up: the run trained "
                         f"{self.trained_s_before / 60:.1f} min before this resume (the budget counts across "
                         "resumes); raise it to train longer")
            cap = self.global_step
        t_run = time.perf_counter()
        try:
            while cap is None or self.global_step < cap:
                timer = Timer()
                t_step = time.perf_counter()
                # ---- 1. the mode's step: this update's samples, then the update
                step = self.take_step(timer)
                if step is None:
                    break  # every prompt of the run has been trained
                self.learner_busy_s += timer.times.get("update_actor", 0.0)
                self.global_step += 1
                metrics = dict(step.metrics)
                # ---- 2. publish v+1 every `parameter_sync_step` updates
                if self.global_step % self.sync_step == 0:
                    self.version += 1
                    metrics.update(self.publish_weights())
                    timer.times["update_weights"] = metrics.pop("timing_s/update_weights")
                else:
                    self.dcall("on_update", self.global_step, self.time_progress())
                self.after_update()
                # ---- 3. save, validate, dump (an update started already is trained first: see update_in_flight)
                done = ((cap is not None and self.global_step >= cap) or self.finished()
                        or (self.past_deadline() and not self.update_in_flight()))
                if self.should_save(done):
                    with timer("save_checkpoint"):
                        self.save_checkpoint()
                if self.should_validate(done):
                    with timer("testing"):
                        metrics.update(self.validate())
                        self.log_rollout_samples(step.batch)
                self.dump_rollout(step.batch)
                timer.times["step"] = time.perf_counter() - t_step
                # ---- 4. metrics: the same keys, with the same meaning, in every mode
                metrics = self.step_metrics(metrics, step.batch, timer, time.perf_counter() - t_run)
                self.tracking.log(metrics, self.global_step)
                bar.set_description_str(self.progress_label(), refresh=False)  # auto's threshold moves
                bar.update(1)
                bar.set_postfix(reward=f"{metrics.get('critic/rewards/mean', float('nan')):.3f}",
                                lag=f"{metrics.get('training/off_policy/trajectory_staleness/max', 0):.0f}")
                if done:
                    break
        finally:
            bar.close()
            self.on_run_end()
        self.monitor.check_run()  # a short run whose rewards failed fails, with the reasons (its checkpoints stay)
        return self.summary()

    def start_run(self) -> None:
        """Publish the current version (0, or the restored one) once and start counting failures."""
        self.publish_weights()
        self.offline.fill()  # the run's offline store into the offline table (only pairs it lacks)
        self.monitor.reset(self.buffer.metrics())

    def step_metrics(self, metrics: dict[str, float], batch: SampledBatch, timer: Timer,
                     run_s: float) -> dict[str, float]:
        """Every step's metrics (VeRL-Omni names), and the bookkeeping that goes with them."""
        for phase in ("gen", "sample", "sample_ahead", "update_ahead"):  # the same timing keys in every mode and step
            timer.times.setdefault(phase, 0.0)
        staleness = np.asarray(batch.info.get("staleness", np.zeros(len(batch))))
        self.all_staleness.append(staleness)
        # each sample's lag, one bucket per version (`omnirl-async report` draws the run's histogram from it)
        self.tracking.log_histogram("training/off_policy/trajectory_staleness", staleness, self.global_step)
        extras = {k[len("extra."):].replace(".", "/"): v for k, v in batch.fields.items() if k.startswith("extra.")}
        if len(batch):
            metrics.update(compute_data_metrics(batch.fields["rewards"], None, extras))
        metrics.update(compute_timing_metrics(timer.times, len(batch)))
        # perf/throughput: every row trained, the offline ones beside the batch too (an offline-only step has only
        # those); perf/total_num_samples: the online samples
        metrics.update(compute_throughput_metrics(len(batch), timer.times["step"],
                                                  int(metrics.get("training/offline_samples", 0))))
        metrics.update(compute_staleness_metrics(staleness))
        buf = self.buffer.metrics()
        metrics.update({f"buffer/{k.split('/', 1)[-1]}": v for k, v in buf.items() if not isinstance(v, (list, tuple))})
        metrics["training/off_policy/dropped_samples"] = float(buf.get("buffer/dropped_stale", 0.0))
        metrics["training/off_policy/threshold"] = float(self.sampler_config().max_off_policy_threshold)  # now
        metrics["perf/learner_idle_frac"] = 1.0 - self.learner_busy_s / max(1e-9, run_s)
        metrics.update(self.rollout_metrics())
        metrics["training/global_step"] = float(self.global_step)
        metrics["training/policy_version"] = float(self.version)
        metrics["training/epoch"] = float(self.dcall("epoch_now"))
        # audit trail, trained tickets, reward failures (raises past `reward.max_failed_frac`)
        self.trained.step(self.global_step, self.version, batch.metas)
        if len(batch):
            self.dcall("mark_trained", [m.tags.ticket for m in batch.metas])
        metrics.update(self.monitor.observe(buf))
        metrics["training/empty_steps"] = float(self.empty_steps)
        self.last_metrics = dict(metrics)
        return metrics

    # ------------------------------------------------------------------ mode hooks
    def training_step(self, timer: Timer) -> StepResult | None:
        """Produce this update's batch and run the update; None when no prompt is left."""
        raise NotImplementedError

    def on_run_start(self) -> None:
        """After the first publish (separate_async starts its rollout loops here)."""

    def on_run_end(self) -> None:
        """Always called when the loop ends, also on an error."""

    def after_update(self) -> None:
        """Bookkeeping once an update is done (which tickets are settled)."""

    def run_finished(self) -> bool:
        """No prompt is left and everything admitted has been trained."""
        raise NotImplementedError

    def rollout_metrics(self) -> dict[str, float]:
        """``perf/rollout_idle_frac``, ``rollout/samples_generated``, ``rollout/gen_s_per_sample``,
        ``rollout/min_worker_version``, ``timing_s/reward``, ``timing_s/put`` (handing the groups to the buffer
        until admitted and their prompts reported done)."""
        raise NotImplementedError

    def progress_label(self) -> str:
        return type(self).__name__

    def take_step(self, timer: Timer) -> StepResult | None:
        """The mode's :meth:`training_step`, or with ``algorithm.sample_source=offline`` an update on offline rows.

        An offline-only step hands the loop an empty online batch: no rollout metrics, staleness or audit
        entries come from offline rows (the learner's metrics say what it trained on)."""
        if not self.offline.only:
            return self.training_step(timer)
        with timer("sample"):
            offline = self.offline.batch(self.version)
        with timer("update_actor"):
            fields, group_ids = learner_inputs(SampledBatch(metas=[], fields={}), offline)
            metrics = self.learners.update(fields, group_ids, self.schedule_progress())
        metrics["training/offline_samples"] = float(len(offline))
        return StepResult(batch=SampledBatch(metas=[], fields={}), metrics=metrics)

    def past_deadline(self) -> bool:
        """``trainer.total_time_minutes`` is up (never without it)."""
        return self.deadline is not None and time.monotonic() > self.deadline

    def trained_s(self) -> float:
        """Training time of the run so far (seconds in :meth:`run_loop`, across resumes)."""
        now = time.monotonic() - self.loop_started if self.loop_started is not None else 0.0
        return self.trained_s_before + now

    def schedule_progress(self, update: int | None = None) -> float:
        """The fraction of the run done when update ``update`` (0-based; default: the next one) starts, for a
        cosine learning rate without ``optim.total_training_steps`` and a tapered offline share: updates after
        warm-up of :meth:`total_steps`, or training time of ``trainer.total_time_minutes`` so far, whichever is
        further along (the run ends at the first)."""
        warmup = int(self.config.actor_rollout_ref.actor.optim.lr_warmup_steps)
        return run_progress(self.global_step if update is None else update, warmup=warmup,
                            total_steps=self.total_steps(), time_progress=self.time_progress())

    def time_progress(self) -> float:
        """Training time so far as a share of ``trainer.total_time_minutes`` (0 without a time budget)."""
        minutes = self.config.trainer.total_time_minutes
        return self.trained_s() / (60.0 * minutes) if minutes else 0.0

    def online_groups(self, update: int) -> int:
        """Online prompt groups update ``update`` (0-based) trains: ``data.train_batch_size``, less those an
        offline share takes the place of (:func:`~omnirl_async.trainer.offline_mix.group_schedule`)."""
        return self.group_schedule.at(update, self.time_progress())

    def update_in_flight(self) -> bool:
        """An update started ahead of its step (separate_async starts one as soon as the last one ends) is still
        to be trained and counted, so the run cannot end before it."""
        return False

    def learner_read_after(self, step: int) -> bool:
        """Whether the loop reads the learners' state once update ``step`` is done, before the next update may
        start: a checkpoint or validation is due at ``step`` (the run's end is not known in advance)."""
        return self.should_save(False, step) or self.should_validate(False, step)

    def finished(self) -> bool:
        """The mode's :meth:`run_finished`; an offline-only run ends after its passes over the offline table."""
        if self.offline.only:
            return self.global_step >= self.total_steps()
        return self.run_finished()

    def prepare_update(self, batch: SampledBatch, version: int, update: int | None = None) -> PreparedUpdate:
        """What the learners train on for ``batch`` at policy ``version``: plus its offline share with
        ``buffer.offline_mix_ratio`` > 0 at the share of ``update`` (0-based; default: the next one), staged in
        the object store (separate_async does this an update ahead)."""
        if len(batch) == 0:
            return PreparedUpdate(batch)
        fields, group_ids, extra = self.offline.mix(batch, version, self.schedule_progress(update))
        return PreparedUpdate(batch, self.learners.stage(fields), group_ids, extra)

    def update_learner(self, batch) -> dict[str, float]:
        """One learner update on ``batch`` (see :meth:`prepare_update`); an empty batch (all of its groups
        failed) is an empty step."""
        prepared = self.prepare_update(batch, self.version)
        pending = self.start_update(prepared)
        return {} if pending is None else {**pending.result(), **prepared.extra}

    def start_update(self, prepared: PreparedUpdate):
        """Start the learners on ``prepared``; a :class:`~omnirl_async.learners.learner_group.PendingUpdate`, or
        None for an empty batch (counted as an empty step)."""
        if prepared.fields is None:
            self.empty_steps += 1
            return None
        return self.learners.start_update(prepared.fields, prepared.group_ids, self.schedule_progress())

    # ------------------------------------------------------------------ run control
    def total_steps(self) -> int:
        """Steps of the run: ``total_training_steps``, or enough batches for ``total_epochs`` passes.

        Batches run across epoch boundaries (the last prompts of an epoch share
        a batch with the first of the next), so a prompt count that the batch
        does not divide costs no prompt; only the very last batch of the run
        may be smaller. With a tapered offline share the updates differ in
        size and the count is that of their mean (an estimate: the run ends
        when its prompts are used up).
        """
        tcfg = self.config.trainer
        if self.config.algorithm.sample_source == "offline":
            return self.offline.total_steps(tcfg.total_training_steps, tcfg.total_epochs)
        if tcfg.total_training_steps:
            return int(tcfg.total_training_steps)
        return int(np.ceil(len(self.prompts) * tcfg.total_epochs / self.group_schedule.mean_groups()))

    def should_save(self, done: bool, step: int | None = None) -> bool:
        """Checkpoint after update ``step`` (default: the one just done)?"""
        freq = self.config.trainer.save_freq
        step = self.global_step if step is None else step
        return done or (freq > 0 and step % freq == 0)

    def stop(self) -> None:
        import ray

        self.tracking.close()
        try:
            self.learners.stop()
        finally:
            for w in self.workers + self.reward_actors + ([self._validator] if self._validator else []):
                ray.kill(w)
            self.workers, self.reward_actors, self._validator = [], [], None
            self.buffer.close()
            self.placements.remove_all()

    def summary(self) -> dict[str, Any]:
        out = {"global_step": self.global_step, "version": self.version, "empty_steps": self.empty_steps,
               "log_dir": os.fspath(self.tracking.log_dir), "checkpoint_dir": os.fspath(self.ckpt.root),
               "trained_log": os.fspath(self.trained.path)}
        out.update(self.monitor.summary())
        return out
