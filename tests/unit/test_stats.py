"""Per-engine stats block: counters, EWMAs, live columns, life cycle and errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fastroute._core import SelectorPy
from fastroute.errors import (
    TableDimensionError,
    TableFormatError,
    TableLockedError,
    TableNotFoundError,
    TableValueError,
)
from fastroute.tables import Counter, Ewma, StatsBlock, TableWriter

pytestmark = pytest.mark.parity


@pytest.fixture
def block(shm_name):
    created = StatsBlock.create(shm_name, [10, 20, 30], max_engines=8)
    yield created
    created.unlink()


def test_counters_are_shared_between_handles(block, shm_name) -> None:
    """Two handles on one block see each other's updates."""
    other = StatsBlock.attach(shm_name)
    assert other.engine_ids.tolist() == [10, 20, 30]
    assert other.slot(20) == 1
    assert block.add(1, Counter.IN_FLIGHT) == 1
    assert other.add(1, Counter.IN_FLIGHT, 2) == 3
    assert block.get(1, Counter.IN_FLIGHT) == 3
    assert other.add(1, Counter.IN_FLIGHT, -3) == 0
    other.close()


def test_ewmas_start_empty_and_follow_samples(block) -> None:
    """EWMAs read NaN until the first sample, then blend with weight alpha."""
    assert math.isnan(block.ewma(0, Ewma.TTFT_S))
    assert block.observe(0, Ewma.TTFT_S, 0.100) == 0.100
    assert block.observe(0, Ewma.TTFT_S, 0.200, alpha=0.5) == pytest.approx(0.150)
    assert block.ewma(0, Ewma.TTFT_S) == pytest.approx(0.150)
    assert math.isnan(block.ewma(0, Ewma.TBOT_S))  # fields are independent
    with pytest.raises(ValueError, match="alpha"):
        block.observe(0, Ewma.TTFT_S, 1.0, alpha=0.0)


def test_columns_are_live_strided_views(block) -> None:
    """column() tracks updates and feeds the bounded-load pick directly."""
    in_flight = block.column(Counter.IN_FLIGHT)
    assert in_flight.dtype == np.int64 and in_flight.tolist() == [0, 0, 0]
    block.add(2, Counter.IN_FLIGHT, 5)
    assert in_flight.tolist() == [0, 0, 5]
    with pytest.raises(ValueError):
        in_flight[0] = 1
    selector = SelectorPy(block.engine_ids, np.ones((1, 3)))
    assert selector.pick_bounded(1, 0, in_flight) in (0, 1, 2)
    assert block.column(Ewma.E2E_S).dtype == np.float64
    del in_flight


def test_slots_and_engines_are_checked(block) -> None:
    """Unknown engines and out-of-range slots raise instead of corrupting neighbours."""
    with pytest.raises(KeyError):
        block.slot(99)
    with pytest.raises(IndexError):
        block.add(3, Counter.REQUESTS)
    with pytest.raises(IndexError):
        block.get(-1, Counter.REQUESTS)


def test_create_validates_engines(shm_name) -> None:
    """Duplicate ids and too many engines are refused."""
    with pytest.raises(TableValueError, match="unique"):
        StatsBlock.create(shm_name, [1, 1])
    with pytest.raises(TableDimensionError, match="do not fit"):
        StatsBlock.create(shm_name, [1, 2, 3], max_engines=2)


def test_one_creator_per_name_and_only_it_unlinks(block, shm_name) -> None:
    """A second creator is refused; an attached handle may not unlink."""
    with pytest.raises(TableLockedError):
        StatsBlock.create(shm_name, [1])
    other = StatsBlock.attach(shm_name)
    with pytest.raises(TableValueError, match="only the creator"):
        other.unlink()
    other.close()


def test_attach_errors(shm_name) -> None:
    """A missing block or a weight table under the name raise specific errors."""
    with pytest.raises(TableNotFoundError):
        StatsBlock.attach(shm_name)
    writer = TableWriter(shm_name, max_engines=2, max_classes=1)
    try:
        with pytest.raises(TableFormatError, match="not a fastroute stats block"):
            StatsBlock.attach(shm_name)
    finally:
        writer.unlink()


def test_fields_must_be_of_the_right_kind(block) -> None:
    """A counter where an EWMA is expected (or a bare int) is a TypeError, not a wrong word."""
    with pytest.raises(TypeError, match="Counter"):
        block.add(0, Ewma.TTFT_S)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Ewma"):
        block.observe(0, Counter.IN_FLIGHT, 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        block.get(0, 0)  # type: ignore[arg-type]


def test_engines_added_later_get_slots_readers_adopt_them_on_refresh(shm_name) -> None:
    creator = StatsBlock.create(shm_name, [1, 2], max_engines=4)
    reader = StatsBlock.attach(shm_name)
    try:
        creator.add(creator.slot(2), Counter.IN_FLIGHT, 3)
        assert creator.add_engines([2, 7, 8, 9]) == [9]  # 2 has a slot; 9 does not fit
        assert creator.slot(7) == 2 and creator.slot(8) == 3
        assert math.isnan(creator.ewma(2, Ewma.TTFT_S))  # a fresh slot: no samples
        with pytest.raises(KeyError):
            reader.slot(7)
        reader.refresh()
        assert [int(i) for i in reader.engine_ids] == [1, 2, 7, 8]
        reader.add(reader.slot(7), Counter.IN_FLIGHT, 5)
        assert creator.get(creator.slot(7), Counter.IN_FLIGHT) == 5
        assert creator.get(creator.slot(2), Counter.IN_FLIGHT) == 3  # old slots untouched
        with pytest.raises(TableValueError):
            reader.add_engines([10])
        with StatsBlock.attach(shm_name) as late:  # a late attacher sees them all
            assert len(late.engine_ids) == 4
    finally:
        reader.close()
        creator.unlink()


def test_unlink_removes_the_peer_pollers_lock_file_too(shm_name) -> None:
    """The host's peer poller locks ``<name>.peers``; the block's removal leaves no file."""
    from fastroute.tables.segment import WriterLock

    created = StatsBlock.create(shm_name, [1])
    poller = WriterLock(created.peer_poller_path)
    lock_file = poller.path
    assert lock_file.name == f"{shm_name}.peers.lock" and lock_file.exists()
    poller.release()
    created.unlink()
    assert not lock_file.exists() and not created.path.exists()
