"""The measuring, analysis and printing half of ``bench_scale.py`` (the driver side only: nothing here runs in
the simulated workers' actors).

:func:`analyse` turns a finished setting (the trainer's step records and audit trail, the simulated workers' counters,
the timed calls and CPU readings) into the figures the issue asks for: throughput against the ideal overlap bound,
where the learner loop's time went, the staleness histogram, exactly-once, and the control plane's cost per step
and per group; :func:`print_setting`, :func:`print_summary` and :func:`goals` report them.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np
from scale_model import MiB, SimSpec

from omnirl_async.actors.rollout_worker import RolloutWorker

if TYPE_CHECKING:
    from bench_scale import SimTrainer, StepRecord


# ----------------------------------------------------------------------------------------------- measuring
def merge_calls(parts: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for part in parts:
        for name, (count, total, peak) in part.items():
            c = out[name]
            c[0] += count
            c[1] += total
            c[2] = max(c[2], peak)
    return dict(out)


def process_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this run's processes: Ray actors by class, Ray's daemons, this driver."""
    import psutil

    out: dict[str, float] = defaultdict(float)
    me = psutil.Process(os.getpid())
    for proc in [me, *me.children(recursive=True)]:  # this run's Ray: its daemons and workers are our children
        try:
            cmd = proc.cmdline() or []
            name = proc.name() or ""
            if proc.pid == me.pid:
                key = "driver (learner loop)"
            elif cmd and cmd[0].startswith("ray::"):
                key = cmd[0][len("ray::"):].split(".")[0].split(" ")[0]
            elif name in ("raylet", "gcs_server"):
                key = name
            else:
                key = "other Ray processes"
            t = proc.cpu_times()
            out[key] += t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return dict(out)


def machine_busy() -> tuple[float, float]:
    """(busy CPU seconds, total CPU seconds) of the whole machine so far."""
    import psutil

    t = psutil.cpu_times()
    total = sum(t)
    return total - t.idle - getattr(t, "iowait", 0.0), total


# ----------------------------------------------------------------------------------------------- analysis
def histogram(lags: np.ndarray) -> dict[int, int]:
    return {int(k): int(v) for k, v in sorted(Counter(lags.tolist()).items())}


def exactly_once(trained_log: list[tuple], group_size: int) -> tuple[bool, str]:
    """Every leased prompt trained at most once: one step per group, at most ``n`` samples per (prompt, epoch)."""
    per_prompt = Counter((prompt, epoch) for _, prompt, epoch, _, _ in trained_log)
    steps_of_group: dict[str, set] = defaultdict(set)
    for group, _, _, _, learner_v in trained_log:
        steps_of_group[group].add(learner_v)
    over = [k for k, c in per_prompt.items() if c > group_size]
    split = [g for g, s in steps_of_group.items() if len(s) > 1]
    ok = not over and not split
    return ok, ("ok" if ok else f"{len(over)} prompts trained more than once, {len(split)} groups in two steps")


def window_of(records: list[StepRecord], warmup: int) -> list[StepRecord]:
    if len(records) < warmup + 2:
        raise RuntimeError(f"only {len(records)} learner steps finished; the measured window needs more than "
                           f"--warmup-steps {warmup} + 1: raise --seconds or --time-scale")
    return records[warmup:]


def analyse(trainer: SimTrainer, hosts: list[dict], spec: SimSpec, *, workers: int, layout: list[int], args,
            marks: dict, wall: float, build_s: float) -> dict[str, Any]:
    """Throughput vs the ideal bound, learner time split, staleness, exactly-once and control-plane costs."""
    t, S = spec.time, spec.time_scale
    recs = window_of(trainer.records, args.warmup_steps)
    span = recs[-1].end - recs[0].end
    body = recs[1:]  # the steps that ended inside the window
    samples = sum(r.samples for r in body)
    thr_model = samples / span / S
    ideal = t.ideal(workers)
    compute = sum(r.compute_s for r in body)
    wait_s = sum(r.times.get("gen", 0.0) for r in body)
    ahead = sum(r.times.get("update_ahead", 0.0) for r in body)  # update time that ran beside the step before
    split = {"update (modelled), inside the step": compute - ahead, "waiting for samples": wait_s,
             "sample + payload fetch": sum(r.times.get("sample", 0.0) for r in body),
             "update call overhead": sum(r.times.get("update_actor", 0.0) - r.compute_s for r in body),
             "publish weights": sum(r.times.get("update_weights", 0.0) for r in body),
             "bookkeeping (metrics, audit, settle)": sum(r.bookkeeping_s for r in body)}
    split["other (refill check, settle, loop)"] = span - sum(split.values())
    lags = np.concatenate([r.lags for r in trainer.records]) if trainer.records else np.zeros(0, np.int64)
    audit_lags = np.array([lv - pv for _, _, _, pv, lv in trainer.trained_log], dtype=np.int64)
    once_ok, once_text = exactly_once(trainer.trained_log, t.group_size)
    learner_cp = (span - compute - wait_s) / len(body)  # the loop's own time per step, outside updates and waits
    sims = host_totals(hosts)
    calls = merge_calls([trainer.clock.snapshot()] + [h.get("calls", {}) for h in hosts])
    worker_cp = worker_critical_path(sims, calls)
    cpu = {k: marks["cpu1"].get(k, 0.0) - marks["cpu0"].get(k, 0.0) for k in marks["cpu1"]}
    interval = marks["t1"] - marks["t0"]
    busy = (marks["busy1"][0] - marks["busy0"][0]) / max(1e-9, marks["busy1"][1] - marks["busy0"][1])
    outside = max(0.0, busy * (os.cpu_count() or 1) - sum(cpu.values()) / max(1e-9, interval))
    window_calls = calls_in_window(trainer.clock.snapshot(), marks.get("calls0", {}))
    return {
        "workers": workers, "poll_s": spec.poll_s, "lease_wait_s": spec.lease_wait_s,
        "sample_ahead": spec.sample_ahead, "land": spec.land, "back_to_back": spec.back_to_back, "layout": layout, "threshold": args.threshold, "time_scale": S,
        "payload_scale": spec.payload_scale, "wall_s": wall, "build_s": build_s,
        "steps": len(trainer.records), "window_steps": len(body), "window_s": span, "samples": samples,
        "throughput": thr_model, "ideal": ideal, "ratio": thr_model / ideal, "capacity": t.capacity(workers),
        "demand": t.demand(), "learner_bound": t.learner_bound(workers),
        "learner_idle": 1.0 - compute / span, "split": {k: v / span for k, v in split.items()},
        "lags": histogram(lags), "audit_lags": histogram(audit_lags),
        "max_lag": int(max(lags.max(initial=0), audit_lags.max(initial=0))),
        "bound_held": bool(lags.max(initial=0) <= args.threshold and audit_lags.max(initial=0) <= args.threshold),
        "exactly_once": once_ok, "exactly_once_text": once_text, "trained_samples": len(trainer.trained_log),
        "learner_cp_s": learner_cp, "learner_cp_frac": learner_cp / (t.step_s(workers) / S),
        "worker_cp_s": worker_cp, "worker_cp_frac": worker_cp / spec.real(t.gen_s),
        "sims": sims, "calls": calls, "driver_window_calls": window_calls, "cpu": cpu, "machine_busy": busy,
        "cpu_interval_s": interval, "outside_cores": outside,
        "window_trained": samples,
    }


def worker_critical_path(sims: dict[str, float], calls: dict[str, list[float]]) -> float:
    """Seconds per group that a simulated worker spends in the control plane before it can generate: one granted
    lease per group (it carries the weights version to install), plus every weight pull and install. (Refused
    leases are admission waits; scoring, put and complete run in the worker's pool, beside the next
    generation.)"""
    groups = max(1.0, sims["groups"])
    granted = calls.get("dispatcher.lease (granted)", [0, 0.0])
    return granted[1] / max(1, granted[0]) + sims["weights_s"] / groups  # weights_s: store.get, ray.get, install


def calls_in_window(now: dict, before: dict) -> dict[str, list[float]]:
    return {k: [v[0] - before.get(k, [0, 0.0])[0], v[1] - before.get(k, [0, 0.0])[1], v[2]] for k, v in now.items()}


def host_totals(hosts: list[dict]) -> dict[str, float]:
    keys = (*RolloutWorker.COUNTERS, "overrun_s", "install_s")
    return {k: float(sum(h.get(k, 0.0) for h in hosts)) for k in keys}


# ----------------------------------------------------------------------------------------------- printing
def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def print_setting(r: dict[str, Any], spec: SimSpec, printer=print) -> None:
    S = r["time_scale"]
    regime = "learner-bound" if r["learner_bound"] else "rollout-bound"
    printer(f"\n== {r['workers']} simulated rollout workers on {len(r['layout'])} Ray actors "
            f"({'/'.join(map(str, r['layout']))}), threshold {r['threshold']}, time scale {S:g}x, "
            + (f"a refused lease waits up to {r['lease_wait_s']:g} s in the dispatcher =="
               if r.get("lease_wait_s", 0.0) > 0 else f"poll after a refused lease {1e3 * r['poll_s']:g} ms =="))
    printer(f"regime: {regime}: rollout capacity {r['capacity']:.2f} vs learner demand {r['demand']:.2f} "
            "samples/model-s")
    printer(f"run: {r['wall_s']:.0f} s real ({r['wall_s'] * S / 60:.0f} model-min), {r['steps']} learner steps; "
            f"measured window: steps {r['steps'] - r['window_steps'] + 1}-{r['steps']} "
            f"({r['window_s']:.1f} s real, {r['samples']} samples)")
    printer(f"throughput: {r['throughput']:.3f} samples/model-s  (ideal overlap bound {r['ideal']:.3f}) "
            f"ratio {100 * r['ratio']:.1f} %")
    printer(f"learner idle: {100 * r['learner_idle']:.1f} %   where the learner loop's time went:")
    for k, v in r["split"].items():
        printer(f"    {k:<38s} {100 * v:6.2f} %")
    printer(f"staleness of trained samples (lag: samples): {r['lags']}  max {r['max_lag']} vs threshold "
            f"{r['threshold']}: {'held' if r['bound_held'] else 'BROKEN'}; audit trail agrees: "
            f"{r['audit_lags'] == r['lags']}")
    printer(f"exactly once: {r['exactly_once_text']} ({r['trained_samples']} samples trained)")
    print_control_plane(r, spec, printer)


def print_control_plane(r: dict[str, Any], spec: SimSpec, printer=print) -> None:
    S, sims, calls = r["time_scale"], r["sims"], r["calls"]
    step_model = spec.time.step_s(r["workers"])
    printer(f"control plane, learner side: {fmt_ms(r['learner_cp_s'])} per step outside updates and waits = "
            f"{100 * r['learner_cp_frac']:.2f} % of a step ({step_model:.0f} model-s = {step_model / S:.2f} s real). "
            f"At full scale it lies between {100 * r['learner_cp_frac'] / S:.3f} % (all of it fixed per-call cost, "
            f"which compression inflates {S:g}x) and {100 * r['learner_cp_frac']:.2f} % (all of it byte copies)")
    printer(f"control plane, worker side:  {fmt_ms(r['worker_cp_s'])} per group before generating (a granted "
            f"lease, weight pulls and installs) = {100 * r['worker_cp_frac']:.2f} % of a group's "
            f"generation; scoring + put + complete run beside the next generation: "
            f"{fmt_ms(sims['put_s'] / max(1.0, sims['groups']))} of put + complete per group; "
            f"{sims['weight_pulls']:.0f} weight pulls for {sims['groups']:.0f} groups (only a granted lease pulls)")
    printer("  timed calls (client round trips on the real objects, whole run; dispatcher.* and buffer.* from the "
            "driver and every simulated worker):")
    trained = max(1, r["trained_samples"])
    for name, (count, total, peak) in sorted(calls.items(), key=lambda kv: -kv[1][1]):
        printer(f"    {name:<36s} {int(count):8d} calls  mean {fmt_ms(total / max(1, count)):>10s}  "
                f"max {fmt_ms(peak):>10s}  per trained sample {1e6 * total / trained:8.1f} us")
    dt = max(1e-9, r["cpu_interval_s"])
    cpu_line = ", ".join(f"{k} {100 * v / dt:.0f} %" for k, v in sorted(r["cpu"].items(), key=lambda kv: -kv[1])
                         if v / dt > 0.005)
    printer(f"  CPU in the window (% of one core): {cpu_line}")
    printer(f"  machine: busy {100 * r['machine_busy']:.0f} % of {os.cpu_count()} cores; processes outside this run "
            f"used {r['outside_cores']:.2f} cores")
    refused = calls.get("dispatcher.lease (refused)", [0, 0.0])[0]
    waiting_s = sims["idle_s"]  # from a refused lease call's start to the next lease call
    waiting = waiting_s / max(1e-9, r["wall_s"])
    printer(f"  admission waits: {100 * waiting_s / max(1e-9, sims['wall_s']):.1f} % of worker time, {waiting:.1f} "
            f"simulated workers on average, polling {refused / max(1e-9, r['wall_s']):.0f} refused leases/s (each: "
            + (f"a lease that waits up to {spec.lease_wait_s:g} s in the dispatcher; should_stop only when a wait "
               "ended early)"
               if spec.lease_wait_s > 0 else
               f"lease + should_stop + {spec.poll_s * 1e3:.0f} ms sleep). The poll interval is real "
               f"time, so at full scale as many waiting workers send the dispatcher up to "
               f"{2 * waiting / spec.poll_s:.0f} calls/s"))


def waits_text(r: dict[str, Any]) -> str:
    """How a worker waits after a refused lease: ``wait`` (in the dispatcher) or the poll interval (``20ms``)."""
    if r.get("lease_wait_s", 0.0) > 0:
        return "wait"
    return f"{1e3 * r['poll_s']:g}ms" if "poll_s" in r else ""


def name(r: dict[str, Any]) -> str:
    """A setting's label: workers, how they wait after a refused lease (``128@wait``, ``128@20ms``) and
    ``:serial`` when the learner does not sample ahead, ``:land`` when it takes the next batch's groups as they
    land, ``:gap`` when the next update waits for the loop's publish and bookkeeping (not back to back)."""
    how = waits_text(r)
    label = f"{r['workers']}@{how}" if how else str(r["workers"])
    if not r.get("sample_ahead", True):
        return label + ":serial"
    if not r.get("back_to_back", True):
        return label + ":gap"
    return label + (":land" if r.get("land", False) else "")


def goals(results: list[dict[str, Any]]) -> list[tuple[str, bool | None, str]]:
    """The issue's goals: (text, met or None when no setting applies, details)."""
    out = []
    big = [r for r in results if r["workers"] >= 32]
    out.append(("throughput >= 90 % of the ideal overlap bound at 32 and 128 simulated workers",
                all(r["ratio"] >= 0.9 for r in big) if big else None,
                ", ".join(f"{name(r)}: {100 * r['ratio']:.1f} %" for r in big)))
    lb = [r for r in results if r["learner_bound"]]
    out.append(("learner idle < 5 % whenever rollout capacity exceeds learner demand",
                all(r["learner_idle"] < 0.05 for r in lb) if lb else None,
                ", ".join(f"{name(r)}: {100 * r['learner_idle']:.1f} %" for r in lb)))
    out.append(("staleness bound held (every trained sample's lag <= threshold)",
                all(r["bound_held"] for r in results),
                ", ".join(f"{name(r)}: max lag {r['max_lag']}" for r in results)))
    out.append(("control plane < 1 % of a step's time (learner loop per step, worker loop per group)",
                all(r["learner_cp_frac"] < 0.01 and r["worker_cp_frac"] < 0.01 for r in results),
                ", ".join(f"{name(r)}: {100 * r['learner_cp_frac']:.2f} % / {100 * r['worker_cp_frac']:.2f} %"
                          for r in results)))
    return out


def print_summary(results: list[dict[str, Any]], printer=print) -> None:
    printer("\n== summary (samples per model second; CP = control plane share of a step / of a group) ==")
    printer(f"{'setting':>10s} {'regime':>13s} {'ideal':>7s} {'got':>7s} {'ratio':>7s} {'l.idle':>7s} "
            f"{'max lag':>7s} {'CP/step':>8s} {'CP/group':>8s} {'steps':>5s}")
    for r in results:
        printer(f"{name(r):>10s} {'learner-bound' if r['learner_bound'] else 'rollout-bound':>13s} "
                f"{r['ideal']:7.3f} {r['throughput']:7.3f} {100 * r['ratio']:6.1f}% {100 * r['learner_idle']:6.1f}% "
                f"{r['max_lag']:7d} {100 * r['learner_cp_frac']:7.2f}% {100 * r['worker_cp_frac']:7.2f}% "
                f"{r['steps']:5d}")
    for how in sorted({waits_text(r) for r in results}):
        subset = [r for r in results if waits_text(r) == how]
        label = {"wait": "refused leases wait in the dispatcher", "": ""}.get(how, f"refused leases poll every {how}")
        printer(f"\ngoals ({label}):" if label else "\ngoals:")
        for text, ok, detail in goals(subset):
            printer(f"  [{'n/a' if ok is None else verdict(ok)}] {text} ({detail})")


def print_model(spec: SimSpec, printer=print) -> None:
    t, p = spec.time, spec.payload
    printer("time model (model seconds; see TimeModel for sources and assumptions):")
    printer(f"  group of {t.group_size} images: generation {t.gen_s:g} s (lognormal sigma {t.gen_sigma:g}), "
            f"reward median {t.reward_median_s:g} s (lognormal sigma {t.reward_sigma:g}, mean "
            f"{t.reward_mean_s():.2f} s, scored on {t.scoring_threads} threads beside generation)")
    printer(f"  learner step: {t.batch_groups} groups = {t.batch_groups * t.group_size} samples in {t.update_s:g} s "
            f"(sigma {t.update_sigma:g}) -> demand {t.demand():.2f} samples/s; one worker: "
            f"{t.capacity(1):.3f} samples/s")
    printer(f"  payload: {p.sample_bytes() / MiB:.1f} MiB per sample, {p.sample_bytes() * t.group_size / MiB:.0f} MiB "
            f"per group at full size; sent at {spec.payload_scale:.4g}x = "
            f"{p.sample_bytes() * t.group_size * spec.payload_scale / MiB:.1f} MiB per group")
    printer(f"  weights: LoRA {p.lora_params() / 1e6:.1f} M params = {p.lora_bytes() / MiB:.0f} MiB in "
            f"{p.lora_tensors()} tensors; sent at {spec.payload_scale:.4g}x")
    printer(f"  compression: time / {spec.time_scale:g}; after a refused lease a worker waits up to "
            f"{spec.lease_wait_s:g} s in the dispatcher (or, with N@S settings, polls every S s; real seconds)")
