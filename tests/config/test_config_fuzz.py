"""Config fuzz: invalid overrides generated from the schema must each raise one ConfigError naming the key.

The generator walks the config dataclasses (``DiffusionTrainerConfig`` and
everything below it) and, for a leaf field, knows from its annotation and its
:class:`~omnirl_async.config.fields.Rule` what is invalid: a value of the wrong
type, null where the field is not optional, a number outside the declared
bounds or not finite, an unknown choice, a value declared as not built, an
unknown key, a malformed override, a dangling interpolation, deleting a key or
replacing a section by a scalar. A fixed seed draws 200 cases; each must raise
:class:`ConfigError` (never a Hydra/OmegaConf/Python error from inside) whose
message starts with the key path.
"""

from __future__ import annotations

import dataclasses
import random
import string
import typing
from typing import Any, Callable

import pytest

from omnirl_async.config import ConfigError, DiffusionTrainerConfig, load_config

SEED = 20240611
N_CASES = 200


@dataclasses.dataclass(frozen=True)
class Leaf:
    path: str       # full key path, e.g. data.train_batch_size
    parent: str     # key path of the section ("" = root)
    tp: Any         # annotation
    rule: Any       # fields.Rule or None
    default: Any


def walk(schema: type, prefix: str = "") -> tuple[list[Leaf], list[str]]:
    """Every leaf field and every section path (including the root, "") of ``schema``."""
    leaves, sections = [], [prefix]
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        path = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints.get(f.name, Any)
        if dataclasses.is_dataclass(tp):
            sub_leaves, sub_sections = walk(tp, path)
            leaves += sub_leaves
            sections += sub_sections
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        leaves.append(Leaf(path, prefix, tp, f.metadata.get("rule"), default))
    return leaves, sections


def _bounds(rule) -> dict[str, float]:
    if rule is None:
        return {}
    return {k: getattr(rule, k) for k in ("ge", "gt", "le", "lt") if getattr(rule, k) is not None}


def _choices(rule) -> list | None:
    if rule is None or rule.choices is None:
        return None
    return list(rule.choices() if callable(rule.choices) else rule.choices)


def _word(rng: random.Random) -> str:
    return "zz_" + "".join(rng.choice(string.ascii_lowercase) for _ in range(6))


# ----------------------------------------------------------------- generators: (leaf, rng) -> (override, key) | None
WRONG_TYPED = {
    int: ["abc", "1.5", "[1,2]", "{a: 1}", "true", "0x10"],
    float: ["abc", "[1.5]", "{a: 1}", "true", "1.2.3"],
    bool: ["maybe", "2", "[true]", "0.5", "{a: 1}", "-1"],
    str: ["[1,2]", "{a: b}"],
    dict: ["5", "abc", "[1,2]"],
}


def gen_wrong_type(leaf: Leaf, rng):
    if leaf.tp in WRONG_TYPED:
        return f"{leaf.path}={rng.choice(WRONG_TYPED[leaf.tp])}", leaf.path
    if leaf.tp is Any and _bounds(leaf.rule):  # loosely typed but bounded: only numbers or null
        return f"{leaf.path}={rng.choice(['abc', '[1]', 'true', '{a: 1}'])}", leaf.path
    return None


def gen_null(leaf: Leaf, rng):
    if leaf.tp in (int, float, bool, dict) or (leaf.tp is str and leaf.default is not None):
        return f"{leaf.path}=null", leaf.path
    return None


def gen_out_of_range(leaf: Leaf, rng):
    bounds = _bounds(leaf.rule)
    if not bounds or leaf.tp not in (int, float, Any):
        return None
    kind, b = rng.choice(sorted(bounds.items()))
    integral = leaf.tp is int or (leaf.tp is Any and float(b).is_integer() and not isinstance(b, float))
    step = 1 if integral else rng.choice([0.5, 1e-3, 10.0])
    value = {"gt": b - rng.choice([0, step]), "ge": b - step, "lt": b + rng.choice([0, step]), "le": b + step}[kind]
    value = int(value) if integral else float(value)
    return f"{leaf.path}={value!r}", leaf.path


def gen_not_finite(leaf: Leaf, rng):
    if leaf.tp is not float:
        return None
    return f"{leaf.path}={rng.choice(['nan', 'inf', '-inf', '1e400'])}", leaf.path


def gen_unknown_choice(leaf: Leaf, rng):
    choices = _choices(leaf.rule)
    if not choices or leaf.tp is bool:
        return None
    return f"{leaf.path}=nope_{_word(rng)}", leaf.path


def gen_not_built(leaf: Leaf, rng):
    refused = [v for v in (leaf.rule.not_built or {}) if v is not None] if leaf.rule else []
    if not refused:
        return None
    value = rng.choice(refused)
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f"{leaf.path}={text}", leaf.path


def gen_unknown_key(leaf: Leaf, rng):
    key = f"{leaf.parent}.{_word(rng)}" if leaf.parent else _word(rng)
    return f"{rng.choice(['', '+', '++'])}{key}={rng.choice(['1', 'abc', 'null', '[1]'])}", key


MALFORMED = ["{k}=[1,2", "{k}={{a:", "{k}", "{k}=${{", "{k}=1=2", "{k}=choice(1,2)", "{k}=range(1,4)",
             "{k}=nope(1)", "{k}=\"unclosed", "{k}=${{oc.create:{{a:1}}}}", "{k}=int(x)", "{k}=glob(*)",
             "{k}=tag(x,1)", "{k}=a b=c"]


def gen_malformed(leaf: Leaf, rng):
    return rng.choice(MALFORMED).format(k=leaf.path), leaf.path


def gen_dangling_interpolation(leaf: Leaf, rng):
    return f"{leaf.path}=${{{_word(rng)}.missing}}", leaf.path


def gen_delete(leaf: Leaf, rng):
    return f"~{leaf.path}", leaf.path


def gen_section_scalar(leaf: Leaf, rng):
    if not leaf.parent:
        return None
    return f"{leaf.parent}={rng.choice(['5', 'abc', '[1,2]'])}", leaf.parent


GENERATORS: dict[str, Callable] = {
    "wrong_type": gen_wrong_type, "null": gen_null, "out_of_range": gen_out_of_range,
    "not_finite": gen_not_finite, "unknown_choice": gen_unknown_choice, "not_built": gen_not_built,
    "unknown_key": gen_unknown_key, "malformed": gen_malformed, "interpolation": gen_dangling_interpolation,
    "delete": gen_delete, "section_scalar": gen_section_scalar,
}


def generate_cases(seed: int = SEED, n: int = N_CASES) -> list[tuple[str, str, str]]:
    """``n`` distinct ``(kind, override, key)`` cases: a kind drawn uniformly, then a leaf it applies to."""
    rng = random.Random(seed)
    leaves, _ = walk(DiffusionTrainerConfig)
    applicable = {kind: [leaf for leaf in leaves if gen(leaf, random.Random(0)) is not None]
                  for kind, gen in GENERATORS.items()}
    kinds = sorted(k for k, v in applicable.items() if v)
    cases, seen = [], set()
    while len(cases) < n:
        kind = rng.choice(kinds)
        override, key = GENERATORS[kind](rng.choice(applicable[kind]), rng)
        if override not in seen:
            seen.add(override)
            cases.append((kind, override, key))
    return cases


CASES = generate_cases()


def test_the_cases_cover_every_kind_and_are_reproducible():
    assert len(CASES) == N_CASES == len({c[1] for c in CASES})
    assert {c[0] for c in CASES} == set(GENERATORS)
    assert generate_cases() == CASES
    load_config([])  # the base config itself is valid, so every failure below is the override's


N_FAST = 60  # the first cases run in `make test`, all of them in the slow set


@pytest.mark.parametrize("kind, override, key", [pytest.param(*c, marks=[pytest.mark.slow] if i >= N_FAST else [])
                                                 for i, c in enumerate(CASES)],
                         ids=[f"{i:03d}-{c[0]}" for i, c in enumerate(CASES)])
def test_invalid_override_raises_config_error_naming_the_key(kind, override, key):
    try:
        load_config([override])
    except ConfigError as err:
        msg = str(err)
    except Exception as err:  # noqa: BLE001 - the point of the test
        pytest.fail(f"{override!r} ({kind}) raised {type(err).__module__}.{type(err).__name__}, not ConfigError: "
                    f"{err}")
    else:
        pytest.fail(f"{override!r} ({kind}) was accepted")
    assert msg.startswith(f"`{key}`") or msg.startswith(f"`{key}."), f"{override!r} ({kind}): {msg}"


#: Holes found while fuzzing by hand, kept as fixed cases: values a class-level ``validate`` used to trip over
#: (TypeError from ``len(5)`` / ``list(5)``), an integer OmegaConf silently turns into a bool, a bounded ``Any``
#: field that took a string, Hydra errors that did not name the key.
REGRESSIONS = [
    ("actor_rollout_ref.rollout.algo.sde_window_range=5", "actor_rollout_ref.rollout.algo.sde_window_range"),
    ("trainer.logger=5", "trainer.logger"),
    ("actor_rollout_ref.model.policy_state_adapters=5", "actor_rollout_ref.model.policy_state_adapters"),
    ("data.shuffle=2", "data.shuffle"),
    ("data.val_batch_size=abc", "data.val_batch_size"),
    ("data.train_batch_size=[1,2", "data.train_batch_size"),
    ("data.train batch=1", "data.train batch"),
    ("~data.train_files", "data.train_files"),
    ("+data.train_batch_size=3", "data.train_batch_size"),
    ("data.trian_batch_size=4", "data.trian_batch_size"),
    ("reward.reward_kwargs.foo=1", "reward.reward_kwargs.foo"),
]


@pytest.mark.parametrize("override, key", REGRESSIONS)
def test_regressions_found_by_fuzzing(override, key):
    with pytest.raises(ConfigError) as err:
        load_config([override])
    assert str(err.value).startswith(f"`{key}`"), str(err.value)


def test_messages_of_the_fixed_holes():
    with pytest.raises(ConfigError) as err:
        load_config(["trainer.logger=5"])
    assert str(err.value) == ("`trainer.logger` = 5 (expected: Any of console, tensorboard, wandb): the check of "
                              "`trainer` cannot use this value (TypeError: 'int' object is not iterable).")
    with pytest.raises(ConfigError) as err:
        load_config(["data.shuffle=2"])
    assert str(err.value) == "`data.shuffle` = 2 is not a bool; write `data.shuffle=true` or `data.shuffle=false`."
    with pytest.raises(ConfigError) as err:
        load_config(["data.val_batch_size=abc"])
    assert str(err.value) == "`data.val_batch_size` = 'abc' is not a number; give a number > 0, or null."
    with pytest.raises(ConfigError) as err:
        load_config(["data.train_batch_size=choice(8,16)"])
    assert str(err.value) == ("`data.train_batch_size`: 'data.train_batch_size=choice(8,16)' is a sweep "
                              "(choice/range/glob/interval/shuffle/sort); a run takes one value: write "
                              "`data.train_batch_size=<value>`.")
    with pytest.raises(ConfigError) as err:
        load_config(["data.train_batch_size"])
    assert str(err.value) == ("`data.train_batch_size`: cannot parse the override 'data.train_batch_size' (missing "
                              "EQUAL at '<EOF>'); write `data.train_batch_size=<value>` in Hydra's grammar and quote "
                              "a value with spaces or special characters, e.g. `data.train_batch_size='a b'`.")
    with pytest.raises(ConfigError) as err:
        load_config(["=3"])
    assert str(err.value) == ("override '=3' has no key before '='; write `<key>=<value>`, e.g. "
                              "`data.train_batch_size=16`.")
