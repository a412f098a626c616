"""The host's key log segment: written by several real processes at once, read whole."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import msgspec
import pytest

from fastroute import _core
from fastroute.config import ProxyConfig
from fastroute.errors import (
    TableFormatError,
    TableNotFoundError,
    TableSizeError,
    TableValueError,
    TableVersionError,
)
from fastroute.tables.key_log import (
    DEFAULT_KEY_LOG_ENTRIES,
    KeyLogSegment,
    key_log_name,
)
from fastroute.tables.segment import lock_path, segment_path

pytestmark = pytest.mark.parity

WRITERS = 3
ENTRIES_EACH = 400


def test_concurrent_writers_lose_nothing_a_reader_then_sees(shm_name: str) -> None:
    """Three processes publish 400 entries each at the same time (``head++`` is atomic
    across processes, in the compiled core and the twin alike): a reader observes all
    1,200, each writer's keys exactly ``ENTRIES_EACH`` times, and none is lost."""
    segment = KeyLogSegment.create(shm_name, 2048)
    code = textwrap.dedent(
        f"""
        import sys
        from fastroute import _core
        from fastroute.tables.key_log import KeyLogSegment
        segment = KeyLogSegment.attach({shm_name!r})
        writer = int(sys.argv[1])
        log = _core.KeyLog(segment.buffer, writer, 0, segment.fd)
        sys.stdin.readline()  # start together
        for i in range({ENTRIES_EACH}):
            log.publish([writer, 1000 * writer + i], 1)
        log.release()
        segment.close()
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(w)], stdin=subprocess.PIPE, env=env, text=True
        )
        for w in range(1, WRITERS + 1)
    ]
    try:
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.close()
        for proc in procs:
            assert proc.wait(timeout=60) == 0
        reader = _core.KeyLog(segment.buffer, 99, 0, segment.fd)
        assert reader.position == 0
        hot, seen = _core.HotKeys(1e9, 1 << 16), _core.HotKeys(1e9, 1 << 16)
        assert reader.drain(hot, seen) == WRITERS * ENTRIES_EACH and reader.lost == 0
        for w in range(1, WRITERS + 1):
            assert hot.share(w) == pytest.approx(1 / WRITERS)  # the observed first key
            assert seen.share(1000 * w + ENTRIES_EACH - 1) > 0.0  # the second, seen only
            assert hot.share(1000 * w) == 0.0
        reader.release()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        segment.close()


def test_attach_errors(shm_name: str) -> None:
    """A missing, foreign, other-layout or truncated segment is refused by name."""
    with pytest.raises(TableNotFoundError):
        KeyLogSegment.attach(shm_name)
    path = segment_path(shm_name)
    path.write_bytes(b"\0" * 64)
    with pytest.raises(TableFormatError, match="not a fastroute key log"):
        KeyLogSegment.attach(shm_name)
    good = KeyLogSegment.create(shm_name, 16)
    try:
        data = bytearray(path.read_bytes())
        other = segment_path(shm_name + "-other")
        other.write_bytes(bytes(data[:8]) + (7).to_bytes(8, "little") + bytes(data[16:]))
        with pytest.raises(TableVersionError, match="layout 7"):
            KeyLogSegment.attach(shm_name + "-other")
        other.write_bytes(bytes(data[:-8]))
        with pytest.raises(TableSizeError, match="too short"):
            KeyLogSegment.attach(shm_name + "-other")
        other.write_bytes(bytes(data[:16]) + (24).to_bytes(8, "little") + bytes(data[24:]))
        with pytest.raises(TableFormatError, match="power of two"):
            KeyLogSegment.attach(shm_name + "-other")
        other.unlink()
    finally:
        good.close()
    with pytest.raises(TableValueError, match="power of two"):
        KeyLogSegment.create(shm_name, 100)


def test_creator_close_removes_the_segment_and_its_lock(shm_name: str) -> None:
    segment = KeyLogSegment.create(shm_name, 16)
    attached = KeyLogSegment.attach(shm_name)
    assert segment_path(shm_name).exists()
    attached.close()
    assert segment_path(shm_name).exists()  # only the creator removes it
    segment.close()
    segment.close()  # idempotent
    assert not segment_path(shm_name).exists()
    assert not lock_path(segment_path(shm_name)).exists()


def test_names_default_and_config_bounds() -> None:
    assert key_log_name("fastroute-stats") == "fastroute-stats.keys"
    assert ProxyConfig().key_log_entries == DEFAULT_KEY_LOG_ENTRIES
    assert msgspec.convert({"key_log_entries": 0}, ProxyConfig).key_log_entries == 0
    for bad in (8, 100, 1 << 21):
        with pytest.raises(msgspec.ValidationError, match="key_log_entries|<= 1048576"):
            msgspec.convert({"key_log_entries": bad}, ProxyConfig)
