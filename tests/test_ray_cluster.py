"""Ray clusters: joining without start-only arguments, placement groups by role, a bounded placement wait,
rendezvous on the node address, checkpoint files written by the caller.

The fast tests need no Ray; the ones marked slow start a small local Ray (the
module's ``ray_cluster`` fixture, 4 CPUs). The two-node run is in
tests/test_ray_cluster_two_nodes.py.
"""

from __future__ import annotations

import socket
import time

import pytest

from omnirl_async.config import ConfigError, load_config
from omnirl_async.learners.learner_group import interface_of, read_folder, rendezvous_address, write_folder
from omnirl_async.placement import (PlacementError, RolePlacement, RoleRequest, check_role_resources,
                                    placement_error_message, role_request)
from omnirl_async.trainer.task_runner import START_ONLY, cluster_to_join, ray_init_kwargs

KEYS = ("actor_rollout_ref.rollout.num_workers", "ray_kwargs.role_resources.rollout")


# ---------------------------------------------------------------------------- joining (no Ray needed)
def test_joining_passes_no_start_only_argument_and_names_each_one_left_out():
    cfg = load_config(["ray_kwargs.num_cpus=6", "actor_rollout_ref.rollout.nice=5", "+ray_kwargs.ray_init.num_cpus=3",
                       "+ray_kwargs.ray_init.num_gpus=1", "+ray_kwargs.ray_init.object_store_memory=100000000",
                       "+ray_kwargs.ray_init._system_config={worker_niceness:0}",
                       "+ray_kwargs.ray_init.include_dashboard=true", "+ray_kwargs.ray_init.namespace=exp",
                       "+ray_kwargs.ray_init.runtime_env={env_vars:{OMP_NUM_THREADS:'1'}}"])
    kwargs, dropped = ray_init_kwargs(cfg, joining=True)
    assert not set(kwargs) & set(START_ONLY)
    # the connection arguments stay; with no address given Ray resolves $RAY_ADDRESS / `ray start`, never starts one
    assert kwargs == {"address": "auto", "namespace": "exp", "log_to_driver": True,
                      "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}}}
    assert dropped == ["ray_kwargs.ray_init._system_config", "ray_kwargs.ray_init.include_dashboard",
                       "ray_kwargs.ray_init.num_cpus", "ray_kwargs.ray_init.num_gpus",
                       "ray_kwargs.ray_init.object_store_memory", "ray_kwargs.num_cpus"]
    explicit, _ = ray_init_kwargs(load_config(["ray_kwargs.address=10.1.2.3:6379"]), joining=True)
    assert explicit == {"address": "10.1.2.3:6379", "log_to_driver": True}


def test_starting_a_local_ray_passes_the_start_arguments():
    cfg = load_config(["ray_kwargs.num_cpus=6", "actor_rollout_ref.rollout.nice=5"])
    kwargs, dropped = ray_init_kwargs(cfg, joining=False)
    assert dropped == []
    # address=local: having decided to start one, never join a cluster by accident
    assert kwargs == {"address": "local", "num_cpus": 6, "include_dashboard": None, "log_to_driver": True,
                      "_system_config": {"worker_niceness": 0}}
    assert "_system_config" not in ray_init_kwargs(load_config([]), joining=False)[0]  # nice = 0


def test_which_cluster_is_joined_follows_rays_order():
    env = {"RAY_ADDRESS": "10.0.0.1:6379"}
    assert cluster_to_join("10.0.0.2:6379", env, "10.0.0.3:6379") == "10.0.0.2:6379"  # ray_kwargs.address first
    assert cluster_to_join(None, env, "10.0.0.3:6379") == "10.0.0.1:6379"  # then $RAY_ADDRESS (ray job submit)
    assert cluster_to_join(None, {}, "10.0.0.3:6379") == "10.0.0.3:6379"  # then a `ray start` on this machine
    assert cluster_to_join(None, {"RAY_ADDRESS": ""}, None) is None  # else start a local Ray
    assert cluster_to_join("local", env, "10.0.0.3:6379") is None  # local always starts one
    assert cluster_to_join("auto", {}, None) == "auto"


# ---------------------------------------------------------------------------- roles and messages
def test_role_requests_carry_each_roles_cpus_gpus_and_custom_resources():
    cfg = load_config(["learner.num_gpus_per_worker=1", "learner.num_cpus_per_worker=2", "reward.num_workers=2",
                       "reward.num_gpus_per_worker=0.5", "transfer_queue.num_data_storage_units=3",
                       "+ray_kwargs.role_resources.rollout={node2:1}", "+ray_kwargs.role_resources.storage={ssd:0.5}"])
    learner, rollout = role_request(cfg, "learner"), role_request(cfg, "rollout")
    assert (learner.count, learner.bundle(), learner.strategy) == (1, {"CPU": 2.0, "GPU": 1.0}, "PACK")
    assert (rollout.count, rollout.bundle(), rollout.strategy) == (2, {"CPU": 1.0, "node2": 1.0}, "SPREAD")
    assert rollout.actor_options() == {"num_cpus": 1.0, "num_gpus": 0.0, "resources": {"node2": 1.0}}
    assert role_request(cfg, "reward").bundle() == {"CPU": 1.0, "GPU": 0.5}
    storage = role_request(cfg, "storage")
    assert (storage.count, storage.bundle()) == (3, {"ssd": 0.5})
    assert role_request(load_config([]), "storage").bundle() == {}  # nothing to reserve: no placement group
    assert role_request(cfg, "rollout", count=1).count == 1  # offline-only runs place one (validation) worker


@pytest.mark.parametrize("value, match", [
    ({"rollot": {"node2": 1}}, r"`ray_kwargs.role_resources` has role 'rollot'; roles are \['learner', 'rollout'"),
    ({"rollout": {"GPU": 1}}, "names resource 'GPU'.*num_gpus_per_worker"),
    ({"learner": {"node2": 0}}, r"`ray_kwargs.role_resources.learner.node2` = 0: give an amount > 0"),
    ({"storage": 1}, r"`ray_kwargs.role_resources.storage` = 1: give a mapping"),
])
def test_bad_role_resources_are_refused_naming_the_key(value, match):
    with pytest.raises(ValueError, match=match):
        check_role_resources(value, "ray_kwargs.role_resources")


def test_config_refuses_role_resources_without_an_effect():
    with pytest.raises(ConfigError, match="`ray_kwargs.role_resources.reward` places reward workers, but "
                                          "`reward.num_workers` = 0 scores inline"):
        load_config(["+ray_kwargs.role_resources.reward={judge:1}", "ray_kwargs.placement_timeout_s=5"])
    with pytest.raises(ConfigError, match="ray_kwargs.role_resources.rollout.+names resource 'CPU'"):
        load_config(["+ray_kwargs.role_resources.rollout={CPU:1}"])


NODES = [("10.0.0.1", {"CPU": 2.0, "memory": 1e9, "node:10.0.0.1": 1.0}), ("10.0.0.2", {"CPU": 4.0, "node2": 2.0})]


def test_placement_error_says_what_was_asked_what_the_cluster_has_and_what_to_change():
    req = RoleRequest("rollout", "rollout workers", 2, 1.0, 0.0, {"gpu_box": 1}, KEYS, "SPREAD")
    msg = placement_error_message(req, 5, NODES, {"CPU": 3.0, "memory": 5e8})
    assert msg.startswith("the Ray cluster did not place the rollout workers within "
                          "`ray_kwargs.placement_timeout_s` = 5 s: they ask for 2 x {CPU: 1, gpu_box: 1}")
    assert "  10.0.0.1: {CPU: 2}\n  10.0.0.2: {CPU: 4, node2: 2}\n  free now in all: {CPU: 3}" in msg
    assert "No node has `gpu_box` at all." in msg
    assert "`actor_rollout_ref.rollout.num_workers`, `ray_kwargs.role_resources.rollout`" in msg
    big = RoleRequest("learner", "learners", 1, 8.0, 0.0, {}, ("learner.num_cpus_per_worker",))
    assert "No single node has {CPU: 8}" in placement_error_message(big, 5, NODES, {})
    many = RoleRequest("rollout", "rollout workers", 3, 1.0, 0.0, {"node2": 1}, KEYS)
    assert "The cluster has 2 node2 in all, less than the 3 actors ask for." in placement_error_message(
        many, 5, NODES, {})
    fits = RoleRequest("rollout", "rollout workers", 2, 1.0, 0.0, {}, KEYS)
    assert "other actors or jobs hold them" in placement_error_message(fits, 5, NODES, {"CPU": 0.0})


# ---------------------------------------------------------------------------- rendezvous and files
def test_learners_rendezvous_on_the_node_address_ray_reports():
    import ray.util

    ip, port = rendezvous_address()
    assert ip == ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
        s.bind((ip, port))  # it was free on that address
    assert interface_of(ip) is not None  # gloo binds to the interface that holds it
    assert interface_of("203.0.113.77") is None


def test_files_cross_as_bytes_and_stay_inside_their_folder(tmp_path):
    (tmp_path / "a" / "sub").mkdir(parents=True)
    (tmp_path / "a" / "x.json").write_text("{}")
    (tmp_path / "a" / "sub" / "w.safetensors").write_bytes(b"\x00\x01")
    files = read_folder(tmp_path / "a")
    assert files == {"sub/w.safetensors": b"\x00\x01", "x.json": b"{}"}
    write_folder(tmp_path / "b", files)
    assert read_folder(tmp_path / "b") == files
    with pytest.raises(ValueError, match="outside"):
        write_folder(tmp_path / "c", {"../evil": b"x"})


# ---------------------------------------------------------------------------- a real placement wait
@pytest.mark.slow  # starts Ray
def test_a_resource_no_node_has_ends_in_a_clear_error_after_the_timeout(ray_cluster):
    import ray

    req = RoleRequest("rollout", "rollout workers", 2, 1.0, 0.0, {"no_such_resource": 1}, KEYS, "SPREAD")
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match="No node has `no_such_resource` at all") as err:
        RolePlacement(req, timeout_s=1.0)
    assert 1.0 <= time.monotonic() - t0 < 10.0
    assert "2 x {CPU: 1, no_such_resource: 1}" in str(err.value) and "free now in all: {CPU: 4}" in str(err.value)
    assert isinstance(err.value, TimeoutError)
    # reward workers take the same path (their pool asks the trainer's placements for each actor's options)
    from omnirl_async.placement import Placements
    from omnirl_async.rewards.worker_pool import make_reward_actors

    cfg = load_config(["reward.num_workers=1", "+ray_kwargs.role_resources.reward={judge_gpu_node:1}",
                       "ray_kwargs.placement_timeout_s=0.5"])
    placements = Placements(cfg)
    with pytest.raises(PlacementError, match=r"(?s)reward workers.*`judge_gpu_node`.*`reward.num_workers`"):
        make_reward_actors(cfg.reward, placement=lambda i: placements.options("reward", i))
    # the group that was never placed is removed: its CPUs stay free for the next one
    ok = RolePlacement(RoleRequest("learner", "learners", 2, 2.0, 0.0, {}, ()), timeout_s=30)
    try:
        @ray.remote
        class Where:
            def node(self):
                return ray.get_runtime_context().get_node_id()

        actors = [Where.options(**ok.options(i)).remote() for i in range(2)]
        assert len(set(ray.get([a.node.remote() for a in actors]))) == 1
        with pytest.raises(IndexError, match="actor 2 has no bundle"):
            ok.options(2)
        assert ray.available_resources().get("CPU", 0) == 0  # both bundles reserved
    finally:
        ok.remove()
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == 4


@pytest.mark.slow  # starts Ray and builds a trainer
@pytest.mark.parametrize("mode", ["sync", "separate_async"])
def test_a_trainer_whose_roles_cannot_be_placed_stops_naming_the_keys(ray_cluster, small_overrides, tmp_path, mode):
    from omnirl_async.learners.learner_group import LearnerGroup

    cfg = load_config(small_overrides + [f"trainer.v1.trainer_mode={mode}", "ray_kwargs.placement_timeout_s=1",
                                         "+ray_kwargs.role_resources.rollout={node_with_gpu:1}",
                                         f"trainer.default_local_dir={tmp_path}", f"trainer.log_dir={tmp_path}/tb"])
    if mode == "sync":
        from omnirl_async.trainer.sync import SyncTrainer as cls
    else:
        from omnirl_async.trainer.separate_async import SeparateAsyncTrainer as cls
    with pytest.raises(PlacementError, match=r"(?s)rollout workers.*No node has `node_with_gpu`.*"
                                             r"`ray_kwargs.role_resources.rollout`"):
        cls(cfg, ["one red circle"], printer=lambda *a: None)
    big = load_config(small_overrides + ["learner.num_cpus_per_worker=64", "ray_kwargs.placement_timeout_s=1"])
    with pytest.raises(PlacementError, match=r"(?s)learners.*No single node has \{CPU: 64\}.*"
                                             r"`learner.num_cpus_per_worker`"):
        LearnerGroup(big, use_ray=True)


@pytest.mark.slow  # starts Ray and builds a trainer
@pytest.mark.parametrize("mode", ["sync", "separate_async"])
def test_a_setup_that_fails_midway_releases_its_placement_groups(ray_cluster, small_overrides, tmp_path, mode):
    """Rollout workers placed, then the learners fail to start: no placement group stays reserved."""
    from ray.util import placement_group_table

    if mode == "sync":
        from omnirl_async.trainer.sync import SyncTrainer as base
    else:
        from omnirl_async.trainer.separate_async import SeparateAsyncTrainer as base

    class LearnersFail(base):
        def make_learners(self):
            raise RuntimeError("the learners could not start")

    def reserved() -> list[str]:
        return [g["name"] or pid for pid, g in placement_group_table().items() if g["state"] != "REMOVED"]

    cfg = load_config(small_overrides + [f"trainer.v1.trainer_mode={mode}", "actor_rollout_ref.rollout.num_workers=2",
                                         f"trainer.default_local_dir={tmp_path}", f"trainer.log_dir={tmp_path}/tb"])
    before = reserved()
    with pytest.raises(RuntimeError, match="the learners could not start"):
        LearnersFail(cfg, ["one red circle"], printer=lambda *a: None)
    deadline = time.monotonic() + 10
    while reserved() != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert reserved() == before
