"""A weight-table snapshot on the wire: what the controller serves at ``GET /v1/table``.

Two encodings of one schema (``docs/signals.md``):

* **msgpack** (default): a map with ``v`` (format version), scalars, and the
  arrays as raw little-endian bytes (``engine_ids`` u64, ``engine_flags`` u8,
  ``class_keys`` u64, ``shed_fraction`` f64, ``weights`` f64 row-major);
* **JSON** (for people and curl): the same keys, arrays as lists of numbers and
  ``weights`` as a list of rows; ``meta`` is the decoded metadata object.

:func:`decode_snapshot` tells them apart by the first byte (``{`` is JSON), checks
the version and dimensions, validates the contents with
:meth:`~fastroute.tables.TableSnapshot.validated` (the rules the writer publishes by),
and checks the xxh3 checksum (``0`` in a hand-written JSON payload skips the checksum
check). :func:`publish_snapshot` writes a snapshot into a local table.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np

from fastroute.errors import TableDimensionError, TableError, TableValueError
from fastroute.tables.layout import HARD_MAX_CLASSES, HARD_MAX_ENGINES, table_checksum
from fastroute.tables.snapshot import TableSnapshot
from fastroute.tables.writer import TableWriter

__all__ = [
    "WIRE_VERSION",
    "MSGPACK_CONTENT_TYPE",
    "JSON_CONTENT_TYPE",
    "WireError",
    "WireFormatError",
    "WireVersionError",
    "WireChecksumError",
    "encode_snapshot",
    "decode_snapshot",
    "publish_snapshot",
]

#: Version of the snapshot wire format (``v``).
WIRE_VERSION = 1
MSGPACK_CONTENT_TYPE = "application/msgpack"
JSON_CONTENT_TYPE = "application/json"


class WireError(TableError, ValueError):
    """A snapshot payload cannot be used."""


class WireFormatError(WireError):
    """The payload is not a well-formed snapshot (syntax, types, shapes or values)."""


class WireVersionError(WireError):
    """The payload has a format version this code does not read."""


class WireChecksumError(WireError):
    """The payload's checksum does not match its contents (corrupted or tampered)."""


class _Head(msgspec.Struct):
    v: int


class _PackedV1(msgspec.Struct, kw_only=True):
    v: int
    generation: int
    published_at: float
    retry_ratio: float
    n_engines: int
    n_classes: int
    engine_ids: bytes
    engine_flags: bytes
    class_keys: bytes
    shed_fraction: bytes
    weights: bytes
    meta: bytes = b""
    checksum: int = 0


class _JsonV1(msgspec.Struct, kw_only=True):
    v: int
    generation: int
    published_at: float
    retry_ratio: float
    engine_ids: list[int]
    engine_flags: list[int]
    class_keys: list[int]
    shed_fraction: list[float]
    weights: list[list[float]]
    meta: dict[str, Any] = {}
    checksum: int = 0


_msgpack_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()


def _validated(
    generation: int,
    published_at: float,
    retry_ratio: float,
    ids: np.ndarray,
    flags: np.ndarray,
    keys: np.ndarray,
    shed: np.ndarray,
    weights: np.ndarray,
    meta_bytes: bytes,
) -> TableSnapshot:
    """The decoded fields as a :meth:`TableSnapshot.validated` snapshot, or WireFormatError."""
    try:
        return TableSnapshot.validated(
            generation,
            ids,
            weights,
            class_keys=keys,
            engine_flags=flags,
            shed_fraction=shed,
            retry_ratio=retry_ratio,
            published_at=published_at,
            meta=meta_bytes,
        )
    except (TableDimensionError, TableValueError) as exc:
        raise WireFormatError(str(exc)) from None


def encode_snapshot(snap: TableSnapshot, fmt: str = "msgpack") -> bytes:
    """Encode ``snap`` for the wire.

    Parameters
    ----------
    snap : TableSnapshot
    fmt : {"msgpack", "json"}

    Returns
    -------
    bytes
        Carries a checksum recomputed from ``snap``'s contents.

    Raises
    ------
    ValueError
        Unknown ``fmt``.
    """
    ids = np.ascontiguousarray(snap.engine_ids, dtype="<u8")
    flags = np.ascontiguousarray(snap.engine_flags, dtype="u1")
    keys = np.ascontiguousarray(snap.class_keys, dtype="<u8")
    shed = np.ascontiguousarray(snap.shed_fraction, dtype="<f8")
    w = np.ascontiguousarray(snap.weights, dtype="<f8").reshape(keys.shape[0], ids.shape[0])
    checksum = table_checksum(
        snap.generation,
        snap.published_at,
        snap.retry_ratio,
        ids,
        flags,
        keys,
        shed,
        snap.meta_bytes,
        w,
    )
    if fmt == "msgpack":
        return _msgpack_encoder.encode(
            _PackedV1(
                v=WIRE_VERSION,
                generation=snap.generation,
                published_at=snap.published_at,
                retry_ratio=snap.retry_ratio,
                n_engines=ids.shape[0],
                n_classes=keys.shape[0],
                engine_ids=ids.tobytes(),
                engine_flags=flags.tobytes(),
                class_keys=keys.tobytes(),
                shed_fraction=shed.tobytes(),
                weights=w.tobytes(),
                meta=snap.meta_bytes,
                checksum=checksum,
            )
        )
    if fmt == "json":
        return _json_encoder.encode(
            _JsonV1(
                v=WIRE_VERSION,
                generation=snap.generation,
                published_at=snap.published_at,
                retry_ratio=snap.retry_ratio,
                engine_ids=ids.tolist(),
                engine_flags=flags.tolist(),
                class_keys=keys.tolist(),
                shed_fraction=shed.tolist(),
                weights=w.tolist(),
                meta=snap.meta,
                checksum=checksum,
            )
        )
    raise ValueError(f"fmt must be 'msgpack' or 'json', got {fmt!r}")


def _array(data: bytes, dtype: str, n: int, name: str) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    if len(data) != n * size:
        raise WireFormatError(f"{name} has {len(data)} bytes; expected {n} x {size}")
    return np.frombuffer(data, dtype=dtype).copy()


def decode_snapshot(data: bytes) -> TableSnapshot:
    """Decode and validate a snapshot in either encoding.

    Parameters
    ----------
    data : bytes
        msgpack, or JSON (first non-blank byte ``{``).

    Returns
    -------
    TableSnapshot
        Read-only arrays; ``verify()`` holds.

    Raises
    ------
    WireVersionError
        ``v`` is not :data:`WIRE_VERSION`.
    WireChecksumError
        The checksum does not match (a JSON ``checksum`` of 0 is not checked).
    WireFormatError
        Anything else wrong: syntax, missing fields, types, shapes, values.
    """
    is_json = data[:1] == b"{" or data.lstrip()[:1] == b"{"
    mod: Any = msgspec.json if is_json else msgspec.msgpack
    try:
        head = mod.decode(data, type=_Head)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireFormatError(f"not a weight-table snapshot: {exc}") from None
    if head.v != WIRE_VERSION:
        raise WireVersionError(
            f"snapshot format version {head.v}; this code reads version {WIRE_VERSION}"
        )
    try:
        if is_json:
            j = msgspec.json.decode(data, type=_JsonV1)
            ids = np.array(j.engine_ids, dtype="<u8")
            n_engines = ids.shape[0]
            flags = np.array(j.engine_flags, dtype="u1")
            keys = np.array(j.class_keys, dtype="<u8")
            shed = np.array(j.shed_fraction, dtype="<f8")
            rows = j.weights
            if any(len(r) != n_engines for r in rows):
                raise WireFormatError(f"every weights row must have {n_engines} entries")
            w = np.array(rows, dtype="<f8").reshape(len(rows), n_engines)
            meta_bytes = msgspec.msgpack.encode(j.meta) if j.meta else b""
            generation, published_at, ratio, checksum = (
                j.generation,
                j.published_at,
                j.retry_ratio,
                j.checksum,
            )
            verify = checksum != 0
        else:
            p = msgspec.msgpack.decode(data, type=_PackedV1)
            if not (0 <= p.n_engines <= HARD_MAX_ENGINES and 0 <= p.n_classes <= HARD_MAX_CLASSES):
                raise WireFormatError(f"table is {p.n_classes} x {p.n_engines}: over the limits")
            ids = _array(p.engine_ids, "<u8", p.n_engines, "engine_ids")
            flags = _array(p.engine_flags, "u1", p.n_engines, "engine_flags")
            keys = _array(p.class_keys, "<u8", p.n_classes, "class_keys")
            shed = _array(p.shed_fraction, "<f8", p.n_classes, "shed_fraction")
            w = _array(p.weights, "<f8", p.n_classes * p.n_engines, "weights").reshape(
                p.n_classes, p.n_engines
            )
            meta_bytes = p.meta
            generation, published_at, ratio, checksum = (
                p.generation,
                p.published_at,
                p.retry_ratio,
                p.checksum,
            )
            verify = True
    except (msgspec.DecodeError, msgspec.ValidationError, OverflowError, ValueError) as exc:
        if isinstance(exc, WireError):
            raise
        raise WireFormatError(f"malformed snapshot: {exc}") from None
    snap = _validated(generation, published_at, ratio, ids, flags, keys, shed, w, meta_bytes)
    if verify and checksum != snap.checksum:
        raise WireChecksumError(
            f"checksum {checksum:#018x} does not match the contents ({snap.checksum:#018x})"
        )
    return snap


def publish_snapshot(writer: TableWriter, snap: TableSnapshot) -> int:
    """Write ``snap`` into a local weight table; return the local generation.

    The local table keeps its own generation counter and publish time (the
    writer's clock); ids, flags, keys, weights, shed fractions, retry ratio and
    metadata are copied as they are.

    Raises
    ------
    fastroute.errors.TableDimensionError
        The snapshot is larger than the writer's segment.
    """
    return writer.write(snap.restamped(writer.generation + 1, time.time()))
