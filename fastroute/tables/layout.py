"""Binary layout of the shared-memory weight table: the single source of truth.

Everything that reads or writes a table derives its offsets from this module; see
``docs/table-format.md`` for the protocol. All integers are little-endian and every
8-byte field is 8-byte aligned (required by the atomics in ``fastroute._core.shm``).

Segment = header page + two buffers (double buffering)::

    header (HEADER_SIZE bytes)
      0  magic            u64   TABLE_MAGIC
      8  layout_version   u32   LAYOUT_VERSION
     12  header_size      u32   HEADER_SIZE
     16  max_engines      u32
     20  max_classes      u32
     24  buffer_size      u64   bytes per buffer
     32  buffer_offset    u64   offset of buffer 0; buffer 1 follows it
     40  created_at       f64   unix seconds
     48  writer_pid       u64   informational
     64  generation       u64   own cache line; see below
    buffer b (b = generation & 1), BUFFER_HEADER then arrays at fixed offsets:
      0  generation       u64   the generation this buffer was written for
      8  n_engines        u32
     12  n_classes        u32
     16  published_at     f64
     24  retry_ratio      f64
     32  checksum         u64   xxh3-64 over buffer fields 0..31, 40..47 and the used arrays
     40  meta_len         u32
     44  reserved         u32
     64  engine_ids       u64[max_engines]
         engine_flags     u8[max_engines]    (padded to 8)
         class_keys       u64[max_classes]
         shed_fraction    f64[max_classes]
         meta             u8[META_MAX_BYTES] (msgpack)
         weights          f64[n_classes * n_engines], packed densely (row = class)

Generation word: the writer fills the inactive buffer, then publishes it with a
release store of ``generation + 1`` (a seqlock over a double buffer). Generation 0
means "nothing published yet". The top bit (``RETIRED_BIT``) marks a segment whose
writer replaced it with a new file: readers re-attach by name.
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

__all__ = [
    "TABLE_MAGIC",
    "STATS_MAGIC",
    "LAYOUT_VERSION",
    "STATS_LAYOUT_VERSION",
    "HEADER_SIZE",
    "GENERATION_OFFSET",
    "RETIRED_BIT",
    "META_MAX_BYTES",
    "HARD_MAX_ENGINES",
    "HARD_MAX_CLASSES",
    "HEADER",
    "BUFFER_HEADER",
    "BUFFER_HEADER_SIZE",
    "FLAG_UNAVAILABLE",
    "FLAG_DRAINING",
    "TableLayout",
    "BufferViews",
    "STATS_HEADER",
    "STATS_SLOT_SIZE",
    "Counter",
    "Ewma",
    "StatsLayout",
    "table_checksum",
    "CHECKSUMMED_HEADER_SPANS",
]

if sys.byteorder != "little":  # the atomics access words in native order
    raise ImportError("fastroute's shared-memory layout requires a little-endian machine")

TABLE_MAGIC = int.from_bytes(b"FRTABLE\x01", "little")
STATS_MAGIC = int.from_bytes(b"FRSTATS\x01", "little")
#: Bumped on any incompatible change of the weight table's layout.
LAYOUT_VERSION = 1
#: Bumped on any incompatible change of the stats block's layout (2: 128-byte slots with
#: ``QUEUED_TOKENS``). Separate from the table's: the stats block is created and read by
#: the processes of one host, one build, so its version never constrains a controller.
STATS_LAYOUT_VERSION = 2
#: One page: the header never shares a page with buffer data.
HEADER_SIZE = 4096
#: The generation word sits alone on its cache line.
GENERATION_OFFSET = 64
RETIRED_BIT = 1 << 63
#: Free-form metadata published with each table (msgpack), e.g. the controller's
#: plan id and solve status.
META_MAX_BYTES = 16 * 1024
#: Absolute limits, whatever a writer asks for (a 65536 x 65536 table would be 32 GiB).
HARD_MAX_ENGINES = 65536
HARD_MAX_CLASSES = 65536

# magic, layout_version, header_size, max_engines, max_classes, buffer_size,
# buffer_offset, created_at, writer_pid
HEADER = struct.Struct("<QIIIIQQdQ")
# generation, n_engines, n_classes, published_at, retry_ratio, checksum, meta_len
BUFFER_HEADER = struct.Struct("<QIIddQI4x")
BUFFER_HEADER_SIZE = 64
#: Bytes of the buffer header covered by the checksum (everything but the checksum).
CHECKSUMMED_HEADER_SPANS = ((0, 32), (40, 48))

#: engine_flags bits, set by the controller.
FLAG_UNAVAILABLE = 1  # never pick (failed health, derated to zero)
FLAG_DRAINING = 2  # finishing in-flight work; pick only if nothing else is available


def _align8(n: int) -> int:
    return (n + 7) & ~7


@dataclass(frozen=True, slots=True)
class TableLayout:
    """Offsets of one table segment, derived from its maximum dimensions.

    Parameters
    ----------
    max_engines, max_classes : int
        Capacity of each buffer; the published table may use fewer.
    """

    max_engines: int
    max_classes: int

    def __post_init__(self) -> None:
        from fastroute.errors import TableDimensionError

        if not 1 <= self.max_engines <= HARD_MAX_ENGINES:
            raise TableDimensionError(
                f"max_engines must be in [1, {HARD_MAX_ENGINES}], got {self.max_engines}"
            )
        if not 1 <= self.max_classes <= HARD_MAX_CLASSES:
            raise TableDimensionError(
                f"max_classes must be in [1, {HARD_MAX_CLASSES}], got {self.max_classes}"
            )

    @property
    def engine_ids_offset(self) -> int:
        return BUFFER_HEADER_SIZE

    @property
    def engine_flags_offset(self) -> int:
        return self.engine_ids_offset + 8 * self.max_engines

    @property
    def class_keys_offset(self) -> int:
        return self.engine_flags_offset + _align8(self.max_engines)

    @property
    def shed_fraction_offset(self) -> int:
        return self.class_keys_offset + 8 * self.max_classes

    @property
    def meta_offset(self) -> int:
        return self.shed_fraction_offset + 8 * self.max_classes

    @property
    def weights_offset(self) -> int:
        return self.meta_offset + META_MAX_BYTES

    @property
    def buffer_size(self) -> int:
        """Bytes per buffer, rounded up to whole pages."""
        raw = self.weights_offset + 8 * self.max_engines * self.max_classes
        return (raw + HEADER_SIZE - 1) // HEADER_SIZE * HEADER_SIZE

    def buffer_offset(self, index: int) -> int:
        """Byte offset of buffer ``index`` (0 or 1) in the segment."""
        return HEADER_SIZE + index * self.buffer_size

    @property
    def segment_size(self) -> int:
        """Total bytes of the segment."""
        return HEADER_SIZE + 2 * self.buffer_size


class BufferViews:
    """numpy views of one table buffer's arrays in a mapped segment (made once per attach)."""

    __slots__ = ("engine_ids", "engine_flags", "class_keys", "shed_fraction", "meta", "weights")

    def __init__(self, mm: Any, layout: TableLayout, base: int) -> None:
        def view(offset: int, dtype: str, count: int) -> np.ndarray:
            return np.frombuffer(mm, dtype=dtype, count=count, offset=base + offset)

        self.engine_ids = view(layout.engine_ids_offset, "<u8", layout.max_engines)
        self.engine_flags = view(layout.engine_flags_offset, "u1", layout.max_engines)
        self.class_keys = view(layout.class_keys_offset, "<u8", layout.max_classes)
        self.shed_fraction = view(layout.shed_fraction_offset, "<f8", layout.max_classes)
        self.meta = view(layout.meta_offset, "u1", META_MAX_BYTES)
        self.weights = view(layout.weights_offset, "<f8", layout.max_engines * layout.max_classes)


def table_checksum(
    generation: int,
    published_at: float,
    retry_ratio: float,
    engine_ids: Any,
    engine_flags: Any,
    class_keys: Any,
    shed_fraction: Any,
    meta: bytes | memoryview,
    weights: Any,
) -> int:
    """xxh3-64 over a table's buffer-header fields (checksum excluded) and its used arrays.

    The one definition of a table's checksum: the writer stores it in the buffer, a
    snapshot recomputes it from its own copies (:meth:`TableSnapshot.verify`), and the
    wire format checks it on decode. Arrays must already have their layout dtypes.
    """
    from xxhash import xxh3_64

    header = BUFFER_HEADER.pack(
        generation,
        len(engine_ids),
        len(class_keys),
        published_at,
        retry_ratio,
        0,
        len(meta),
    )
    digest = xxh3_64()
    for first, last in CHECKSUMMED_HEADER_SPANS:
        digest.update(header[first:last])
    for part in (engine_ids, engine_flags, class_keys, shed_fraction, meta):
        digest.update(part)
    digest.update(np.ascontiguousarray(weights).reshape(-1))
    return digest.intdigest()


# -- per-engine stats block -------------------------------------------------------
#
#    header (HEADER_SIZE bytes): magic u64 (STATS_MAGIC), layout_version u32,
#      header_size u32, max_engines u32, n_engines u32, slots_offset u64
#    engine_ids  u64[max_engines]     at HEADER_SIZE
#    slots       STATS_SLOT_SIZE bytes per engine, at slots_offset (64-aligned), each
#                two whole cache lines so that workers updating different engines never
#                share a line; fields below, updated only with atomics.

# magic, layout_version, header_size, max_engines, n_engines, slots_offset
STATS_HEADER = struct.Struct("<QIIIIQ")
STATS_SLOT_SIZE = 128


class Counter(IntEnum):
    """int64 fields of a stats slot (value = byte offset in the slot)."""

    IN_FLIGHT = 0  # requests sent to the engine and not finished
    IN_FLIGHT_TOKENS = 8  # their prompt + expected output tokens (bounded-load work)
    REQUESTS = 16  # finished requests, total
    FAILURES = 24  # failed requests, total
    # Prompt tokens of the attempts in flight that have not produced their first token
    # (or whole answer) yet: the prefill work queued ahead of a new request (prefix-hrw).
    # With proxy.peers it also holds what the other proxies have queued there (below).
    QUEUED_TOKENS = 64
    # The part of QUEUED_TOKENS that is the deployment's other proxies', as this host's peer
    # poller last read them (proxy.peers); written by that one worker only, into both fields.
    PEER_QUEUED_TOKENS = 72


class Ewma(IntEnum):
    """float64 EWMA fields of a stats slot (value = byte offset); NaN until a sample."""

    TTFT_S = 32
    TBOT_S = 40
    E2E_S = 48
    FAILURE_RATE = 56


@dataclass(frozen=True, slots=True)
class StatsLayout:
    """Offsets of a stats block for ``max_engines`` engines."""

    max_engines: int

    def __post_init__(self) -> None:
        from fastroute.errors import TableDimensionError

        if not 1 <= self.max_engines <= HARD_MAX_ENGINES:
            raise TableDimensionError(
                f"max_engines must be in [1, {HARD_MAX_ENGINES}], got {self.max_engines}"
            )

    @property
    def engine_ids_offset(self) -> int:
        return HEADER_SIZE

    @property
    def slots_offset(self) -> int:
        end = self.engine_ids_offset + 8 * self.max_engines
        return (end + STATS_SLOT_SIZE - 1) // STATS_SLOT_SIZE * STATS_SLOT_SIZE

    def slot_offset(self, slot: int) -> int:
        return self.slots_offset + slot * STATS_SLOT_SIZE

    @property
    def segment_size(self) -> int:
        return self.slots_offset + STATS_SLOT_SIZE * self.max_engines
