"""Tables whose writer is gone (``fastroute table stale``): listed with age and epoch, removed."""

from __future__ import annotations

import time

import numpy as np
import pytest

from fastroute.tables import TableSnapshot, TableWriter
from fastroute.tables.segment import segment_path
from fastroute.tables.stale import (
    StaleTable,
    find_stale,
    inspect_start,
    judge_start,
    remove_stale,
)


def test_a_table_is_stale_once_its_writer_is_gone_and_can_be_removed(shm_name: str) -> None:
    writer = TableWriter(shm_name, max_engines=4, max_classes=2)
    writer.publish([1, 2], np.array([[1.0, 3.0]]), meta={"epoch": 42})
    assert shm_name not in [t.name for t in find_stale()]  # its writer lives
    writer.close()
    (mine,) = [t for t in find_stale() if t.name == shm_name]
    assert mine.generation == 1 and mine.epoch == 42 and 0 <= mine.age_s < 60
    assert shm_name not in [t.name for t in find_stale(min_age_s=3600)]
    assert remove_stale([mine]) == [shm_name]
    assert not segment_path(shm_name).exists()
    assert shm_name not in [t.name for t in find_stale()]


def _write(name: str, *, age_s: float = 0.0, epoch: int | None = None) -> TableWriter:
    """A writer holding ``name`` with one table published ``age_s`` ago."""
    writer = TableWriter(name, max_engines=4, max_classes=2)
    meta = {} if epoch is None else {"epoch": epoch}
    snap = TableSnapshot.validated(
        1, [1, 2], np.array([[1.0, 3.0]]), published_at=time.time() - age_s, meta=meta
    )
    writer.write(snap)
    return writer


def _table(age_s: float, epoch: int | None = 7) -> StaleTable:
    return StaleTable("t", 3, age_s, epoch)


@pytest.mark.parametrize(
    ("age_s", "alive", "pulls", "expected"),
    [
        (5.0, True, False, None),  # a live writer (controller on this host): current
        (500.0, True, False, None),  # ... however old: it is today's behaviour
        (5.0, True, True, None),  # a sibling worker's puller with a young table: current
        (500.0, True, True, (False, "too_old")),  # a sibling's puller that has not pulled
        (5.0, False, False, (True, "fresh")),  # writer gone moments ago, nobody to ask
        (500.0, False, False, (False, "too_old")),
        (5.0, False, True, (False, "unconfirmed")),  # the controller's first table decides
        (500.0, False, True, (False, "too_old")),
        (60.0, False, False, (True, "fresh")),  # the bound itself is still fresh
    ],
)
def test_the_start_rule(
    age_s: float, alive: bool, pulls: bool, expected: tuple[bool, str] | None
) -> None:
    verdict = judge_start(_table(age_s), alive, max_age_s=60.0, pulls=pulls)
    if expected is None:
        assert verdict is None
    else:
        assert verdict is not None and (verdict.use, verdict.reason) == expected
        assert verdict.writer_alive is alive


@pytest.mark.parametrize("epoch", [None, 9])
def test_inspect_start_reads_age_epoch_and_whether_the_writer_lives(
    shm_name: str, epoch: int | None
) -> None:
    assert inspect_start(shm_name) is None  # no table: nothing to judge
    writer = _write(shm_name, age_s=3600.0, epoch=epoch)
    found = inspect_start(shm_name)
    assert found is not None and found[1] is True
    writer.close()
    found = inspect_start(shm_name)
    assert found is not None
    table, alive = found
    assert not alive and table.epoch == epoch and table.generation == 1
    assert 3599.0 <= table.age_s < 3700.0
    verdict = judge_start(table, alive, max_age_s=60.0, pulls=False)
    assert verdict is not None and verdict.reason == "too_old" and not verdict.use
