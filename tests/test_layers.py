"""The package reads top-down: every import runs down the layers, and no two modules import each other.

Every module of ``omnirl_async`` is parsed with :mod:`ast` (nothing is
imported), and every ``import`` / ``from ... import`` in it counts, including
those inside functions (lazy imports) and under ``if TYPE_CHECKING:``. A module
belongs to the layer of its top-level subpackage or module (:data:`LAYERS`).

* (a) the module graph has no cycle, lazy imports included: a lazy import only
  hides a cycle from Python's import system, not from the reader;
* (b) a module imports only from its own layer or the layers below. Modules of
  the same layer may import each other across packages (``actors`` ->
  ``learners.weight_store``) as long as (a) holds.

The layers are documented in docs/CONTRACTS.md ("Layers"); change both together.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "omnirl_async"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

#: Layer rank of each top-level subpackage or module: a module may import ranks <= its own.
LAYERS: dict[str, int] = {
    # entry points
    "cli": 6,
    "demo": 6,
    # runs a job: Ray start-up, the training loops, checkpoints, the driver's input checks
    "trainer": 5,
    # Ray actors around a policy
    "actors": 4,
    "learners": 4,
    # state and compute the actors hold
    "buffer": 3,
    "models": 3,
    # domain leaves: losses and advantages, reward functions, prompt sets; config reads their registries
    "algos": 2,
    "rewards": 2,
    "data": 2,
    "config": 2,
    # shared foundation: standard library / numpy / msgspec only
    "protocol": 1,
    "metrics": 1,
    "preflight": 1,
    "staleness": 1,
    "userfiles": 1,
    "placement": 1,
    "waits": 1,
    # the package itself (``omnirl_async/__init__.py``)
    "": 0,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of the dotted ``name`` that is a module of the package (None: outside it)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """``(line, imported module)`` for every import of a package module in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # ``from pkg import sub`` imports the submodule ``pkg.sub`` when there is one
            targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem for alias in node.names]
        else:
            continue
        for target in targets:
            resolved = _resolve(target, modules)
            if resolved is None or resolved == module or (node.lineno, resolved) in found:
                continue
            if isinstance(node, ast.Import) and module.startswith(resolved + "."):
                continue  # ``import <own parent package>``: Python has imported it before this module anyway
            found.append((node.lineno, resolved))
    return found


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _graph() -> tuple[dict[str, Path], dict[str, list[tuple[int, str]]]]:
    modules = _modules()
    return modules, {m: _imports(m, p, modules) for m, p in modules.items()}


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT.parent)}:{line}"


def _cycles(edges: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:  # the graph is small (~100 modules): recursion is fine
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for _, w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def test_every_module_has_a_layer():
    modules = _modules()
    missing = sorted({_layer(m) for m in modules} - set(LAYERS))
    assert not missing, (f"top-level module(s)/subpackage(s) {missing} of {PACKAGE} have no layer; add them to "
                         "LAYERS in tests/test_layers.py and to the Layers section of docs/CONTRACTS.md")


def test_no_import_cycles():
    modules, edges = _graph()
    problems = []
    for component in _cycles(edges):
        members = set(component)
        lines = [f"  {_where(modules[m], line)} imports {target}"
                 for m in component for line, target in edges[m] if target in members]
        problems.append(f"cycle between {', '.join(component)}:\n" + "\n".join(lines))
    assert not problems, "import cycles (lazy imports count too):\n" + "\n".join(problems)


def test_imports_run_down_the_layers():
    modules, edges = _graph()
    problems = []
    for module, imported in sorted(edges.items()):
        rank = LAYERS.get(_layer(module))
        for line, target in imported:
            target_rank = LAYERS.get(_layer(target))
            if rank is not None and target_rank is not None and target_rank > rank:
                problems.append(f"  {_where(modules[module], line)} imports {target} "
                                f"(layer {_layer(target)!r} = {target_rank} is above {_layer(module)!r} = {rank})")
    assert not problems, "imports that run up the layers:\n" + "\n".join(problems)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The walker itself: a lazy import inside a function and a relative import both count."""
    modules = {"omnirl_async.a": tmp_path / "a.py", "omnirl_async.b": tmp_path / "b.py",
               "omnirl_async.b.c": tmp_path / "c.py"}
    (tmp_path / "a.py").write_text("def f():\n    from omnirl_async.b import c\n    import omnirl_async.b\n"
                                   "from . import b\nimport numpy\n")
    got = _imports("omnirl_async.a", tmp_path / "a.py", modules)
    assert sorted(got) == [(2, "omnirl_async.b.c"), (3, "omnirl_async.b"), (4, "omnirl_async.b")]
    edges = {"x": [(1, "y")], "y": [(1, "z")], "z": [(1, "x")], "w": [(1, "x")]}
    assert _cycles(edges) == [["x", "y", "z"]]
