"""Bounded ``ray.get``: every wait of the driver on a remote call has a limit, and a wait that hits it says
what was awaited, the limit with the key that sets it, and why the answer may not have come."""

from __future__ import annotations

from typing import Any


def bounded_get(refs: Any, timeout_s: float, what: str, why: str, key: str | None = "trainer.wait_timeout_s") -> Any:
    """``ray.get(refs)`` within ``timeout_s``; past it, :class:`TimeoutError` reading
    "<what> got no answer within `<key>` = <timeout_s> s. <why>" (``key`` None: no key sets the limit alone).
    Errors raised by the call itself pass through."""
    import ray

    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        limit = f"`{key}` = {timeout_s:g} s" if key else f"{timeout_s:g} s"
        raise TimeoutError(f"{what} got no answer within {limit}. {why}") from None
