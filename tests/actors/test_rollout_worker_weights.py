"""A rollout worker's weight installs: versions only move forward; a fetch that lost a race is left alone."""

from __future__ import annotations

import numpy as np
import pytest

from omnirl_async.actors.rollout_worker import RolloutWorker
from omnirl_async.config import load_config


def _lora(worker: RolloutWorker, shift: float) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() + shift for k, v in worker.policy.lora_state_dict().items()}


def test_an_older_version_is_refused_or_with_if_newer_left_alone(small_overrides):
    worker = RolloutWorker(load_config(small_overrides))
    base = _lora(worker, 0.0)
    two, one = _lora(worker, 0.02), _lora(worker, 0.01)
    assert worker.set_weights(2, two) == 2
    installed = {k: v.detach().cpu().numpy() for k, v in worker.policy.lora_state_dict().items()}
    assert all(np.allclose(installed[k], two[k]) for k in two) and not all(np.allclose(installed[k], base[k])
                                                                          for k in base)
    with pytest.raises(ValueError, match="version 1 is older than the installed 2"):
        worker.set_weights(1, one)
    # the rollout loop fetched version 1 while a validation request installed 2: the loop's install is a no-op
    assert worker.set_weights(1, one, if_newer=True) == 2
    after = {k: v.detach().cpu().numpy() for k, v in worker.policy.lora_state_dict().items()}
    assert all(np.array_equal(after[k], installed[k]) for k in installed)
    assert worker.get_version() == 2


def test_read_only_arrays_from_shared_memory_install_without_a_copy_or_a_warning(small_overrides):
    """The weight store's arrays come back read-only (views of Ray's shared memory): they are installed as they
    are – no whole-state copy first, no "not writable" warning – and stay as they were."""
    import warnings

    from omnirl_async.actors.rollout_worker import _to_tensor_dict

    worker = RolloutWorker(load_config(small_overrides))
    fetched = _lora(worker, 0.03)
    for v in fetched.values():
        v.flags.writeable = False
    before = {k: v.copy() for k, v in fetched.items()}
    tensors = _to_tensor_dict(fetched)
    key = next(iter(fetched))
    assert tensors[key].data_ptr() == fetched[key].ctypes.data  # a view, not a copy
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert worker.set_weights(1, fetched) == 1
    installed = {k: v.detach().cpu().numpy() for k, v in worker.policy.lora_state_dict().items()}
    assert all(np.array_equal(installed[k], before[k]) for k in before)
    assert all(np.array_equal(fetched[k], before[k]) for k in before)
    # the model's parameters are its own memory, not the (read-only, soon released) shared arrays
    assert all(p.data_ptr() != fetched[key].ctypes.data for p in worker.policy.transformer.parameters())


def test_a_lease_for_a_version_the_store_lacks_stops_the_loop_with_the_reason(ray_cluster, small_overrides):
    """The dispatcher admitted a lease for version 3 (announced), but the weight store's newest is 1: generating
    with version 1 would break the staleness bound admission counted on, so the loop fails, naming both versions."""
    from omnirl_async.actors.prompt_dispatcher import PromptDispatcher
    from omnirl_async.learners.weight_store import WeightStore, publish_weights

    worker = RolloutWorker(load_config(small_overrides))
    store = ray_cluster.remote(num_cpus=0)(WeightStore).remote(keep=2)
    publish_weights(store, 1, _lora(worker, 0.01), is_lora=True)
    dispatcher = ray_cluster.remote(num_cpus=0)(PromptDispatcher).remote(["one red circle"], n=2, batch_groups=1)
    ray_cluster.get(dispatcher.on_update.remote(0, published_version=3))
    with pytest.raises(RuntimeError, match="admitted for weights version 3, but the weight store's newest is 1"):
        worker.run_loop(dispatcher, store, None, worker_id="w0", lease_wait_s=0.5)
    assert worker.get_version() == 1


def test_a_waiting_lease_that_times_out_skips_the_stop_question_and_a_stop_still_ends_the_loop(
        ray_cluster, small_overrides):
    """A paused dispatcher refuses every lease: each waits its whole ``lease_wait_s`` and comes back empty, which
    only a timeout does, so the loop does not ask ``should_stop`` after it (one call per wait, not two); a stop
    wakes the waiting lease early, and the loop then asks and ends."""
    import threading
    import time

    from omnirl_async.actors.prompt_dispatcher import PromptDispatcher
    from omnirl_async.learners.weight_store import WeightStore

    class CountingDispatcher(PromptDispatcher):
        asked = 0

        def should_stop(self) -> bool:
            self.asked += 1
            return super().should_stop()

        def times_asked(self) -> int:
            return self.asked

    worker = RolloutWorker(load_config(small_overrides))
    store = ray_cluster.remote(num_cpus=0)(WeightStore).remote(keep=2)
    dispatcher = ray_cluster.remote(num_cpus=0, max_concurrency=4)(CountingDispatcher).remote(
        ["one red circle"], n=2, batch_groups=1)
    ray_cluster.get(dispatcher.pause.remote())
    done, errors = threading.Event(), []

    def loop():
        try:
            worker.run_loop(dispatcher, store, None, worker_id="w0", lease_wait_s=0.3)
        except BaseException as err:  # reported below, with the assertion that the loop ended
            errors.append(err)
        done.set()

    threading.Thread(target=loop, daemon=True).start()
    time.sleep(1.5)  # about 5 waits of 0.3 s, all timed out
    assert not done.is_set()
    assert ray_cluster.get(dispatcher.times_asked.remote()) == 0
    t_stop = time.monotonic()
    ray_cluster.get(dispatcher.stop.remote())
    assert done.wait(10) and not errors, f"a stop must end the loop cleanly: {errors}"
    assert time.monotonic() - t_stop < 2.0
    assert 1 <= ray_cluster.get(dispatcher.times_asked.remote()) <= 2
