"""Rollout worker: generate groups with per-step behaviour log-probs and score them.

A worker holds its own copy of the policy (base weights + LoRA). For each
:class:`~omnirl_async.protocol.PromptLease` it generates ``n`` trajectories
with the weights of one exact policy version, scores the images, and returns
(or puts into the replay buffer) the samples tagged with that version. New
weights are installed only between requests (:meth:`set_weights`), never in
the middle of a trajectory.

The class is plain Python; the trainer wraps it with ``ray.remote``.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from omnirl_async.actors.prompt_dispatcher import sample_seeds
from omnirl_async.models.sampler import sample_with_logprob
from omnirl_async.models.sde_window import SDEWindow
from omnirl_async.models.setup import build_policy, pick_device
from omnirl_async.protocol import PromptLease, SampleMeta, SampleStatus, SampleTags, new_uid
from omnirl_async.rewards import RewardManager
from omnirl_async.rewards.worker_pool import RewardPool

__all__ = ["RolloutWorker", "GeneratedBatch"]

GeneratedBatch = tuple[list[SampleMeta], dict[str, np.ndarray], dict[str, float]]


def _to_tensor_dict(weights: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Tensors over the fetched arrays, without copying them: the weight store's arrays come back as read-only
    views of Ray's shared memory, and the strict load only reads them (it copies each into its parameter), so
    the one copy an install makes is the one into the model (not a second, whole-state copy first)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in weights.items()}


def lower_cpu_priority(increment: int) -> int:
    """Add ``increment`` to the niceness of every thread of this process; returns the new niceness.

    On Linux niceness belongs to threads, and ``os.nice`` changes only the calling
    one, so each existing thread is updated; threads started later inherit it.
    """
    target = min(os.getpriority(os.PRIO_PROCESS, 0) + int(increment), 19)
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else [str(os.getpid())]
    for tid in tasks:
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), target)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that ended meanwhile, or one we may not touch
    return os.getpriority(os.PRIO_PROCESS, 0)


class InlineTimeout:
    """Inline scoring bounded by ``reward.timeout_s``: a call that outlives it fails its group.

    The call runs in a daemon thread; when it does not answer in time every
    sample of the group is marked failed (reason names the key) and the worker
    goes on. Python cannot stop the thread, so a reward that hangs for good
    keeps one thread; this is the inline counterpart of the reward worker
    pool's timeout, which can abandon a whole process.
    """

    def __init__(self, reward, timeout_s: float):
        self.reward, self.timeout_s = reward, timeout_s

    def __call__(self, images, prompts, rows=None):
        from omnirl_async.rewards.worker_pool import failed_result

        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["out"] = self.reward(images, prompts, rows)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["err"] = e

        t = threading.Thread(target=run, name="reward-call", daemon=True)
        t.start()
        t.join(self.timeout_s)
        if t.is_alive():
            return failed_result(len(prompts), f"reward call took longer than `reward.timeout_s` = "
                                               f"{self.timeout_s:g} s (inline scoring)")
        if "err" in box:
            raise box["err"]
        return box["out"]


class RolloutWorker:
    #: cumulative counters of the continuous loop (:meth:`stats`), all starting at zero
    COUNTERS = {"groups": 0, "samples": 0, "gen_s": 0.0, "reward_s": 0.0, "idle_s": 0.0, "put_s": 0.0,
                "weights_s": 0.0, "weights_bytes": 0, "weight_pulls": 0, "wall_s": 0.0}

    def __init__(self, config, *, worker_index: int = 0, num_threads: int | None = None,
                 reward_actors: list | None = None):
        if num_threads:
            torch.set_num_threads(num_threads)
        if config.actor_rollout_ref.rollout.nice:
            lower_cpu_priority(config.actor_rollout_ref.rollout.nice)
        self.config = config
        self.worker_index = worker_index
        aro = config.actor_rollout_ref
        self.rollout_cfg, self.model_cfg = aro.rollout, aro.model
        self.device = pick_device(config.trainer.device)
        self.policy = build_policy(self.model_cfg, self.device, seed=config.data.seed)
        self.policy.transformer.eval()
        if reward_actors:  # score on the shared reward worker pool (reward.num_workers > 0)
            self.reward = RewardPool(reward_actors, timeout_s=config.reward.timeout_s)
        else:
            self.reward = RewardManager.from_config(config.reward)
            if config.reward.timeout_s:
                self.reward = InlineTimeout(self.reward, float(config.reward.timeout_s))
        algo = self.rollout_cfg.algo
        steps = self.rollout_cfg.pipeline.num_inference_steps
        self.window = SDEWindow(num_steps=steps, window_size=algo.sde_window_size,
                                window_range=algo.sde_window_range, strategy=algo.sample_strategy,
                                iters_per_group=algo.iters_per_group, seed=algo.sde_window_seed)
        # policy gradient trains the stored SDE steps; direct preference re-noises the clean latents x0
        self.keep_trajectory = config.algorithm.trainer_type != "direct_preference"
        self.version = 0
        self.max_inflight_scores = 4  # groups being scored while the next one is sampled
        self._pool = ThreadPoolExecutor(max_workers=self.max_inflight_scores, thread_name_prefix="score")
        self._count_lock = threading.Lock()
        self._weights_lock = threading.Lock()
        self.counters = dict(self.COUNTERS)

    # ------------------------------------------------------------------ lifecycle
    def assert_healthy(self) -> dict[str, Any]:
        return {"worker_index": self.worker_index, "version": self.version, "pid": os.getpid()}

    def get_version(self) -> int:
        return self.version

    def stats(self) -> dict[str, float]:
        """Cumulative counters of the continuous loop (safe to call while it runs)."""
        return dict(self.counters, version=self.version, worker_index=self.worker_index)

    # ------------------------------------------------------------------ continuous loop (separate_async)
    def run_loop(self, dispatcher, store, buffer, *, worker_id: str, poll_s: float = 0.02,
                 lease_wait_s: float = 2.0, put_timeout: float = 600.0, slowdown_s: float = 0.0) -> dict[str, float]:
        """Lease → (new weights, once granted) → generate → score → put → complete, until the trainer stops it.

        A lease that admission control refuses waits in the dispatcher up to
        ``lease_wait_s`` for something to change (a learner update, a lease given
        back, ...; ``PromptDispatcher.lease(wait_s=...)``) – one call per wait
        instead of two calls every ``poll_s`` (``should_stop`` is asked only
        when a wait ended early); with ``lease_wait_s=0`` the loop polls every
        ``poll_s``. A granted lease names the weights version to generate with
        at least (``lease.weights_version``); the worker pulls only then.
        ``slowdown_s`` adds a sleep per group (tests and benchmarks of
        stragglers). Returns the final counters.
        """
        import ray

        t_start = time.perf_counter()
        inflight: deque = deque()
        while True:
            # Lease first, pull after: admission counts on the newest published version the dispatcher knows
            # (``lease.weights_version``), and the weights are fetched only once a lease is granted. A worker
            # refused a lease (a learner-bound run: most of them, after every update) pulls nothing. What it then
            # installs is that version or a later one, so its group lags no more than admission allowed.
            t0 = time.perf_counter()
            leases = ray.get(dispatcher.lease.remote(1, global_step=None, worker_id=worker_id,
                                                     worker_version=self.version, wait_s=lease_wait_s))
            if not leases:
                # Only the trainer ends the loop: a run whose prompts are all leased may still hand out
                # refills (a group evicted for failed members) or leases of a worker that died. A waiting lease
                # comes back empty before its wait is up only on stop, so one that waited it all out timed out
                # and the stop question is skipped (a stop landing just then ends the next lease at once).
                if ((lease_wait_s <= 0 or time.perf_counter() - t0 < lease_wait_s)
                        and ray.get(dispatcher.should_stop.remote())):
                    break
                if lease_wait_s <= 0:
                    time.sleep(poll_s)  # admission control says wait (or paused, or nothing left yet)
                self.counters["idle_s"] += time.perf_counter() - t0
                continue
            self.counters["idle_s"] += leases[0].admission_wait_s  # granted after waiting for admission
            need = leases[0].weights_version
            if need is not None and need > self.version:
                t2 = time.perf_counter()
                info = self._install_newest(store, latest=need)
                if self.version < need:
                    raise RuntimeError(
                        f"worker {worker_id}: lease {leases[0].lease_id} was admitted for weights version {need}, "
                        f"but the weight store's newest is {self.version}; the trainer must announce a version "
                        "(`on_update(published_version=)`) only after the store holds it")
                if info is not None:  # None: a validation pull installed it meanwhile
                    self.counters["weights_bytes"] += info.num_bytes
                    self.counters["weight_pulls"] += 1
                self.counters["weights_s"] += time.perf_counter() - t2
            group = self._sample_group(leases[0], self.window.select(leases[0].global_step))
            if slowdown_s:
                time.sleep(slowdown_s)
            # scoring, put and completion run in the pool while the next group is sampled
            inflight.append(self._pool.submit(self._finish_group, group, dispatcher, buffer, put_timeout, worker_id))
            while len(inflight) >= self.max_inflight_scores or (inflight and inflight[0].done()):
                inflight.popleft().result()  # re-raises a failure of that stage here
            self.counters["wall_s"] = time.perf_counter() - t_start
        for fut in inflight:
            fut.result()
        self.counters["wall_s"] = time.perf_counter() - t_start
        return self.stats()

    def set_weights(self, version: int, weights: dict[str, Any], *, if_newer: bool = False) -> int:
        """Install a published weight version (LoRA state, or full weights when lora_rank=0); returns the installed
        version. An older version than the installed one is an error, or with ``if_newer`` is left alone: the
        rollout loop and a validation request each fetch the newest and may race, and the later fetch can then
        install first."""
        with self._weights_lock:  # the rollout loop and a validation request may both install it
            if version < self.version:
                if if_newer:
                    return self.version
                raise ValueError(f"weights version {version} is older than the installed {self.version}")
            if version == self.version:
                return self.version
            weights = _to_tensor_dict(weights)
            if self.model_cfg.lora_rank > 0:
                self.policy.load_lora_state_dict(weights)
            else:
                self.policy.load_full_state_dict(weights)
            self.version = version
            return self.version

    def pull_weights(self, store) -> int:
        """Install the newest version the weight store holds (separate_async, before validating)."""
        self._install_newest(store)
        return self.version

    def _install_newest(self, store, *, latest: int | None = None):
        """Fetch and install the store's newest weights when newer than the installed ones (``latest``: a version
        the caller knows the store holds – read from it, or announced with a lease –, which saves asking for the
        newest); returns the fetched version's ``WeightsInfo``, or None."""
        from omnirl_async.learners.weight_store import fetch_weights_if_newer

        newer = fetch_weights_if_newer(store, self.version, latest=latest)
        if newer is None:
            return None
        info, weights = newer
        self.set_weights(info.version, weights, if_newer=True)  # the loop and a validation pull may race
        return info

    def validate(self, prompts: list[str], *, seed: int = 0) -> dict[str, Any]:
        """Score ``prompts`` with ``rollout.val_kwargs`` and the weights this worker holds.

        A :class:`~omnirl_async.data.prompts.PromptSet` brings its rows' other
        fields, which the reward receives as in training.
        """
        from omnirl_async.models.evaluate import evaluate_policy, validation_settings

        res = evaluate_policy(self.policy, self.reward, prompts, self.rollout_cfg.val_kwargs, seed=seed,
                              **validation_settings(self.config))
        return {"metrics": res.metrics, "images": res.images, "prompts": res.prompts,
                "strict": next((v for k, v in res.extra.items() if k.endswith("strict")), None),
                "failures": res.failure_note()}

    def _finish_group(self, group, dispatcher, buffer, put_timeout: float, worker_id: str) -> None:
        """Score, put into the buffer, complete the lease (one group, in a pool thread)."""
        import ray

        metas, fields, (gen_s, reward_s) = self._score_group(group)
        t0 = time.perf_counter()
        buffer.put(metas, fields, timeout=put_timeout, producer=worker_id)  # it may own the payload
        # admitted before the lease is done (a death before here re-leases it); waits out put_linger_s, so that
        # groups this worker's other pool threads finish meanwhile share the controller call
        buffer.flush(timeout=put_timeout, share=True)
        ray.get(dispatcher.complete.remote([group["lease"].lease_id]))
        with self._count_lock:
            self.counters["put_s"] += time.perf_counter() - t0
            self.counters["groups"] += 1
            self.counters["samples"] += len(metas)
            self.counters["gen_s"] += gen_s
            self.counters["reward_s"] += reward_s

    # ------------------------------------------------------------------ generation
    def generate(self, leases: list[PromptLease], *, iteration: int | None = None) -> GeneratedBatch:
        """Generate and score every lease; returns (metas, fields, stats) for whole groups.

        Scoring of one group overlaps the generation of the next (a reward
        server's latency is hidden behind the sampler), in a small thread pool.
        """
        if not leases:
            return [], {}, {}
        it = leases[0].global_step if iteration is None else iteration
        window = self.window.select(it)
        futures = []
        for lease in leases:
            group = self._sample_group(lease, window)
            futures.append(self._pool.submit(self._score_group, group))
        done = [f.result() for f in futures]
        metas = [m for ms, _, _ in done for m in ms]
        fields = {k: np.concatenate([f[k] for _, f, _ in done]) for k in done[0][1]}
        stats = {"timing_s/gen": sum(g for _, _, (g, _) in done), "timing_s/reward": sum(r for _, _, (_, r) in done),
                 "rollout/version": float(self.version), "rollout/window_start": float(window[0]) if window else 0.0}
        return metas, fields, stats

    def _sample_group(self, lease: PromptLease, window) -> dict[str, Any]:
        """Stage 1 (the policy, this thread): the ``n`` trajectories of one lease."""
        pcfg, acfg = self.rollout_cfg.pipeline, self.rollout_cfg.algo
        t0 = time.perf_counter()
        neg = [lease.negative_prompt or pcfg.negative_prompt] if pcfg.true_cfg_scale > 1 else None
        emb = self.policy.encode_prompt([lease.prompt], negative_prompts=neg,
                                        max_sequence_length=pcfg.max_sequence_length)
        seeds = sample_seeds(lease)
        micro = self.rollout_cfg.micro_batch_size or lease.n
        parts = []
        for lo in range(0, lease.n, micro):
            chunk = seeds[lo:lo + micro]
            if acfg.sde_type == "dance" and lo > 0:  # DanceGRPO: the whole group shares its initial noise
                chunk = [seeds[0]] + chunk
            out = sample_with_logprob(
                self.policy, emb.repeat_interleave(len(chunk)), seeds=chunk, height=pcfg.height,
                width=pcfg.width, num_inference_steps=pcfg.num_inference_steps, noise_level=acfg.noise_level,
                sde_type=acfg.sde_type, window=window, true_cfg_scale=pcfg.true_cfg_scale,
                guidance_scale=pcfg.guidance_scale,
                shared_noise_groups=[0] * len(chunk) if acfg.sde_type == "dance" else None,
                keep_trajectory=self.keep_trajectory)
            part = out.to_fields(trajectory=self.keep_trajectory)
            if acfg.sde_type == "dance" and lo > 0:
                part = {k: v[1:] for k, v in part.items()}
            parts.append(part)
        fields = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        fields.update({f"emb.{k}": v for k, v in emb.repeat_interleave(lease.n).to_numpy().items()})
        return {"lease": lease, "fields": fields, "seeds": seeds, "version": self.version,
                "gen_s": time.perf_counter() - t0}

    def _score_group(self, group: dict[str, Any]) -> tuple[list[SampleMeta], dict[str, np.ndarray], tuple]:
        """Stage 2 (any thread): reward, then metadata tagged with the version that generated the group."""
        lease, fields, seeds = group["lease"], group["fields"], group["seeds"]
        t1 = time.perf_counter()
        rows = [lease.fields] * lease.n if lease.fields else None  # the prompt row's other fields, for the reward
        scored = self.reward(fields["images"], [lease.prompt] * lease.n, rows)
        t_reward = time.perf_counter() - t1
        fields["rewards"] = np.where(scored.failed, 0.0, scored.scores).astype(np.float32)
        for name, arr in scored.extra.items():
            fields["extra." + name.replace("/", ".")] = np.asarray(arr, dtype=np.float32)
        metas = []
        for k in range(lease.n):
            failed = bool(scored.failed[k])
            tags = SampleTags(uid=new_uid(), group_uid=lease.group_uid, sample_index=k, group_size=lease.n,
                              policy_version=group["version"], global_step=lease.global_step, seed=seeds[k],
                              prompt=lease.prompt, epoch=lease.epoch, ticket=lease.ticket,
                              max_lag=lease.max_lag)
            metas.append(SampleMeta(key=tags.uid, tags=tags,
                                    status=SampleStatus.FAILURE if failed else SampleStatus.SUCCESS,
                                    reason=scored.reasons[k] if failed else None,
                                    reward=None if failed else float(scored.scores[k]),
                                    timings={"gen_s": group["gen_s"] / lease.n, "reward_s": t_reward / lease.n}))
        return metas, fields, (group["gen_s"], t_reward)
