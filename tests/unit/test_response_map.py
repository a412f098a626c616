"""The stored-response id → engine map: shared between processes, bounded, oldest first out."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from fastroute.config import ProxyConfig
from fastroute.errors import TableFormatError, TableNotFoundError, TableValueError
from fastroute.tables.response_map import (
    DEFAULT_RESPONSE_MAP_CAPACITY,
    WAYS,
    ResponseMap,
    response_map_name,
)
from fastroute.tables.segment import segment_path

pytestmark = pytest.mark.parity


@pytest.fixture
def created(shm_name):
    m = ResponseMap.create(shm_name, capacity=64)
    yield m
    m.close()


def test_put_get_and_overwrite_same_key(created) -> None:
    """A key maps to the engine last put for it; unknown keys and 0 are None."""
    created.put(12345, 7)
    assert created.get(12345) == 7
    created.put(12345, 9)
    assert created.get(12345) == 9
    assert len(created) == 1
    assert created.get(54321) is None
    assert created.get(0) is None
    with pytest.raises(TableValueError):
        created.put(0, 1)


def test_shared_with_another_process(created, shm_name) -> None:
    """A mapping one process puts is read by another, and the other way round."""
    created.put(1111, 42)
    code = textwrap.dedent(
        f"""
        from fastroute.tables.response_map import ResponseMap
        m = ResponseMap.attach({shm_name!r})
        assert m.get(1111) == 42, m.get(1111)
        m.put(2222, 43)
        m.close()
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
    assert created.get(2222) == 43


def test_bounded_and_oldest_of_a_bucket_goes_first(created) -> None:
    """Many more keys than entries: the map never holds more than its capacity; within a
    bucket the oldest mapping is overwritten first, the newest are kept."""
    buckets = created.capacity // WAYS
    same_bucket = [3 + buckets * i for i in range(WAYS + 3)]  # one bucket, 11 keys
    for n, key in enumerate(same_bucket):
        created.put(key, 100 + n)
    assert [created.get(k) for k in same_bucket[:3]] == [None, None, None]
    assert [created.get(k) for k in same_bucket[3:]] == [100 + n for n in range(3, WAYS + 3)]
    for key in range(1, 10 * created.capacity):
        created.put(key, key)
    assert len(created) == created.capacity
    assert created.get(10 * created.capacity - 1) == 10 * created.capacity - 1


def test_attach_errors_and_private(shm_name) -> None:
    """Attaching a missing or foreign segment fails; a private map works alone."""
    with pytest.raises(TableNotFoundError):
        ResponseMap.attach(shm_name)
    segment_path(shm_name).write_bytes(b"\0" * 64)
    with pytest.raises(TableFormatError):
        ResponseMap.attach(shm_name)
    with pytest.raises(TableValueError):
        ResponseMap.private(capacity=12)
    private = ResponseMap.private(capacity=WAYS)
    private.put(5, 6)
    assert private.get(5) == 6
    private.close()


def test_creator_close_removes_the_segment(shm_name) -> None:
    m = ResponseMap.create(shm_name, capacity=WAYS)
    assert segment_path(shm_name).exists()
    m.close()
    assert not segment_path(shm_name).exists()


def test_names_and_default_capacity() -> None:
    """The map is named after the stats block; the config's default is the module's."""
    assert response_map_name("fastroute-stats") == "fastroute-stats.responses"
    assert ProxyConfig().response_map_capacity == DEFAULT_RESPONSE_MAP_CAPACITY
