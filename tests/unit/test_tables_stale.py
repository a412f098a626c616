"""Tables whose writer is gone (``fastroute table stale``): listed with age and epoch, removed."""

from __future__ import annotations

import numpy as np

from fastroute.tables import TableWriter
from fastroute.tables.segment import segment_path
from fastroute.tables.stale import find_stale, remove_stale


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
