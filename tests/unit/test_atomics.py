"""Atomic word access on shared buffers: compiled and pure-Python twins behave alike."""

from __future__ import annotations

import math
import mmap
import os

import pytest

from fastroute import _core

pytestmark = pytest.mark.parity

IMPLS = {"py": _core.AtomicBufferPy}
if _core.AtomicBufferC is not None:
    IMPLS["cy"] = _core.AtomicBufferC


@pytest.fixture(params=sorted(IMPLS), ids=sorted(IMPLS))
def atomic(request: pytest.FixtureRequest, tmp_path):
    fd = os.open(tmp_path / "buf", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096)
    mm = mmap.mmap(fd, 4096)
    buf = IMPLS[request.param](mm, writable=True, lock_fd=fd)
    yield buf
    buf.release()
    mm.close()
    os.close(fd)


def test_load_store_roundtrip(atomic) -> None:
    """Stored u64 and f64 words load back unchanged; i64 views the same bits signed."""
    atomic.store_u64(8, 2**64 - 1)
    assert atomic.load_u64(8) == 2**64 - 1
    assert atomic.load_i64(8) == -1
    atomic.store_f64(16, 0.25)
    assert atomic.load_f64(16) == 0.25


def test_add_returns_the_new_value(atomic) -> None:
    """add_i64 is add-and-fetch, signed."""
    assert atomic.add_i64(0, 5) == 5
    assert atomic.add_i64(0, -7) == -2
    assert atomic.load_i64(0) == -2


def test_ewma_starts_from_the_first_sample(atomic) -> None:
    """A NaN slot takes the first sample; later samples blend with weight alpha."""
    atomic.store_f64(24, math.nan)
    assert atomic.ewma_f64(24, 2.0, 0.5) == 2.0
    assert atomic.ewma_f64(24, 4.0, 0.5) == 3.0
    assert atomic.ewma_f64(24, 3.0, 0.1) == pytest.approx(3.0)


def test_offsets_are_checked(atomic) -> None:
    """Unaligned, negative or out-of-range offsets are a ValueError, not a crash."""
    for offset in (-8, 3, 4096, 4092):
        with pytest.raises(ValueError, match="aligned 8-byte word"):
            atomic.load_u64(offset)


def test_read_only_buffers_refuse_writes(tmp_path) -> None:
    """A read-only mapping can be loaded but not stored to, in both implementations."""
    path = tmp_path / "ro"
    path.write_bytes(b"\x01" + b"\x00" * 4095)
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, 4096, prot=mmap.PROT_READ)
    for impl in IMPLS.values():
        buf = impl(mm, writable=False)
        assert buf.load_u64(0) == 1
        with pytest.raises(ValueError, match="read-only"):
            buf.store_u64(0, 2)
        buf.release()
        with pytest.raises(BufferError):
            impl(mm, writable=True)
    mm.close()
    os.close(fd)


def test_released_buffer_is_unusable(atomic) -> None:
    """After release() every access raises instead of touching unmapped memory."""
    atomic.release()
    with pytest.raises(ValueError, match="released"):
        atomic.load_u64(0)
