"""Where each role's Ray actors run: one placement group per role, a bounded wait, a clear error.

A *role* is a kind of actor the trainer starts several of: ``learner``,
``rollout`` (rollout workers), ``reward`` (reward workers, with
``reward.num_workers`` > 0) and ``storage`` (transfer-queue storage units).
Each actor of a role asks for the same resources, its *bundle*:

* ``CPU`` = the role's ``num_cpus_per_worker`` and ``GPU`` = its
  ``num_gpus_per_worker`` when above 0 (a GPU bundle on a GPU cluster, a CPU
  bundle otherwise);
* plus the custom resources of ``ray_kwargs.role_resources.<role>``, e.g.
  ``{rollout: {node2: 1}}`` puts every rollout worker on a node started with
  ``ray start --resources='{"node2": 4}'``.

:class:`RolePlacement` reserves ``count`` such bundles at once in one Ray
placement group (learners ``PACK``: a process group is faster on one node;
the others ``SPREAD`` over the nodes) and actor ``i`` runs in bundle ``i``; a
replacement for a dead actor takes the bundle its predecessor left. Why a
placement group and not plain actor options: plain options let Ray start some
learners of a process group while the rest wait forever (they hold their CPUs
and the group never forms), and a request no node can ever satisfy pends
silently. A placement group is reserved whole or not at all, and its wait is
bounded: after ``ray_kwargs.placement_timeout_s`` the wait ends in a
:class:`PlacementError` that names the role, the bundle and count it asked
for, every node with its resources, what is free now and the keys to change
(:func:`placement_error_message`). A role whose bundle is empty (storage units
need no CPU) and has no custom resources gets no placement group: Ray places
such actors anywhere at once.

:func:`driver_node_options` pins an actor to the driver's node (the
transfer-queue controller, which writes and reads buffer snapshots, so that
every checkpoint file is written on the driver's node).

This module reads the root config by attribute access only (it is the one
place that maps config keys to Ray resources) and imports Ray lazily.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["ROLES", "RoleRequest", "RolePlacement", "Placements", "PlacementError", "role_request",
           "placement_error_message", "cluster_nodes", "driver_node_options", "check_role_resources"]

#: The roles whose actors ``ray_kwargs.role_resources`` can place.
ROLES = ("learner", "rollout", "reward", "storage")
#: Resources a role asks for through its own keys (``num_cpus_per_worker``...), never through role_resources.
RESERVED = ("CPU", "GPU", "memory", "object_store_memory")
#: How often a wait for placement says what it is waiting for.
NOTE_EVERY_S = 30.0


class PlacementError(TimeoutError):
    """The cluster did not place a role's actors within ``ray_kwargs.placement_timeout_s``."""


def check_role_resources(value: Any, path: str) -> None:
    """``ValueError`` naming ``path`` unless ``value`` maps roles to ``{resource name: amount > 0}``."""
    if not isinstance(value, Mapping):
        raise ValueError(f"`{path}` = {value!r}: give a mapping of role to resources, e.g. {{rollout: {{node2: 1}}}}.")
    for role, res in value.items():
        if role not in ROLES:
            raise ValueError(f"`{path}` has role {role!r}; roles are {list(ROLES)}.")
        if not isinstance(res, Mapping):
            raise ValueError(f"`{path}.{role}` = {res!r}: give a mapping of Ray resource name to amount per actor, "
                             "e.g. {node2: 1}.")
        for name, amount in res.items():
            if not isinstance(name, str) or name in RESERVED:
                raise ValueError(f"`{path}.{role}` names resource {name!r}: CPU, GPU and memory come from the "
                                 "role's own keys (`num_cpus_per_worker`, `num_gpus_per_worker`); list only custom "
                                 "resources (those of `ray start --resources=...`, or node:<ip>).")
            if (isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount)
                    or amount <= 0 or (amount < 1 and round(amount * 10000) == 0)):
                raise ValueError(f"`{path}.{role}.{name}` = {amount!r}: give an amount > 0 per actor (at least "
                                 "0.0001; e.g. 1, or 0.01 to let many actors share one unit).")


@dataclass(frozen=True)
class RoleRequest:
    """What each of ``count`` actors of one role asks for, and the config keys that say so."""

    role: str
    label: str                 # for messages: "rollout workers"
    count: int
    num_cpus: float = 0.0
    num_gpus: float = 0.0
    resources: Mapping[str, float] = field(default_factory=dict)
    keys: tuple[str, ...] = ()
    strategy: str = "PACK"

    def bundle(self) -> dict[str, float]:
        """One actor's resources as a placement-group bundle (empty: the role needs no reservation)."""
        out: dict[str, float] = {}
        if self.num_cpus > 0:
            out["CPU"] = float(self.num_cpus)
        if self.num_gpus > 0:
            out["GPU"] = float(self.num_gpus)
        out.update({k: float(v) for k, v in self.resources.items()})
        return out

    def actor_options(self) -> dict[str, Any]:
        """``num_cpus`` / ``num_gpus`` / ``resources`` of one actor (what it takes out of its bundle)."""
        opts: dict[str, Any] = {"num_cpus": float(self.num_cpus), "num_gpus": float(self.num_gpus)}
        if self.resources:
            opts["resources"] = {k: float(v) for k, v in self.resources.items()}
        return opts


def role_request(config: Any, role: str, count: int | None = None) -> RoleRequest:
    """The request of ``role`` from the root ``config``; ``count`` overrides the role's number of actors."""
    res = dict((getattr(config.ray_kwargs, "role_resources", None) or {}).get(role) or {})
    rr = f"ray_kwargs.role_resources.{role}"
    if role == "learner":
        c = config.learner
        return RoleRequest(role, "learners", c.num_workers if count is None else count, c.num_cpus_per_worker,
                           c.num_gpus_per_worker, res, ("learner.num_workers", "learner.num_cpus_per_worker",
                                                        "learner.num_gpus_per_worker", rr), "PACK")
    if role == "rollout":
        c, p = config.actor_rollout_ref.rollout, "actor_rollout_ref.rollout"
        return RoleRequest(role, "rollout workers", c.num_workers if count is None else count,
                           c.num_cpus_per_worker, c.num_gpus_per_worker, res,
                           (f"{p}.num_workers", f"{p}.num_cpus_per_worker", f"{p}.num_gpus_per_worker", rr), "SPREAD")
    if role == "reward":
        c = config.reward
        return RoleRequest(role, "reward workers", c.num_workers if count is None else count, c.num_cpus_per_worker,
                           float(getattr(c, "num_gpus_per_worker", 0.0) or 0.0), res,
                           ("reward.num_workers", "reward.num_cpus_per_worker", "reward.num_gpus_per_worker", rr),
                           "SPREAD")
    if role == "storage":
        n = config.transfer_queue.num_data_storage_units
        return RoleRequest(role, "transfer-queue storage units", n if count is None else count, 0.0, 0.0, res,
                           ("transfer_queue.num_data_storage_units", rr), "SPREAD")
    raise ValueError(f"unknown role {role!r}; roles are {list(ROLES)}")


# ---------------------------------------------------------------------------- the cluster, for messages
def _shown(resources: Mapping[str, float]) -> dict[str, float]:
    """CPU, GPU and custom resources; not memory, node ids or the placement groups' own bookkeeping."""
    return {k: v for k, v in resources.items()
            if k not in ("memory", "object_store_memory") and not k.startswith(("node:", "accelerator_type:"))
            and "_group_" not in k}


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def cluster_nodes() -> list[tuple[str, dict[str, float]]]:
    """``(address, total resources)`` of every live node of the connected Ray cluster."""
    import ray

    return [(n.get("NodeManagerAddress", "?"), dict(n.get("Resources") or {}))
            for n in ray.nodes() if n.get("Alive", n.get("alive", False))]


def _fits(bundle: Mapping[str, float], have: Mapping[str, float]) -> bool:
    return all(have.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())


def placement_error_message(request: RoleRequest, timeout_s: float, nodes: list[tuple[str, dict[str, float]]],
                            free: Mapping[str, float]) -> str:
    """Why ``request`` was not placed within ``timeout_s``: what it asked, what the cluster has, what to change."""
    bundle = request.bundle()
    lines = [f"the Ray cluster did not place the {request.label} within `ray_kwargs.placement_timeout_s` = "
             f"{timeout_s:g} s: they ask for {request.count} x {_fmt(bundle)} (one bundle per actor, placement "
             f"strategy {request.strategy}), but the cluster has {len(nodes)} node(s):"]
    lines += [f"  {addr}: {_fmt(_shown(res))}" for addr, res in nodes]
    lines.append(f"  free now in all: {_fmt(_shown(free))}")
    missing = sorted(k for k in bundle if not any(res.get(k, 0.0) > 0 for _, res in nodes))
    if missing:
        lines.append(f"No node has {', '.join(f'`{k}`' for k in missing)} at all.")
    elif not any(_fits(bundle, res) for _, res in nodes):
        lines.append(f"No single node has {_fmt(bundle)}, and one actor's bundle must fit on one node.")
    else:
        total = {k: sum(res.get(k, 0.0) for _, res in nodes) for k in bundle}
        short = [k for k, v in bundle.items() if v * request.count > total[k] + 1e-9]
        if short:
            lines.append(f"The cluster has {', '.join(f'{total[k]:g} {k}' for k in short)} in all, less than "
                         f"the {request.count} actors ask for.")
        else:
            lines.append("The cluster has these resources, but other actors or jobs hold them (see `ray status`).")
    lines.append(f"Fix: lower or change {', '.join(f'`{k}`' for k in request.keys)}; or add nodes that have "
                 "them (`ray start --address=<head>:6379 --num-cpus=N --num-gpus=N --resources='{\"name\": N}'`); "
                 "on an autoscaling cluster raise `ray_kwargs.placement_timeout_s`.")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- placing
class RolePlacement:
    """The placement group of one role (none when its bundle is empty); actor ``i`` gets bundle ``i``."""

    def __init__(self, request: RoleRequest, *, timeout_s: float, printer: Callable[[str], None] | None = None):
        self.request = request
        self.timeout_s = float(timeout_s)
        self.pg = None
        bundle = request.bundle()
        if request.count > 0 and bundle:
            self.pg = self._reserve(bundle, printer)

    def _reserve(self, bundle: dict[str, float], printer):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        req = self.request
        pg = placement_group([dict(bundle) for _ in range(req.count)], strategy=req.strategy)
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if pg.wait(timeout_seconds=max(0.0, min(left, NOTE_EVERY_S))):
                return pg
            if time.monotonic() >= deadline:
                remove_placement_group(pg)
                raise PlacementError(placement_error_message(req, self.timeout_s, cluster_nodes(),
                                                             ray.available_resources()))
            if printer is not None:
                printer(f"waiting for the Ray cluster to place {req.count} {req.label} ({_fmt(bundle)} each; "
                        f"free now: {_fmt(_shown(ray.available_resources()))}); giving up after "
                        f"`ray_kwargs.placement_timeout_s` = {self.timeout_s:g} s")

    def options(self, index: int) -> dict[str, Any]:
        """Ray actor options of actor ``index``: its resources and, with a placement group, its bundle."""
        opts = self.request.actor_options()
        if self.pg is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            if not 0 <= index < self.request.count:
                raise IndexError(f"{self.request.label}: actor {index} has no bundle (0..{self.request.count - 1})")
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=index, placement_group_capture_child_tasks=False)
        return opts

    def remove(self) -> None:
        """Give the reservation back (the actors in it are ended by Ray); safe to call twice."""
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - Ray already shut down or the group is gone
                pass
            self.pg = None


class Placements:
    """The roles of one run, each placed at its first use; :meth:`remove_all` at the end of the run."""

    def __init__(self, config: Any, *, printer: Callable[[str], None] | None = None):
        self.config = config
        self.timeout_s = float(config.ray_kwargs.placement_timeout_s)
        self.printer = printer
        self.roles: dict[str, RolePlacement] = {}

    def role(self, role: str, count: int | None = None) -> RolePlacement:
        """The placement of ``role`` (reserved now when it is the first use; ``count``: its number of actors)."""
        if role not in self.roles:
            self.roles[role] = RolePlacement(role_request(self.config, role, count), timeout_s=self.timeout_s,
                                             printer=self.printer)
        return self.roles[role]

    def options(self, role: str, index: int, count: int | None = None) -> dict[str, Any]:
        return self.role(role, count).options(index)

    def remove_all(self) -> None:
        for placement in self.roles.values():
            placement.remove()
        self.roles = {}


def driver_node_options() -> dict[str, Any]:
    """Actor options that keep an actor on the driver's node (files it writes land where the driver writes)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                  soft=False)}
