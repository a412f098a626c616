"""Property tests of the table wire codec (hypothesis): an encoded table decodes to an
equal one in both encodings; any other bytes raise a ``WireError``, nothing else."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fastroute.tables import TableSnapshot
from fastroute.tables.wire import WireError, decode_snapshot, encode_snapshot


@st.composite
def snapshots(draw: st.DrawFn) -> TableSnapshot:
    n_engines = draw(st.integers(0, 6))
    n_classes = draw(st.integers(0, 4)) if n_engines else 0
    ids = draw(
        st.lists(st.integers(1, 2**64 - 1), min_size=n_engines, max_size=n_engines, unique=True)
    )
    keys = draw(
        st.lists(st.integers(0, 2**64 - 1), min_size=n_classes, max_size=n_classes, unique=True)
    )
    weight = st.floats(0.0, 1.0, allow_nan=False)
    weights = draw(st.lists(weight, min_size=n_classes * n_engines, max_size=n_classes * n_engines))
    return TableSnapshot.validated(
        draw(st.integers(1, 2**62)),
        np.array(ids, np.uint64),
        np.array(weights, np.float64).reshape(n_classes, n_engines),
        class_keys=np.array(keys, np.uint64),
        engine_flags=draw(st.lists(st.integers(0, 3), min_size=n_engines, max_size=n_engines)),
        shed_fraction=np.array(draw(st.lists(weight, min_size=n_classes, max_size=n_classes))),
        retry_ratio=draw(weight),
        published_at=draw(st.floats(0, 2e9)),
        meta=draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3)),
    )


@given(snapshots(), st.sampled_from(["msgpack", "json"]))
def test_a_decoded_table_equals_the_encoded_one(snap: TableSnapshot, fmt: str) -> None:
    back = decode_snapshot(encode_snapshot(snap, fmt))
    assert back.generation == snap.generation and back.checksum == snap.checksum
    for name in ("engine_ids", "engine_flags", "class_keys", "weights", "shed_fraction"):
        assert np.array_equal(getattr(back, name), getattr(snap, name)), name
    assert (back.retry_ratio, back.published_at, back.meta) == (
        snap.retry_ratio,
        snap.published_at,
        snap.meta,
    )


@given(
    snapshots(),
    st.sampled_from(["msgpack", "json"]),
    st.integers(0, 10**6),
    st.binary(min_size=1, max_size=4),
)
def test_a_corrupted_table_raises_a_wire_error(
    snap: TableSnapshot, fmt: str, at: int, junk: bytes
) -> None:
    data = encode_snapshot(snap, fmt)
    at %= len(data)
    for corrupted in (data[:at], data[:at] + junk + data[at + len(junk) :]):
        try:
            decode_snapshot(corrupted)
        except WireError:
            pass


@given(st.binary(max_size=300))
def test_any_bytes_decode_or_raise_a_wire_error(data: bytes) -> None:
    try:
        decode_snapshot(data)
    except WireError:
        pass
