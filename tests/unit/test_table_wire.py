"""The weight-table wire format: round trips, rejection of bad payloads, local publication."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from fastroute.errors import TableDimensionError, TableValueError
from fastroute.tables import FLAG_DRAINING, TableReader, TableSnapshot, TableWriter
from fastroute.tables.wire import (
    WIRE_VERSION,
    WireChecksumError,
    WireFormatError,
    WireVersionError,
    decode_snapshot,
    encode_snapshot,
    publish_snapshot,
)


def _snap(rand: object, n_classes: int = 3, n_engines: int = 5, generation: int = 42):
    rng = rand.np  # type: ignore[attr-defined]
    return TableSnapshot.validated(
        generation,
        rng.choice(2**62, n_engines, replace=False).astype(np.uint64) + np.uint64(2**63),
        rng.random((n_classes, n_engines)),
        class_keys=np.arange(n_classes, dtype=np.uint64) + np.uint64(2**64 - 1000),
        engine_flags=[FLAG_DRAINING] + [0] * (n_engines - 1),
        shed_fraction=np.linspace(0, 1, n_classes),
        retry_ratio=0.2,
        published_at=1795950000.25,
        meta={"plan": "p-1", "status": "optimal"},
    )


def _same(a, b) -> None:
    assert a.generation == b.generation
    for name in ("engine_ids", "engine_flags", "class_keys", "weights", "shed_fraction"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert (a.retry_ratio, a.published_at, a.meta) == (b.retry_ratio, b.published_at, b.meta)


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_round_trip(rand: object, fmt: str) -> None:
    """decode(encode(s)) equals s, bit for bit, in both encodings, and verifies."""
    s = _snap(rand)
    d = decode_snapshot(encode_snapshot(s, fmt))
    _same(s, d)
    assert d.verify() and d.checksum == s.checksum
    assert not d.weights.flags.writeable


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_empty_table_round_trips(fmt: str) -> None:
    """A table with no classes and no engines survives the wire."""
    s = TableSnapshot.validated(1, np.zeros(0, np.uint64), np.zeros((0, 0)))
    _same(s, decode_snapshot(encode_snapshot(s, fmt)))


def test_msgpack_is_compact(rand: object) -> None:
    """The msgpack encoding is the raw arrays plus a small fixed overhead."""
    s = _snap(rand, 100, 400)
    raw = s.weights.nbytes + s.engine_ids.nbytes * 2 + 100 * 16 + 400
    assert len(encode_snapshot(s)) < raw + 512


def _packed(s, **changes: object) -> bytes:
    obj = msgspec.msgpack.decode(encode_snapshot(s))
    obj.update(changes)
    return msgspec.msgpack.encode(obj)


def test_rejects_bad_payloads(rand: object) -> None:
    """Garbage, wrong versions, bad shapes, bad values and bad checksums raise specific errors."""
    s = _snap(rand)
    with pytest.raises(WireVersionError):
        decode_snapshot(_packed(s, v=WIRE_VERSION + 1))
    with pytest.raises(WireChecksumError):
        decode_snapshot(_packed(s, retry_ratio=0.3))
    bad_weights = np.array(s.weights, copy=True)
    bad_weights[0, 0] = -1.0
    bad = [
        b"",
        b"\x00garbage",
        b"{not json",
        msgspec.msgpack.encode([1, 2, 3]),
        _packed(s, weights=b"\x00" * 7),
        _packed(s, n_engines=6),
        _packed(s, engine_ids=np.zeros(5, "<u8").tobytes()),
        _packed(s, weights=bad_weights.tobytes()),
        _packed(s, shed_fraction=np.full(3, 2.0).tobytes()),
        _packed(s, retry_ratio=float("nan")),
        _packed(s, meta=b"\xc1"),
        _packed(s, generation=-1),
    ]
    for payload in bad:
        with pytest.raises(WireFormatError):
            decode_snapshot(payload)
    obj = msgspec.json.decode(encode_snapshot(s, "json"))
    obj["weights"][1] = obj["weights"][1][:-1]
    with pytest.raises(WireFormatError):
        decode_snapshot(msgspec.json.encode(obj))
    obj = msgspec.json.decode(encode_snapshot(s, "json"))
    obj["engine_ids"][0] = -3
    with pytest.raises(WireFormatError):
        decode_snapshot(msgspec.json.encode(obj))
    with pytest.raises(ValueError):
        encode_snapshot(s, "xml")


def test_hand_written_json_without_checksum_is_accepted() -> None:
    """A JSON snapshot with checksum 0 (hand-written) decodes; its checksum is filled in."""
    text = (
        b'{"v":1,"generation":3,"published_at":0,"retry_ratio":0.1,"engine_ids":[1,2],'
        b'"engine_flags":[0,0],"class_keys":[9],"shed_fraction":[0],"weights":[[1,3]]}'
    )
    d = decode_snapshot(text)
    assert d.verify() and d.weights.tolist() == [[1.0, 3.0]] and d.meta == {}


def test_validated_snapshot_refuses_what_the_writer_refuses() -> None:
    """TableSnapshot.validated (what the writer publishes) refuses bad tables."""
    with pytest.raises(TableValueError):
        TableSnapshot.validated(1, [1, 1], np.ones((1, 2)))
    with pytest.raises(TableDimensionError):
        TableSnapshot.validated(1, [1, 2], np.ones((1, 3)))
    with pytest.raises(TableValueError):
        TableSnapshot.validated(1, [1, 2], np.ones((1, 2)), shed_fraction=[1.5])


def test_writer_publishes_the_validated_snapshot_as_it_is(rand: object, shm_name: str) -> None:
    """write() stores the snapshot's own generation, time and checksum; only the next one."""
    with TableWriter(shm_name, max_engines=16, max_classes=8) as writer:
        s = _snap(rand, generation=1)
        assert writer.write(s) == 1
        reader = TableReader(shm_name, verify=True)
        try:
            local = reader.snapshot()
        finally:
            reader.close()
        _same(s, local)
        assert local.checksum == s.checksum
        with pytest.raises(TableValueError, match="generation 2"):
            writer.write(_snap(rand, generation=5))
        assert writer.generation == 1


def test_publish_snapshot_writes_the_local_table(rand: object, shm_name: str) -> None:
    """publish_snapshot makes the local table hold the snapshot's contents."""
    s = _snap(rand)
    with TableWriter(shm_name, max_engines=16, max_classes=8) as writer:
        gen = publish_snapshot(writer, decode_snapshot(encode_snapshot(s)))
        reader = TableReader(shm_name, verify=True)
        try:
            local = reader.snapshot()
        finally:
            reader.close()
    assert gen == local.generation == 1
    for name in ("engine_ids", "engine_flags", "class_keys", "weights", "shed_fraction"):
        assert np.array_equal(getattr(local, name), getattr(s, name)), name
    assert local.retry_ratio == s.retry_ratio and local.meta == s.meta
