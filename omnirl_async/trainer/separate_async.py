"""``trainer.v1.trainer_mode=separate_async``: rollout and learning at the same time.

Rollout workers run :meth:`RolloutWorker.run_loop` continuously: lease a
prompt (admission control decides whether it may start, given the newest
published version), then take that version's weights if newer than the
installed ones (only between requests; a refused worker pulls nothing), generate, score, put
the group into the Ray replay buffer, complete the lease. The driver runs the
learner: wait for the next batch, sample it, update, and every
``parameter_sync_step`` updates publish version ``v+1`` through the
:class:`~omnirl_async.learners.weight_store.WeightStore`.

Staleness (``trainer.v1.sampler``):

* ``wait`` – tickets (see :mod:`omnirl_async.actors.staleness`): update ``u``
  waits until every ticket below ``(u+1)*B`` is done and then trains exactly
  the groups of tickets ``[u*B, (u+1)*B)`` that reached the buffer, so no
  trained sample ever lags by more than ``max_off_policy_threshold`` and
  nothing is dropped. A group whose reward failed leaves its ticket's slot
  empty (a smaller batch; with ``drop_incomplete_groups`` it is generated
  again under a new ticket), so failures never stall admission, and the last
  batch of the run is simply the tickets that are left;
* ``drop`` – workers run ahead freely; the buffer evicts stale groups (counted
  in ``training/off_policy/dropped_samples``); the learner takes ``B`` groups'
  worth of fresh samples, or what is left when the prompts are used up.

With ``max_off_policy_threshold: auto`` a
:class:`~omnirl_async.trainer.auto_threshold.ThresholdController` moves the
threshold within ``[auto.min, auto.max]`` every ``auto.window`` updates, from
the learner's and the workers' idle time, the samples dropped stale and the
learner's ``rollout_corr/kl`` / ``rollout_corr/ess``; admission applies a new
value to the next lease, and samples already admitted keep their own bound.
Each decision is logged (``training/off_policy/threshold``,
``training/off_policy/auto/*``) and the run summary prints them.

Every wait of the driver is bounded by ``trainer.wait_timeout_s`` and its
error says what was awaited and what the dispatcher and buffer held. Reward
failures are counted per kind and stop the job past ``reward.max_failed_frac``
(:mod:`omnirl_async.trainer.failures`).

A worker that dies has its leases returned (or completed, when its group had
already reached the buffer) and is replaced, so every prompt of an epoch is
trained exactly once. Checkpoints quiesce the workers first (pause leasing,
let in-flight groups land) so that the buffer snapshot and the prompt cursor
agree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from typing import Any

import numpy as np

from omnirl_async import staleness as rule
from omnirl_async.actors.prompt_dispatcher import PromptDispatcher
from omnirl_async.actors.staleness import AdmissionController
from omnirl_async.actors.ticket_layout import TicketLayout
from omnirl_async.buffer import SampledBatch, make_replay_buffer
from omnirl_async.buffer.base import concat_batches
from omnirl_async.config.trainer import AUTO
from omnirl_async.learners.weight_store import WeightStore
from omnirl_async.metrics import Timer
from omnirl_async.trainer.auto_threshold import StepSignals, ThresholdController
from omnirl_async.trainer.base import BaseTrainer, PreparedUpdate, StepResult
from omnirl_async.waits import bounded_get

__all__ = ["SeparateAsyncTrainer"]


class SeparateAsyncTrainer(BaseTrainer):
    poll_s = 0.02
    #: sample (and stage) the next batch while an update runs, when it is ready (:meth:`sample_ahead`)
    sample_ahead_enabled = True
    _ahead: PreparedUpdate | None = None
    #: start the next update as soon as this one ends when its batch is staged already (:meth:`start_next_early`),
    #: so that publishing, metrics and the audit trail of this step run while the learners train the next one
    back_to_back_enabled = True
    #: (the batch, the update running on it, when it was started), started by :meth:`start_next_early`
    _started: tuple[PreparedUpdate, Any, float] | None = None
    #: rank 0 publishing the weights of the update just done, started ahead of the next update
    _publishing: tuple[int, Any] | None = None
    #: ``wait``: while the next update's groups are still landing, take those done at most this often (seconds), so
    #: that fetching their payloads overlaps the running update (or the wait) instead of following the last group.
    #: None (the default): off - measured slower in benchmarks/bench_scale.py (``N:land`` vs ``N``, README), because
    #: joining the parts copies the whole batch once more after the last group lands
    land_every_s: float | None = None

    def __init__(self, config, prompts, *, printer=print, worker_slowdowns: list[float] | None = None):
        import ray

        v1 = config.trainer.v1
        auto = v1.sampler.max_off_policy_threshold == AUTO
        self.auto = ThresholdController.from_config(v1.sampler.auto) if auto else None
        self.threshold = self.auto.value if auto else v1.sampler.max_off_policy_threshold  # the value of the moment
        # (idle seconds, samples) of all workers at the last step and now, and samples dropped stale: the controller
        # reads what changed in between
        self._rollout_totals = self._rollout_now = (0.0, 0.0)
        self._dropped_total = 0.0
        self.strategy = v1.sampler.max_off_policy_strategy
        self.worker_slowdowns = worker_slowdowns
        self.store = ray.remote(num_cpus=0)(WeightStore).remote(keep=2)
        self._ticket_ranges: dict[int, range] = {}  # update -> its tickets, as the dispatcher laid them out
        super().__init__(config, prompts, printer=printer)
        self.run_refs: dict[int, object] = {}
        self.worker_ids: dict[int, str] = {}
        self.consumed_groups: set[str] = set()
        self._landed: list[SampledBatch] = []  # groups of the next update already taken (``wait``; :meth:`take_landed`)
        self.landed_groups = 0  # how many groups were taken that way, over the run
        self.back_to_back_updates = 0  # updates started by start_next_early, over the run
        self.trained_log: list[tuple[str, str, int, int, int]] = []
        self.replaced_workers = 0
        self.final_worker_stats: list = []
        self.totals_seen: dict[str, float] = {}  # workers' running totals at the last step (:meth:`since_last_step`)

    # ------------------------------------------------------------------ construction
    def updates_per_version(self) -> int:
        return self.config.trainer.v1.separate_async.parameter_sync_step

    def sampler_config(self):
        """``trainer.v1.sampler`` with the threshold as a number (under ``auto``, the one it starts at)."""
        return dataclasses.replace(self.config.trainer.v1.sampler, max_off_policy_threshold=self.threshold)

    def make_dispatcher(self, prompts):
        import ray

        # the tickets of each update: group_schedule's sizes (they change when a tapered offline share hands its
        # rows back to online groups), laid out by admission as it admits
        layout = TicketLayout(self.group_schedule)
        admission = AdmissionController(threshold=self.threshold, layout=layout,
                                        updates_per_version=self.updates_per_version(), strategy=self.strategy)
        # a thread per rollout loop: a refused lease waits in the dispatcher (RolloutWorker.run_loop's
        # lease_wait_s), and the trainer's own calls must still get through
        return ray.remote(num_cpus=0, max_concurrency=self.lease_waiters() + 8)(PromptDispatcher).remote(
            prompts, admission=admission, **self.dispatcher_kwargs())

    def lease_waiters(self) -> int:
        """How many rollout loops may wait in the dispatcher at once (one per rollout worker)."""
        return int(self.config.actor_rollout_ref.rollout.num_workers)

    def make_buffer(self):
        buffer_cfg = self.config.buffer
        if self.strategy == "wait" and buffer_cfg.sampler == "fifo":
            # FIFO in admission order: the oldest ticket first keeps every lag within the threshold
            buffer_cfg = dataclasses.replace(buffer_cfg, sampler="ticket")
        return make_replay_buffer(buffer_cfg, self.sampler_config(), self.config.transfer_queue,
                                  use_ray=True, seed=self.config.data.seed, **self.buffer_actor_options())

    def make_worker(self, index: int, **options):
        return super().make_worker(index, max_concurrency=2)  # stats() answers while run_loop runs

    # ------------------------------------------------------------------ weights
    def publish_weights(self) -> dict[str, float]:
        t0 = time.perf_counter()
        if self._publishing is not None:  # started before the next update (start_next_early): its reply
            (version, pending), self._publishing = self._publishing, None
            if version != self.version:
                raise RuntimeError(f"weights version {version} was published ahead, but the loop publishes "
                                   f"{self.version} now")
            info = pending.result()
        else:
            info = self.learners.publish(self.store, self.version)
        # announced once the store holds it: leases are admitted at this version and their workers install it
        self.dcall("on_update", self.global_step, self.time_progress(), published_version=info.version)
        return {"timing_s/update_weights": time.perf_counter() - t0,
                "perf/weight_sync_bytes": float(info.num_bytes)}

    # ------------------------------------------------------------------ workers
    def _start_worker(self, i: int) -> None:
        slow = self.worker_slowdowns[i % len(self.worker_slowdowns)] if self.worker_slowdowns else 0.0
        self.worker_ids[i] = f"w{i}.{self.replaced_workers}"
        self.run_refs[i] = self.workers[i].run_loop.remote(
            self.dispatcher, self.store, self.buffer, worker_id=self.worker_ids[i],
            put_timeout=self.config.transfer_queue.put_timeout_s, slowdown_s=slow)

    def check_workers(self) -> None:
        """Replace a dead worker; its leases go back (or complete, if its group already landed).

        Only a dead actor is replaced; an exception raised inside the loop is a
        bug and is re-raised here with its original type.
        """
        import ray

        refs = list(self.run_refs.values())
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for i, ref in list(self.run_refs.items()):
            if ref not in done:
                continue
            try:
                ray.get(ref)
                continue  # finished normally (stopped or exhausted)
            except ray.exceptions.RayActorError as err:
                reason = type(err).__name__
            self._recover_leases(self.worker_ids[i])
            self.printer(f"rollout worker {i} died ({reason}); its leases were returned; starting a replacement")
            self.replaced_workers += 1
            self.workers[i] = self.make_worker(i)
            self._start_worker(i)

    def _recover_leases(self, worker_id: str) -> None:
        """Leases of a dead worker: complete those whose group reached the buffer, release the rest; then the
        groups whose payload it owned (``transfer_queue.producer_owned_payloads``) and that were not trained
        yet are dropped and generated again (``buffer/regenerated_groups``), so none is lost."""
        leases = self.dcall("outstanding", worker_id)
        landed = [x.lease_id for x in leases
                  if x.group_uid in self.consumed_groups or self.buffer.list_keys(group_uid=x.group_uid)]
        if landed:
            self.dcall("complete", landed)
        rest = [x.lease_id for x in leases if x.lease_id not in landed]
        if rest:
            self.dcall("release", rest)
        if self.buffer.drop_producer(worker_id):
            self.requeue_refills()

    # ------------------------------------------------------------------ learner side
    def requeue_refills(self) -> int:
        """Groups the buffer evicted for a failed member (``drop_incomplete_groups``) are generated again."""
        refills = self.buffer.take_refill_requests()
        for r in refills:
            self.dcall("requeue", r.group_uid, r.prompt, r.n, epoch=r.epoch)
        return len(refills)

    def prompts_finished(self) -> bool:
        """No prompt left to lease, none in flight, no refill pending."""
        self.requeue_refills()
        return bool(self.dcall("exhausted")) and not self.dcall("num_outstanding")

    def describe_state(self) -> str:
        """What the dispatcher, the buffer and the workers hold, for timeout messages."""
        buf = self.buffer.metrics()
        failed = {k.rsplit("/", 1)[-1]: int(v) for k, v in buf.items() if k.startswith("buffer/failed/")}
        try:
            dispatcher = self.describe_dispatcher()
        except TimeoutError:  # the dispatcher is what hangs: this message is already the one to read
            dispatcher = "dispatcher: did not answer"
        return (f"{dispatcher}; buffer: "
                f"{int(buf.get('buffer/ready_samples', 0))} ready samples in {int(buf.get('buffer/ready_groups', 0))} "
                f"groups, {int(buf.get('buffer/incomplete_groups', 0))} incomplete groups, "
                f"{int(buf.get('buffer/dropped_stale', 0))} dropped stale, failed samples by kind {failed or 'none'}; "
                f"rollout workers replaced so far: {self.replaced_workers}; learner version {self.version}")

    def describe_dispatcher(self) -> str:
        return (f"dispatcher: tickets issued {self.dcall('tickets_issued')}, done below "
                f"{self.dcall('tickets_done')}, leases outstanding {self.dcall('num_outstanding')}, epoch "
                f"{self.dcall('epoch_now')}, exhausted {self.dcall('exhausted')}")

    def _wait_until(self, ready, what: str, timer: Timer, on_poll=None) -> None:
        """Poll ``ready()`` (checking workers and reward failures, calling ``on_poll()`` every ``land_every_s``)
        until true, or explain the timeout."""
        deadline = time.monotonic() + self.wait_timeout_s
        last_check = last_poll = 0.0
        with timer("gen"):  # timing_s/gen: what this step waited for its samples to be generated
            while not ready():
                self.check_workers()
                if time.monotonic() - last_check > 1.0:
                    self.monitor.observe(self.buffer.metrics())  # a reward that always fails stops here
                    last_check = time.monotonic()
                if on_poll is not None and time.monotonic() - last_poll >= self.land_every_s:
                    on_poll()
                    last_poll = time.monotonic()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"step {self.global_step + 1}: waited `trainer.wait_timeout_s` = {self.wait_timeout_s:g} s "
                        f"for {what}. {self.describe_state()}. Likely causes: rollout workers too slow or stuck in "
                        "a reward call (set `reward.timeout_s`), or the staleness bound "
                        f"(`max_off_policy_threshold` = {self.threshold_text()}) holding workers back while the "
                        "learner waits; raise `trainer.wait_timeout_s` if generation is just slow.")
                time.sleep(self.poll_s)

    def next_batch(self, timer: Timer, *, ahead: bool = False):
        """The batch of the next update (possibly smaller, possibly empty), or None when the run is over.

        ``ahead``: the batch of the update after the one running now, sampled at the policy version that update
        will train at, if it is ready now (no wait; None otherwise and at the end of the run)."""
        step = self.global_step + int(ahead)
        version = self.version_at(step)
        if self.strategy == "wait":
            sep = self.config.trainer.v1.separate_async
            first = step == 0 and sep.num_warmup_batches > 1
            cap = rule.startup_batches(threshold=self.threshold, updates_per_version=self.sync_step)
            target = self.update_tickets(step + min(sep.num_warmup_batches if first else 1, cap)).start
            if ahead:
                if self.dcall("tickets_done") < target:
                    return None
            else:
                self._wait_until(lambda: self.dcall("tickets_done") >= target or self.prompts_finished(),
                                 f"the prompt groups of tickets below {target}", timer,
                                 on_poll=None if self.land_every_s is None else lambda: self.take_landed(step))
            tickets = self.update_tickets(step)
            with timer("sample_ahead" if ahead else "sample"):
                batch = self.buffer.sample_tickets(tickets.stop, learner_version=version)
                if self._landed:  # with the groups taken as they landed, in ticket order as one call gives them
                    batch = concat_batches([*self._landed, batch], order=lambda m: (m.tags.ticket, m.tags.group_uid))
                    self._landed = []
            # the run is over when no ticket of this update was ever issued; an update whose tickets were issued
            # but all failed is an empty step (as in sync), so that the end of the run is still saved
            if len(batch) == 0 and self.prompts_finished() and self.dcall("tickets_issued") <= tickets.start:
                return None
        else:
            want = len(self.update_tickets(step)) * self.n
            sep = self.config.trainer.v1.separate_async
            first = want * max(1, sep.num_warmup_batches) if step == 0 else want  # warm-up: queue more first
            if ahead:
                if self.buffer.num_ready_samples(version) < want:
                    return None
            else:
                self._wait_until(
                    lambda: self.buffer.num_ready_samples(version) >= first or self.prompts_finished(),
                    f"{first} fresh samples (lag <= {self.threshold}) in the buffer", timer)
            ready = self.buffer.num_ready_samples(version)
            if ready == 0:
                return None  # prompts finished and nothing fresh left
            with timer("sample_ahead" if ahead else "sample"):
                batch = self.buffer.sample(min(want, ready), learner_version=version,
                                           timeout=self.wait_timeout_s, source="online")
        self.consumed_groups.update(m.tags.group_uid for m in batch.metas)  # out of the buffer
        return batch

    def sample_ahead(self, timer: Timer, pending) -> PreparedUpdate | None:
        """While ``pending`` (an update) runs: the next update's batch, staged for the learners, as soon as it is
        ready; None if the update ends first (the next step then waits for it as usual).

        Takes sampling and the copy into the object store off the learner's critical path. Not past
        ``trainer.total_training_steps``; a checkpoint taken while such a batch is held lists its tickets
        (:meth:`dispatcher_state`), so a resumed run generates those groups again."""
        cap = self.config.trainer.total_training_steps
        if not self.sample_ahead_enabled or (cap and self.global_step + 1 >= int(cap)):
            return None
        last_take = 0.0
        # a learner that neither answers nor fails: after wait_timeout_s the update's own wait (result()) names it
        deadline = time.monotonic() + self.wait_timeout_s
        while (batch := self.next_batch(timer, ahead=True)) is None:
            if time.monotonic() >= deadline:
                return None
            if (self.strategy == "wait" and self.land_every_s is not None
                    and time.monotonic() - last_take >= self.land_every_s):
                with timer("sample_ahead"):
                    self.take_landed(self.global_step + 1)
                last_take = time.monotonic()
            if pending.wait(self.poll_s):
                return None
        with timer("sample_ahead"):
            return self.prepare_update(batch, self.version_at(self.global_step + 1), self.global_step + 1)

    def take_landed(self, step: int) -> None:
        """``wait``: take the groups of update ``step`` that are done already (never blocks); :meth:`next_batch`
        adds them to the rest. Their payloads are fetched now, while the update before runs or the last groups are
        still being generated, rather than all at once after the last group lands (a long-tailed reward makes the
        last group late). A checkpoint taken meanwhile lists their tickets as held (:meth:`dispatcher_state`)."""
        tickets = self.update_tickets(step)
        part = self.buffer.sample_tickets(tickets.stop, learner_version=self.version_at(step))
        if len(part):
            self._landed.append(part)
            self.landed_groups += len(part.group_slices())
            self.consumed_groups.update(m.tags.group_uid for m in part.metas)

    def update_tickets(self, update: int) -> range:
        """The tickets update ``update`` (0-based) trains: admission's layout (fixed sizes: computed here; sizes
        that change along the run: asked of the dispatcher once per update, which lays them out)."""
        if self.group_schedule.fixed:
            return rule.update_tickets(update, batch_groups=self.batch_prompts)
        if update not in self._ticket_ranges:
            self._ticket_ranges[update] = range(*self.dcall("update_tickets", update))
            for old in [u for u in self._ticket_ranges if u < update - 8]:  # the loop only looks a few ahead
                del self._ticket_ranges[old]
        return self._ticket_ranges[update]

    def version_at(self, step: int) -> int:
        """The policy version update ``step`` trains at (this one, or the next: publication follows its update)."""
        return self.version + int(step > self.global_step and step % self.sync_step == 0)

    def dispatcher_state(self) -> dict:
        state = super().dispatcher_state()
        held = [m for b in self._landed for m in b.metas]
        for prepared in (self._ahead, self._started and self._started[0]):
            if prepared is not None:
                held += prepared.batch.metas
        if held:
            state["held"] = sorted({int(m.tags.ticket) for m in held})
        return state

    def trained_below(self) -> int:
        """Every ticket below this one has had its update (``wait``)."""
        return self.update_tickets(self.global_step).start

    def run_finished(self) -> bool:
        """Every admitted group has been trained (or failed) and no prompt is left."""
        if self._ahead is not None or self._started is not None or not self.prompts_finished():
            return False
        if self.strategy == "wait":
            return self.dcall("tickets_issued") <= self.trained_below()
        return self.buffer.num_ready_samples(self.version) == 0

    def rollout_metrics(self) -> dict[str, float]:
        import ray

        self.check_workers()
        stats = []
        for ref in [w.stats.remote() for w in self.workers]:  # asked of all at once, collected in turn
            try:
                stats.append(ray.get(ref, timeout=60))
            except ray.exceptions.RayActorError:
                continue  # died since check_workers(); replaced on the next check
            except ray.exceptions.GetTimeoutError:
                continue  # busy (a replacement still loading its model): its figures join the next step's
        if not stats:
            return {}
        wall = sum(s["wall_s"] for s in stats) or 1.0
        self._rollout_now = (sum(s["idle_s"] for s in stats), float(sum(s["samples"] for s in stats)))
        return {"perf/rollout_idle_frac": sum(s["idle_s"] for s in stats) / wall,
                "rollout/samples_generated": float(sum(s["samples"] for s in stats)),
                "rollout/gen_s_per_sample": sum(s["gen_s"] for s in stats) / max(1, sum(s["samples"] for s in stats)),
                "rollout/min_worker_version": float(min(s["version"] for s in stats)),
                "timing_s/reward": self.since_last_step("reward_s", stats),
                "timing_s/put": self.since_last_step("put_s", stats)}

    def since_last_step(self, name: str, stats: list[dict]) -> float:
        """How much the workers' running total ``name`` grew since the last step (0 when it fell: a replaced
        worker's total starts again at 0)."""
        total = sum(s[name] for s in stats)
        grown, self.totals_seen[name] = max(0.0, total - self.totals_seen.get(name, 0.0)), total
        return grown

    @contextlib.contextmanager
    def quiesced(self, purpose: str):
        """No new leases, and every in-flight group has landed, for the duration of the block."""
        self.dcall("pause", True)
        try:
            self._wait_until(lambda: not self.dcall("num_outstanding"),
                             f"in-flight prompt groups to land before {purpose}", Timer())
            yield
        finally:
            self.dcall("pause", False)

    def save_checkpoint(self):
        """Quiesce, then save everything consistently."""
        with self.quiesced("a checkpoint"):
            return super().save_checkpoint()

    # ------------------------------------------------------------------ hooks of the one loop
    def on_run_start(self) -> None:
        self.resume_threshold()
        for i in range(len(self.workers)):
            self._start_worker(i)

    def training_step(self, timer: Timer) -> StepResult | None:
        """Wait for this update's batch (what the rollout loops made meanwhile; or the one sampled ahead during
        the last update), requeue refills, train; while the update runs, sample the next batch if it is ready.
        An update started at the end of the last step (:meth:`start_next_early`) is this step's."""
        started, self._started = self._started, None
        if started is not None:
            prepared, pending, t_start = started
        else:
            pending, t_start = None, None
            prepared, self._ahead = self._ahead, None
            if prepared is None:
                batch = self.next_batch(timer)
                if batch is None:
                    return None
                with timer("sample"):
                    prepared = self.prepare_update(batch, self.version)
        # audit trail: (group, prompt, epoch, behaviour version, learner version) of every trained sample
        self.trained_log.extend((m.tags.group_uid, m.tags.prompt, m.tags.epoch, m.tags.policy_version, self.version)
                                for m in prepared.batch.metas)
        self.requeue_refills()
        compat = self.config.trainer.v1.separate_async.sync_compatible
        if compat:
            self.dcall("pause", True)
        if started is None:
            t_start = time.perf_counter()
            pending = self.start_update(prepared)
        if pending is not None:
            self._ahead = self.sample_ahead(timer, pending)
        metrics = {} if pending is None else {**pending.result(), **prepared.extra}
        # timing_s/update_actor, the learners' busy time: from the start of the update, which may be before this
        # step's (update_ahead: the part that ran beside the last step's publish and bookkeeping)
        timer.times["update_actor"] = time.perf_counter() - t_start
        timer.times["update_ahead"] = max(0.0, timer.started - t_start)
        if compat:
            self.dcall("pause", False)
        if pending is not None:
            self.start_next_early()
        return StepResult(batch=prepared.batch, metrics=metrics)

    def start_next_early(self) -> None:
        """Right after an update ends, start the next one if its batch is staged already (sampled ahead), and
        before it rank 0's publish of this update's weights when one is due: the learners go from one update to
        the next while the loop publishes (:meth:`publish_weights` collects the reply), logs and settles this step.

        Not when the loop reads the learners between the two (a checkpoint or validation is due after this update,
        ``trainer.total_time_minutes`` is up), with ``sync_compatible`` (rollouts pause during updates), or with
        in-process learners (nothing would run beside the loop). Each update still trains on the weights of the one
        before and is published after it, exactly as if started later (an actor serves its calls in order)."""
        prepared = self._ahead
        step = self.global_step + 1  # the update that just ended (the loop counts it after this returns)
        if (not self.back_to_back_enabled or prepared is None or prepared.fields is None
                or self.learners.local is not None or self.config.trainer.v1.separate_async.sync_compatible
                or self.learner_read_after(step) or self.past_deadline()):
            return
        if step % self.sync_step == 0:
            self._publishing = (self.version + 1, self.learners.start_publish(self.store, self.version + 1))
        self._ahead = None
        self._started = (prepared, self.start_update(prepared), time.perf_counter())
        self.back_to_back_updates += 1

    def update_in_flight(self) -> bool:
        return self._started is not None

    def after_update(self) -> None:
        if self.strategy == "wait":
            self.dcall("settle_below", self.trained_below())

    def on_run_end(self) -> None:
        import ray

        self.dcall("stop")
        failing = sys.exc_info()[0] is not None  # the loop is ending on an error: do not wait on stuck workers
        try:
            self.final_worker_stats = ray.get(list(self.run_refs.values()), timeout=5 if failing else 120)
        except Exception as err:  # a dead worker at shutdown is reported, not raised
            self.printer(f"rollout workers did not stop cleanly: {type(err).__name__}: {err}")
            self.final_worker_stats = []

    def validate(self) -> dict[str, float]:
        """Validate the learner's current version: quiesce leasing, let worker 0 install it, score, resume."""
        with self.quiesced("validation"):
            got = bounded_get(self.validation_worker().pull_weights.remote(self.store), self.wait_timeout_s,
                              f"rollout worker 0, pulling weights version {self.version} before validation,",
                              "It may be stuck in a reward call of its own groups (`reward.timeout_s` bounds them) "
                              "or out of memory.")
            if got != self.version:
                raise RuntimeError(f"rollout worker 0 holds weights version {got} after pulling; the learner "
                                   f"published {self.version}")
            return super().validate()

    def progress_label(self) -> str:
        return f"async {self.config.actor_rollout_ref.actor.diffusion_loss.loss_mode} (lag<={self.threshold_text()})"

    # ------------------------------------------------------------------ the threshold (fixed, or auto)
    def threshold_text(self) -> str:
        return f"auto, now {self.threshold}" if self.auto is not None else str(self.threshold)

    def set_threshold(self, threshold: int) -> None:
        """Admit under ``threshold`` from the next lease on (admitted samples keep the bound they have)."""
        self.threshold = int(threshold)
        self.dcall("set_threshold", self.threshold)

    def step_signals(self, metrics: dict[str, float], timer: Timer) -> StepSignals:
        """What this update measured, for the controller: its timings, the workers' idle time and samples since
        the last step, the samples dropped stale and the learner's mismatch metrics."""
        idle_then, samples_then = self._rollout_totals
        idle_now, samples_now = self._rollout_totals = self._rollout_now
        dropped_now = float(metrics.get("training/off_policy/dropped_samples", 0.0))
        dropped_then, self._dropped_total = self._dropped_total, dropped_now
        step_s = float(timer.times.get("step", 0.0))
        return StepSignals(step_s=step_s, learner_wait_s=float(timer.times.get("gen", 0.0)),
                           rollout_idle_s=max(0.0, idle_now - idle_then), rollout_slots_s=len(self.workers) * step_s,
                           generated=max(0.0, samples_now - samples_then),
                           dropped=max(0.0, dropped_now - dropped_then),
                           kl=metrics.get("rollout_corr/kl"), ess=metrics.get("rollout_corr/ess"))

    def step_metrics(self, metrics, batch, timer, run_s):
        """The shared metrics and, under ``auto``, each decision with its signals; ``training/off_policy/threshold``
        is the value admission uses from the end of the step on (after a decision: the new one)."""
        out = super().step_metrics(metrics, batch, timer, run_s)
        if self.auto is not None:
            decision = self.auto.observe(self.step_signals(out, timer))
            if decision is not None:
                if decision.new != self.threshold:
                    self.set_threshold(decision.new)
                out.update(decision.metrics())
        self.last_metrics = dict(out)
        return out

    def resume_threshold(self) -> None:
        """A resumed ``auto`` run continues from the threshold its checkpoint saved (within this run's range)."""
        if self.auto is None or self.resumed_from is None:
            return
        from omnirl_async.trainer.checkpoint import load_state

        saved = ((load_state(self.resumed_from, "trainer").get("dispatcher") or {}).get("admission") or {})
        if "threshold" in saved:
            self.auto.resume_at(int(saved["threshold"]))
            self.set_threshold(self.auto.value)

    def summary(self) -> dict:
        stale = np.concatenate(self.all_staleness) if self.all_staleness else np.zeros(0)
        out = super().summary()
        buf = self.buffer.metrics()
        out.update({"staleness_max": float(stale.max()) if stale.size else 0.0,
                    "staleness_mean": float(stale.mean()) if stale.size else 0.0,
                    "dropped_samples": float(buf.get("buffer/dropped_stale", 0.0)),
                    "regenerated_groups": int(buf.get("buffer/regenerated_groups", 0)),
                    "learner_idle_frac": float(self.last_metrics.get("perf/learner_idle_frac", 1.0)),
                    "replaced_workers": self.replaced_workers, "threshold": self.threshold,
                    "landed_groups": self.landed_groups, "back_to_back_updates": self.back_to_back_updates})
        if self.auto is not None:
            out["auto_threshold"] = self.auto.summary()
            self.printer(self.auto.summary_text())
        return out
