"""Fixtures of the controller's integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fastroute.tables.segment import shm_dir


@pytest.fixture
def proxy_table(shm_name: str) -> Iterator[str]:
    """A second unique table name (the proxy's), removed afterwards."""
    name = shm_name + "-proxy"
    yield name
    for suffix in ("", ".lock", ".tmp"):
        (shm_dir() / (name + suffix)).unlink(missing_ok=True)
