"""`actor_rollout_ref.rollout.nice`: every thread of a rollout worker process runs at the lower priority."""

import subprocess
import sys
import textwrap

import pytest

from omnirl_async.config import ConfigError, load_config

SCRIPT = textwrap.dedent("""
    import os, threading
    from omnirl_async.actors.rollout_worker import lower_cpu_priority
    started, stop = threading.Event(), threading.Event()
    tid = []
    def body():
        tid.append(threading.get_native_id()); started.set(); stop.wait()
    t = threading.Thread(target=body); t.start(); started.wait()
    base = os.getpriority(os.PRIO_PROCESS, 0)
    new = lower_cpu_priority(5)
    later = []
    t2 = threading.Thread(target=lambda: later.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    t2.start(); t2.join()
    print(base, new, os.getpriority(os.PRIO_PROCESS, tid[0]), later[0])
    stop.set(); t.join()
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux behaviour")
def test_lower_cpu_priority_reaches_existing_and_new_threads():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=120)
    base, new, existing, later = map(int, out.stdout.split())
    expected = min(base + 5, 19)
    assert (new, existing, later) == (expected, expected, expected)


@pytest.mark.parametrize("value", [-1, 20])
def test_nice_out_of_range_is_refused_with_the_key(value):
    with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.nice"):
        load_config([f"actor_rollout_ref.rollout.nice={value}"])


@pytest.mark.slow  # starts its own Ray; the thread-niceness test above is the fast one
def test_init_ray_starts_workers_at_nice_0_so_rollout_workers_sit_nice_levels_below(small_overrides):
    import os

    import ray

    from omnirl_async.actors.rollout_worker import lower_cpu_priority
    from omnirl_async.trainer.task_runner import init_ray

    if ray.is_initialized():
        pytest.skip("needs to start its own Ray")
    cfg = load_config(small_overrides + ["actor_rollout_ref.rollout.nice=5", "ray_kwargs.num_cpus=2"])
    assert init_ray(cfg)
    try:
        @ray.remote(num_cpus=0)
        def niceness(increment):
            base = os.getpriority(os.PRIO_PROCESS, 0)
            return base, lower_cpu_priority(increment) if increment else base

        assert ray.get(niceness.remote(0)) == (0, 0)  # a learner-like worker: Ray's 15 is not applied
        assert ray.get(niceness.remote(5)) == (0, 5)  # a rollout worker: 5 levels below it
    finally:
        ray.shutdown()
