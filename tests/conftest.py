"""Shared fixtures: a seeded random source whose seed shows in failures, unique shm names,
small Azure-format traces."""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from fastroute import _core
from fastroute.tables.segment import shm_dir
from fastroute.testing.traces import write_azure_csv


class Rand(random.Random):
    """A seeded ``random.Random`` whose ``repr`` shows the seed (msgspec's habit)."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.seed_value = seed
        self.np = np.random.default_rng(seed)

    def __repr__(self) -> str:
        return f"Rand(seed={self.seed_value})"


@pytest.fixture
def rand() -> Rand:
    """Seeded randomness, fixed by default for reproducible CI; FASTROUTE_TEST_SEED varies it."""
    return Rand(int(os.environ.get("FASTROUTE_TEST_SEED", "20261129")))


@pytest.fixture
def shm_name() -> Iterator[str]:
    """A segment name no other test uses; its files are removed afterwards."""
    name = f"fastroute-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    yield name
    for suffix in ("", ".lock", ".tmp"):
        (shm_dir() / (name + suffix)).unlink(missing_ok=True)


@pytest.fixture
def azure_csv():
    """``azure_csv(path, rows, gap_s=, prompt=, out=)``: write a small Azure-format trace."""
    return write_azure_csv


# Property tests: a fast bounded profile in the normal suite; `--hypothesis-profile fuzz`
# for a long run (docs/failure-handling.md, "Fuzzing").
settings.register_profile(
    "fastroute", max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "fuzz", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("fastroute")


def pytest_report_header(config: pytest.Config) -> str:
    return f"fastroute core: {'pure-Python twins' if _core.NO_EXTENSIONS else 'compiled'}"
