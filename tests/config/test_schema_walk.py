"""No silent setting: every leaf key of the schema takes effect somewhere, or is refused where it does not.

The rule of the project: a key the config accepts has its effect in every mode
(``trainer.v1.trainer_mode`` = sync or separate_async), or a value other than its
default is refused at start-up with the reason. :func:`test_every_key_is_read_or_refused`
walks every leaf of :class:`DiffusionTrainerConfig` and passes a key when

(a) it is *read* outside ``omnirl_async/config/`` (see the heuristic below), or
(b) it is *refused* for some value in some mode: loading the config with a
    non-default value of the key's type (:data:`PROBES`, else one derived from
    the type and rule) raises :class:`ConfigError` whose message starts with
    the key path, under sync or separate_async, or
(c) it is in :data:`ALLOWED`, each with a one-line justification.

:data:`WIRED_ELSEWHERE` lists keys that had to be made to take effect by other
owners; they pass by (a) like any other key, and
:func:`test_keys_wired_elsewhere_are_read` says which one lost its read.

The read heuristic (``ast`` over every ``.py`` of the package but ``config/``):

* an attribute chain in load context (``self.config.trainer.v1.sampler.max_off_policy_strategy``),
  ``getattr(obj, "key")`` and any other string constant that is not a docstring
  (``cfg_get(b, "max_times_sampled", 1)``) are evidence;
* the head of a chain is expanded through simple aliases: local assignments
  (``aro = config.actor_rollout_ref``, ``pcfg, acfg = val_cfg.pipeline, val_cfg.algo``),
  ``self.x = ...`` in any method of the same class, and function parameters bound
  at call sites anywhere in the package (``evaluate_policy(..., self.rollout_cfg.val_kwargs)``
  binds ``val_cfg``): ``f(...)`` and ``Class(...)`` by name, ``self.m(...)`` within the
  class, ``obj.m(...)`` only when a single function of the package is called ``m``;
* the longest tail of the expanded chain that is a tail of some key path selects
  the keys it reads (``pipeline.height`` reads both ``rollout.pipeline.height`` and
  ``rollout.val_kwargs.pipeline.height``; ``val_kwargs.pipeline.height`` only the latter).
  A key of a section whose dataclass serves two paths (pipeline, algo) needs at
  least ``<section>.<key>`` (a bare name or string says nothing about which path);
  any other key is read by its bare name.

Limits: it is a name match, not a type analysis. A bare attribute of an unrelated
object with the same name as a key (``lease.n``, ``self.buffer.max_size``) counts as
a read; so does a string constant that happens to equal a key name; aliases through
containers, returns, ``**kwargs``, ``dataclasses.replace`` or Ray ``.remote`` calls are
not followed (their heads stay unresolved, which is lenient, not strict). A read is not an
effect either: a key read only to be logged passes. It catches what it is for: a key
added to the schema that no code reads and no check refuses, and the validation
section (``val_kwargs``) keys that validation does not use.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import math
import typing
from pathlib import Path
from typing import Any, Iterable

import pytest

import omnirl_async
from omnirl_async.config import ConfigError, DiffusionTrainerConfig, load_config
from omnirl_async.config.doc import iter_keys, render

PACKAGE = Path(omnirl_async.__file__).resolve().parent
CONFIG_PKG = PACKAGE / "config"
REPO = PACKAGE.parent
MODES = ("sync", "separate_async")

#: Keys that pass without being read or refused, each with why that is not a silent setting.
ALLOWED: dict[str, str] = {}

#: Keys that must take effect and that another owner wired in this session (commit 07d0350); each was checked by
#: hand to be read where it says (and the walk finds the read). :func:`test_keys_wired_elsewhere_are_read` names one that is not.
WIRED_ELSEWHERE: dict[str, str] = {
    # wired by the trainer owner in this session
    "data.val_batch_size": "models/evaluate.py validation_settings() -> evaluate_policy(batch_size=...), called by "
                           "RolloutWorker.validate (trainer validation) and `omnirl-async eval`",
    # wired by the trainer owner in this session
    "actor_rollout_ref.rollout.val_kwargs.pipeline.negative_prompt":
        "models/evaluate.py validation_settings() -> evaluate_policy(negative_prompt=...), same callers",
}

#: Non-default values to try for (b) where the one derived from the type would be implausible.
PROBES: dict[str, Any] = {
    "actor_rollout_ref.rollout.val_kwargs.algo.sde_window_range": [0, 2],
    "actor_rollout_ref.rollout.val_kwargs.algo.sde_window_size": 2,
    "actor_rollout_ref.model.policy_state_adapters": ["default", "old"],
    "actor_rollout_ref.model.fsdp_layer_prefixes": ["transformer_blocks"],
    "actor_rollout_ref.model.target_parameters": ["proj.weight"],
    "reward.reward_manager": "dapo",
}


# ----------------------------------------------------------------------------------------------- the schema
@dataclasses.dataclass(frozen=True)
class Key:
    path: str
    tp: Any
    rule: Any
    default: Any
    shared: bool  # its section's dataclass also serves another path

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    @property
    def segments(self) -> tuple[str, ...]:
        return tuple(self.path.split("."))


def _sections(schema: type, prefix: str = "") -> Iterable[tuple[str, type]]:
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        tp = hints.get(f.name, Any)
        if dataclasses.is_dataclass(tp):
            path = f"{prefix}.{f.name}" if prefix else f.name
            yield path, tp
            yield from _sections(tp, path)


@functools.lru_cache(maxsize=None)
def schema_keys() -> tuple[Key, ...]:
    section_types = dict(_sections(DiffusionTrainerConfig))
    uses: dict[type, int] = {}
    for tp in section_types.values():
        uses[tp] = uses.get(tp, 0) + 1
    keys = []
    for info in iter_keys():
        parent = info.path.rpartition(".")[0]
        keys.append(Key(info.path, info.tp, info.rule, info.schema_default,
                        uses.get(section_types.get(parent), 0) > 1))
    return tuple(keys)


# ----------------------------------------------------------------------------------------------- (a) reads
def _chain(node: ast.AST) -> tuple[str, ...]:
    """``a.b.c`` -> ("a", "b", "c"); a head that is not a name (a call, a subscript) becomes "?"."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    parts.append(node.id if isinstance(node, ast.Name) else "?")
    return tuple(reversed(parts))


@dataclasses.dataclass
class Scope:
    module: str
    cls: str | None
    func: ast.AST | None  # FunctionDef, or None for module level
    params: tuple[str, ...] = ()
    locals: dict[str, list[tuple[str, ...]]] = dataclasses.field(default_factory=dict)


class ReadIndex:
    """What the package reads: expanded attribute chains and bare string constants."""

    def __init__(self, root: Path = PACKAGE, exclude: Path = CONFIG_PKG):
        self.trees = {p: ast.parse(p.read_text(), str(p)) for p in sorted(root.rglob("*.py"))
                      if exclude not in p.parents}
        self.scopes: dict[ast.AST, Scope] = {}          # function node -> scope
        self.class_attrs: dict[tuple[str, str], dict[str, list[tuple[tuple[str, ...], Scope]]]] = {}
        self.defs: dict[str, list[tuple[ast.AST, bool]]] = {}  # function name -> (node, is_method)
        self.bindings: dict[ast.AST, dict[str, list[tuple[tuple[str, ...], Scope]]]] = {}
        self.chains: set[tuple[str, ...]] = set()
        self.strings: set[str] = set()
        self._memo: dict = {}
        for path, tree in self.trees.items():
            self._collect_scopes(str(path), tree)
        for path, tree in self.trees.items():
            self._collect_aliases(tree)
        for path, tree in self.trees.items():
            self._collect_reads(tree)

    # --- pass 1: scopes and function definitions
    def _collect_scopes(self, module: str, tree: ast.Module) -> None:
        self.scopes[tree] = Scope(module, None, None)

        def visit(node: ast.AST, cls: str | None) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    visit(child, child.name)
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = child.args
                    params = tuple(x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs))
                    self.scopes[child] = Scope(module, cls, child, params)
                    is_method = cls is not None and bool(params) and params[0] in ("self", "cls")
                    if child.name == "__init__" and cls:
                        self.defs.setdefault(cls, []).append((child, True))  # Class(...) calls __init__
                    elif not child.name.startswith("__"):
                        self.defs.setdefault(child.name, []).append((child, is_method))
                    visit(child, cls)
                else:
                    visit(child, cls)

        visit(tree, None)

    def _own_nodes(self, scope_node: ast.AST) -> Iterable[ast.AST]:
        """Nodes of a function (or module) body, not descending into nested functions or classes."""
        stack = list(ast.iter_child_nodes(scope_node))
        while stack:
            node = stack.pop()
            yield node
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                stack.extend(ast.iter_child_nodes(node))

    # --- pass 2: aliases and parameter bindings
    def _collect_aliases(self, tree: ast.Module) -> None:
        for scope_node, scope in list(self.scopes.items()):
            if scope.module != self.scopes[tree].module:
                continue
            for node in self._own_nodes(scope_node):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        self._bind_target(target, node.value, scope)
                elif isinstance(node, ast.Call):
                    self._bind_call(node, scope)

    def _bind_target(self, target: ast.AST, value: ast.AST, scope: Scope) -> None:
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
                and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):
                self._bind_target(t, v, scope)
            return
        if not isinstance(value, (ast.Attribute, ast.Name)):
            return
        chain = _chain(value)
        if isinstance(target, ast.Name):
            scope.locals.setdefault(target.id, []).append(chain)
        elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
              and target.value.id == "self" and scope.cls):
            attrs = self.class_attrs.setdefault((scope.module, scope.cls), {})
            attrs.setdefault(target.attr, []).append((chain, scope))

    def _callees(self, call: ast.Call, scope: Scope) -> list[tuple[ast.AST, bool]]:
        """The package functions a call may reach: ``f(...)`` / ``Class(...)`` by name, ``self.m(...)`` in the same
        class, ``obj.m(...)`` only when one function of the package has that name."""
        func = call.func
        if isinstance(func, ast.Name):
            return self.defs.get(func.id, [])
        if not isinstance(func, ast.Attribute):
            return []
        defs = self.defs.get(func.attr, [])
        if isinstance(func.value, ast.Name) and func.value.id == "self" and scope.cls:
            return [(f, m) for f, m in defs if self.scopes[f].cls == scope.cls] or (defs if len(defs) == 1 else [])
        return defs if len(defs) == 1 else []

    def _bind_call(self, call: ast.Call, scope: Scope) -> None:
        for fnode, is_method in self._callees(call, scope):
            fscope = self.scopes[fnode]
            params = fscope.params[1:] if is_method else fscope.params
            bound = self.bindings.setdefault(fnode, {})
            for param, arg in zip(params, call.args):
                if isinstance(arg, (ast.Attribute, ast.Name)):
                    bound.setdefault(param, []).append((_chain(arg), scope))
            for kw in call.keywords:
                if kw.arg in fscope.params and isinstance(kw.value, (ast.Attribute, ast.Name)):
                    bound.setdefault(kw.arg, []).append((_chain(kw.value), scope))

    # --- expansion of a chain's head through the aliases
    def expand(self, chain: tuple[str, ...], scope: Scope) -> set[tuple[str, ...]]:
        """Every chain ``chain`` may stand for once its head is replaced by what it aliases (itself if nothing)."""
        head_len, prefixes = self._prefixes(chain[0], chain[1] if len(chain) > 1 else None, scope, frozenset())
        return {p + chain[head_len:] for p in prefixes}

    def _prefixes(self, head: str, attr: str | None, scope: Scope,
                  visiting: frozenset) -> tuple[int, set[tuple[str, ...]]]:
        """What ``head`` (or ``self.attr``) stands for: (how many chain elements it replaces, expanded prefixes)."""
        memo_key = (head, attr if head == "self" else None, id(scope))
        if memo_key in self._memo:
            return self._memo[memo_key]
        if memo_key in visiting or len(visiting) > 8:
            return (1, {(head,)})
        visiting = visiting | {memo_key}
        if head == "self" and attr is not None and scope.cls:
            aliases = self.class_attrs.get((scope.module, scope.cls), {}).get(attr, [])
            used = 2
        elif head in scope.locals:
            aliases, used = [(a, scope) for a in scope.locals[head]], 1
        elif head in scope.params and scope.func is not None:
            aliases, used = self.bindings.get(scope.func, {}).get(head, []), 1
        else:
            aliases, used = [], 1
        out: set[tuple[str, ...]] = set()
        for alias, where in aliases:
            n, prefixes = self._prefixes(alias[0], alias[1] if len(alias) > 1 else None, where, visiting)
            out |= {p + alias[n:] for p in prefixes}
            if len(out) > 64:
                break
        result = (used, out) if out else (1, {(head,)})
        if len(visiting) == 1:
            self._memo[memo_key] = result
        return result

    # --- pass 3: reads
    def _collect_reads(self, tree: ast.Module) -> None:
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        module = self.scopes[tree].module
        for scope_node, scope in self.scopes.items():
            if scope.module != module:
                continue
            for node in self._own_nodes(scope_node):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    self.chains |= self.expand(_chain(node), scope)
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                      and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                      and isinstance(node.args[1].value, str)):
                    base = node.args[0]
                    obj = self.expand(_chain(base), scope) if isinstance(base, (ast.Attribute, ast.Name)) else {("?",)}
                    self.chains |= {c + (node.args[1].value,) for c in obj}
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                    self.strings.add(node.value)

    # --- which keys are read
    def reads(self, keys: Iterable[Key]) -> dict[str, str]:
        """Key path -> one piece of evidence, for every key read."""
        keys = list(keys)
        by_name: dict[str, list[Key]] = {}
        for k in keys:
            by_name.setdefault(k.name, []).append(k)
        found: dict[str, str] = {}
        for chain in self.chains:
            candidates = by_name.get(chain[-1], [])
            if not candidates:
                continue
            # the longest tail of the chain that is a tail of some key path
            best = 0
            for k in candidates:
                n = 0
                while n < min(len(chain), len(k.segments)) and chain[-1 - n] == k.segments[-1 - n]:
                    n += 1
                best = max(best, n)
            for k in candidates:
                if k.segments[-best:] == chain[-best:] and (best >= 2 or not k.shared):
                    found.setdefault(k.path, ".".join(chain))
        for k in keys:
            if not k.shared and k.name in self.strings:
                found.setdefault(k.path, repr(k.name))
        return found


@functools.lru_cache(maxsize=None)
def read_keys() -> dict[str, str]:
    return ReadIndex().reads(schema_keys())


# ----------------------------------------------------------------------------------------------- (b) refusals
def _hydra(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra(v) for v in value) + "]"
    if isinstance(value, str):
        return f"'{value}'"
    return repr(value)


def _in_bounds(rule, v: float) -> bool:
    if rule is None:
        return True
    return all(b is None or ok for b, ok in ((rule.ge, rule.ge is not None and v >= rule.ge),
                                            (rule.gt, rule.gt is not None and v > rule.gt),
                                            (rule.le, rule.le is not None and v <= rule.le),
                                            (rule.lt, rule.lt is not None and v < rule.lt)))


def probe_value(key: Key) -> Any:
    """A value of the key's type, allowed by its declared rule, other than its default."""
    if key.path in PROBES:
        return PROBES[key.path]
    rule, default = key.rule, key.default
    choices = None
    if rule is not None and rule.choices is not None:
        choices = list(rule.choices() if callable(rule.choices) else rule.choices)
    if key.tp is bool:
        return not default
    if choices:
        others = [c for c in choices if c != default]
        return others[0] if others else f"zz_not_{default}"
    if key.tp in (int, float) or (key.tp is Any and rule is not None and
                                  any(getattr(rule, b) is not None for b in ("ge", "gt", "le", "lt"))):
        base = default if isinstance(default, (int, float)) and not isinstance(default, bool) else 0
        for cand in (base + 1, base * 2 + 1, base - 1, 0.5, 1, 2):
            if key.tp is int:
                cand = int(cand)
            if cand != default and _in_bounds(rule, cand) and math.isfinite(cand):
                return cand
    if key.tp is dict:
        return {"zz_probe": 1}
    return "zz_probe"


def refusal(key: Key) -> str | None:
    """The ConfigError message for a non-default value of ``key`` in the first mode that refuses it, or None."""
    value = probe_value(key)
    for mode in MODES:
        try:
            load_config([f"trainer.v1.trainer_mode={mode}", f"{key.path}={_hydra(value)}"])
        except ConfigError as err:
            if str(err).startswith(f"`{key.path}`"):
                return f"[{mode}] {err}"
    return None


# ----------------------------------------------------------------------------------------------- the tests
def test_the_walk_sees_every_key_and_the_shared_sections():
    keys = {k.path: k for k in schema_keys()}
    assert len(keys) > 150
    assert keys["actor_rollout_ref.rollout.val_kwargs.pipeline.negative_prompt"].shared
    assert keys["actor_rollout_ref.rollout.pipeline.negative_prompt"].shared
    assert not keys["data.val_batch_size"].shared
    for path in [*ALLOWED, *WIRED_ELSEWHERE, *PROBES]:
        assert path in keys, f"{path} is not a config key any more; drop it from the lists of this test"


def test_the_read_heuristic_resolves_aliases_and_sections():
    reads = read_keys()
    # evaluate_policy(val_cfg): pcfg, acfg = val_cfg.pipeline, val_cfg.algo, bound at its call sites
    assert "actor_rollout_ref.rollout.val_kwargs.algo.noise_level" in reads
    assert "actor_rollout_ref.rollout.val_kwargs.pipeline.height" in reads
    # the training pipeline's negative prompt is read through self.rollout_cfg (class alias)
    assert "actor_rollout_ref.rollout.pipeline.negative_prompt" in reads
    # the training window is read; the validation one is not (validation never uses a window)
    assert "actor_rollout_ref.rollout.algo.sde_window_size" in reads
    assert "actor_rollout_ref.rollout.val_kwargs.algo.sde_window_size" not in reads
    # string constants: cfg_get(b, "max_times_sampled", 1)
    assert "buffer.max_times_sampled" in reads


MINI_WORKER = """
class Worker:
    def __init__(self, config):
        aro = config.actor_rollout_ref
        self.rollout_cfg = aro.rollout

    def validate(self, prompts):
        \"\"\"The docstring names val_batch_size, which is no read.\"\"\"
        ro = self.rollout_cfg
        return evaluate(prompts, ro.val_kwargs, negative_prompt=self.rollout_cfg.pipeline.negative_prompt)

    def generate(self, lease):
        return [lease.negative_prompt, lease.height]
"""

MINI_EVALUATE = """
def evaluate(prompts, val_cfg, negative_prompt=""):
    pcfg, acfg = val_cfg.pipeline, val_cfg.algo
    return pcfg.height, acfg.noise_level, getattr(val_cfg, "n"), negative_prompt
"""


def test_the_read_heuristic_on_a_small_package(tmp_path):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "schema.py").write_text("x = cfg.data.val_batch_size\n")  # config/ is not scanned
    (tmp_path / "worker.py").write_text(MINI_WORKER)
    (tmp_path / "evaluate.py").write_text(MINI_EVALUATE)
    reads = ReadIndex(tmp_path, tmp_path / "config").reads(schema_keys())
    ro = "actor_rollout_ref.rollout"
    assert reads.get(f"{ro}.pipeline.negative_prompt") == f"config.{ro}.pipeline.negative_prompt"
    assert reads.get(f"{ro}.val_kwargs.pipeline.height") == f"config.{ro}.val_kwargs.pipeline.height"
    assert reads.get(f"{ro}.val_kwargs.algo.noise_level") == f"config.{ro}.val_kwargs.algo.noise_level"
    assert reads.get(f"{ro}.val_kwargs.n") == f"config.{ro}.val_kwargs.n"
    # neither the validation negative prompt (lease.negative_prompt is a bare name of a shared section's key),
    # nor the training pipeline's height / noise level (evaluate's pcfg / acfg are the validation ones)
    for path in (f"{ro}.val_kwargs.pipeline.negative_prompt", f"{ro}.pipeline.height", f"{ro}.algo.noise_level",
                 "data.val_batch_size"):
        assert path not in reads, (path, reads.get(path))


def test_every_key_is_read_or_refused():
    reads = read_keys()
    silent = []
    for key in schema_keys():
        if key.path in reads or key.path in ALLOWED:
            continue
        if refusal(key) is None:
            silent.append(f"{key.path} (tried {key.path}={_hydra(probe_value(key))} in {' and '.join(MODES)})")
    assert not silent, ("keys no code outside omnirl_async/config reads and no check refuses (a silent setting): "
                        "read them, refuse a non-default value with the reason (`no_effect=` in opt()), or allow "
                        "them in ALLOWED with a justification:\n  " + "\n  ".join(silent))


def test_keys_wired_elsewhere_are_read():
    reads = read_keys()
    lost = {k: where for k, where in WIRED_ELSEWHERE.items() if k not in reads}
    assert not lost, f"these keys must take effect but nothing reads them any more: {lost}"


def test_allowed_keys_are_not_read_or_refused_anyway():
    reads = read_keys()
    keys = {k.path: k for k in schema_keys()}
    stale = [p for p in ALLOWED if p in reads or refusal(keys[p]) is not None]
    assert not stale, f"{stale} pass without ALLOWED now; remove them from it"


# ---------------------------------------------------------------------------- each refusal, with its message
VAL_WINDOW = ("validation denoises every step alike with `val_kwargs.algo.noise_level` (0 = the ODE) and never uses "
              "an SDE window, so nothing reads it")
SYNC = "is refused under `trainer.v1.trainer_mode` = sync: "
WAIT = ("is refused under `trainer.v1.trainer_mode` = separate_async with `trainer.v1.sampler.max_off_policy_strategy` "
        "= wait: each update trains exactly the prompt groups admission control let in for it (that is what keeps "
        "every lag within the threshold), so ")

REFUSALS = [
    # (mode, overrides, expected message)
    ("sync", ["algorithm.old_policy_decay_schedule=linear_to_0_5"],
     "`algorithm.old_policy_decay_schedule` = 'linear_to_0_5' is refused with `algorithm.trainer_type` = "
     "policy_gradient: only the 'old' LoRA adapter (DiffusionNFT / AWM, direct_preference trainer) is refreshed on "
     "this schedule; leave it at its default ('copy'), or add the old adapter: "
     "`actor_rollout_ref.model.policy_state_adapters=[default,old]`."),
    ("sync", ["algorithm.old_policy_decay=0.5"],
     "`algorithm.old_policy_decay` = 0.5 is refused with `algorithm.trainer_type` = policy_gradient: only the 'old'"),
    ("separate_async", ["algorithm.old_policy_update_interval=2", "algorithm.trainer_type=direct_preference",
                        "actor_rollout_ref.model.algorithm=awm"],
     "`algorithm.old_policy_update_interval` = 2 is refused while `actor_rollout_ref.model.policy_state_adapters` "
     "has no 'old' adapter: only the 'old' LoRA adapter"),
    ("sync", ["actor_rollout_ref.actor.diffusion_loss.mix_beta=0.3"],
     "`actor_rollout_ref.actor.diffusion_loss.mix_beta` = 0.3 is refused with "
     "`actor_rollout_ref.actor.diffusion_loss.loss_mode` = 'flow_grpo': only diffusion_nft reads the mixing beta; "
     "leave it at its default (0.5), or use loss_mode diffusion_nft."),
    ("sync", ["actor_rollout_ref.actor.diffusion_loss.ref_kl_coef=0.1"],
     "`actor_rollout_ref.actor.diffusion_loss.ref_kl_coef` = 0.1 is refused with "
     "`actor_rollout_ref.actor.diffusion_loss.loss_mode` = 'flow_grpo': only diffusion_nft / awm read the reference "
     "MSE coefficient"),
    ("sync", ["actor_rollout_ref.actor.diffusion_loss.adaptive_weight_min=0.001"],
     "`actor_rollout_ref.actor.diffusion_loss.adaptive_weight_min` = 0.001 is refused with "
     "`actor_rollout_ref.actor.diffusion_loss.loss_mode` = 'flow_grpo': only diffusion_nft reads"),
    ("separate_async", ["actor_rollout_ref.actor.diffusion_loss.dpo_beta=500", "algorithm.trainer_type=direct_preference",
                        "actor_rollout_ref.model.algorithm=awm"],
     "`actor_rollout_ref.actor.diffusion_loss.dpo_beta` = 500.0 is refused with "
     "`actor_rollout_ref.actor.diffusion_loss.loss_mode` = 'awm': only dpo reads the DPO inverse temperature"),
    ("sync", ["actor_rollout_ref.actor.diffusion_loss.clip_ratio=0.01", "algorithm.trainer_type=direct_preference",
              "actor_rollout_ref.model.algorithm=awm"],
     "`actor_rollout_ref.actor.diffusion_loss.clip_ratio` = 0.01 is refused with the direct-preference `loss_mode` = "
     "'awm': direct-preference losses have no per-step policy ratio to clip or mask"),
    ("sync", ["actor_rollout_ref.model.policy_state_adapters=[default,old]"],
     "`actor_rollout_ref.model.policy_state_adapters` = ['default', 'old'] is refused with `algorithm.trainer_type` "
     "= policy_gradient: named LoRA policy states (e.g. 'old' for DiffusionNFT) are used by `algorithm.trainer_type` "
     "= direct_preference (DiffusionNFT / DPO / AWM); the reference policy is always the base model with the adapter "
     "disabled; leave it at its default (null)"),
    ("sync", ["actor_rollout_ref.actor.distill_loss_mode=distill_fm_mse"],
     "`actor_rollout_ref.actor.distill_loss_mode` = 'distill_fm_mse' is refused while "
     "`actor_rollout_ref.actor.use_distill_loss` = false: distillation is off, so nothing reads it; leave it at its "
     "default ('distill_kl'), or set `actor_rollout_ref.actor.use_distill_loss` = true."),
    ("separate_async", ["actor_rollout_ref.actor.distill_loss_coef=0.5"],
     "`actor_rollout_ref.actor.distill_loss_coef` = 0.5 is refused while `actor_rollout_ref.actor.use_distill_loss` "
     "= false: distillation is off"),
    ("sync", ["actor_rollout_ref.actor.distill_teacher_path=embedded:tiny-sd3"],
     "`actor_rollout_ref.actor.distill_teacher_path` = 'embedded:tiny-sd3' is refused while "
     "`actor_rollout_ref.actor.use_distill_loss` = false: distillation is off"),
    ("sync", ["actor_rollout_ref.model.fsdp_layer_prefixes=[transformer_blocks]"],
     "`actor_rollout_ref.model.fsdp_layer_prefixes` = ['transformer_blocks'] is refused: this project does not "
     "shard with FSDP (`actor_rollout_ref.actor.strategy` = ddp), so nothing reads it; leave it at its default "
     "(null)."),
    ("sync", ["reward.reward_manager=dapo"],
     "`reward.reward_manager` = 'dapo' is refused: the built-in reward manager (omnirl_async.rewards.RewardManager) "
     "is always used; choose what it scores with `reward.reward_fn_name`, `reward.reward_functions` or "
     "`reward.custom_reward_function`; leave it at null (or upstream's default 'naive')."),
    ("separate_async", ["reward.reward_manager={name: prime}"],
     "`reward.reward_manager` = {'name': 'prime'} is refused: the built-in reward manager"),
    ("sync", ["trainer.video_fps=24"],
     "`trainer.video_fps` = 24 is refused: this project generates images only (`pipeline.num_frames` = 1), so no "
     "video is ever written; leave it at its default (8)."),
    *[("sync", [f"actor_rollout_ref.rollout.val_kwargs.algo.{k}={v}"],
       f"`actor_rollout_ref.rollout.val_kwargs.algo.{k}` = {r} is refused: {VAL_WINDOW}; leave it at its default "
       f"({d}).")
      for k, v, r, d in [("sde_window_size", "2", "2", "null"), ("sde_window_range", "[0,2]", "[0, 2]", "null"),
                         ("sde_window_seed", "7", "7", "0"), ("sample_strategy", "progressive", "'progressive'",
                                                             "'random'"),
                         ("iters_per_group", "2", "2", "1")]],
    ("sync", ["actor_rollout_ref.rollout.val_kwargs.algo.sde_type=cps"],
     "`actor_rollout_ref.rollout.val_kwargs.algo.sde_type` = 'cps' is refused while "
     "`actor_rollout_ref.rollout.val_kwargs.algo.noise_level` = 0: with noise level 0 every SDE variant takes the "
     "same deterministic Euler (ODE) step; leave it at its default ('sde'), or set a noise_level > 0."),
    ("sync", ["trainer.v1.separate_async.parameter_sync_step=2"],
     f"`trainer.v1.separate_async.parameter_sync_step` = 2 {SYNC}sync publishes the weights after every update; "
     "leave it at its default (1), or set `trainer.v1.trainer_mode` = separate_async."),
    ("sync", ["trainer.v1.separate_async.num_warmup_batches=3"],
     f"`trainer.v1.separate_async.num_warmup_batches` = 3 {SYNC}sync generates each batch right before training on "
     "it, so no batch is queued ahead; leave it at its default (1), or set `trainer.v1.trainer_mode` = "
     "separate_async."),
    ("sync", ["trainer.v1.separate_async.sync_compatible=true"],
     f"`trainer.v1.separate_async.sync_compatible` = True {SYNC}sync never generates while the learner trains, so "
     "there is nothing to pause; leave it at its default (false), or set `trainer.v1.trainer_mode` = "
     "separate_async."),
    ("sync", ["trainer.v1.sampler.max_off_policy_threshold=2"],
     f"`trainer.v1.sampler.max_off_policy_threshold` = 2 {SYNC}sync trains on-policy (threshold 0): every sample is "
     "trained by the weights that generated it; leave it at its default (1) or use 0, or set "
     "`trainer.v1.trainer_mode` = separate_async."),
    ("sync", ["trainer.v1.sampler.max_off_policy_strategy=drop"],
     f"`trainer.v1.sampler.max_off_policy_strategy` = 'drop' {SYNC}sync trains on-policy (threshold 0), so no sample "
     "is ever stale: there is nothing to wait for or drop; leave it at its default ('wait'), or set "
     "`trainer.v1.trainer_mode` = separate_async."),
    ("sync", ["buffer.max_times_sampled=2"],
     f"`buffer.max_times_sampled` = 2 {SYNC}sync trains every sample with the weights that generated it; a reused "
     "sample would be one version stale at the next step and evicted unused; leave it at its default (1), or set "
     "`trainer.v1.trainer_mode` = separate_async."),
    ("sync", ["actor_rollout_ref.model.algorithm=grpo_guard", "actor_rollout_ref.actor.use_kl_loss=true"],
     "`actor_rollout_ref.actor.use_kl_loss` = True is refused with `actor_rollout_ref.actor.diffusion_loss.loss_mode` "
     "= 'grpo_guard': this loss never reads the KL term (it does not take the reference mean `ref_mean`), so the "
     "reference forward pass would only cost time; set it to false, or use a loss_mode with a KL term (flow_grpo, "
     "mix_grpo, dance_grpo)."),
    ("separate_async", ["actor_rollout_ref.actor.diffusion_loss.loss_mode=flow_dppo",
                        "actor_rollout_ref.actor.use_kl_loss=true"],
     "`actor_rollout_ref.actor.use_kl_loss` = True is refused with `actor_rollout_ref.actor.diffusion_loss.loss_mode` "
     "= 'flow_dppo': this loss never reads the KL term"),
    ("sync", ["actor_rollout_ref.actor.kl_loss_coef=0.01"],
     "`actor_rollout_ref.actor.kl_loss_coef` = 0.01 is refused while `actor_rollout_ref.actor.use_kl_loss` = false: "
     "the KL penalty is off, so nothing reads its coefficient; leave it at its default (0.001), or set "
     "`actor_rollout_ref.actor.use_kl_loss` = true."),
    ("separate_async", ["buffer.sampler=prioritized"],
     f"`buffer.sampler` = 'prioritized' {WAIT}a sampler cannot choose other groups; use fifo (or ticket), or the drop "
     "strategy."),
    ("separate_async", ["trainer.v1.sampler.custom_sampler.path=/x.py", "trainer.v1.sampler.custom_sampler.name=S"],
     f"`trainer.v1.sampler.custom_sampler.path` = '/x.py' {WAIT}a custom sampler would never be asked; unset it, or "
     "use the drop strategy."),
    ("sync", ["actor_rollout_ref.model.tokenizer_path=/tok"],
     "`actor_rollout_ref.model.tokenizer_path` = '/tok' is refused: loading components from outside the pipeline "
     "folder is not built yet; put them under `actor_rollout_ref.model.path`; leave it at its default (null)."),
    ("sync", ["actor_rollout_ref.rollout.val_kwargs.pipeline.num_frames=4"],
     "`actor_rollout_ref.rollout.val_kwargs.pipeline.num_frames` = 4 is refused: video generation is not built yet; "
     "leave it at its default (1)."),
    ("sync", ["buffer.priority_exponent=2.0"],
     "`buffer.priority_exponent` = 2.0 is refused with `buffer.sampler` = 'fifo': only the prioritized sampler reads "
     "the priority exponent; leave it at its default (0.6), or use `buffer.sampler=prioritized` (without a custom "
     "sampler, and without 'exponent' in `trainer.v1.sampler.sampler_kwargs`)."),
    ("separate_async", ["trainer.v1.sampler.max_off_policy_strategy=drop", "buffer.sampler=prioritized",
                        "+trainer.v1.sampler.sampler_kwargs.exponent=1.0", "buffer.priority_exponent=2.0"],
     "`buffer.priority_exponent` = 2.0 is refused while `trainer.v1.sampler.sampler_kwargs` sets 'exponent' (it "
     "wins): only the prioritized sampler reads the priority exponent"),
    ("separate_async", ["buffer.freshness_decay=0.9"],
     "`buffer.freshness_decay` = 0.9 is refused with `buffer.sampler` = 'fifo': only the freshness sampler reads the "
     "per-lag decay; leave it at its default (0.5), or use `buffer.sampler=freshness`"),
    ("separate_async", ["trainer.v1.sampler.max_off_policy_strategy=drop", "buffer.sampler=freshness",
                        "trainer.v1.sampler.custom_sampler.path=/x.py", "trainer.v1.sampler.custom_sampler.name=S",
                        "buffer.freshness_decay=0.9"],
     "`buffer.freshness_decay` = 0.9 is refused while `trainer.v1.sampler.custom_sampler` is set (a custom sampler "
     "gets only `sampler_kwargs`): only the freshness sampler reads the per-lag decay"),
    ("sync", ["buffer.samples_per_insert_error_buffer=3"],
     "`buffer.samples_per_insert_error_buffer` = 3 is refused while `buffer.samples_per_insert` is null (no rate "
     "limiter): the slack belongs to the samples-per-insert rate limiter, which is off; leave it at its default "
     "(null), or set `buffer.samples_per_insert`."),
    ("sync", ["actor_rollout_ref.actor.optim.total_training_steps=100"],
     "`actor_rollout_ref.actor.optim.total_training_steps` = 100 is refused with "
     "`actor_rollout_ref.actor.optim.lr_scheduler_type` = 'constant': only the cosine schedule has a horizon; the "
     "run's length is `trainer.total_training_steps`; leave it at its default (null), or set "
     "`actor_rollout_ref.actor.optim.lr_scheduler_type=cosine`; to stop the run after N updates set "
     "`trainer.total_training_steps=N`."),
    ("separate_async", ["trainer.rollout_data_max_samples=5"],
     "`trainer.rollout_data_max_samples` = 5 is refused while `trainer.rollout_data_save_freq` = 0 (no dump): rollout "
     "samples are dumped only with `trainer.rollout_data_save_freq` > 0; leave it at its default (16), or set "
     "`trainer.rollout_data_save_freq` > 0 (dump every N steps)."),
]


@pytest.mark.parametrize("mode, overrides, message", REFUSALS, ids=[" ".join(r[1]) for r in REFUSALS])
def test_refusal_names_key_value_and_reason(mode, overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config([f"trainer.v1.trainer_mode={mode}", *overrides])
    assert str(err.value).startswith(message), f"\n got: {err.value}\nwant: {message}"


ACCEPTED = [
    # the defaults, in both modes
    ("sync", []), ("separate_async", []),
    # values that mean what happens anyway
    ("sync", ["trainer.v1.sampler.max_off_policy_threshold=0"]),
    ("sync", ["actor_rollout_ref.model.policy_state_adapters=[default]"]),
    ("sync", ["actor_rollout_ref.model.policy_state_adapters=[default,reference]"]),
    # the direct-preference keys where they take effect
    ("sync", ["actor_rollout_ref.model.algorithm=diffusion_nft", "algorithm.trainer_type=direct_preference",
              "actor_rollout_ref.model.policy_state_adapters=[default,old]",
              "actor_rollout_ref.rollout.rollout_adapter=old", "actor_rollout_ref.actor.diffusion_loss.mix_beta=0.3",
              "actor_rollout_ref.actor.diffusion_loss.adaptive_weight_min=0.001",
              "actor_rollout_ref.actor.diffusion_loss.ref_kl_coef=0.1",
              "algorithm.old_policy_decay_schedule=delayed_linear_to_0_999", "algorithm.old_policy_update_interval=2"]),
    ("separate_async", ["actor_rollout_ref.model.algorithm=dpo", "algorithm.trainer_type=direct_preference",
                        "algorithm.paired_preference=true", "actor_rollout_ref.actor.diffusion_loss.dpo_beta=500"]),
    ("separate_async", ["actor_rollout_ref.model.algorithm=awm", "algorithm.trainer_type=direct_preference",
                        "actor_rollout_ref.model.policy_state_adapters=[default,old]", "algorithm.old_policy_decay=0.9",
                        "actor_rollout_ref.actor.diffusion_loss.old_kl_coef=0.01"]),
    # an algorithm alone: its preset sets the keys it needs (omnirl_async/config/presets.py)
    *[(mode, [f"actor_rollout_ref.model.algorithm={algo}"]) for mode in ("sync", "separate_async")
      for algo in ("diffusion_nft", "dpo", "awm", "flow_dppo", "dance_grpo", "grpo_guard")],
    ("sync", ["actor_rollout_ref.rollout.algo.sde_type=cps"]),
    ("sync", ["reward.reward_manager=naive"]),
    ("sync", ["reward.reward_manager={source: register, name: naive}"]),
    ("sync", ["actor_rollout_ref.model.target_parameters=[]"]),
    # the same keys where they take effect
    ("separate_async", ["trainer.v1.separate_async.parameter_sync_step=2",
                        "trainer.v1.separate_async.num_warmup_batches=3",
                        "trainer.v1.separate_async.sync_compatible=true",
                        "trainer.v1.sampler.max_off_policy_threshold=2", "buffer.max_times_sampled=2"]),
    ("separate_async", ["trainer.v1.sampler.max_off_policy_strategy=drop", "buffer.sampler=prioritized"]),
    ("separate_async", ["buffer.sampler=ticket"]),
    ("sync", ["actor_rollout_ref.rollout.algo.sde_window_size=2", "actor_rollout_ref.rollout.algo.sde_window_seed=3",
              "actor_rollout_ref.rollout.algo.sample_strategy=progressive"]),
    ("sync", ["actor_rollout_ref.rollout.val_kwargs.algo.noise_level=0.5",
              "actor_rollout_ref.rollout.val_kwargs.algo.sde_type=cps"]),
    ("sync", ["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.01"]),
    ("separate_async", ["actor_rollout_ref.model.algorithm=mix_grpo", "actor_rollout_ref.actor.use_kl_loss=true"]),
    ("sync", ["transfer_queue.num_data_storage_units=3", "transfer_queue.put_timeout_s=30"]),
    ("sync", ["buffer.sampler=prioritized", "buffer.priority_exponent=2.0"]),
    ("separate_async", ["trainer.v1.sampler.max_off_policy_strategy=drop", "buffer.sampler=freshness",
                        "buffer.freshness_decay=0.9"]),
    ("separate_async", ["trainer.v1.sampler.max_off_policy_strategy=drop", "buffer.samples_per_insert=0.5",
                        "buffer.samples_per_insert_error_buffer=3", "buffer.max_times_sampled=2"]),
    ("sync", ["actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
              "actor_rollout_ref.actor.optim.total_training_steps=100"]),
    ("sync", ["trainer.rollout_data_save_freq=2", "trainer.rollout_data_max_samples=5"]),
]


@pytest.mark.parametrize("mode, overrides", ACCEPTED, ids=[" ".join([m, *o]) for m, o in ACCEPTED])
def test_defaults_and_effective_values_still_load(mode, overrides):
    load_config([f"trainer.v1.trainer_mode={mode}", *overrides])


# ----------------------------------------------------------------------------------------------- the key table
def test_config_keys_doc_is_current():
    doc = REPO / "docs" / "CONFIG_KEYS.md"
    assert doc.is_file(), "docs/CONFIG_KEYS.md is missing: python -m omnirl_async.config.doc > docs/CONFIG_KEYS.md"
    # rendered in a fresh interpreter: other tests register losses/rewards of their own in this one
    import subprocess
    import sys

    fresh = subprocess.run([sys.executable, "-m", "omnirl_async.config.doc"], capture_output=True, text=True,
                           check=True, cwd=REPO).stdout
    assert doc.read_text() == fresh, ("docs/CONFIG_KEYS.md is out of date; regenerate it with "
                                      "`python -m omnirl_async.config.doc > docs/CONFIG_KEYS.md`")


def test_config_keys_doc_lists_every_key_with_its_mode_effect():
    text = render()
    for key in schema_keys():
        assert f"| `{key.path}` |" in text, key.path
    key = "| `trainer.v1.separate_async.parameter_sync_step`"
    row = next(line for line in text.splitlines() if line.startswith(key))
    sync, separate = row.split(" | ")[2:4]
    assert sync.startswith("refused: sync publishes the weights after every update")
    assert separate == "applies"
