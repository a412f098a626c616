"""Routing-key hashing: xxh3-64, identical across processes and hosts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fastroute.hashing import class_key, engine_id, key_hash

pytestmark = pytest.mark.parity


def test_known_xxh3_vectors() -> None:
    """The empty key hashes to XXH3_64's published value; str is hashed as UTF-8."""
    assert key_hash(b"") == 0x2D06800538D394C2
    assert key_hash("fastroute") == key_hash(b"fastroute") == 0xC4C4A4CE1BD22D57
    assert key_hash("é") == key_hash("é".encode())


def test_accepts_buffers_and_rejects_other_types() -> None:
    """bytearray and memoryview hash like bytes; ints are a TypeError."""
    assert key_hash(bytearray(b"abc")) == key_hash(memoryview(b"abc")) == key_hash(b"abc")
    with pytest.raises(TypeError, match="bytes or str"):
        key_hash(123)  # type: ignore[arg-type]


def test_engine_id_is_the_key_hash_of_the_name() -> None:
    """Engine ids are stable 64-bit hashes of engine names."""
    assert engine_id("engine-a") == key_hash("engine-a")
    assert 0 <= engine_id("engine-a") < 2**64


def test_stable_across_processes_with_different_hash_salts() -> None:
    """A fresh interpreter with another PYTHONHASHSEED computes the same hashes."""
    code = "from fastroute.hashing import key_hash; print(key_hash('session-42'))"
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=dict(os.environ, PYTHONHASHSEED=seed),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        assert int(out) == key_hash("session-42")


def test_class_key_formula_is_pinned() -> None:
    """Proxy and controller share class_key; its value is pinned so rolling upgrades agree."""
    assert class_key("local", "demo-8b", "default") == 0xFCE8E0E465A419D4
    assert class_key("local", "demo-8b", "default") == key_hash("\0class\0local\0demo-8b\0default")
