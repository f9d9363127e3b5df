"""A two-node Ray cluster on one machine: join it as `ray job submit` does, place the rollout workers and
the storage unit on the second node, train separate_async, checkpoint, then resume from the checkpoint."""

from __future__ import annotations

import pytest

from omnirl_async.config import load_config
from omnirl_async.trainer.separate_async import SeparateAsyncTrainer
from omnirl_async.trainer.task_runner import init_ray

PROMPTS = ["one red circle", "two blue squares", "a green triangle", "three yellow circles",
           "a white square", "two purple triangles", "one blue circle", "four red squares"]


@pytest.fixture
def two_nodes():
    """A head with 1 CPU (the learner) and a second node with 2 CPUs and the custom resource ``node2``."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 150 << 20,
                                                             "include_dashboard": False})
    node2 = cluster.add_node(num_cpus=2, resources={"node2": 3}, object_store_memory=150 << 20)
    try:
        cluster.wait_for_nodes()
        yield cluster, node2.node_id
    finally:
        ray.shutdown()
        cluster.shutdown()


class Recording(SeparateAsyncTrainer):
    """Records the payload bytes of each trained group (a payload at or over `transfer_queue.inline_max_bytes`
    went through a storage unit)."""

    group_bytes: list[int]

    def prepare_update(self, batch, version):
        if len(batch):
            groups = len({m.tags.group_uid for m in batch.metas})
            self.group_bytes = getattr(self, "group_bytes", []) + [
                sum(v.nbytes for v in batch.fields.values()) // groups]
        return super().prepare_update(batch, version)


def _node_of(actor) -> str:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()), timeout=120)


@pytest.mark.slow  # a two-node Ray cluster and two short training runs
def test_separate_async_on_two_nodes_places_roles_and_resumes(two_nodes, small_overrides, tmp_path, monkeypatch):
    import ray

    from omnirl_async.buffer.spec import TransportSpec

    cluster, node2 = two_nodes
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)  # what `ray job submit` sets for its entrypoint

    def cfg(steps):
        return load_config(small_overrides + [
            "trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.rollout.num_workers=2",
            "actor_rollout_ref.rollout.pipeline.num_inference_steps=3", "transfer_queue.num_data_storage_units=1",
            "transfer_queue.producer_owned_payloads=false",  # the storage unit on node2 owns the payloads
            "+ray_kwargs.role_resources.rollout={node2:1}", "+ray_kwargs.role_resources.storage={node2:1}",
            "ray_kwargs.placement_timeout_s=120", f"trainer.total_training_steps={steps}", "trainer.save_freq=1",
            f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.log_dir={tmp_path / 'tb'}",
            # start-only arguments a recipe may carry: joining must leave them out, not fail
            "ray_kwargs.num_cpus=8", "+ray_kwargs.ray_init.num_cpus=8",
            "+ray_kwargs.ray_init.runtime_env={env_vars:{OMP_NUM_THREADS:'1'}}"])

    lines: list[str] = []
    assert init_ray(cfg(1), printer=lines.append)
    assert any("joining the running Ray cluster" in x for x in lines)
    assert any("ray_kwargs.ray_init.num_cpus, ray_kwargs.num_cpus" in x for x in lines)
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    driver_node = ray.get_runtime_context().get_node_id()

    # ---- run 1: one update, a checkpoint at step 1
    trainer = Recording(cfg(1), PROMPTS, printer=lines.append)
    try:
        assert [_node_of(w) for w in trainer.workers] == [node2, node2]
        assert [_node_of(u) for u in trainer.buffer._units] == [node2]
        assert _node_of(trainer.buffer._controller) == driver_node  # it writes the buffer snapshot
        assert _node_of(trainer.learners.actors[0]) != node2  # node2's CPUs are the rollout workers'
        summary = trainer.fit()
    finally:
        trainer.stop()
    assert summary["global_step"] == 1
    assert min(trainer.group_bytes) >= TransportSpec().inline_max_bytes  # every group's payload went through the unit on node2
    ckpt = tmp_path / "ckpt" / "global_step_1"
    names = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()}
    assert {"learner.safetensors", "trainer.msgpack", "manifest.json", "COMPLETE"} <= names
    assert any(n.startswith("lora/") and n.endswith(".safetensors") for n in names)
    assert any(n.startswith("buffer/") for n in names)

    # ---- run 2: resumes from step 1 (the first run's placement groups were given back: node2 has room again)
    trainer = Recording(cfg(2), PROMPTS, printer=lines.append)
    try:
        assert trainer.maybe_resume()
        assert trainer.resumed_from == ckpt and trainer.global_step == 1
        summary = trainer.fit()
    finally:
        trainer.stop()
    assert summary["global_step"] == 2 and summary["version"] == 2
    assert (tmp_path / "ckpt" / "global_step_2" / "COMPLETE").is_file()
