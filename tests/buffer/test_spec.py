"""The buffer's typed parts: the defaults are the config schema's, every key lands in its field, bad values fail."""

from __future__ import annotations

import dataclasses
import pickle
from types import SimpleNamespace

import pytest

from conftest import make_group
from omnirl_async.buffer import LocalReplayBuffer
from omnirl_async.buffer.core import BufferCore
from omnirl_async.buffer.spec import (BufferSpec, CapacitySpec, RateSpec, StalenessSpec, TableSpec,
                                      TransportSpec)
from omnirl_async.config import load_config
from omnirl_async.config.buffer import BufferConfig, TransferQueueConfig
from omnirl_async.config.trainer import V1SamplerConfig

SECTIONS = ("buffer", "trainer.v1.sampler", "transfer_queue")

#: Spec field (``<part>.<field>``, or a field of BufferSpec itself) -> (config key it comes from, a non-default value
#: that is valid on its own).
KEYS: dict[str, tuple[str, object]] = {
    "table.max_size": ("buffer.max_size", 100),
    "table.sampler": ("buffer.sampler", "uniform"),
    "table.sampler_kwargs": ("trainer.v1.sampler.sampler_kwargs", {"exponent": 1.5}),
    "table.priority_exponent": ("buffer.priority_exponent", 0.9),
    "table.freshness_decay": ("buffer.freshness_decay", 0.25),
    "table.custom_sampler_path": ("trainer.v1.sampler.custom_sampler.path", "my_sampler.py"),
    "table.custom_sampler_name": ("trainer.v1.sampler.custom_sampler.name", "MySampler"),
    "table.remover": ("buffer.remover", "zz_remover"),
    "table.max_times_sampled": ("buffer.max_times_sampled", 3),
    "table.drop_incomplete_groups": ("trainer.v1.sampler.drop_incomplete_groups", True),
    "table.max_refill_rounds": ("trainer.v1.sampler.max_incomplete_group_refill_rounds", 5),
    "staleness.threshold": ("trainer.v1.sampler.max_off_policy_threshold", 4),
    "staleness.strategy": ("trainer.v1.sampler.max_off_policy_strategy", "drop"),
    "rate.min_size_to_sample": ("buffer.min_size_to_sample", 8),
    "rate.samples_per_insert": ("buffer.samples_per_insert", 0.5),
    "rate.error_buffer": ("buffer.samples_per_insert_error_buffer", 16.0),
    "capacity.total_storage_size": ("transfer_queue.total_storage_size", 100),
    "capacity.memory_budget_bytes": ("transfer_queue.memory_budget_bytes", 1024),
    "capacity.put_timeout_s": ("transfer_queue.put_timeout_s", 5.0),
    "transport.num_data_storage_units": ("transfer_queue.num_data_storage_units", 3),
    "transport.producer_owned_payloads": ("transfer_queue.producer_owned_payloads", False),
    "transport.inline_max_bytes": ("transfer_queue.inline_max_bytes", 0),
    "transport.max_pending_puts": ("transfer_queue.max_pending_puts", 2),
    "transport.put_linger_s": ("transfer_queue.put_linger_s", 0.0),
    "offline_mix_ratio": ("buffer.offline_mix_ratio", 0.25),
}


def default_sections() -> dict[str, object]:
    return {"buffer": BufferConfig(), "trainer.v1.sampler": V1SamplerConfig(), "transfer_queue": TransferQueueConfig()}


def split(key: str) -> tuple[str, list[str]]:
    """``trainer.v1.sampler.custom_sampler.path`` -> (``trainer.v1.sampler``, [custom_sampler, path])."""
    section = next(s for s in SECTIONS if key.startswith(s + "."))
    return section, key[len(section) + 1:].split(".")


def spec_field(spec: BufferSpec, name: str):
    obj = spec
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def from_sections(sections: dict[str, object]) -> BufferSpec:
    return BufferSpec.from_sections(*(sections[s] for s in SECTIONS))


def as_namespace(obj):
    """A dataclass section as nested namespaces (attributes can be deleted)."""
    if dataclasses.is_dataclass(obj):
        return SimpleNamespace(**{f.name: as_namespace(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
    return obj


# ----------------------------------------------------------------------------------------------------- defaults
def test_spec_defaults_are_the_config_schema_defaults():
    assert BufferSpec() == from_sections(default_sections())


@pytest.mark.parametrize("mode", ["sync", "separate_async"])
def test_spec_defaults_are_a_loaded_default_config(mode):
    cfg = load_config([f"trainer.v1.trainer_mode={mode}"])
    assert BufferSpec() == BufferSpec.from_sections(cfg.buffer, cfg.trainer.v1.sampler, cfg.transfer_queue)


def test_every_spec_field_has_a_config_key():
    parts = {f.name: f.type for f in dataclasses.fields(BufferSpec)}
    names = set()
    for part in (TableSpec, StalenessSpec, RateSpec, CapacitySpec, TransportSpec):
        name = next(f.name for f in dataclasses.fields(BufferSpec) if f.default_factory is part)
        names |= {f"{name}.{f.name}" for f in dataclasses.fields(part)}
        parts.pop(name)
    names |= set(parts)  # BufferSpec's own fields (offline_mix_ratio)
    assert names == set(KEYS), (names ^ set(KEYS))


# ------------------------------------------------------------------------------------------------ each key lands
@pytest.mark.parametrize("name", list(KEYS))
def test_a_non_default_key_changes_its_field_only(name):
    key, value = KEYS[name]
    sections = default_sections()
    section, attrs = split(key)
    obj = sections[section]
    for a in attrs[:-1]:
        obj = getattr(obj, a)
    assert hasattr(obj, attrs[-1]), f"`{key}` is not a config key"
    assert getattr(obj, attrs[-1]) == spec_field(BufferSpec(), name) != value
    setattr(obj, attrs[-1], value)
    spec = from_sections(sections)
    assert spec_field(spec, name) == value
    for other in KEYS:
        if other != name:
            assert spec_field(spec, other) == spec_field(BufferSpec(), other), other


@pytest.mark.parametrize("name", list(KEYS))
def test_a_missing_key_is_named(name):
    key, _ = KEYS[name]
    sections = {s: as_namespace(obj) for s, obj in default_sections().items()}
    section, attrs = split(key)
    obj = sections[section]
    for a in attrs[:-1]:
        obj = getattr(obj, a)
    delattr(obj, attrs[-1])
    with pytest.raises(ValueError, match=rf"^`{key.replace('.', '[.]')}` is missing: .* has no attribute "
                                         rf"'{attrs[-1]}'; pass the full section"):
        from_sections(sections)


def test_a_missing_section_is_named():
    sections = default_sections()
    sections["transfer_queue"] = None
    with pytest.raises(ValueError, match=r"`transfer_queue`: no config section given \(None\)"):
        from_sections(sections)


def test_null_sampler_kwargs_mean_none_and_the_spec_keeps_its_own_copy():
    sections = default_sections()
    sections["trainer.v1.sampler"].sampler_kwargs = None
    assert from_sections(sections).table.sampler_kwargs == {}
    kwargs = {"exponent": 1.0}
    table = TableSpec(sampler="prioritized", sampler_kwargs=kwargs)
    kwargs["exponent"] = 2.0
    assert table.sampler_kwargs == {"exponent": 1.0}
    assert table.sampler_defaults() == {"exponent": 0.6}
    assert TableSpec(sampler="freshness").sampler_defaults() == {"decay": 0.5}
    assert TableSpec().sampler_defaults() == {}


# -------------------------------------------------------------------------------------------------- bad values
BAD = [
    ({"buffer.max_size": 0}, r"`buffer.max_size` = 0: must be an integer > 0"),
    ({"buffer.max_size": -4}, r"`buffer.max_size` = -4: must be an integer > 0"),
    ({"buffer.offline_mix_ratio": -0.1}, r"`buffer.offline_mix_ratio` = -0.1: must be in \[0, 1\]"),
    ({"buffer.offline_mix_ratio": 1.5}, r"`buffer.offline_mix_ratio` = 1.5: must be in \[0, 1\]"),
    ({"buffer.max_size": 8, "buffer.min_size_to_sample": 9},
     r"`buffer.min_size_to_sample` = 9 must deadlock: it exceeds `buffer.max_size` = 8"),
    ({"buffer.samples_per_insert": 2.0},
     r"`buffer.samples_per_insert` = 2.0 must deadlock: .* `buffer.max_times_sampled` = 1 times; raise"),
    ({"buffer.max_times_sampled": 0}, r"`buffer.max_times_sampled` = 0: must be an integer >= 1"),
    ({"trainer.v1.sampler.max_off_policy_threshold": -1}, r"`trainer.v1.sampler.max_off_policy_threshold` = -1"),
    ({"trainer.v1.sampler.max_off_policy_strategy": "later"}, r"`trainer.v1.sampler.max_off_policy_strategy` = "
                                                               r"'later': choose one of"),
    ({"trainer.v1.sampler.max_incomplete_group_refill_rounds": -1},
     r"`trainer.v1.sampler.max_incomplete_group_refill_rounds` = -1: must be an integer >= 0"),
    ({"trainer.v1.sampler.sampler_kwargs": [1]}, r"`trainer.v1.sampler.sampler_kwargs` = \[1\]: must be a mapping"),
    ({"buffer.samples_per_insert_error_buffer": -1.0}, r"`buffer.samples_per_insert_error_buffer` = -1.0"),
    ({"buffer.samples_per_insert": 1.0, "buffer.samples_per_insert_error_buffer": -1.0},
     r"`buffer.samples_per_insert_error_buffer` = -1.0"),
    ({"transfer_queue.num_data_storage_units": 0}, r"`transfer_queue.num_data_storage_units` = 0: must be an "
                                                    r"integer >= 1"),
    ({"transfer_queue.total_storage_size": 0}, r"`transfer_queue.total_storage_size` = 0: must be an integer > 0"),
    ({"transfer_queue.memory_budget_bytes": 0}, r"`transfer_queue.memory_budget_bytes` = 0"),
    ({"transfer_queue.put_timeout_s": 0.0}, r"`transfer_queue.put_timeout_s` = 0.0"),
    ({"transfer_queue.producer_owned_payloads": "yes"}, r"`transfer_queue.producer_owned_payloads` = 'yes'"),
    ({"transfer_queue.inline_max_bytes": -1}, r"`transfer_queue.inline_max_bytes` = -1"),
    ({"transfer_queue.max_pending_puts": -1}, r"`transfer_queue.max_pending_puts` = -1: must be an integer >= 0"),
    ({"transfer_queue.put_linger_s": -0.1}, r"`transfer_queue.put_linger_s` = -0.1: must be a number of seconds"),
    ({"transfer_queue.put_linger_s": "5ms"}, r"`transfer_queue.put_linger_s` = '5ms'"),
    ({"transfer_queue.max_pending_puts": 0},
     r"`transfer_queue.put_linger_s` = 0.02 has no effect with `transfer_queue.max_pending_puts` = 0 .* set "
     r"`transfer_queue.put_linger_s=0`"),
]


@pytest.mark.parametrize("values, match", BAD, ids=[",".join(v) for v, _ in BAD])
def test_bad_values_fail_naming_the_key(values, match):
    sections = default_sections()
    for key, value in values.items():
        section, attrs = split(key)
        setattr(sections[section], attrs[-1], value)
    with pytest.raises(ValueError, match=match):
        from_sections(sections)


def test_bad_values_fail_when_the_spec_is_built_directly():
    with pytest.raises(ValueError, match=r"`buffer.max_size` = 0"):
        TableSpec(max_size=0)
    with pytest.raises(ValueError, match=r"`buffer.offline_mix_ratio` = 2"):
        BufferSpec(offline_mix_ratio=2)
    with pytest.raises(ValueError, match=r"`buffer.min_size_to_sample` = 20 must deadlock"):
        BufferSpec(table=TableSpec(max_size=10), rate=RateSpec(min_size_to_sample=20))
    with pytest.raises(ValueError, match=r"`buffer.samples_per_insert` = 3 must deadlock"):
        BufferSpec(table=TableSpec(max_times_sampled=2), rate=RateSpec(samples_per_insert=3))
    with pytest.raises(ValueError, match=r"`table` = .*: must be a TableSpec"):
        BufferSpec(table={"max_size": 3})
    with pytest.raises(ValueError, match=r"`spec` = .*: must be a BufferSpec"):
        BufferCore(BufferConfig())
    BufferSpec(table=TableSpec(max_times_sampled=2), rate=RateSpec(samples_per_insert=2))  # at the bound: fine


# ------------------------------------------------------------------------------------------------ use of a spec
def test_a_spec_is_frozen_and_crosses_processes():
    spec = BufferSpec(table=TableSpec(max_size=7, sampler_kwargs={"a": 1}), staleness=StalenessSpec(threshold=None))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.offline_mix_ratio = 0.5
    assert pickle.loads(pickle.dumps(spec)) == spec


def test_the_buffer_is_built_from_its_spec():
    assert LocalReplayBuffer().core.spec == BufferSpec()
    spec = BufferSpec(table=TableSpec(max_size=4, sampler="uniform"), staleness=StalenessSpec(threshold=3),
                      capacity=CapacitySpec(total_storage_size=6, put_timeout_s=0.01), offline_mix_ratio=0.5)
    b = LocalReplayBuffer(spec, seed=0)
    core = b.core
    assert core.tables["online"].max_size == 4 and core.staleness.threshold == 3
    assert core.total_storage_size == 6 and core.default_timeout == 0.01 and core.offline_mix_ratio == 0.5
    assert type(core.tables["online"].sampler).__name__ == "UniformSampler"
    b.put(*make_group("g", 4))
    with pytest.raises(TimeoutError, match="online table 4/4 samples"):  # put_timeout_s is the default wait
        b.put(*make_group("h", 2))
