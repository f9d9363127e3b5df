"""Old-policy EMA: decay schedules and the in-place update."""

from __future__ import annotations

import pytest
import torch

from omnirl_async.algos import DECAY_SCHEDULES, decay_at, ema_update_

STEPS = (0, 50, 75, 100, 1000)


@pytest.mark.parametrize("schedule, expected", [
    ("copy", (0.0, 0.0, 0.0, 0.0, 0.0)),
    ("linear_to_0_5", (0.0, 0.05, 0.075, 0.1, 0.5)),
    ("delayed_linear_to_0_999", (0.0, 0.0, 0.0, 0.1875, 0.999)),
])
def test_schedule_values(schedule, expected):
    for step, want in zip(STEPS, expected):
        assert decay_at(step, schedule) == pytest.approx(want, abs=1e-12), (schedule, step)


def test_schedule_edges():
    assert decay_at(499, "linear_to_0_5") == pytest.approx(0.499)
    assert decay_at(500, "linear_to_0_5") == 0.5 and decay_at(10**6, "linear_to_0_5") == 0.5
    assert decay_at(74, "delayed_linear_to_0_999") == 0.0
    assert decay_at(76, "delayed_linear_to_0_999") == pytest.approx(0.0075)
    assert decay_at(208, "delayed_linear_to_0_999") == pytest.approx(0.9975)
    assert decay_at(209, "delayed_linear_to_0_999") == 0.999  # 0.0075*134 = 1.005, capped
    assert set(DECAY_SCHEDULES) == {"copy", "linear_to_0_5", "delayed_linear_to_0_999"}


def test_fixed_overrides_schedule():
    for step in STEPS:
        assert decay_at(step, "linear_to_0_5", fixed=0.9) == 0.9
        assert decay_at(step, "delayed_linear_to_0_999", fixed=0.0) == 0.0
    with pytest.raises(ValueError, match="algorithm.old_policy_decay"):
        decay_at(3, "copy", fixed=1.5)


def test_unknown_schedule_and_bad_step():
    with pytest.raises(ValueError) as e:
        decay_at(0, "cosine")
    msg = str(e.value)
    assert "algorithm.old_policy_decay_schedule" in msg and "'cosine'" in msg
    for name in ("copy", "linear_to_0_5", "delayed_linear_to_0_999"):
        assert name in msg
    with pytest.raises(ValueError, match="step"):
        decay_at(-1, "copy")


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    return {"a.lora_A": torch.randn(4, 3, generator=g), "a.lora_B": torch.randn(3, 4, generator=g),
            "b.lora_A": torch.randn(2, generator=g, dtype=torch.float64)}


@pytest.mark.parametrize("d", [0.0, 0.25, 0.999, 1.0])
def test_ema_update_in_place(d):
    old, cur = _params(0), _params(1)
    before = {k: v.clone() for k, v in old.items()}
    ptrs = {k: v.data_ptr() for k, v in old.items()}
    ema_update_(old, cur, d)
    for k in old:
        assert old[k].data_ptr() == ptrs[k]
        want = [d * a + (1 - d) * b for a, b in zip(before[k].reshape(-1).tolist(), cur[k].reshape(-1).tolist())]
        got = old[k].reshape(-1).tolist()
        assert got == pytest.approx(want, rel=1e-6, abs=1e-6), k
    if d == 0.0:
        for k in old:
            assert torch.equal(old[k], cur[k])
    if d == 1.0:
        for k in old:
            assert torch.equal(old[k], before[k])


def test_ema_update_no_grad_and_current_untouched():
    old = {k: v.requires_grad_(False) for k, v in _params(0).items()}
    cur = {k: v.clone().requires_grad_(True) for k, v in _params(1).items()}
    cur_before = {k: v.detach().clone() for k, v in cur.items()}
    ema_update_(old, cur, 0.5)
    for k in old:
        assert old[k].grad_fn is None and not old[k].requires_grad
        assert torch.equal(cur[k].detach(), cur_before[k])
    # leaf parameters that require grad can be updated in place too (no autograd recording)
    p_old = {"w": torch.nn.Parameter(torch.zeros(3))}
    ema_update_(p_old, {"w": torch.ones(3)}, 0.5)
    assert torch.equal(p_old["w"].detach(), torch.full((3,), 0.5)) and p_old["w"].grad_fn is None


def test_ema_update_key_and_shape_errors():
    old, cur = _params(0), _params(1)
    del cur["a.lora_B"]
    with pytest.raises(KeyError, match="a.lora_B"):
        ema_update_(old, cur, 0.5)
    old, cur = _params(0), _params(1)
    cur["extra"] = torch.zeros(1)
    with pytest.raises(KeyError, match="extra"):
        ema_update_(old, cur, 0.5)
    old, cur = _params(0), _params(1)
    cur["a.lora_A"] = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="a.lora_A"):
        ema_update_(old, cur, 0.5)
    with pytest.raises(ValueError, match="decay"):
        ema_update_(_params(0), _params(1), 1.5)
    # nothing changed by the failed calls
    old, ref = _params(0), _params(0)
    cur = _params(1)
    del cur["b.lora_A"]
    with pytest.raises(KeyError):
        ema_update_(old, cur, 0.0)
    assert all(torch.equal(old[k], ref[k]) for k in old)
