"""Fixtures of the real-engine tier: two real vLLM engines, a real controller and a real proxy,
once per session.

Only ``pytest -m real tests/real`` (``make test-real``) runs this tier; the main suite
deselects it (``-m "not real"`` in the pytest options), so nothing here starts unless asked.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import real_harness as rh

#: Marker of the tests that kill a session engine (sorted last).
KILLS_ENGINE = "kills_engine"


@pytest.fixture(scope="session")
def real_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Logs and configs of this session's processes."""
    return tmp_path_factory.mktemp("real")


@pytest.fixture(scope="session")
def vllm_engines(real_dir: Path) -> Iterator[list[rh.Running]]:
    """Two vLLM engines, one pinned to each core, started together and ready.

    ``FASTROUTE_REAL_ENGINES=URL,URL`` uses engines already running instead (started as
    :func:`real_harness.start_vllm` does; they are left running): minutes saved per run while
    developing the tier.
    """
    given = os.environ.get("FASTROUTE_REAL_ENGINES")
    if given:
        reuse = [rh.Running(None, url, real_dir / "given.log") for url in given.split(",")]
        rh.wait_ready(reuse, "/health")
        yield reuse
        return
    inst = rh.installed()
    engines = [rh.start_vllm(inst, real_dir, name=f"vllm-{i}", cpu=str(i)) for i in range(2)]
    try:
        took_s = rh.wait_ready(engines, "/health")
        print(f"\nvLLM engines ready in {took_s:.0f} s: {[e.url for e in engines]}")
        yield engines
    finally:
        rh.stop(engines)


@pytest.fixture(scope="session")
def stack(vllm_engines: list[rh.Running], real_dir: Path) -> rh.Stack:
    """The config of the controller and the proxy in front of both engines."""
    return rh.write_config([e.url for e in vllm_engines], real_dir)


@pytest.fixture(scope="session")
def controller(stack: rh.Stack, real_dir: Path) -> Iterator[rh.Running]:
    """``fastroute controller`` over both engines (scraping them, publishing the weight table
    the proxy routes on), serving its first plan."""
    run = rh.start_controller(stack, real_dir)
    try:
        rh.wait_ready([run], "/health", timeout_s=60.0)
        yield run
    finally:
        rh.stop([run])


@pytest.fixture(scope="session")
def proxy(stack: rh.Stack, controller: rh.Running, real_dir: Path) -> Iterator[rh.Running]:
    """``fastroute serve`` (one worker) in front of both engines, on the controller's table."""
    run = rh.start_proxy(stack, real_dir)
    try:
        rh.wait_ready([run], "/ready", timeout_s=60.0)
        yield run
    finally:
        rh.stop([run])


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{KILLS_ENGINE}: the test kills a session engine; it runs after all others"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that kill an engine go last, so every other test has both engines."""
    items.sort(key=lambda item: item.get_closest_marker(KILLS_ENGINE) is not None)
