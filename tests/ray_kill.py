"""Killing a Ray actor in a test and waiting until it is really dead.

`ray.kill` only sends the request: on a loaded machine a call submitted just after it may still be served by the
actor (a CI run saw a "dead" reward worker score a whole group). Tests of what happens *after* a death wait here.
"""

from __future__ import annotations

import time


def kill_and_wait_until_dead(actor, timeout_s: float = 60.0) -> None:
    """Kill ``actor`` and return once a call to it fails with `RayActorError`; fail the test after ``timeout_s``."""
    import ray

    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass  # dying actors may neither answer nor fail for a while: ask again until the deadline
        assert time.monotonic() < deadline, f"the killed actor {actor} still answers {timeout_s:.0f} s after ray.kill"
        time.sleep(0.1)
