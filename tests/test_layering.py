"""Import contracts of DESIGN.md §6: imports flow one way.

* ``fastroute`` never imports ``controller`` (the CLI loads subcommands by name, lazily);
* ``fastroute._core`` depends on nothing else in fastroute but ``_env``;
* ``fastroute.tables`` builds only on ``_core``, ``errors`` and itself;
* the data plane (``proxy``) and the simulator never import the solver (``highspy``);
* ``controller`` may import only ``fastroute.{tables,signals,config,errors,policy}``;
* the simulator never imports the data plane (``proxy``); the layers both share
  (``predict``, ``policy``, ``workload``, ``guards``, ``hardware``, ``tokens``) import
  neither ``proxy`` nor ``emulator``;
* the production path (everything but ``emulator``, ``sim``, ``demo``, ``bench``,
  ``testing`` and the lazy CLI) never imports the fake engines (``emulator``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (module prefix, prefixes it must not import); "fastroute" alone means "any fastroute module
# other than the allowed ones" and is expressed through ALLOWED below.
FORBIDDEN: list[tuple[str, tuple[str, ...]]] = [
    ("fastroute", ("controller",)),
    ("fastroute.proxy", ("highspy",)),
    ("fastroute.sim", ("highspy",)),
    ("fastroute._core", ("aiohttp", "highspy", "uvloop")),
    ("fastroute.tables", ("aiohttp", "highspy", "uvloop")),
    ("fastroute.sim", ("fastroute.proxy",)),
    *[
        (shared, ("fastroute.proxy", "fastroute.emulator"))
        for shared in (
            "fastroute.predict",
            "fastroute.policy",
            "fastroute.workload",
            "fastroute.guards",
            "fastroute.hardware",
            "fastroute.tokens",
        )
    ],
    *[
        (production, ("fastroute.emulator",))
        for production in (
            "fastroute.proxy",
            "fastroute.signals",
            "fastroute.tables",
            "fastroute.loadgen",
            "fastroute.config",
            "fastroute.errors",
            "fastroute.hashing",
            "fastroute.systemd",
            "controller",
        )
    ],
]
ALLOWED_FASTROUTE: dict[str, tuple[str, ...]] = {
    "fastroute._core": ("fastroute._core", "fastroute._env"),
    "fastroute.tables": ("fastroute.tables", "fastroute._core", "fastroute.errors"),
    "controller": (
        "fastroute.tables",
        "fastroute.signals",
        "fastroute.config",
        "fastroute.errors",
        "fastroute.policy",
        "fastroute.hashing",
        "fastroute.hardware",  # seed latencies of the datasheet profiles (controller/service.py)
        "fastroute.systemd",  # sd_notify readiness of the controller process (controller/cli.py)
    ),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(source: str, package: str) -> list[str]:
    """Absolute names of every module ``source`` (a module of ``package``) imports."""
    tree = ast.parse(source)
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                names.append(f"{base}.{node.module}" if node.module else base)
            else:
                names.append(node.module or "")
    return names


def _sources() -> list[Path]:
    files = [*ROOT.joinpath("fastroute").rglob("*.py"), *ROOT.joinpath("fastroute").rglob("*.pyx")]
    return sorted([*files, *ROOT.joinpath("controller").rglob("*.py")])


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _forbidden_imports(imported: list[str], forbidden: tuple[str, ...]) -> list[str]:
    return [name for name in imported for f in forbidden if _within(name, f)]


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_respect_the_layering(path: Path) -> None:
    """Every module imports only what its layer may import."""
    if path.suffix == ".pyx":
        source = path.read_text()
        module = _module_name(path)
        imported = [
            line.split()[1]
            for line in source.splitlines()
            if line.startswith(("import ", "from ", "cimport "))
        ]
    else:
        module = _module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        imported = _imports(path.read_text(), package)
    for prefix, forbidden in FORBIDDEN:
        if _within(module, prefix):
            bad = _forbidden_imports(imported, forbidden)
            assert not bad, f"{module} must not import {bad}"
    for prefix, allowed in ALLOWED_FASTROUTE.items():
        if _within(module, prefix):
            bad = [
                name
                for name in imported
                if _within(name, "fastroute") and not any(_within(name, a) for a in allowed)
            ]
            assert not bad, f"{module} may only import {allowed} from fastroute, not {bad}"


def test_the_checker_sees_violations() -> None:
    """The import scanner finds absolute and relative imports (so the contract can fail)."""
    source = "import controller.lp\nfrom highspy import Highs\nfrom ..proxy import app\n"
    assert _imports(source, "fastroute.sim") == ["controller.lp", "highspy", "fastroute.proxy"]


@pytest.mark.parametrize(
    ("prefix", "forbidden"), FORBIDDEN, ids=[f"{p}-{','.join(f)}" for p, f in FORBIDDEN]
)
def test_each_forbidden_import_rule_can_fail(prefix: str, forbidden: tuple[str, ...]) -> None:
    """A module of ``prefix`` importing (a submodule of) each forbidden name is flagged,
    and the rule covers modules that exist (a renamed package would disarm it)."""
    for name in forbidden:
        assert _forbidden_imports([f"{name}.x", "json"], forbidden) == [f"{name}.x"]
    modules = [_module_name(p) for p in _sources()]
    assert any(_within(m, prefix) for m in modules), f"no module is {prefix} or below it"
