"""Shared-memory table costs: publish (write + flip), generation check, snapshot."""

from __future__ import annotations

import numpy as np
import pytest

from fastroute.tables import Counter, StatsBlock, TableReader, TableWriter
from fastroute.testing.tables import make_table

SIZES = [(100, 100), (1000, 1000)]


@pytest.mark.benchmark(group="publish")
@pytest.mark.parametrize(("n_classes", "n_engines"), SIZES, ids=["100x100", "1000x1000"])
def test_publish(benchmark, shm_name, n_classes, n_engines) -> None:
    """Validate, write the inactive buffer, checksum and publish one table."""
    ids, weights = make_table(n_engines, n_classes)
    with TableWriter(shm_name, max_engines=1024, max_classes=1024) as writer:
        writer.publish(ids, weights)  # fault both buffers' pages in outside the timing
        writer.publish(ids, weights)
        benchmark(writer.publish, ids, weights)
        benchmark.extra_info["table_bytes"] = 8 * n_classes * n_engines
        assert writer.generation > 2


@pytest.mark.benchmark(group="snapshot")
@pytest.mark.parametrize(("n_classes", "n_engines"), SIZES, ids=["100x100", "1000x1000"])
def test_snapshot(benchmark, shm_name, n_classes, n_engines) -> None:
    """A consistent copy of the current table."""
    ids, weights = make_table(n_engines, n_classes)
    with TableWriter(shm_name, max_engines=1024, max_classes=1024) as writer:
        writer.publish(ids, weights)
        with TableReader(shm_name) as reader:
            snap = benchmark(reader.snapshot)
            assert np.array_equal(snap.weights, weights)
            del snap


@pytest.mark.benchmark(group="generation")
def test_generation_check(benchmark, shm_name) -> None:
    """The cheap "did anything change?" poll."""
    with TableWriter(shm_name, max_engines=16, max_classes=4) as writer:
        writer.publish(*make_table(16))
        with TableReader(shm_name) as reader:
            assert benchmark(reader.generation) == 1


@pytest.mark.benchmark(group="stats")
def test_stats_in_flight_add(benchmark, shm_name) -> None:
    """One atomic in-flight increment in the shared stats block."""
    block = StatsBlock.create(shm_name, list(range(64)))
    try:
        benchmark(block.add, 3, Counter.IN_FLIGHT, 1)
        assert block.get(3, Counter.IN_FLIGHT) > 0
    finally:
        block.unlink()
