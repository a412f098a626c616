"""Shared memory across real processes: seqlock snapshots, atomics, writer crash and restart."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from fastroute.tables import Counter, StatsBlock, TableReader, TableWriter
from fastroute.testing.shm_workers import (
    hammer_counters,
    pattern_table,
    publish_until_stopped,
    snapshot_and_check,
)

pytestmark = [pytest.mark.parity, pytest.mark.integration]

SPAWN = multiprocessing.get_context("spawn")
PROCESS_TIMEOUT_S = 240


def _wait_until(predicate, timeout_s: float = 30.0, interval_s: float = 0.01) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout_s} s")
        time.sleep(interval_s)


@pytest.fixture
def spawn():
    """Start spawn-context processes; any still alive at teardown is killed (no hung CI)."""
    started: list = []

    def start(target, *args):
        process = SPAWN.Process(target=target, args=args, daemon=True)
        process.start()
        started.append(process)
        return process

    yield start
    for process in started:
        if process.is_alive():
            process.kill()
        process.join(10)


def _results(queue, n: int) -> list:
    return [queue.get(timeout=PROCESS_TIMEOUT_S) for _ in range(n)]


def _generation(name: str) -> int:
    try:
        with TableReader(name) as reader:
            return reader.generation()
    except Exception:
        return 0


@pytest.mark.slow
def test_no_torn_snapshots_under_a_fast_writer(shm_name, spawn) -> None:
    """A writer publishing >= 10k generations, two readers taking 200k snapshots each: 0 torn.

    Every table is a pure function of its generation (ids, weights and sizes), and
    every buffer carries a checksum, so a snapshot mixing two generations fails both.
    """
    max_engines, max_classes = 32, 8
    queue, stop = SPAWN.Queue(), SPAWN.Event()
    writer = spawn(publish_until_stopped, shm_name, max_engines, max_classes, stop, 10_000, queue)
    _wait_until(lambda: _generation(shm_name) > 0)
    readers = [
        spawn(snapshot_and_check, shm_name, 200_000, max_engines, max_classes, queue)
        for _ in range(2)
    ]
    reports = [payload for kind, payload in _results(queue, 2) if kind == "reader"]
    stop.set()
    ((writer_kind, published),) = _results(queue, 1)
    for process in [writer, *readers]:
        process.join(PROCESS_TIMEOUT_S)
        assert process.exitcode == 0
    assert writer_kind == "writer" and published >= 10_000
    for report in reports:
        assert report["snapshots"] == 200_000
        assert report["torn"] == 0, report
        assert report["regressions"] == 0, report
        assert report["distinct"] > 100, report  # readers really raced the writer


def test_concurrent_counter_updates_lose_nothing(shm_name, spawn) -> None:
    """Four processes hammering one slot: totals are exact, in-flight returns to zero."""
    block = StatsBlock.create(shm_name, [1, 2])
    queue = SPAWN.Queue()
    iterations = 20_000
    workers = [spawn(hammer_counters, shm_name, iterations, queue) for _ in range(4)]
    assert [n for _, n in _results(queue, 4)] == [iterations] * 4
    for worker in workers:
        worker.join(PROCESS_TIMEOUT_S)
        assert worker.exitcode == 0
    assert block.get(0, Counter.REQUESTS) == 4 * iterations
    assert block.get(0, Counter.IN_FLIGHT) == 0
    assert block.get(1, Counter.IN_FLIGHT_TOKENS) == 4 * sum(i % 7 for i in range(iterations))
    assert block.get(1, Counter.QUEUED_TOKENS) == 0
    assert block.column(Counter.QUEUED_TOKENS).tolist()[:2] == [0, 0]
    block.unlink()


def test_readers_survive_a_killed_writer_and_follow_its_successor(shm_name, spawn) -> None:
    """SIGKILL the writer: readers keep the last table; a new writer takes over the name."""
    queue, stop = SPAWN.Queue(), SPAWN.Event()
    writer = spawn(publish_until_stopped, shm_name, 32, 8, stop, 10**12, queue)
    _wait_until(lambda: _generation(shm_name) > 100)
    reader = TableReader(shm_name, verify=True)
    os.kill(writer.pid, signal.SIGKILL)
    writer.join(PROCESS_TIMEOUT_S)
    last = reader.snapshot()  # the last complete generation, never a half-written one
    ids, weights = pattern_table(last.generation, 32, 8)
    assert (last.engine_ids == ids).all() and (last.weights == weights).all()
    successor = TableWriter(shm_name, max_engines=32, max_classes=8)  # lock freed by the kernel
    assert successor.generation == last.generation
    successor.publish([1], [[1.0]])
    assert reader.snapshot().generation == last.generation + 1
    reader.close()
    successor.unlink()
