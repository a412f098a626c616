"""An immutable, consistent copy of one published weight table, and the rules it obeys.

:meth:`TableSnapshot.validated` is the one place a table's contents are checked: the
shared-memory writer publishes validated snapshots and the wire format decodes into one.
:func:`check_weights` is the weight rule itself, shared with the controller's own checks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import msgspec
import numpy as np

from fastroute.errors import TableDimensionError, TableValueError
from fastroute.tables.layout import (
    FLAG_DRAINING,
    FLAG_UNAVAILABLE,
    HARD_MAX_CLASSES,
    HARD_MAX_ENGINES,
    META_MAX_BYTES,
    table_checksum,
)

__all__ = ["TableSnapshot", "DEFAULT_RETRY_RATIO", "check_weights"]

#: Retry budget ratio published when the caller gives none.
DEFAULT_RETRY_RATIO = 0.1


def check_weights(weights: np.ndarray) -> None:
    """The weight rule of a table: every entry finite and ≥ 0 (zero means "never").

    Parameters
    ----------
    weights : ndarray, shape (n_classes, n_engines)

    Raises
    ------
    fastroute.errors.TableValueError
        Naming the first offending class row and what was found.
    """
    bad = ~np.isfinite(weights).all(axis=1) | (weights < 0).any(axis=1)
    if bad.any():
        g = int(np.argmax(bad))
        raise TableValueError(
            f"class row {g}: weights must be finite and non-negative (>= 0), got {weights[g]}"
        )


def _frozen(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


def _vector(value: Any, dtype: str, n: int, name: str, default: Any) -> np.ndarray:
    if value is None:
        return default(n, dtype=dtype)
    arr = np.ascontiguousarray(value, dtype=dtype)
    if arr.shape != (n,):
        raise TableDimensionError(f"{name} must have shape ({n},), got {arr.shape}")
    return arr


def _meta_bytes(meta: dict[str, Any] | bytes | None) -> bytes:
    if isinstance(meta, bytes):
        if meta:
            try:
                decoded = msgspec.msgpack.decode(meta)
            except msgspec.DecodeError as exc:
                raise TableValueError(f"meta is not msgpack: {exc}") from None
            if not isinstance(decoded, dict):
                raise TableValueError(f"meta must be a map, got {type(decoded).__name__}")
        encoded = meta
    else:
        encoded = msgspec.msgpack.encode(meta) if meta else b""
    if len(encoded) > META_MAX_BYTES:
        raise TableValueError(f"meta encodes to {len(encoded)} bytes; at most {META_MAX_BYTES}")
    return encoded


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

    @classmethod
    def validated(
        cls,
        generation: int,
        engine_ids: Any,
        weights: Any,
        *,
        class_keys: Any = None,
        engine_flags: Any = None,
        shed_fraction: Any = None,
        retry_ratio: float | None = None,
        published_at: float = 0.0,
        meta: dict[str, Any] | bytes | None = None,
    ) -> TableSnapshot:
        """Check a table's contents and build its snapshot (read-only copies, checksum set).

        Parameters
        ----------
        generation : int
            In [0, 2**63).
        engine_ids : array_like of uint64, shape (n_engines,)
            Stable engine ids, unique.
        weights : array_like of float64, shape (n_classes, n_engines)
            See :func:`check_weights`.
        class_keys : array_like of uint64, shape (n_classes,), optional
            Key of each class row (unique); default ``0 .. n_classes - 1``.
        engine_flags : array_like of uint8, shape (n_engines,), optional
            ``FLAG_UNAVAILABLE`` / ``FLAG_DRAINING`` bits; default 0.
        shed_fraction : array_like of float64, shape (n_classes,), optional
            Fraction of each class to shed, in [0, 1]; default 0.
        retry_ratio : float, optional
            Retry budget ratio in [0, 1]; default :data:`DEFAULT_RETRY_RATIO`.
        published_at : float
            Unix time of publication; finite.
        meta : dict or bytes, optional
            Free-form metadata (msgpack-encodable), or its msgpack encoding (a map);
            at most ``META_MAX_BYTES`` encoded. Empty means none.

        Raises
        ------
        fastroute.errors.TableDimensionError
            Shapes disagree or exceed the hard limits of the format.
        fastroute.errors.TableValueError
            A value is out of its domain.
        """
        ids = np.ascontiguousarray(engine_ids, dtype="<u8")
        if ids.ndim != 1:
            raise TableDimensionError(f"engine_ids must be 1-D, got shape {ids.shape}")
        n_engines = ids.shape[0]
        w = np.ascontiguousarray(weights, dtype="<f8")
        if w.ndim != 2 or w.shape[1] != n_engines:
            raise TableDimensionError(
                f"weights must have shape (n_classes, {n_engines}), got {w.shape}"
            )
        n_classes = w.shape[0]
        if n_engines > HARD_MAX_ENGINES or n_classes > HARD_MAX_CLASSES:
            raise TableDimensionError(
                f"table is {n_classes} x {n_engines}; "
                f"at most {HARD_MAX_CLASSES} x {HARD_MAX_ENGINES}"
            )
        keys = _vector(class_keys, "<u8", n_classes, "class_keys", np.arange)
        flags = _vector(engine_flags, "u1", n_engines, "engine_flags", np.zeros)
        shed = _vector(shed_fraction, "<f8", n_classes, "shed_fraction", np.zeros)
        ratio = DEFAULT_RETRY_RATIO if retry_ratio is None else float(retry_ratio)
        if not 0 <= generation < 2**63:
            raise TableValueError(f"generation must be in [0, 2**63), got {generation}")
        if not math.isfinite(published_at):
            raise TableValueError(f"published_at must be finite, got {published_at}")
        if len(np.unique(ids)) != n_engines:
            raise TableValueError("engine_ids must be unique")
        if len(np.unique(keys)) != n_classes:
            raise TableValueError("class_keys must be unique")
        check_weights(w)
        if not np.all((shed >= 0) & (shed <= 1)):
            raise TableValueError("shed_fraction must be in [0, 1]")
        if not (math.isfinite(ratio) and 0.0 <= ratio <= 1.0):
            raise TableValueError(f"retry_ratio must be in [0, 1], got {retry_ratio}")
        meta_bytes = _meta_bytes(meta)
        checksum = table_checksum(
            generation, published_at, ratio, ids, flags, keys, shed, meta_bytes, w
        )
        return cls(
            generation=generation,
            engine_ids=_frozen(ids),
            engine_flags=_frozen(flags),
            class_keys=_frozen(keys),
            weights=_frozen(w),
            shed_fraction=_frozen(shed),
            retry_ratio=ratio,
            published_at=float(published_at),
            meta_bytes=meta_bytes,
            checksum=checksum,
        )

    def restamped(self, generation: int, published_at: float) -> TableSnapshot:
        """The same table under another generation and publish time (checksum recomputed).

        How a puller republishes a fetched table into its own local segment.
        """
        checksum = table_checksum(
            generation,
            published_at,
            self.retry_ratio,
            self.engine_ids,
            self.engine_flags,
            self.class_keys,
            self.shed_fraction,
            self.meta_bytes,
            self.weights,
        )
        return dataclasses.replace(
            self, generation=generation, published_at=float(published_at), checksum=checksum
        )

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
