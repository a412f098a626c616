"""Benchmark fixtures: implementations, seeded tables and keys, unique segment names.

Run timed with ``make bench``; ``make test`` runs each benchmark once untimed
(``--benchmark-disable``) to prove it still works.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from fastroute import _core
from fastroute.tables.segment import shm_dir

SELECTORS = {"py": _core.SelectorPy}
if _core.SelectorC is not None:
    SELECTORS["cy"] = _core.SelectorC


@pytest.fixture(params=sorted(SELECTORS), ids=sorted(SELECTORS))
def selector_impl(request: pytest.FixtureRequest) -> type:
    return SELECTORS[request.param]


@pytest.fixture
def keys() -> list[int]:
    rng = np.random.default_rng(11)
    return [int(k) for k in rng.integers(0, 2**64, size=4096, dtype=np.uint64)]


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = f"fastroute-bench-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    yield name
    for suffix in ("", ".lock", ".tmp"):
        (shm_dir() / (name + suffix)).unlink(missing_ok=True)
