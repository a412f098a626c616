"""The import matrix of docs/design.md §6: imports flow one way.

Every module belongs to one *layer* (a top-level package of ``fastroute``, a top-level module
of it, or ``controller``), and :data:`MAY_IMPORT` lists, for every layer, the other layers it
may import. A module of a layer the matrix does not name fails the test, so a new package has
to take its place in the picture before it can land. What the matrix says in words:

* ``fastroute`` never imports ``controller`` (the CLI loads subcommands by name, lazily;
  the simulator receives the optimiser as an injected callable);
* the leaves (``errors``, ``hashing``, ``hardware``, ``systemd``, ``_env``) import nothing of
  fastroute; ``_core`` only ``_env``; ``tables`` only ``_core`` and ``errors``;
* the layers the proxy and the simulator share (``guards``, ``policy``, ``predict``,
  ``workload``, ``tokens``, ``hardware``) never import ``proxy``, ``emulator`` or ``sim``;
* the simulator never imports the data plane (``proxy``);
* the production path (``proxy``, ``signals``, ``tables``, ``config``, ``controller`` and what
  they import) never imports the fake engines (``emulator``); only the emulator, the
  simulator, the fleet benchmark harness and the test helpers do (``demo`` goes through the
  harness);
* ``controller`` imports only
  ``fastroute.{tables,signals,config,discovery,errors,etcd,hardware,hashing,systemd}``
  (and may import ``policy`` and ``guards``), never ``proxy``;
* the solver (``highspy``) is the controller's alone; the asyncio stack (``aiohttp``,
  ``uvloop``) stays out of the pure layers;
* no import cycle between modules (imports at module level).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Layer → the other layers its modules may import (fastroute's own and ``controller``).
MAY_IMPORT: dict[str, frozenset[str]] = {
    name: frozenset(allowed)
    for name, allowed in {
        "fastroute": {"fastroute._version"},
        "fastroute.__main__": {"fastroute.cli"},
        "fastroute._version": set(),
        "fastroute._env": set(),
        "fastroute.cli": {"fastroute._version"},
        "fastroute.errors": set(),
        "fastroute.hashing": set(),
        "fastroute.hardware": set(),
        "fastroute.systemd": set(),
        "fastroute.tokens": {"fastroute.hardware", "fastroute.hashing"},
        "fastroute.config": {"fastroute.errors", "fastroute.hardware"},
        "fastroute._core": {"fastroute._env"},
        "fastroute.tables": {"fastroute._core", "fastroute.errors"},
        "fastroute.guards": {"fastroute._core"},
        "fastroute.predict": {"fastroute.hardware"},
        "fastroute.policy": {
            "fastroute._core",
            "fastroute.config",
            "fastroute.errors",
            "fastroute.predict",
            "fastroute.tokens",  # prefix-hrw: bytes of prompt text -> tokens saved
        },
        "fastroute.signals": {
            "fastroute.errors",
            "fastroute.predict",
        },
        "fastroute.workload": {
            "fastroute.errors",
            "fastroute.hardware",
            "fastroute.hashing",
            "fastroute.tokens",
        },
        "fastroute.loadgen": set(),
        "fastroute.discovery": {"fastroute.config", "fastroute.errors"},
        "fastroute.etcd": {"fastroute.errors"},
        "fastroute.proxy": {
            "fastroute._core",
            "fastroute.config",
            "fastroute.discovery",
            "fastroute.errors",
            "fastroute.etcd",
            "fastroute.guards",
            "fastroute.hashing",
            "fastroute.policy",
            "fastroute.predict",
            "fastroute.signals",
            "fastroute.systemd",
            "fastroute.tables",
        },
        "fastroute.emulator": {
            "fastroute.hardware",
            "fastroute.hashing",
            "fastroute.tokens",
        },
        "fastroute.sim": {
            "fastroute.emulator",
            "fastroute.guards",
            "fastroute.hardware",
            "fastroute.hashing",
            "fastroute.policy",
            "fastroute.predict",
            "fastroute.workload",
        },
        "fastroute.fleetbench": {
            "fastroute.config",
            "fastroute.emulator",
            "fastroute.hardware",
            "fastroute.loadgen",
            "fastroute.policy",
            "fastroute.tables",
            "fastroute.workload",
        },
        "fastroute.demo": {
            "fastroute.fleetbench",
            "fastroute.loadgen",
            "fastroute.workload",
        },
        "fastroute.testing": {
            "fastroute.fleetbench",
            "fastroute.hashing",
            "fastroute.proxy",
            "fastroute.tables",
        },
        "controller": {
            "fastroute.config",
            "fastroute.discovery",
            "fastroute.errors",
            "fastroute.etcd",
            "fastroute.guards",
            "fastroute.hardware",
            "fastroute.hashing",
            "fastroute.policy",
            "fastroute.signals",
            "fastroute.systemd",
            "fastroute.tables",
        },
    }.items()
}
#: Third-party packages a layer must not import.
THIRD_PARTY_BANNED: dict[str, frozenset[str]] = {
    layer: frozenset(banned)
    for layer, banned in {
        **{
            pure: {"aiohttp", "uvloop", "highspy"}
            for pure in (
                "fastroute._core",
                "fastroute.tables",
                "fastroute.guards",
                "fastroute.policy",
                "fastroute.predict",
                "fastroute.hardware",
                "fastroute.tokens",
                "fastroute.config",
                "fastroute.errors",
                "fastroute.hashing",
                "fastroute.workload",
            )
        },
        **{
            layer: {"highspy"}
            for layer in MAY_IMPORT
            if layer != "controller" and layer.startswith("fastroute")
        },
    }.items()
}
#: The design's rules in words, each a (layer, layers it must never import) pair; the
#: matrix above must agree with every one (a rule the matrix breaks fails the test).
NEVER: list[tuple[str, tuple[str, ...]]] = [
    *[(layer, ("controller",)) for layer in MAY_IMPORT if layer.startswith("fastroute")],
    ("fastroute.sim", ("fastroute.proxy",)),
    *[
        (shared, ("fastroute.proxy", "fastroute.emulator", "fastroute.sim"))
        for shared in (
            "fastroute.guards",
            "fastroute.policy",
            "fastroute.predict",
            "fastroute.workload",
            "fastroute.tokens",
            "fastroute.hardware",
        )
    ],
    *[
        (production, ("fastroute.emulator", "fastroute.fleetbench", "fastroute.testing"))
        for production in (
            "fastroute.proxy",
            "fastroute.signals",
            "fastroute.tables",
            "fastroute.config",
            "fastroute.discovery",
            "fastroute.etcd",
            "fastroute.loadgen",
            "controller",
        )
    ],
    ("controller", ("fastroute.proxy", "fastroute.sim", "fastroute.emulator")),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    """The layer of a module name: ``controller``, ``fastroute`` or ``fastroute.<top>``."""
    parts = module.split(".")
    if parts[0] == "fastroute" and len(parts) > 1:
        return f"fastroute.{parts[1]}"
    return parts[0]


def _imports(source: str, package: str, *, top_level_only: bool = False) -> list[str]:
    """Absolute names of the modules ``source`` (a module of ``package``) imports.

    ``top_level_only``: only imports executed when the module is imported (not those inside
    functions or under ``if TYPE_CHECKING``), the ones that can form a cycle.
    """
    tree = ast.parse(source)
    nodes = _module_level(tree.body) if top_level_only else ast.walk(tree)
    names: list[str] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            names.append(module)
            if top_level_only:  # ``from pkg import submodule`` imports the submodule
                names.extend(f"{module}.{alias.name}" for alias in node.names)
    return names


def _module_level(body: list[ast.stmt]) -> list[ast.stmt]:
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.If, ast.Try)):
            out.extend(_module_level(node.body))
            out.extend(_module_level(node.orelse))
            for handler in getattr(node, "handlers", []):
                out.extend(_module_level(handler.body))
        else:
            out.append(node)
    return out


def _sources() -> list[Path]:
    files = [*ROOT.joinpath("fastroute").rglob("*.py"), *ROOT.joinpath("fastroute").rglob("*.pyx")]
    return sorted([*files, *ROOT.joinpath("controller").rglob("*.py")])


def _imported_by(path: Path) -> list[str]:
    module = _module_name(path)
    if path.suffix == ".pyx":
        return [
            line.split()[1]
            for line in path.read_text().splitlines()
            if line.startswith(("import ", "from ", "cimport "))
        ]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    return _imports(path.read_text(), package)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(module: str, imported: list[str]) -> list[str]:
    """The imports of ``module`` the matrix does not allow (empty: it keeps the layering)."""
    layer = layer_of(module)
    allowed = MAY_IMPORT.get(layer)
    if allowed is None:
        return [f"{module}: layer {layer} is not in the import matrix"]
    bad = []
    for name in imported:
        top = name.split(".")[0]
        if top in ("fastroute", "controller"):
            target = layer_of(name)
            if target != layer and target not in allowed:
                bad.append(name)
        elif top in THIRD_PARTY_BANNED.get(layer, ()):
            bad.append(name)
    return bad


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_respect_the_matrix(path: Path) -> None:
    """Every module imports only what its layer may import."""
    module = _module_name(path)
    bad = violations(module, _imported_by(path))
    assert not bad, f"{module} must not import {bad} (tests/test_layering.py MAY_IMPORT)"


@pytest.mark.parametrize(("layer", "never"), NEVER, ids=[f"{a}-{','.join(b)}" for a, b in NEVER])
def test_the_matrix_keeps_each_rule_of_the_design(layer: str, never: tuple[str, ...]) -> None:
    """No rule of the design is granted by the matrix, and each rule covers a layer that exists
    (a renamed package would disarm it)."""
    granted = MAY_IMPORT[layer] & set(never)
    assert not granted, f"the matrix lets {layer} import {sorted(granted)}"
    assert any(_within(_module_name(p), layer) for p in _sources()), f"no module in {layer}"


def test_the_checker_sees_violations() -> None:
    """The scanner finds absolute and relative imports, and the matrix flags them (so the
    contract can fail)."""
    source = "import controller.lp\nfrom highspy import Highs\nfrom ..proxy import app\n"
    imported = _imports(source, "fastroute.sim")
    assert imported == ["controller.lp", "highspy", "fastroute.proxy"]
    assert violations("fastroute.sim.core", imported) == imported
    assert violations("fastroute.sim.core", ["fastroute.policy.base", "numpy"]) == []
    assert violations("fastroute.brand_new.x", []) != []  # an unplaced layer fails
    assert violations("fastroute.proxy.path.x", ["fastroute.proxy.http.reply"]) == []


def _module_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in _sources() if p.suffix == ".py"}
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for name in _imports(path.read_text(), package, top_level_only=True):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module and not _within(module, name):
                graph[module].add(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module → the modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def test_no_import_cycle() -> None:
    """No module imports, at module level, a module that imports it back (directly or not)."""
    cycle = find_cycle(_module_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
