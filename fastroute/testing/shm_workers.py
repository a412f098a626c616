"""Process entry points that exercise shared memory from several real processes.

Used by the cross-process tests and benchmarks: a writer that publishes tables whose
every value is derived from their generation, readers that check each snapshot
against that pattern and its checksum, and counter hammers for the stats block.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

__all__ = ["pattern_table", "publish_until_stopped", "snapshot_and_check", "hammer_counters"]


def pattern_table(generation: int, max_engines: int, max_classes: int) -> tuple[Any, Any]:
    """Ids and weights fully determined by ``generation`` (sizes vary with it too)."""
    n_engines = 1 + generation % max_engines
    n_classes = 1 + (generation // 7) % max_classes
    ids = np.arange(n_engines, dtype=np.uint64) + np.uint64(generation * 100_000)
    weights = np.add.outer(np.arange(n_classes) * 1000.0, np.arange(n_engines)) + generation
    return ids, weights


def publish_until_stopped(
    name: str, max_engines: int, max_classes: int, stop: Any, min_generations: int, out: Any
) -> None:
    """Publish pattern tables until ``stop`` is set and ``min_generations`` are out."""
    from fastroute.tables import TableWriter

    writer = TableWriter(name, max_engines=max_engines, max_classes=max_classes)
    count = 0
    try:
        while not (stop.is_set() and count >= min_generations):
            ids, weights = pattern_table(writer.generation + 1, max_engines, max_classes)
            writer.publish(ids, weights)
            count += 1
    finally:
        out.put(("writer", count))
        writer.close()


def snapshot_and_check(
    name: str, n_snapshots: int, max_engines: int, max_classes: int, out: Any
) -> None:
    """Take ``n_snapshots`` snapshots; count any that is torn (checksum or pattern)."""
    from fastroute.tables import TableReader

    reader = TableReader(name)
    torn = regressions = 0
    seen: set[int] = set()
    last = 0
    started = time.perf_counter()
    for _ in range(n_snapshots):
        snap = reader.snapshot()
        ids, weights = pattern_table(snap.generation, max_engines, max_classes)
        if not (
            snap.verify()
            and np.array_equal(snap.engine_ids, ids)
            and np.array_equal(snap.weights, weights)
        ):
            torn += 1
        if snap.generation < last:
            regressions += 1
        last = snap.generation
        seen.add(snap.generation)
    elapsed_s = time.perf_counter() - started
    reader.close()
    out.put(
        (
            "reader",
            {
                "torn": torn,
                "regressions": regressions,
                "distinct": len(seen),
                "snapshots": n_snapshots,
                "elapsed_s": elapsed_s,
            },
        )
    )


def hammer_counters(name: str, iterations: int, out: Any) -> None:
    """Increment shared counters ``iterations`` times; in-flight and queued tokens go up
    and back down."""
    from fastroute.tables import Counter, StatsBlock

    block = StatsBlock.attach(name)
    for i in range(iterations):
        block.add(0, Counter.IN_FLIGHT, 1)
        block.add(0, Counter.REQUESTS, 1)
        block.add(1, Counter.IN_FLIGHT_TOKENS, i % 7)
        block.add(1, Counter.QUEUED_TOKENS, 100 + i)  # queued, then prefilled
        block.add(0, Counter.IN_FLIGHT, -1)
        block.add(1, Counter.QUEUED_TOKENS, -(100 + i))
    block.close()
    out.put(("hammer", iterations))


def admit_tenant_requests(
    name: str, attempts: int, limit_per_min: int, start: Any, out: Any
) -> None:
    """After ``start`` is set, try ``attempts`` admissions of tenant slot 0 under one
    shared per-minute limit."""
    from fastroute.tables.tenant_limits import Charge, SlotLimits, TenantLimitBlock

    block = TenantLimitBlock.attach(name)
    limits = SlotLimits(requests_per_min=limit_per_min, max_concurrent=10**6)
    admitted = 0
    start.wait(60)
    for _ in range(attempts):
        charge = block.admit(0, 3, limits)
        if isinstance(charge, Charge):
            admitted += 1
            block.finish(charge, used_tokens=5)
    block.close()
    out.put(("admitted", admitted))
