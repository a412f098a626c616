"""An immutable, consistent copy of one published weight table."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import msgspec
import numpy as np

from fastroute.tables.layout import (
    FLAG_DRAINING,
    FLAG_UNAVAILABLE,
    table_checksum,
)

__all__ = ["TableSnapshot"]


@dataclass(frozen=True, eq=False)
class TableSnapshot:
    """One generation of the weight table, copied out of shared memory.

    Arrays are private copies marked read-only, so a snapshot stays valid whatever
    the writer does next.

    Attributes
    ----------
    generation : int
        Publication counter (strictly increasing per segment name).
    engine_ids : ndarray of uint64, shape (n_engines,)
    engine_flags : ndarray of uint8, shape (n_engines,)
        ``FLAG_UNAVAILABLE`` / ``FLAG_DRAINING`` bits from the controller.
    class_keys : ndarray of uint64, shape (n_classes,)
    weights : ndarray of float64, shape (n_classes, n_engines)
    shed_fraction : ndarray of float64, shape (n_classes,)
    retry_ratio : float
    published_at : float
        Unix time of publication (the writer's clock).
    meta_bytes : bytes
        msgpack-encoded metadata; decoded by :attr:`meta`.
    checksum : int
        xxh3-64 the writer computed; :meth:`verify` recomputes it from the copies.
    """

    generation: int
    engine_ids: np.ndarray
    engine_flags: np.ndarray
    class_keys: np.ndarray
    weights: np.ndarray
    shed_fraction: np.ndarray
    retry_ratio: float
    published_at: float
    meta_bytes: bytes = b""
    checksum: int = 0
    _rows: dict[int, int] = field(default_factory=dict, init=False, repr=False)

    @property
    def n_engines(self) -> int:
        return int(self.engine_ids.shape[0])

    @property
    def n_classes(self) -> int:
        return int(self.class_keys.shape[0])

    @cached_property
    def meta(self) -> dict[str, Any]:
        """The decoded metadata (empty when none was published)."""
        return msgspec.msgpack.decode(self.meta_bytes) if self.meta_bytes else {}

    def row(self, class_key: int) -> int:
        """Return the row of ``class_key``; ``KeyError`` if the table has no such class."""
        if not self._rows:
            self._rows.update((int(k), i) for i, k in enumerate(self.class_keys))
        return self._rows[class_key]

    def available(self, *, allow_draining: bool = False) -> np.ndarray:
        """Mask (uint8) of engines the controller allows picking."""
        blocked = FLAG_UNAVAILABLE if allow_draining else FLAG_UNAVAILABLE | FLAG_DRAINING
        return ((self.engine_flags & blocked) == 0).astype(np.uint8)

    def selector(self) -> Any:
        """A :class:`fastroute._core.Selector` over this table."""
        from fastroute._core import Selector

        return Selector(self.engine_ids, self.weights)

    def verify(self) -> bool:
        """Recompute the checksum from this snapshot's own copies; True if it matches."""
        computed = table_checksum(
            self.generation,
            self.published_at,
            self.retry_ratio,
            self.engine_ids,
            self.engine_flags,
            self.class_keys,
            self.shed_fraction,
            self.meta_bytes,
            self.weights,
        )
        return computed == self.checksum
