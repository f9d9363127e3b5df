"""`buffer.*` and `transfer_queue.*`: where samples wait between rollout and learner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omnirl_async.config.fields import NoEffect, opt

__all__ = ["BufferConfig", "TransferQueueConfig", "wait_no_effect"]

#: Under separate_async + wait, update u trains exactly the admitted tickets [u*B, (u+1)*B): the buffer settings
#: that would choose other groups, or hold a batch back, cannot apply.
_WAIT_TRAINS_ADMITTED = ("each update trains exactly the prompt groups admission control let in for it (that is what "
                        "keeps every lag within the threshold), so")


def _wait_strategy(section, root) -> str | None:
    """The condition of the separate_async + wait refusals: ``max_off_policy_strategy`` = wait."""
    strategy = root.trainer.v1.sampler.max_off_policy_strategy
    return "with `trainer.v1.sampler.max_off_policy_strategy` = wait" if strategy == "wait" else None


def wait_no_effect(reason: str, **kw) -> NoEffect:
    """Refused under separate_async with the wait strategy, for ``reason`` (completes "..., so")."""
    return NoEffect(f"{_WAIT_TRAINS_ADMITTED} {reason}", modes=("separate_async",), when=_wait_strategy,
                    when_doc="with `trainer.v1.sampler.max_off_policy_strategy` = wait", **kw)


def _policy_gradient(section, root) -> str | None:
    """Offline pairs train only direct-preference losses."""
    return ("with `algorithm.trainer_type` = policy_gradient"
            if root.algorithm.trainer_type == "policy_gradient" else None)


#: Offline pairs are clean latents plus a preference: nothing a policy-gradient loss can train on.
OFFLINE_NEEDS_PREFERENCE = NoEffect(
    "offline preference pairs hold clean latents and a preference, no SDE trajectory or behaviour log-probs, so a "
    "policy-gradient loss cannot train on them", when=_policy_gradient,
    when_doc="with `algorithm.trainer_type` = policy_gradient",
    fix="use a direct-preference loss (`actor_rollout_ref.model.algorithm=diffusion_nft`, dpo or awm), or leave it "
        "at {default}")


def _offline_source(section, root) -> str | None:
    return "with `algorithm.sample_source` = offline" if root.algorithm.sample_source == "offline" else None


def _online_source(section, root) -> str | None:
    return "with `algorithm.sample_source` = online" if root.algorithm.sample_source == "online" else None


def _no_mixing(section, root) -> str | None:
    if root.algorithm.sample_source == "offline":
        return "with `algorithm.sample_source` = offline"
    return "while `buffer.offline_mix_ratio` = 0" if not section.offline_mix_ratio > 0 else None


def _no_taper(section, root) -> str | None:
    no_mixing = _no_mixing(section, root)
    if no_mixing is not None:
        return no_mixing
    return "while `buffer.offline_mix_ratio_final` is null" if section.offline_mix_ratio_final is None else None


def _sampler_not(name: str, kwarg: str):
    """A ``when`` condition: the key is the default ``kwarg`` of the built-in sampler ``name`` only
    (omnirl_async/buffer/spec.py ``sampler_defaults``); another sampler, a custom one or ``sampler_kwargs`` setting
    ``kwarg`` leave it unread."""
    def when(buffer, root) -> str | None:
        s = root.trainer.v1.sampler
        if s.custom_sampler.path is not None or s.custom_sampler.name is not None:
            return "while `trainer.v1.sampler.custom_sampler` is set (a custom sampler gets only `sampler_kwargs`)"
        if buffer.sampler != name:
            return f"with `buffer.sampler` = {buffer.sampler!r}"
        if kwarg in (s.sampler_kwargs or {}):
            return f"while `trainer.v1.sampler.sampler_kwargs` sets {kwarg!r} (it wins)"
        return None
    return when


def _sampler_only(name: str, kwarg: str, what: str) -> NoEffect:
    return NoEffect(f"only the {name} sampler reads {what}", when=_sampler_not(name, kwarg),
                    when_doc=f"unless `buffer.sampler` = {name} (and no custom sampler, no `sampler_kwargs.{kwarg}`)",
                    fix=f"leave it at its default ({{default}}), or use `buffer.sampler={name}` (without a custom "
                        f"sampler, and without {kwarg!r} in `trainer.v1.sampler.sampler_kwargs`)")


def _no_rate_limiter(buffer, root) -> str | None:
    return "while `buffer.samples_per_insert` is null (no rate limiter)" if buffer.samples_per_insert is None else None


_WAIT_LIMITER = wait_no_effect("a rate limiter cannot hold a batch back (admission control already paces the "
                               "rollout)", fix="set it to null, or use the drop strategy")


@dataclass
class BufferConfig:
    sampler: str = opt("fifo", "Which samples a learner batch takes: fifo (oldest first; in separate_async with "
                       "the wait strategy: lowest admission ticket first), ticket, uniform, prioritized, freshness.",
                       choices=("fifo", "ticket", "uniform", "prioritized", "freshness"),
                       no_effect=wait_no_effect("a sampler cannot choose other groups", accept=("ticket",),
                                                fix="use fifo (or ticket), or the drop strategy"))
    remover: str = opt("fifo", "Which samples leave a full table first.", choices=("fifo",))
    max_size: int = opt(4096, "Max samples per table.", gt=0)
    max_times_sampled: int = opt(1, "A sample leaves the table after this many uses.", gt=0,
                                 no_effect=NoEffect("sync trains every sample with the weights that generated it; a "
                                                    "reused sample would be one version stale at the next step and "
                                                    "evicted unused", modes=("sync",)))
    min_size_to_sample: Any = opt(None, "Samples needed before sampling; null = one learner batch.", gt=0,
                                  no_effect=_WAIT_LIMITER)
    samples_per_insert: Any = opt(None, "Rate limiter: target samples drawn per sample inserted; null = off.", gt=0,
                                  no_effect=_WAIT_LIMITER)
    samples_per_insert_error_buffer: Any = opt(
        None, "Slack of the rate limiter in samples; null = one batch.", gt=0,
        no_effect=NoEffect("the slack belongs to the samples-per-insert rate limiter, which is off",
                           when=_no_rate_limiter, when_doc="while `buffer.samples_per_insert` is null",
                           fix="leave it at its default ({default}), or set `buffer.samples_per_insert`"))
    priority_exponent: float = opt(0.6, "Exponent of the prioritized sampler.", ge=0,
                                   no_effect=_sampler_only("prioritized", "exponent", "the priority exponent"))
    freshness_decay: float = opt(0.5, "Per-version-lag priority decay of the freshness sampler.", gt=0, le=1,
                                 no_effect=_sampler_only("freshness", "decay", "the per-lag decay"))
    offline_mix_ratio: float = opt(
        0.0, "Fraction of each learner batch drawn from the offline table (the run's offline store, "
        "docs/PREFERENCE_DATA.md): offline pairs take the place of round(r x data.train_batch_size) online groups "
        "per update (at least one group stays online) and make this share of all rows trained; 0 = online only.",
        ge=0, le=1,
        no_effect=(OFFLINE_NEEDS_PREFERENCE,
                   NoEffect("every learner row already comes from the offline table", when=_offline_source,
                            when_doc="with `algorithm.sample_source` = offline", fix="leave it at {default}"),
                   NoEffect("a ratio of 1 leaves no room for online samples: rollouts would run and never be "
                            "trained", accept=lambda v: v < 1, accept_doc="values below 1", when=_online_source,
                            when_doc="with `algorithm.sample_source` = online",
                            fix="set `algorithm.sample_source=offline` to train on the offline table alone, or a "
                                "ratio below 1")))
    offline_mix_ratio_final: Any = opt(
        None, "The offline share at the end of the run: the share drawn for each update moves linearly from "
        "offline_mix_ratio at the start to this value at the end (the run's progress, as a cosine learning rate "
        "measures it: trainer.total_training_steps updates or trainer.total_time_minutes of training time, whichever "
        "ends first). The rows the share frees go back to online groups (each update trains round((1 - share) x "
        "data.train_batch_size) of them, at least one), so with 0 the last updates train whole online batches. For "
        "pairs that help early and hold a stronger policy back later; null = offline_mix_ratio throughout.", ge=0, lt=1,
        no_effect=(NoEffect("no offline share is drawn to taper", when=_no_mixing,
                            when_doc="while `buffer.offline_mix_ratio` = 0 or `algorithm.sample_source` = offline",
                            fix="leave it at {default}, or mix offline pairs in (`buffer.offline_mix_ratio` > 0 with "
                                "`algorithm.sample_source=online`)"),))
    offline_mix_taper_end: float = opt(
        1.0, "The run's progress (0-1, as for offline_mix_ratio_final) at which the tapered share reaches "
        "offline_mix_ratio_final and stays there: 0.25 tapers over the first quarter of the run (offline pairs as a "
        "warm start, then the final share to the end); 1 = over the whole run.", gt=0, le=1,
        no_effect=(NoEffect("the offline share does not taper", when=_no_taper,
                            when_doc="while `buffer.offline_mix_ratio_final` is null (or there is no mixing)",
                            fix="leave it at {default}, or set `buffer.offline_mix_ratio_final`"),))
    snapshot_with_checkpoint: bool = opt(True, "Save the buffer with every checkpoint.")


@dataclass
class TransferQueueConfig:
    num_data_storage_units: int = opt(2, "Storage shards (Ray actors) holding tensor fields.", gt=0)
    total_storage_size: Any = opt(None, "Capacity in samples; null = bounded by memory_budget_bytes.", gt=0)
    memory_budget_bytes: int = opt(2 * 1024**3, "Capacity in bytes when total_storage_size is null.", gt=0)
    put_timeout_s: float = opt(600.0, "How long a producer blocks on a full queue before failing.", gt=0)
    producer_owned_payloads: bool = opt(True, "Rollout workers own their payloads (one object-store put per "
                                        "group, full object-store speed); the groups of a worker that dies before "
                                        "they are trained are generated again (`buffer/regenerated_groups`). "
                                        "false: storage units copy and own the data, so it outlives its producer "
                                        "(a second copy per put).")
    inline_max_bytes: int = opt(64 * 1024, "Payloads (a group's arrays) below this many bytes travel inside the "
                                "controller call and are kept by the controller (one call, and they outlive their "
                                "producer); larger ones go through the object store. 0 = always the object store.",
                                ge=0)
    max_pending_puts: int = opt(8, "Puts a process hands to a background sender without waiting for the controller "
                                "to admit them (registrations queued meanwhile go out together, one call per batch); "
                                "a put beyond that waits. Errors come back at the next buffer call; rollout workers "
                                "flush before reporting a group done. 0 = every put waits for the controller.", ge=0)
    put_linger_s: float = opt(0.02, "How long the background sender waits after a put for others to share its "
                              "controller call. Rollout workers and the sync trainer wait it out before reporting "
                              "their groups done (groups finished meanwhile share the call; timing_s/put, "
                              "buffer/put_calls); other buffer calls send at once. 0 = send at once; must be 0 when "
                              "max_pending_puts is 0 (no background sender).", ge=0)
