"""Weight table writer, reader and snapshot in one process: contents, life cycle, errors."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from fastroute.errors import (
    TableDimensionError,
    TableEmptyError,
    TableFencedError,
    TableFormatError,
    TableLockedError,
    TableNotFoundError,
    TableSizeError,
    TableValueError,
    TableVersionError,
)
from fastroute.tables import (
    DEFAULT_RETRY_RATIO,
    FLAG_DRAINING,
    FLAG_UNAVAILABLE,
    TableReader,
    TableWriter,
)
from fastroute.tables.layout import (
    BUFFER_HEADER,
    BUFFER_HEADER_SIZE,
    GENERATION_OFFSET,
    HEADER,
    HEADER_SIZE,
    TableLayout,
)
from fastroute.tables.segment import segment_path

pytestmark = pytest.mark.parity


@pytest.fixture
def writer(shm_name):
    w = TableWriter(shm_name, max_engines=16, max_classes=8)
    yield w
    w.unlink()


def test_layout_fields_are_aligned_and_disjoint() -> None:
    """Every array starts 8-aligned, after the previous one ends; buffers are page-aligned."""
    layout = TableLayout(max_engines=13, max_classes=5)
    assert BUFFER_HEADER.size <= BUFFER_HEADER_SIZE
    assert HEADER.size <= GENERATION_OFFSET and GENERATION_OFFSET % 64 == 0
    starts = [
        (layout.engine_ids_offset, 8 * 13),
        (layout.engine_flags_offset, 13),
        (layout.class_keys_offset, 8 * 5),
        (layout.shed_fraction_offset, 8 * 5),
        (layout.meta_offset, 16 * 1024),
        (layout.weights_offset, 8 * 13 * 5),
    ]
    for (start, size), (next_start, _) in zip(starts, starts[1:], strict=False):
        assert start % 8 == 0 and start + size <= next_start
    assert starts[-1][0] + starts[-1][1] <= layout.buffer_size
    assert layout.buffer_size % HEADER_SIZE == 0
    assert layout.segment_size == HEADER_SIZE + 2 * layout.buffer_size
    with pytest.raises(TableDimensionError):
        TableLayout(0, 1)
    with pytest.raises(TableDimensionError):
        TableLayout(1, 70000)


def test_publish_then_snapshot_roundtrip(writer, shm_name) -> None:
    """Everything published comes back in the snapshot, as immutable copies."""
    reader = TableReader(shm_name, verify=True)
    assert reader.generation() == 0
    with pytest.raises(TableEmptyError):
        reader.snapshot()
    ids = [101, 202, 303]
    weights = [[0.5, 0.25, 0.25], [0.0, 1.0, 0.0]]
    generation = writer.publish(
        ids,
        weights,
        class_keys=[7, 9],
        engine_flags=[0, FLAG_DRAINING, FLAG_UNAVAILABLE],
        shed_fraction=[0.0, 0.3],
        retry_ratio=0.05,
        meta={"plan": "abc", "objective_s": 1.5},
    )
    assert generation == writer.generation == 1 == reader.generation()
    snap = reader.snapshot()
    assert snap.generation == 1
    assert snap.engine_ids.tolist() == ids
    assert snap.weights.tolist() == weights
    assert snap.class_keys.tolist() == [7, 9]
    assert snap.shed_fraction.tolist() == [0.0, 0.3]
    assert snap.retry_ratio == 0.05
    assert snap.meta == {"plan": "abc", "objective_s": 1.5}
    assert snap.row(9) == 1
    with pytest.raises(KeyError):
        snap.row(8)
    assert snap.available().tolist() == [1, 0, 0]
    assert snap.available(allow_draining=True).tolist() == [1, 1, 0]
    assert snap.verify()
    with pytest.raises(ValueError):
        snap.weights[0, 0] = 2.0
    assert snap.selector().pick(12345, 1) == 1

    writer.publish([1], [[1.0]])
    assert snap.engine_ids.tolist() == ids  # a later publication never changes a snapshot
    later = reader.snapshot()
    assert later.generation == 2 and later.retry_ratio == DEFAULT_RETRY_RATIO
    assert later.meta == {} and later.class_keys.tolist() == [0]
    reader.close()


def test_generations_alternate_buffers_and_stay_consistent(writer, shm_name) -> None:
    """Many publications of changing sizes: each snapshot matches what was published."""
    reader = TableReader(shm_name, verify=True)
    rng = np.random.default_rng(1)
    for expected in range(1, 50):
        n_e, n_c = int(rng.integers(1, 17)), int(rng.integers(1, 9))
        weights = rng.random((n_c, n_e))
        ids = rng.choice(2**40, size=n_e, replace=False)
        assert writer.publish(ids, weights) == expected
        snap = reader.snapshot()
        assert snap.generation == expected
        assert np.array_equal(snap.weights, weights)
        assert np.array_equal(snap.engine_ids, ids)
    reader.close()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"weights": [[1.0, float("nan")]]}, TableValueError, "finite"),
        ({"weights": [[1.0, -1.0]]}, TableValueError, "non-negative"),
        ({"weights": [[1.0, 2.0, 3.0]]}, TableDimensionError, "shape"),
        ({"engine_ids": [1, 1]}, TableValueError, "unique"),
        ({"engine_ids": list(range(17)), "weights": np.ones((1, 17))}, TableDimensionError, "16"),
        ({"weights": np.ones((9, 2))}, TableDimensionError, "at most 8"),
        ({"class_keys": [3, 3], "weights": np.ones((2, 2))}, TableValueError, "unique"),
        ({"class_keys": [1, 2]}, TableDimensionError, "class_keys"),
        ({"engine_flags": [0]}, TableDimensionError, "engine_flags"),
        ({"shed_fraction": [1.5]}, TableValueError, r"\[0, 1\]"),
        ({"retry_ratio": -0.1}, TableValueError, "retry_ratio"),
        ({"retry_ratio": float("nan")}, TableValueError, "retry_ratio"),
        ({"meta": {"blob": "x" * 20000}}, TableValueError, "meta"),
    ],
)
def test_publish_rejects_invalid_tables(writer, kwargs, error, message) -> None:
    """Invalid input raises a specific error and publishes nothing."""
    args = {"engine_ids": [1, 2], "weights": [[1.0, 1.0]]} | kwargs
    engine_ids, weights = args.pop("engine_ids"), args.pop("weights")
    with pytest.raises(error, match=message):
        writer.publish(engine_ids, weights, **args)
    assert writer.generation == 0


def test_second_writer_is_refused(writer, shm_name) -> None:
    """One writer per name: a second one gets TableLockedError."""
    with pytest.raises(TableLockedError, match="another live writer"):
        TableWriter(shm_name, max_engines=16, max_classes=8)


def test_restarted_writer_takes_over_in_place(shm_name) -> None:
    """A compatible restart keeps the file (readers keep their mapping) and the generation."""
    first = TableWriter(shm_name, max_engines=16, max_classes=8)
    first.publish([1, 2], [[1.0, 1.0]])
    reader = TableReader(shm_name)
    first.close()
    second = TableWriter(shm_name, max_engines=16, max_classes=8)
    assert second.generation == 1
    assert second.publish([3], [[1.0]]) == 2
    assert reader.reattach_if_replaced() is False
    assert reader.snapshot().engine_ids.tolist() == [3]
    reader.close()
    second.unlink()


def test_incompatible_writer_replaces_the_segment_and_readers_follow(shm_name) -> None:
    """New maxima retire the old file; readers re-attach and generations keep increasing."""
    first = TableWriter(shm_name, max_engines=16, max_classes=8)
    first.publish([1, 2], [[1.0, 1.0]])
    first.publish([1, 2], [[1.0, 2.0]])
    reader = TableReader(shm_name)
    first.close()
    second = TableWriter(shm_name, max_engines=64, max_classes=8)
    assert second.generation == 2
    assert second.publish(list(range(40)), np.ones((1, 40))) == 3
    assert reader.generation() == 3  # the retired bit made it re-attach
    assert reader.layout.max_engines == 64
    assert reader.snapshot().n_engines == 40
    reader.close()
    second.unlink()


def test_reader_notices_a_segment_recreated_behind_its_back(shm_name) -> None:
    """If the file is deleted and re-created, reattach_if_replaced() maps the new one."""
    first = TableWriter(shm_name, max_engines=16, max_classes=8)
    first.publish([1], [[1.0]])
    reader = TableReader(shm_name)
    first.close()
    os.unlink(segment_path(shm_name))  # an operator removed it
    second = TableWriter(shm_name, max_engines=16, max_classes=8)
    second.publish([2], [[1.0]])
    assert reader.snapshot().engine_ids.tolist() == [1]  # still the orphaned old file
    assert reader.reattach_if_replaced() is True
    assert reader.snapshot().engine_ids.tolist() == [2]
    reader.close()
    second.unlink()


def test_unlinked_table_tells_its_readers(shm_name) -> None:
    """After the writer unlinks, readers get TableNotFoundError instead of stale data."""
    writer = TableWriter(shm_name, max_engines=4, max_classes=2)
    writer.publish([1], [[1.0]])
    reader = TableReader(shm_name)
    writer.unlink()
    with pytest.raises(TableNotFoundError):
        reader.generation()
    reader.close()
    assert not segment_path(shm_name).exists()


def test_verify_detects_a_corrupted_buffer(writer, shm_name) -> None:
    """A flipped weight byte makes a verifying snapshot fail with TableFormatError."""
    writer.publish([1, 2], [[1.0, 2.0]])
    reader = TableReader(shm_name, verify=True)
    layout = writer.layout
    with open(segment_path(shm_name), "r+b") as f:
        f.seek(layout.buffer_offset(1) + layout.weights_offset)
        f.write(struct.pack("<d", 9.0))
    with pytest.raises(TableFormatError, match="checksum"):
        reader.snapshot()
    assert TableReader(shm_name).snapshot().weights.tolist() == [[9.0, 2.0]]
    reader.close()


def test_buffer_contradicting_its_generation_is_reported(writer, shm_name) -> None:
    """A buffer whose own generation disagrees with the header is a corrupt segment."""
    writer.publish([1, 2], [[1.0, 2.0]])
    with open(segment_path(shm_name), "r+b") as f:
        f.seek(writer.layout.buffer_offset(1))
        f.write(struct.pack("<Q", 77))
    with pytest.raises(TableFormatError, match="corrupt"):
        TableReader(shm_name).snapshot()


def _write_segment(name: str, data: bytes) -> None:
    segment_path(name).write_bytes(data)


def _valid_header(**overrides: int) -> bytearray:
    layout = TableLayout(4, 2)
    fields = {
        "magic": int.from_bytes(b"FRTABLE\x01", "little"),
        "version": 1,
        "header_size": HEADER_SIZE,
        "max_e": 4,
        "max_c": 2,
        "buffer_size": layout.buffer_size,
        "buffer_offset": HEADER_SIZE,
    } | overrides
    head = bytearray(HEADER_SIZE)
    HEADER.pack_into(head, 0, *fields.values(), 0.0, 0)
    return head


def test_attach_errors_name_what_was_expected(shm_name) -> None:
    """Missing, foreign, old-version, truncated and oversized segments raise specific errors."""
    path = segment_path(shm_name)
    try:
        with pytest.raises(TableNotFoundError, match="has its writer started"):
            TableReader(shm_name)
        _write_segment(shm_name, b"")
        with pytest.raises(TableNotFoundError, match="not initialised"):
            TableReader(shm_name)
        _write_segment(shm_name, b"junk" * 2000)
        with pytest.raises(TableFormatError, match="not a fastroute weight table"):
            TableReader(shm_name)
        _write_segment(shm_name, b"\x00" * 100)
        with pytest.raises(TableSizeError, match="shorter than"):
            TableReader(shm_name)
        _write_segment(shm_name, bytes(_valid_header(version=99)))
        with pytest.raises(TableVersionError, match="layout version 99"):
            TableReader(shm_name)
        _write_segment(shm_name, bytes(_valid_header(max_e=10**6)))
        with pytest.raises(TableDimensionError, match="limits"):
            TableReader(shm_name)
        _write_segment(shm_name, bytes(_valid_header(buffer_size=8)))
        with pytest.raises(TableFormatError, match="inconsistent header"):
            TableReader(shm_name)
        _write_segment(shm_name, bytes(_valid_header()))  # header only, buffers missing
        with pytest.raises(TableSizeError, match="requires"):
            TableReader(shm_name)
    finally:
        path.unlink(missing_ok=True)


def test_writer_refuses_to_clobber_a_foreign_file(shm_name) -> None:
    """A non-fastroute file under the name is left alone and reported."""
    _write_segment(shm_name, b"precious data" * 1000)
    try:
        with pytest.raises(TableFormatError, match="remove it"):
            TableWriter(shm_name, max_engines=4, max_classes=2)
        assert segment_path(shm_name).read_bytes().startswith(b"precious data")
    finally:
        segment_path(shm_name).unlink()


def test_invalid_names_are_rejected() -> None:
    """Segment names cannot escape the shm directory or collide with lock files."""
    for bad in ("../etc", "a/b", "", "x.lock", ".hidden"):
        with pytest.raises(ValueError, match="invalid segment name"):
            TableWriter(bad)


def test_writer_fences_tables_of_an_older_epoch(shm_name: str) -> None:
    """A deposed leader's table (older ``meta["epoch"]``) is refused and counted, also after
    the segment is taken over; tables without an epoch always pass."""
    ids = [1, 2]
    w = np.array([[1.0, 1.0]])
    with TableWriter(shm_name, max_engines=4, max_classes=2) as writer:
        writer.publish(ids, w, meta={"epoch": 9})
        assert writer.epoch == 9
        with pytest.raises(TableFencedError, match="epoch 4 refused, epoch 9"):
            writer.publish(ids, w, meta={"epoch": 4})
        assert writer.fenced_total == 1 and writer.generation == 1
        writer.publish(ids, w, meta={"plan_id": 3})  # no epoch: no HA, not fenced
        writer.publish(ids, w, meta={"epoch": 12})
    with TableWriter(shm_name, max_engines=4, max_classes=2) as taken_over:
        assert taken_over.epoch == 12
        with pytest.raises(TableFencedError):
            taken_over.publish(ids, w, meta={"epoch": 11})
        assert taken_over.generation == 3
