"""Fixtures of the integration tests that start real processes."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from fastroute.testing.processes import kill_groups


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes started by the test (own sessions); their groups are killed at teardown."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    kill_groups(started)
