"""Packaging: sdist → wheel → fresh venv, and what the install must contain.

The flow is ``python -m build``'s: an sdist is built from a copy of this checkout, the wheel is
built *from the unpacked sdist* (so a file missing from the sdist breaks the wheel, as it would
for a user), and the wheel goes into a new venv made without ``--system-site-packages`` and
without the checkout on ``sys.path``.

Offline-ish and fast: builds use this venv's setuptools/Cython (``--no-build-isolation``, the
build requirements of pyproject.toml are already here), and the runtime dependencies are
installed with ``--no-index --find-links`` from a wheel cache
(``$FASTROUTE_WHEEL_CACHE``, default ``~/.cache/fastroute/test-wheels``), pinned to the versions
installed in this venv. Only when that cache lacks something does the test run
``pip download`` once (network) to fill it; later runs are fully offline.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
VERSION = importlib.metadata.version("fastroute")
#: Sources the compiled core is built from: they must ship in the sdist (and the .pyi/.pxd
#: in the wheel, for type checkers and for Cython users cimporting them).
CORE_SOURCES = ("selector.pyx", "selector.pxd", "shm.pyx", "prefix.pyx", "mix.pxd", "atomics.h")
CORE_STUBS = ("selector.pyi", "shm.pyi", "prefix.pyi", "selector.pxd", "mix.pxd")
EXTENSIONS = ("fastroute._core.selector", "fastroute._core.shm", "fastroute._core.prefix")
#: What a source checkout contributes to an sdist (everything else is tests, docs, tooling).
TOP_LEVEL = ("pyproject.toml", "setup.py", "README.md", "MANIFEST.in", "LICENSE")
PACKAGES = ("fastroute", "controller")
IGNORE = shutil.ignore_patterns(
    "__pycache__", "*.pyc", "*.so", "*.c", "*.html", "*.egg-info", ".pytest_cache"
)
TIMEOUT_S = 300


def _run(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None,
         check: bool = True) -> subprocess.CompletedProcess[str]:  # fmt: skip
    result = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {result.returncode}\n"
            f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
        )
    return result


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without anything that would leak the checkout or switch the core."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "FASTROUTE_NO_EXTENSIONS", "VIRTUAL_ENV", "PYTHONHOME")
    }
    return {**env, **extra}


def _pins() -> list[str]:
    """``name==version`` of this venv's runtime dependencies (and theirs), recursively."""
    seen: dict[str, str] = {}
    todo = [
        re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0]
        for req in importlib.metadata.requires("fastroute") or []
        if "extra ==" not in req
    ]
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional/conditional dependency not installed here
        seen[key] = dist.version
        for req in dist.requires or []:
            if "extra ==" not in req:  # constraints never install: over-pinning is harmless
                todo.append(re.split(r"[ ;<>=!~\[(]", req.strip(), maxsplit=1)[0])
    return [f"{k}=={v}" for k, v in sorted(seen.items())]


@dataclass
class Built:
    sdist: Path
    wheel: Path
    venv: Path
    work: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def site_core(self) -> Path:
        code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        out = _run([str(self.python), "-c", code], cwd=self.work, env=_clean_env())
        return Path(out.stdout.strip()) / "fastroute" / "_core"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    work = tmp_path_factory.mktemp("packaging")
    python = sys.executable
    # 1. a copy of the checkout's package sources (no build products: the sdist must not
    #    depend on them)
    src = work / "src"
    src.mkdir()
    for name in TOP_LEVEL:
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=IGNORE)
    # 2. sdist (the PEP 517 hook, as `python -m build --sdist --no-isolation` calls it)
    dist = work / "dist"
    out = _run([python, "-c", "import sys; from setuptools import build_meta as b; "
                "print(b.build_sdist(sys.argv[1]))", str(dist)], cwd=src)  # fmt: skip
    sdist = dist / out.stdout.strip().splitlines()[-1]
    # 3. wheel from the unpacked sdist
    unpacked = work / "unpacked"
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4
            tar.extractall(unpacked, filter="data")
        else:
            tar.extractall(unpacked)  # our own sdist
    (sdist_root,) = unpacked.iterdir()
    _run([python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(dist), str(sdist_root)], env=_clean_env())  # fmt: skip
    (wheel,) = dist.glob("fastroute-*.whl")
    # 4. a fresh venv (no pip of its own: this venv's pip installs into it)
    venv = work / "venv"
    _run([python, "-m", "venv", "--without-pip", str(venv)])
    pins = work / "pins.txt"
    pins.write_text("\n".join(_pins()) + "\n")
    cache = Path(
        os.environ.get("FASTROUTE_WHEEL_CACHE", Path.home() / ".cache/fastroute/test-wheels")
    )
    cache.mkdir(parents=True, exist_ok=True)
    pip = [python, "-m", "pip", "--python", str(venv / "bin" / "python"),
           "--disable-pip-version-check"]  # fmt: skip
    install = [*pip, "install", "-q", "--no-index", "--find-links", str(cache), "-c", str(pins),
               str(wheel)]  # fmt: skip
    if _run(install, env=_clean_env(), check=False).returncode != 0:
        # fill the cache once (network), with exactly the pinned versions
        _run([python, "-m", "pip", "download", "-q", "--disable-pip-version-check",
              "-d", str(cache), "-c", str(pins), "--find-links", str(dist), str(wheel)],
             env=_clean_env())  # fmt: skip
        for stale in cache.glob("fastroute-*"):  # the cache holds dependencies only
            stale.unlink()
        _run(install, env=_clean_env())
    return Built(sdist=sdist, wheel=wheel, venv=venv, work=work)


def test_sdist_ships_the_core_sources(built):
    with tarfile.open(built.sdist) as tar:
        names = {Path(n).relative_to(Path(n).parts[0]).as_posix() for n in tar.getnames()}
    for name in CORE_SOURCES:
        assert f"fastroute/_core/{name}" in names, name
    assert "pyproject.toml" in names and "setup.py" in names
    assert "fastroute/py.typed" in names


def test_wheel_is_compiled_and_ships_stubs(built):
    assert not built.wheel.name.endswith("-none-any.whl"), built.wheel.name  # platform wheel
    with zipfile.ZipFile(built.wheel) as whl:
        names = set(whl.namelist())
    for module in EXTENSIONS:
        prefix = module.replace(".", "/") + "."
        assert any(n.startswith(prefix) and n.endswith(".so") for n in names), module
    for name in CORE_STUBS:
        assert f"fastroute/_core/{name}" in names, name
    assert "fastroute/py.typed" in names
    assert any(n.startswith("controller/") for n in names)


def test_installed_command_reports_its_version(built):
    out = _run([str(built.venv / "bin" / "fastroute"), "--version"], cwd=built.work,
               env=_clean_env())  # fmt: skip
    assert out.stdout.strip() == f"fastroute {VERSION}"


def test_installed_package_loads_the_compiled_core(built):
    code = (
        "import fastroute, fastroute._core as c, fastroute._core.selector as s, "
        "fastroute._core.shm as m; "
        "print(fastroute.__file__); print(s.__file__); print(m.__file__); "
        "print(c.Selector is c.SelectorC, c.AtomicBuffer is c.AtomicBufferC, c.NO_EXTENSIONS)"
    )
    out = _run([str(built.python), "-c", code], cwd=built.work, env=_clean_env())
    pkg, selector, shm, flags = out.stdout.strip().splitlines()
    venv = str(built.venv.resolve())
    assert Path(pkg).resolve().as_posix().startswith(venv), pkg  # not the checkout
    for path in (selector, shm):
        assert path.endswith(".so") and Path(path).resolve().as_posix().startswith(venv), path
    assert flags == "True True False"
    # the controller (HiGHS) imports from the install too
    _run([str(built.python), "-c", "import controller.solve, highspy"], cwd=built.work,
         env=_clean_env())  # fmt: skip


def test_missing_extension_fails_with_a_clear_message(built):
    core = built.site_core()
    hidden = built.work / "hidden-extensions"
    hidden.mkdir(exist_ok=True)
    moved = [Path(shutil.move(str(so), hidden / so.name)) for so in core.glob("*.so")]
    assert len(moved) == len(EXTENSIONS)
    try:
        out = _run([str(built.python), "-c", "import fastroute._core"], cwd=built.work,
                   env=_clean_env(), check=False)  # fmt: skip
        assert out.returncode != 0
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("ImportError: fastroute's compiled core"), out.stderr
        assert "is not built" in last and "FASTROUTE_NO_EXTENSIONS=1" in last, last
        # and the documented escape hatch works: the pure-Python twins
        out = _run([str(built.python), "-c",
                    "import fastroute._core as c; print(c.Selector is c.SelectorPy)"],
                   cwd=built.work, env=_clean_env(FASTROUTE_NO_EXTENSIONS="1"))  # fmt: skip
        assert out.stdout.strip() == "True"
    finally:
        for so in moved:
            shutil.move(str(so), core / so.name)


def test_installed_demo_runs(built):
    """``fastroute demo --duration 10`` from the wheel: the installed package runs the demo."""
    env = _clean_env(FASTROUTE_SHM_DIR=str(built.work / "shm"))
    (built.work / "shm").mkdir(exist_ok=True)
    out = _run([str(built.venv / "bin" / "fastroute"), "demo", "--duration", "10"],
               cwd=built.work, env=env, check=False)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert list((built.work / "shm").iterdir()) == []  # the demo cleaned up its segments
